//! Prefill/decode disaggregation metrics under the metrics prefix (`kiln:` by default; kiln's
//! own series): counters `kiln:kv_transfer_blocks_total{direction}` and
//! `kiln:kv_transfer_bytes_total{direction}` (KV blocks and their bytes sent to decode
//! workers, `direction="sent"`, or fetched from prefill workers, `"received"`),
//! `kiln:kv_transfer_failures_total{direction}` (transfers that ended in an error: a refused
//! or broken connection, a corrupted frame; a failed fetch is recomputed by the decode worker),
//! histogram `kiln:kv_transfer_seconds` (a decode worker's fetch of one request's blocks, from
//! connecting to the last block), gauge `kiln:kv_pinned_blocks` (blocks a prefill worker holds
//! for decode workers) and counter `kiln:kv_pins_expired_total` (pins released unfetched). All
//! series exist from the start at 0.

use kiln_engine::KvHandoffStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type DirectionLabel = [(&'static str, &'static str); 1];

pub(crate) const SENT: DirectionLabel = [("direction", "sent")];
pub(crate) const RECEIVED: DirectionLabel = [("direction", "received")];

const SECONDS_BUCKETS: [f64; 12] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Totals for the periodic stats log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvTransferTotals {
    pub blocks_sent: u64,
    pub bytes_sent: u64,
    pub blocks_received: u64,
    pub bytes_received: u64,
    pub failures: u64,
    pub pinned_blocks: i64,
}

/// The stats log's KV transfer line over an interval of `secs` seconds (`None`: nothing moved
/// or failed in it).
pub fn log_line(before: &KvTransferTotals, now: &KvTransferTotals, secs: f64) -> Option<String> {
    let d = |a: u64, b: u64| b.saturating_sub(a);
    let failures = d(before.failures, now.failures);
    let sent = d(before.blocks_sent, now.blocks_sent);
    let received = d(before.blocks_received, now.blocks_received);
    if sent == 0 && received == 0 && failures == 0 {
        return None;
    }
    let mib_s = |a: u64, b: u64| d(a, b) as f64 / f64::from(1 << 20) / secs.max(1e-9);
    Some(format!(
        "KV transfer: sent {sent} blocks ({:.1} MiB/s), received {received} blocks ({:.1} \
         MiB/s), {failures} failures, {} blocks pinned",
        mib_s(before.bytes_sent, now.bytes_sent),
        mib_s(before.bytes_received, now.bytes_received),
        now.pinned_blocks,
    ))
}

#[derive(Debug)]
pub(crate) struct KvTransferMetrics {
    blocks: Family<DirectionLabel, Counter>,
    bytes: Family<DirectionLabel, Counter>,
    failures: Family<DirectionLabel, Counter>,
    seconds: Histogram,
    pinned_blocks: Gauge,
    pins_expired: Counter,
}

impl Default for KvTransferMetrics {
    fn default() -> Self {
        Self {
            blocks: Family::default(),
            bytes: Family::default(),
            failures: Family::default(),
            seconds: Histogram::new(SECONDS_BUCKETS),
            pinned_blocks: Gauge::default(),
            pins_expired: Counter::default(),
        }
    }
}

impl KvTransferMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        let name = |n: &str| format!("{prefix}:{n}");
        for d in [SENT, RECEIVED] {
            drop(self.blocks.get_or_create(&d));
            drop(self.bytes.get_or_create(&d));
            drop(self.failures.get_or_create(&d));
        }
        r.register(
            name("kv_transfer_blocks"),
            "KV blocks sent to decode workers or received from prefill workers",
            self.blocks.clone(),
        );
        r.register(
            name("kv_transfer_bytes"),
            "Bytes of KV sent to decode workers or received from prefill workers",
            self.bytes.clone(),
        );
        r.register(
            name("kv_transfer_failures"),
            "KV transfers that ended in an error",
            self.failures.clone(),
        );
        r.register(
            name("kv_transfer_seconds"),
            "Time to fetch one request's KV blocks from a prefill worker",
            self.seconds.clone(),
        );
        r.register(
            name("kv_pinned_blocks"),
            "KV blocks held for decode workers to fetch",
            self.pinned_blocks.clone(),
        );
        r.register(
            name("kv_pins_expired"),
            "KV pins released unfetched at their deadline",
            self.pins_expired.clone(),
        );
    }

    /// `blocks` blocks of `bytes` bytes moved in `direction`.
    pub(crate) fn on_moved(&self, direction: &DirectionLabel, blocks: usize, bytes: usize) {
        self.blocks.get_or_create(direction).inc_by(blocks as u64);
        self.bytes.get_or_create(direction).inc_by(bytes as u64);
    }

    /// A fetch of one request's blocks took `seconds`.
    pub(crate) fn on_fetched(&self, seconds: f64) {
        self.seconds.observe(seconds);
    }

    pub(crate) fn totals(&self) -> KvTransferTotals {
        let get = |f: &Family<DirectionLabel, Counter>, d| f.get_or_create(d).get();
        KvTransferTotals {
            blocks_sent: get(&self.blocks, &SENT),
            bytes_sent: get(&self.bytes, &SENT),
            blocks_received: get(&self.blocks, &RECEIVED),
            bytes_received: get(&self.bytes, &RECEIVED),
            failures: get(&self.failures, &SENT) + get(&self.failures, &RECEIVED),
            pinned_blocks: self.pinned_blocks.get(),
        }
    }

    pub(crate) fn on_failure(&self, direction: &DirectionLabel) {
        self.failures.get_or_create(direction).inc();
    }

    /// The engine's pin gauge and expiry total (`last`: the total already counted).
    pub(super) fn update(&self, last: &mut u64, now: &KvHandoffStats) {
        self.pinned_blocks.set(i64::try_from(now.pinned_blocks).unwrap_or(i64::MAX));
        super::advance(&self.pins_expired, last, now.pins_expired);
    }
}
