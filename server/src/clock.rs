//! Timestamps as stored in the database: RFC3339 UTC text with a fixed width
//! (`2025-01-31T12:00:00.000Z`), so that text comparison in SQL orders them by time.

use std::time::{Duration, SystemTime};

use time::OffsetDateTime;

/// `t` as fixed-width RFC3339 UTC with milliseconds; times the calendar cannot show
/// (beyond year 9999 either way) are shown as its last (or first) millisecond.
pub fn rfc3339(t: SystemTime) -> String {
    let nanos = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => i128::try_from(after.as_nanos()).unwrap_or(i128::MAX),
        Err(before) => i128::try_from(before.duration().as_nanos()).map_or(i128::MIN, |n| -n),
    };
    let t = OffsetDateTime::from_unix_timestamp_nanos(nanos).unwrap_or(if nanos > 0 {
        time::PrimitiveDateTime::MAX.assume_utc()
    } else {
        time::PrimitiveDateTime::MIN.assume_utc()
    });
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

/// A timestamp in any RFC3339 form between 1970 and 2999 (a review later than that is
/// nonsense, and dates after it can overflow the scheduling arithmetic); stored and
/// answered in [`rfc3339`]'s fixed form.
pub fn parse_time(text: &str) -> Option<SystemTime> {
    let t = OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    (1970..3000).contains(&t.year()).then(|| SystemTime::from(t))
}

pub fn now() -> SystemTime {
    SystemTime::now()
}

/// `t + d` as stored text.
pub fn after(t: SystemTime, d: Duration) -> String {
    rfc3339(t.checked_add(d).unwrap_or(t))
}

/// `t - d` as stored text (the epoch if that would be earlier).
pub fn before(t: SystemTime, d: Duration) -> String {
    rfc3339(t.checked_sub(d).unwrap_or(SystemTime::UNIX_EPOCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_width_and_ordered() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let a = rfc3339(t);
        let b = after(t, Duration::from_millis(900));
        assert_eq!(a.len(), b.len());
        assert!(a < b);
        assert!(before(t, Duration::from_secs(1)) < a);
    }

    #[test]
    fn times_beyond_the_calendar_do_not_panic() {
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(400_000_000_000);
        assert_eq!(rfc3339(far), "9999-12-31T23:59:59.999Z");
        assert_eq!(after(far, Duration::MAX), "9999-12-31T23:59:59.999Z");
    }
}
