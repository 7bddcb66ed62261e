//! `strftime_now(format)`: the current UTC time formatted like C / Python `strftime` in the C
//! locale, with std only.
//!
//! Directives: `%a %A %b %B %d %e %H %I %j %m %M %p %S %y %Y %%`; a `-` flag (`%-d`, glibc)
//! drops the zero padding of numeric ones. Any other directive is copied as written.
//! Invariant: instants are whole seconds since 1970-01-01T00:00:00Z (proleptic Gregorian).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const SECONDS_PER_DAY: u64 = 86_400;
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
/// Weekdays from Sunday.
const WEEKDAYS: [&str; 7] =
    ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// The current UTC time formatted with `format`.
pub(super) fn strftime_now(format: &str) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format_utc(format, now)
}

/// A calendar instant in UTC.
#[derive(Debug, PartialEq, Eq)]
struct DateTime {
    year: u64,
    /// 1..=12
    month: u64,
    /// 1..=31
    day: u64,
    /// 1..=366
    day_of_year: u64,
    /// 0 = Sunday
    weekday: u64,
    hour: u64,
    minute: u64,
    second: u64,
}

fn is_leap(year: u64) -> bool {
    year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400))
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl DateTime {
    fn from_unix(secs: u64) -> Self {
        let mut days = secs / SECONDS_PER_DAY;
        let in_day = secs % SECONDS_PER_DAY;
        // 1970-01-01 was a Thursday.
        let weekday = (days + 4) % 7;
        let mut year = 1970;
        loop {
            let len = if is_leap(year) { 366 } else { 365 };
            if days < len {
                break;
            }
            days -= len;
            year += 1;
        }
        let day_of_year = days + 1;
        let mut month = 1;
        while days >= days_in_month(year, month) {
            days -= days_in_month(year, month);
            month += 1;
        }
        Self {
            year,
            month,
            day: days + 1,
            day_of_year,
            weekday,
            hour: in_day / 3600,
            minute: in_day / 60 % 60,
            second: in_day % 60,
        }
    }
}

/// `format` with the directives replaced by the fields of `unix_secs` (UTC).
pub(super) fn format_utc(format: &str, unix_secs: u64) -> String {
    let t = DateTime::from_unix(unix_secs);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.next_if_eq(&'-').is_some();
        let Some(directive) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let hour12 = if t.hour.is_multiple_of(12) { 12 } else { t.hour % 12 };
        let month_name = MONTHS[(t.month - 1) as usize];
        let weekday_name = WEEKDAYS[t.weekday as usize];
        let mut number = |value: u64, width: usize| {
            let width = if no_pad { 0 } else { width };
            let _ = write!(out, "{value:0width$}");
        };
        match directive {
            'd' => number(t.day, 2),
            'H' => number(t.hour, 2),
            'I' => number(hour12, 2),
            'j' => number(t.day_of_year, 3),
            'm' => number(t.month, 2),
            'M' => number(t.minute, 2),
            'S' => number(t.second, 2),
            'y' => number(t.year % 100, 2),
            'Y' => number(t.year, 0),
            'a' => out.push_str(&weekday_name[..3]),
            'A' => out.push_str(weekday_name),
            'b' => out.push_str(&month_name[..3]),
            'B' => out.push_str(month_name),
            'e' => {
                let _ = write!(out, "{:2}", t.day);
            }
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_fields() {
        // 2024-02-29T23:59:59Z, a Thursday, day 60 of a leap year.
        let t = DateTime::from_unix(1_709_251_199);
        let expected = DateTime {
            year: 2024,
            month: 2,
            day: 29,
            day_of_year: 60,
            weekday: 4,
            hour: 23,
            minute: 59,
            second: 59,
        };
        assert_eq!(t, expected);
        assert_eq!(format_utc("%-d/%-m %e|%q%", 1_709_251_199), "29/2 29|%q%");
    }
}
