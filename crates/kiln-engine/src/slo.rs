//! Latency objectives: the targets the batch controller holds (`--target-itl-ms`,
//! `--target-tpot-ms`, `--target-ttft-ms`), service-level classes that give requests
//! first-token deadlines by their `priority` (`--slo-classes`), and what admission does with a
//! deadline that cannot be met (`--slo-admission`).
//!
//! `--slo-classes` is a JSON object from a priority (vLLM's request field; lower is more
//! urgent) to that class's objectives: `{"0": {"ttft_ms": 1000, "tpot_ms": 60}, "1":
//! {"ttft_ms": 30000}}`. A request whose priority names no class gets the default class: the
//! `--target-ttft-ms` / `--target-tpot-ms` targets, or no deadline when there is no TTFT target
//! (under the deadline policy such a request is due `slo_demotion_ms` after it arrives, so it
//! cannot starve). Unknown keys and values outside their domain are refused with the field
//! named.
//!
//! Two per-token targets, as vLLM's benchmarks measure them: `--target-itl-ms` bounds the p95 of
//! every gap between tokens (each step), `--target-tpot-ms` a request's mean gap after its first
//! token (TPOT), which lets a step run long on time that shorter steps saved. The batch
//! controller holds `--target-itl-ms` and the strictest TPOT: `--target-tpot-ms` or a class's
//! `tpot_ms`, whichever is lower.
//!
//! Admission ([`decide`]): a request is refused (or demoted) only when the work queued ahead of
//! it makes its deadline unmeetable; a request that would be late even on an idle server is
//! admitted (refusing it would not help: a retry would be just as late).

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
    /// Target of a request's mean time per output token after the first, ms: turns on adaptive
    /// batch control.
    pub target_tpot_ms: Option<f64>,
    /// p95 time-to-first-token target, ms: the default class's first-token deadline.
    pub target_ttft_ms: Option<f64>,
    /// Classes by priority.
    pub classes: BTreeMap<i64, SloClass>,
    pub admission: SloAdmission,
}

impl SloConfig {
    /// Whether anything here needs the controller (targets or classes).
    pub fn is_active(&self) -> bool {
        self.target_itl_ms.is_some()
            || self.target_tpot_ms.is_some()
            || self.target_ttft_ms.is_some()
            || !self.classes.is_empty()
    }

    /// The TPOT target the batch controller holds, ms: the lowest of `target_tpot_ms` and the
    /// classes' `tpot_ms`.
    pub fn controller_tpot_ms(&self) -> Option<f64> {
        let classes = self.classes.values().filter_map(|c| c.tpot_ms).map(f64::from);
        self.target_tpot_ms.into_iter().chain(classes).reduce(f64::min)
    }

    /// The TPOT objective of a request of `priority`, ms: its class's, or `target_tpot_ms`.
    pub fn tpot_ms_for(&self, priority: i64) -> Option<f64> {
        let class = self.classes.get(&priority).and_then(|c| c.tpot_ms).map(f64::from);
        class.or(self.target_tpot_ms)
    }

    /// The objectives of a request of `priority`: its class's, or the default class's (`None`
    /// without a TTFT target).
    pub fn class_for(&self, priority: i64) -> Option<SloClass> {
        self.classes.get(&priority).copied().or_else(|| {
            Some(SloClass {
                ttft_ms: self.target_ttft_ms?.ceil() as u64,
                tpot_ms: self.target_tpot_ms.map(|t| t.ceil() as u32),
            })
        })
    }
}

/// What admission control does with a request that has a deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionDecision {
    Admit,
    /// Queue it with its deadline pushed back.
    Demote,
    /// Refuse it: the first token is predicted `predicted_ms` after arrival.
    Reject {
        predicted_ms: u64,
    },
}

/// Admission control for a request due `ttft_ms` after arrival, whose first token is predicted
/// `alone_ms` after arrival on an idle server and `queued_ms` behind the work queued ahead of it
/// (`None`: no prediction yet, e.g. before the cost model has seen enough steps).
pub fn decide(
    mode: SloAdmission,
    ttft_ms: u64,
    alone_ms: Option<u64>,
    queued_ms: Option<u64>,
) -> AdmissionDecision {
    let (Some(alone), Some(queued)) = (alone_ms, queued_ms) else {
        return AdmissionDecision::Admit;
    };
    if queued <= ttft_ms || alone > ttft_ms {
        return AdmissionDecision::Admit;
    }
    match mode {
        SloAdmission::Reject => AdmissionDecision::Reject { predicted_ms: queued },
        SloAdmission::Demote => AdmissionDecision::Demote,
        SloAdmission::Off => AdmissionDecision::Admit,
    }
}

/// A request's first-token time as admission control sees it, ms (all `None` until the batch
/// controller's cost model is fitted).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Prediction {
    /// On an idle server, scaled by the admission calibration.
    pub alone_ms: Option<u64>,
    /// Behind the work queued ahead of it, scaled by the admission calibration.
    pub queued_ms: Option<u64>,
    /// The same before the calibration, seconds: what the calibration learns from.
    pub uncalibrated: Option<f64>,
}

/// A request admission control let in with a deadline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Admitted {
    pub deadline: kiln_sched::Deadline,
    /// Queued behind work that can be on time, its deadline pushed back.
    pub demoted: bool,
    /// [`Prediction::uncalibrated`] when it is held to its deadline (`None` when demoted).
    pub predicted: Option<f64>,
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

/// A JSON value read only to refuse duplicate object keys at any depth (a `Value` keeps the
/// last of them silently).
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueKeysVisitor)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = UniqueKeys;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<UniqueKeys, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
            }
            map.next_value::<UniqueKeys>()?;
        }
        Ok(UniqueKeys)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueKeys, A::Error> {
        while seq.next_element::<UniqueKeys>()?.is_some() {}
        Ok(UniqueKeys)
    }

    fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
}

/// Parses `--slo-classes` (module docs). A key given twice, or two keys naming one priority
/// (`"1"` and `"01"`), is an error rather than the last one silently winning.
pub fn parse_slo_classes(text: &str) -> Result<BTreeMap<i64, SloClass>, SloClassesError> {
    serde_json::from_str::<UniqueKeys>(text)
        .map_err(|e| err("(json)", format!("is not valid JSON: {e}")))?;
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
        if classes.insert(priority, SloClass { ttft_ms, tpot_ms }).is_some() {
            return Err(err(&key, format!("names priority {priority} a second time")));
        }
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
            (r#"{"1": {"ttft_ms": 10}, "1": {"ttft_ms": 20}}"#, "(json)"),
            (r#"{"1": {"ttft_ms": 10, "ttft_ms": 20}}"#, "(json)"),
        ];
        for (text, field) in cases {
            let e = parse_slo_classes(text).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
        }
        let e = parse_slo_classes(r#"{"1": {"ttft_ms": 10}, "01": {"ttft_ms": 20}}"#).unwrap_err();
        assert!(e.message.contains("priority 1 a second time"), "{e}");
    }

    #[test]
    fn only_the_queue_ahead_makes_a_request_refused() {
        use AdmissionDecision::{Admit, Demote, Reject};
        let d = |mode, alone, queued| decide(mode, 1000, alone, queued);
        assert_eq!(d(SloAdmission::Reject, Some(100), Some(900)), Admit);
        assert_eq!(d(SloAdmission::Reject, Some(100), Some(1000)), Admit);
        assert_eq!(d(SloAdmission::Reject, Some(100), Some(1001)), Reject { predicted_ms: 1001 });
        assert_eq!(d(SloAdmission::Demote, Some(100), Some(5000)), Demote);
        assert_eq!(d(SloAdmission::Off, Some(100), Some(5000)), Admit);
        // Late even alone: a retry would be as late, so it is admitted.
        assert_eq!(d(SloAdmission::Reject, Some(1200), Some(5000)), Admit);
        // No prediction yet.
        assert_eq!(d(SloAdmission::Reject, None, None), Admit);
    }

    #[test]
    fn the_controller_holds_the_strictest_tpot_target() {
        let mut config = SloConfig::default();
        assert_eq!(config.controller_tpot_ms(), None);
        config.classes.insert(0, SloClass { ttft_ms: 500, tpot_ms: Some(40) });
        config.classes.insert(1, SloClass { ttft_ms: 9000, tpot_ms: None });
        assert_eq!(config.controller_tpot_ms(), Some(40.0));
        config.target_tpot_ms = Some(60.0);
        assert_eq!(config.controller_tpot_ms(), Some(40.0));
        assert_eq!((config.tpot_ms_for(0), config.tpot_ms_for(1)), (Some(40.0), Some(60.0)));
        config.target_tpot_ms = Some(25.0);
        assert_eq!(config.controller_tpot_ms(), Some(25.0));
        // The ITL target is a separate per-step bound.
        config.target_itl_ms = Some(10.0);
        assert_eq!(config.controller_tpot_ms(), Some(25.0));
    }

    #[test]
    fn a_priority_without_a_class_gets_the_default_targets() {
        let mut config = SloConfig::default();
        assert_eq!(config.class_for(0), None);
        config.target_ttft_ms = Some(800.0);
        config.target_tpot_ms = Some(59.5);
        config.classes.insert(1, SloClass { ttft_ms: 20_000, tpot_ms: None });
        assert_eq!(config.class_for(0), Some(SloClass { ttft_ms: 800, tpot_ms: Some(60) }));
        assert_eq!(config.class_for(1), Some(SloClass { ttft_ms: 20_000, tpot_ms: None }));
    }
}
