//! Service-level objectives for goodput (`--goodput ttft:500 tpot:50 e2el:10000`, in
//! milliseconds, as in vLLM): a request counts toward goodput when it meets every one given.

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Slos {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Slos {
    /// Parses `KEY:MS` items; keys `ttft`, `tpot`, `e2el`.
    pub fn parse(items: &[String]) -> Result<Self, String> {
        let mut slos = Self::default();
        for item in items.iter().flat_map(|i| i.split_whitespace()) {
            let Some((key, value)) = item.split_once(':') else {
                return Err(format!("--goodput `{item}`: expected KEY:MS (e.g. ttft:500)"));
            };
            let ms = match value.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => v,
                _ => {
                    return Err(format!(
                        "--goodput `{item}`: `{value}` is not a positive number of ms"
                    ));
                }
            };
            let slot = match key {
                "ttft" => &mut slos.ttft_ms,
                "tpot" => &mut slos.tpot_ms,
                "e2el" => &mut slos.e2el_ms,
                _ => return Err(format!("--goodput `{item}`: the key must be ttft, tpot or e2el")),
            };
            *slot = Some(ms);
        }
        Ok(slos)
    }

    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2el_ms.is_none()
    }

    /// Whether a request with these latencies (ms) meets every objective.
    pub fn met(&self, ttft_ms: f64, tpot_ms: f64, e2el_ms: f64) -> bool {
        let ok = |slo: Option<f64>, v: f64| slo.is_none_or(|s| v <= s);
        ok(self.ttft_ms, ttft_ms) && ok(self.tpot_ms, tpot_ms) && ok(self.e2el_ms, e2el_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks_objectives() {
        let s = Slos::parse(&["ttft:500".into(), "tpot:50 e2el:1e4".into()]).unwrap();
        assert_eq!(s, Slos { ttft_ms: Some(500.0), tpot_ms: Some(50.0), e2el_ms: Some(1e4) });
        assert!(s.met(500.0, 10.0, 100.0));
        assert!(!s.met(501.0, 10.0, 100.0));
        assert!(!s.met(1.0, 51.0, 100.0));
        assert!(Slos::default().met(1e9, 1e9, 1e9) && Slos::default().is_empty());
        for bad in ["ttft", "ttft:-1", "itl:5", "ttft:abc"] {
            assert!(Slos::parse(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
