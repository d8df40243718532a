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

/// 1234 -> "1.23 k", 4_500_000 -> "4.50 M", up to E (1e18).
pub fn si(x: f64) -> String {
    let a = x.abs();
    if a >= 1e18 {
        format!("{:.2} E", x / 1e18)
    } else if a >= 1e15 {
        format!("{:.2} P", x / 1e15)
    } else if a >= 1e12 {
        format!("{:.2} T", x / 1e12)
    } else if a >= 1e9 {
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

/// A number of a buffer, as short as it stays exact enough to check by hand:
/// 1000 -> "1000", 1.5 -> "1.5", 0.123456 -> "0.1235", 3e-7 -> "3.00e-7".
pub fn value(x: f32) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    let a = x.abs();
    if x == x.trunc() && a < 1e7 {
        return format!("{x:.0}");
    }
    if a != 0.0 && !(1e-3..1e7).contains(&a) {
        return format!("{x:.2e}");
    }
    let decimals = if a >= 1000.0 {
        1
    } else if a >= 10.0 {
        2
    } else {
        4
    };
    let s = format!("{x:.decimals$}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// Bytes in words: 96 -> "96 B", 4096 -> "4.0 KiB", 3_000_000 -> "2.9 MiB", up to PiB.
pub fn bytes(b: f64) -> String {
    if b < 1024.0 {
        return format!("{} B", value(b as f32));
    }
    let (scale, unit) = byte_unit(b);
    let decimals = if unit == "KiB" || unit == "MiB" { 1 } else { 2 };
    format!("{:.decimals$} {unit}", b / scale)
}

/// The binary unit `b` bytes read best in: (bytes per unit, name), B up to PiB.
pub fn byte_unit(b: f64) -> (f64, &'static str) {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut scale = 1.0;
    let mut i = 0;
    while b.abs() >= scale * 1024.0 && i + 1 < UNITS.len() {
        scale *= 1024.0;
        i += 1;
    }
    (scale, UNITS[i])
}

/// A whole number with thousands separators: 3355443 -> "3,355,443".
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes in words with the exact count, for tooltips: "3.2 MiB (3,355,443 bytes)".
pub fn bytes_exact(n: u64) -> String {
    if n < 1024 {
        format!("{n} bytes")
    } else {
        format!("{} ({} bytes)", bytes(n as f64), grouped(n))
    }
}

/// A share as a percentage: 0.2727 -> "27.3%".
pub fn percent(share: f64) -> String {
    if share.is_finite() {
        format!("{:.1}%", share * 100.0)
    } else {
        "–".into()
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
        assert_eq!(si(4.52e18), "4.52 E");
        assert_eq!(si(3.15e12), "3.15 T");
        assert_eq!(num(0.003), "3.00e-3");
        assert_eq!(num(1.5), "1.500");
        assert_eq!(value(1000.0), "1000");
        assert_eq!(value(-4.0), "-4");
        assert_eq!(value(1.5), "1.5");
        assert_eq!(value(0.123456), "0.1235");
        assert_eq!(value(53.333336), "53.33");
        assert_eq!(value(3e-7), "3.00e-7");
        assert_eq!(bytes(96.0), "96 B");
        assert_eq!(bytes(53.333336), "53.33 B");
        assert_eq!(bytes(4096.0), "4.0 KiB");
        assert_eq!(bytes(3_000_000.0), "2.9 MiB");
        assert_eq!(bytes(112.0 * (1u64 << 30) as f64), "112.00 GiB");
        assert_eq!(bytes(3.0 * (1u64 << 50) as f64), "3.00 PiB");
        assert_eq!(byte_unit(1023.0), (1.0, "B"));
        assert_eq!(byte_unit(2048.0), (1024.0, "KiB"));
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(3_355_443), "3,355,443");
        assert_eq!(bytes_exact(96), "96 bytes");
        assert_eq!(bytes_exact(4096), "4.0 KiB (4,096 bytes)");
        assert_eq!(percent(0.27272), "27.3%");
    }
}
