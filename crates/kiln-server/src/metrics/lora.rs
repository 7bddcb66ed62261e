//! `kiln:lora_requests_info` (vLLM's `vllm:lora_requests_info`): one gauge series whose labels
//! name the LoRA adapters of running requests (`running_lora_adapters`, comma-separated in slot
//! order), of waiting requests (`waiting_lora_adapters`) and the most adapters one step may
//! carry (`max_lora`, empty for no limit); its value is the Unix time the labels were set. The
//! series is replaced whenever the adapters in use change, so exactly one is exported (vLLM
//! keeps the old label sets too; a query takes the newest by value).

use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::escape_label_value;

type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Default)]
pub(super) struct LoraMetrics {
    info: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl LoraMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        r.register(
            format!("{prefix}:lora_requests_info"),
            "Running stats on lora requests.",
            self.info.clone(),
        );
    }

    /// Replaces the series with the adapters now running and waiting.
    pub(super) fn set(&self, running: &[String], waiting: &[String], max_lora: Option<usize>) {
        let list = |names: &[String]| escape_label_value(&names.join(","));
        let labels = vec![
            ("running_lora_adapters", list(running)),
            ("waiting_lora_adapters", list(waiting)),
            ("max_lora", max_lora.map_or_else(String::new, |n| n.to_string())),
        ];
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.info.clear();
        self.info.get_or_create(&labels).set(now);
    }
}
