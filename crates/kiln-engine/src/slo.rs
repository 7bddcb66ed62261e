//! Latency objectives: the targets the batch controller holds (`--target-itl-ms`,
//! `--target-ttft-ms`), service-level classes that give requests first-token deadlines by their
//! `priority` (`--slo-classes`), and what admission does with a deadline that cannot be met
//! (`--slo-admission`).
//!
//! `--slo-classes` is a JSON object from a priority (vLLM's request field; lower is more
//! urgent) to that class's objectives: `{"0": {"ttft_ms": 1000, "tpot_ms": 60}, "1":
//! {"ttft_ms": 30000}}`. A request whose priority names no class gets the default class: the
//! `--target-ttft-ms` / `--target-itl-ms` targets, or no deadline when there is no TTFT target.
//! Unknown keys and values outside their domain are refused with the field named.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

/// One class's objectives, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SloClass {
    /// The first token is due this long after arrival.
    pub ttft_ms: u64,
    /// Target time per output token (the batch controller holds the strictest of the running
    /// requests' targets).
    pub tpot_ms: Option<u32>,
}

/// What admission does with a request whose deadline the queued work already makes unmeetable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SloAdmission {
    /// Refuse it (the server answers 429 with the predicted time), so the work that can still be
    /// on time stays on time.
    #[default]
    Reject,
    /// Queue it with its deadline pushed back by `slo_demotion_ms` (it waits behind work that
    /// can be on time).
    Demote,
    /// Queue it as it is.
    Off,
}

impl SloAdmission {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Demote => "demote",
            Self::Off => "off",
        }
    }
}

/// The engine's latency objectives (all off by default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SloConfig {
    /// p95 inter-token latency target, ms: turns on adaptive batch control.
    pub target_itl_ms: Option<f64>,
    /// p95 time-to-first-token target, ms: the default class's first-token deadline.
    pub target_ttft_ms: Option<f64>,
    /// Classes by priority.
    pub classes: BTreeMap<i64, SloClass>,
    pub admission: SloAdmission,
}

impl SloConfig {
    /// Whether anything here needs the controller (targets or classes).
    pub fn is_active(&self) -> bool {
        self.target_itl_ms.is_some() || self.target_ttft_ms.is_some() || !self.classes.is_empty()
    }

    /// The objectives of a request of `priority`: its class's, or the default class's (`None`
    /// without a TTFT target).
    pub fn class_for(&self, priority: i64) -> Option<SloClass> {
        self.classes.get(&priority).copied().or_else(|| {
            Some(SloClass {
                ttft_ms: self.target_ttft_ms?.ceil() as u64,
                tpot_ms: self.target_itl_ms.map(|t| t.ceil() as u32),
            })
        })
    }
}

/// A `--slo-classes` value that is not valid; names the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SloClassesError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for SloClassesError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--slo-classes: `{}` {}", self.field, self.message)
    }
}

impl std::error::Error for SloClassesError {}

fn err(field: impl Into<String>, message: impl Into<String>) -> SloClassesError {
    SloClassesError { field: field.into(), message: message.into() }
}

/// Parses `--slo-classes` (module docs).
pub fn parse_slo_classes(text: &str) -> Result<BTreeMap<i64, SloClass>, SloClassesError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| err("(json)", format!("is not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(err(
            "(json)",
            "must be an object from priority to objectives, e.g. {\"0\": {\"ttft_ms\": 1000}}",
        ));
    };
    let mut classes = BTreeMap::new();
    for (key, spec) in map {
        let priority: i64 =
            key.trim().parse().map_err(|_| err(&key, "is not an integer priority"))?;
        let Value::Object(fields) = spec else {
            return Err(err(&key, "must be an object with `ttft_ms` and optionally `tpot_ms`"));
        };
        if let Some(unknown) = fields.keys().find(|k| !["ttft_ms", "tpot_ms"].contains(&k.as_str()))
        {
            return Err(err(format!("{key}.{unknown}"), "is not supported (ttft_ms, tpot_ms)"));
        }
        let positive = |name: &str, max: u64| -> Result<Option<u64>, SloClassesError> {
            let Some(v) = fields.get(name) else { return Ok(None) };
            match v.as_u64() {
                Some(n) if (1..=max).contains(&n) => Ok(Some(n)),
                _ => {
                    Err(err(format!("{key}.{name}"), format!("must be an integer from 1 to {max}")))
                }
            }
        };
        let ttft_ms = positive("ttft_ms", 86_400_000)?
            .ok_or_else(|| err(format!("{key}.ttft_ms"), "is required"))?;
        let tpot_ms = positive("tpot_ms", 600_000)?.map(|n| n as u32);
        classes.insert(priority, SloClass { ttft_ms, tpot_ms });
    }
    if classes.is_empty() {
        return Err(err("(json)", "names no class"));
    }
    Ok(classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_parse_and_errors_name_the_field() {
        let c = parse_slo_classes(
            r#"{"0": {"ttft_ms": 1000, "tpot_ms": 60}, "-3": {"ttft_ms": 30000}}"#,
        )
        .unwrap();
        assert_eq!(c[&0], SloClass { ttft_ms: 1000, tpot_ms: Some(60) });
        assert_eq!(c[&-3], SloClass { ttft_ms: 30_000, tpot_ms: None });
        let cases = [
            ("[1]", "(json)"),
            ("{", "(json)"),
            ("{}", "(json)"),
            (r#"{"x": {"ttft_ms": 1}}"#, "x"),
            (r#"{"1": 5}"#, "1"),
            (r#"{"1": {"tpot_ms": 5}}"#, "1.ttft_ms"),
            (r#"{"1": {"ttft_ms": 0}}"#, "1.ttft_ms"),
            (r#"{"1": {"ttft_ms": 10, "tpot_ms": -1}}"#, "1.tpot_ms"),
            (r#"{"1": {"ttft_ms": 10, "itl_ms": 5}}"#, "1.itl_ms"),
        ];
        for (text, field) in cases {
            let e = parse_slo_classes(text).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
        }
    }

    #[test]
    fn a_priority_without_a_class_gets_the_default_targets() {
        let mut config = SloConfig::default();
        assert_eq!(config.class_for(0), None);
        config.target_ttft_ms = Some(800.0);
        config.target_itl_ms = Some(59.5);
        config.classes.insert(1, SloClass { ttft_ms: 20_000, tpot_ms: None });
        assert_eq!(config.class_for(0), Some(SloClass { ttft_ms: 800, tpot_ms: Some(60) }));
        assert_eq!(config.class_for(1), Some(SloClass { ttft_ms: 20_000, tpot_ms: None }));
    }
}
