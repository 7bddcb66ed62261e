//! `process_*` metrics (the names of Prometheus' client libraries), read from `/proc/self` on
//! every scrape. Linux only: elsewhere nothing is written. A file that cannot be read or a field
//! that does not parse leaves out that metric; nothing here panics on odd `/proc` contents.
//!
//! Sources and units:
//! - `process_cpu_seconds_total`: `utime + stime` of `/proc/self/stat`, clock ticks / [`USER_HZ`];
//! - `process_virtual_memory_bytes`: `vsize` of `/proc/self/stat` (bytes);
//! - `process_resident_memory_bytes`: `VmRSS` of `/proc/self/status` (kB × 1024), which saves
//!   knowing the page size;
//! - `process_start_time_seconds`: `starttime` of `/proc/self/stat` / [`USER_HZ`] plus `btime` of
//!   `/proc/stat` (Unix time);
//! - `process_open_fds`: entries in `/proc/self/fd`.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Clock ticks per second of `/proc` times. Fixed at 100 on Linux's user ABI for all mainstream
/// architectures; prometheus/procfs hard-codes it the same way (`userHZ`) to avoid `sysconf`.
pub(super) const USER_HZ: f64 = 100.0;

/// Writes the process metrics on each encode.
#[derive(Debug)]
pub(super) struct ProcessCollector;

/// One reading; `None` where the source was unreadable or malformed.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_memory_bytes: Option<u64>,
    pub virtual_memory_bytes: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<u64>,
}

/// The fields of `/proc/<pid>/stat` we use, in clock ticks or bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct StatFields {
    pub utime: Option<u64>,
    pub stime: Option<u64>,
    pub starttime: Option<u64>,
    pub vsize: Option<u64>,
}

impl ProcessStats {
    /// Reads `/proc` now (all `None` off Linux).
    pub fn read() -> Self {
        #[cfg(target_os = "linux")]
        {
            let stat = std::fs::read_to_string("/proc/self/stat")
                .map(|s| parse_stat(&s))
                .unwrap_or_default();
            let resident_memory_bytes = std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| parse_status_kb(&s, "VmRSS"))
                .and_then(|kb| kb.checked_mul(1024));
            let boot_time =
                std::fs::read_to_string("/proc/stat").ok().and_then(|s| parse_boot_time(&s));
            let open_fds =
                std::fs::read_dir("/proc/self/fd").ok().map(|dir| dir.flatten().count() as u64);
            Self {
                cpu_seconds: stat
                    .utime
                    .zip(stat.stime)
                    .map(|(u, s)| u.saturating_add(s) as f64 / USER_HZ),
                resident_memory_bytes,
                virtual_memory_bytes: stat.vsize,
                start_time_seconds: stat
                    .starttime
                    .zip(boot_time)
                    .map(|(ticks, boot)| boot as f64 + ticks as f64 / USER_HZ),
                open_fds,
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            Self::default()
        }
    }
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may itself hold
/// spaces and parentheses, so fields are counted from the last `)`.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(super) fn parse_stat(text: &str) -> StatFields {
    let Some((_, rest)) = text.rsplit_once(')') else {
        return StatFields::default();
    };
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // `rest` starts at field 3 (`state`); `proc(5)` numbers fields from 1.
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    StatFields { utime: field(14), stime: field(15), starttime: field(22), vsize: field(23) }
}

/// The value of a `Key:   1234 kB` line of `/proc/<pid>/status`, in kB.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(super) fn parse_status_kb(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        if k != key {
            return None;
        }
        let mut parts = v.split_ascii_whitespace();
        let value = parts.next()?.parse().ok()?;
        matches!(parts.next(), Some("kB") | None).then_some(value)
    })
}

/// `btime` (boot time, Unix seconds) of `/proc/stat`.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(super) fn parse_boot_time(text: &str) -> Option<u64> {
    text.lines().find_map(|line| line.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let stats = ProcessStats::read();
        if let Some(v) = stats.cpu_seconds {
            let counter = ConstCounter::new(v);
            counter.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                counter.metric_type(),
            )?)?;
        }
        if let Some(v) = stats.start_time_seconds {
            let gauge = ConstGauge::new(v);
            gauge.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                None,
                gauge.metric_type(),
            )?)?;
        }
        let integer_gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                stats.resident_memory_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                stats.virtual_memory_bytes,
            ),
            ("process_open_fds", "Number of open file descriptors.", stats.open_fds),
        ];
        for (name, help, value) in integer_gauges {
            if let Some(v) = value {
                let gauge = ConstGauge::new(v);
                gauge.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    gauge.metric_type(),
                )?)?;
            }
        }
        Ok(())
    }
}
