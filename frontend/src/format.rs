//! Numbers and times in words for the pages.

/// Milliseconds since the epoch for a server timestamp: RFC 3339, or SQLite's
/// `YYYY-MM-DD HH:MM:SS` (UTC, without a zone).
pub fn parse_time(s: &str) -> Option<f64> {
    let s = s.trim();
    let normalized = if s.len() == 19 && s.as_bytes().get(10) == Some(&b' ') {
        format!("{}T{}Z", &s[..10], &s[11..])
    } else {
        s.to_string()
    };
    let ms = js_sys::Date::parse(&normalized);
    ms.is_finite().then_some(ms)
}

pub fn now_ms() -> f64 {
    js_sys::Date::now()
}

/// A server timestamp in local time, `2025-03-01 14:05:09`; the raw text when it does not parse.
pub fn local_time(s: &str) -> String {
    let Some(ms) = parse_time(s) else { return s.to_string() };
    let d = js_sys::Date::new(&wasm_bindgen::JsValue::from_f64(ms));
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        d.get_full_year(),
        d.get_month() + 1,
        d.get_date(),
        d.get_hours(),
        d.get_minutes(),
        d.get_seconds()
    )
}

/// "12 s ago", "5 min ago", "3 h ago", "2 days ago".
pub fn ago(s: &str) -> String {
    let Some(ms) = parse_time(s) else { return String::new() };
    let secs = ((now_ms() - ms) / 1000.0).max(0.0);
    if secs < 60.0 {
        format!("{secs:.0} s ago")
    } else if secs < 3600.0 {
        format!("{:.0} min ago", (secs / 60.0).floor())
    } else if secs < 86400.0 {
        format!("{:.0} h ago", (secs / 3600.0).floor())
    } else {
        format!("{:.0} days ago", (secs / 86400.0).floor())
    }
}

/// Seconds as "4.2 s", "3 min 05 s", "1 h 02 min".
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "–".into();
    }
    if secs < 60.0 {
        format!("{secs:.1} s")
    } else if secs < 3600.0 {
        let s = secs.round() as u64;
        format!("{} min {:02} s", s / 60, s % 60)
    } else {
        let m = (secs / 60.0).round() as u64;
        format!("{} h {:02} min", m / 60, m % 60)
    }
}

/// 1234 -> "1.23 k", 4_500_000 -> "4.50 M".
pub fn si(x: f64) -> String {
    let a = x.abs();
    if a >= 1e9 {
        format!("{:.2} G", x / 1e9)
    } else if a >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if a >= 1e4 {
        format!("{:.1} k", x / 1e3)
    } else if a >= 100.0 || x == x.trunc() {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// A number in a compact scientific-friendly form: 0.003 -> "3.00e-3", 1.5 -> "1.500".
pub fn num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() < 0.01 || x.abs() >= 1e5 {
        format!("{x:.2e}")
    } else {
        format!("{x:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration(4.25), "4.2 s");
        assert_eq!(duration(185.0), "3 min 05 s");
        assert_eq!(duration(3720.0), "1 h 02 min");
    }

    #[test]
    fn numbers() {
        assert_eq!(si(1234.0), "1234");
        assert_eq!(si(45_600.0), "45.6 k");
        assert_eq!(si(4_500_000.0), "4.50 M");
        assert_eq!(num(0.003), "3.00e-3");
        assert_eq!(num(1.5), "1.500");
    }
}
