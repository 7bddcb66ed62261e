use std::collections::BTreeMap;
use std::time::Duration;

use kiln_engine::{EngineStats, PrefixCacheStats};

use super::process::{ProcessStats, parse_boot_time, parse_stat, parse_status_kb};
use super::{FinishedRequest, Metrics, build_1_2_5_buckets};

mod names;

const MODEL: &str = "test-model";

/// One sample line of the text format.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A small parser for sample lines (`name{k="v",...} value`), unescaping label values; panics on
/// anything malformed so a broken exposition fails the test.
fn parse(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        assert!(!line.is_empty(), "empty line in exposition");
        let name_end = line.find(['{', ' ']).expect("sample without value");
        let name = &line[..name_end];
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                && !name.starts_with(|c: char| c.is_ascii_digit()),
            "bad metric name {name:?}"
        );
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            loop {
                let (start, c) = chars.next().expect("unterminated labels");
                if c == '}' {
                    rest = &body[start + 1..];
                    break;
                }
                if c == ',' {
                    continue;
                }
                let eq = body[start..].find("=\"").expect("label without value") + start;
                let key = body[start..eq].to_owned();
                // Skip the rest of the key and `="`.
                chars.nth(eq - start);
                let mut value = String::new();
                loop {
                    match chars.next().expect("unterminated label value").1 {
                        '"' => break,
                        '\\' => match chars.next().expect("dangling escape").1 {
                            'n' => value.push('\n'),
                            c @ ('\\' | '"') => value.push(c),
                            c => panic!("bad escape \\{c}"),
                        },
                        c => value.push(c),
                    }
                }
                assert!(labels.insert(key, value).is_none(), "duplicate label");
            }
        }
        let value = rest.trim_start();
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        samples.push(Sample { name: name.to_owned(), labels, value });
    }
    samples
}

fn render(m: &Metrics) -> Vec<Sample> {
    let text = m.render();
    assert!(text.ends_with("# EOF\n"), "missing EOF marker");
    assert_eq!(text.matches("# EOF").count(), 1);
    parse(&text)
}

/// The value of the one sample with `name` and exactly `labels` plus `model_name`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut want: BTreeMap<String, String> =
        labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    want.insert("model_name".into(), MODEL.into());
    let found: Vec<_> = samples.iter().filter(|s| s.name == name && s.labels == want).collect();
    assert_eq!(found.len(), 1, "{name} {want:?}: {found:?}");
    found[0].value
}

/// `(le, cumulative count)` of a histogram, in rendered order.
fn buckets(samples: &[Sample], name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    samples
        .iter()
        .filter(|s| s.name == bucket)
        .map(|s| {
            assert_eq!(s.labels.get("model_name").map(String::as_str), Some(MODEL));
            let le = &s.labels["le"];
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("le") };
            (le, s.value)
        })
        .collect()
}

fn bucket_at(samples: &[Sample], name: &str, le: f64) -> f64 {
    buckets(samples, name)
        .into_iter()
        .find(|(b, _)| *b == le)
        .unwrap_or_else(|| panic!("{name} has no bucket le={le}"))
        .1
}

fn stats(
    queries: u64,
    hits: u64,
    preemptions: u64,
    num_steps: u64,
    step_tokens: usize,
) -> EngineStats {
    EngineStats {
        num_running: 3,
        num_waiting: 2,
        kv_usage: 0.25,
        prefix_cache: PrefixCacheStats {
            num_queried_tokens: queries,
            num_hit_tokens: hits,
            ..PrefixCacheStats::default()
        },
        num_preemptions: preemptions,
        step_scheduled_tokens: step_tokens,
        num_steps,
        ..EngineStats::default()
    }
}

fn finished(reason: &str) -> FinishedRequest<'_> {
    FinishedRequest {
        finished_reason: reason,
        num_prompt_tokens: 10,
        num_generation_tokens: 4,
        e2e: Duration::from_millis(400),
        queue: Some(Duration::from_millis(10)),
        ttft: Some(Duration::from_millis(50)),
        prefill: Some(Duration::from_millis(40)),
        decode: Some(Duration::from_millis(350)),
        inference: Some(Duration::from_millis(390)),
    }
}

const GAUGES: [&str; 3] =
    ["kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:kv_cache_usage_perc"];
const COUNTERS: [&str; 8] = [
    "kiln:spec_decode_num_drafts_total",
    "kiln:spec_decode_num_draft_tokens_total",
    "kiln:spec_decode_num_accepted_tokens_total",
    "kiln:prefix_cache_queries_total",
    "kiln:prefix_cache_hits_total",
    "kiln:num_preemptions_total",
    "kiln:prompt_tokens_total",
    "kiln:generation_tokens_total",
];
const HISTOGRAMS: [&str; 9] = [
    "kiln:time_to_first_token_seconds",
    "kiln:inter_token_latency_seconds",
    "kiln:e2e_request_latency_seconds",
    "kiln:request_queue_time_seconds",
    "kiln:request_prefill_time_seconds",
    "kiln:request_decode_time_seconds",
    "kiln:iteration_tokens_total",
    "kiln:request_prompt_tokens",
    "kiln:request_generation_tokens",
];

#[test]
fn every_name_is_present_with_model_name() {
    let m = Metrics::new(MODEL, 4096);
    let text = m.render();
    let samples = render(&m);
    for name in GAUGES.iter().chain(&COUNTERS) {
        assert_eq!(value(&samples, name, &[]), 0.0, "{name}");
    }
    for reason in ["stop", "length", "abort"] {
        let v = value(&samples, "kiln:request_success_total", &[("finished_reason", reason)]);
        assert_eq!(v, 0.0);
    }
    for name in HISTOGRAMS {
        assert_eq!(value(&samples, &format!("{name}_count"), &[]), 0.0);
        assert_eq!(value(&samples, &format!("{name}_sum"), &[]), 0.0);
        assert!(!buckets(&samples, name).is_empty(), "{name}");
    }
    // Every `kiln:` series is labelled; the `process_` ones are not.
    for s in &samples {
        if s.name.starts_with("kiln:") {
            assert_eq!(s.labels["model_name"], MODEL, "{}", s.name);
        } else {
            assert!(s.name.starts_with("process_"), "{}", s.name);
            assert!(s.labels.is_empty(), "{}", s.name);
        }
    }
    // Counter families are typed under the name without `_total`, as OpenMetrics requires.
    assert!(text.contains("# TYPE kiln:num_preemptions counter\n"));
    assert!(text.contains("# TYPE kiln:iteration_tokens_total histogram\n"));
    assert!(text.contains("# TYPE kiln:kv_cache_usage_perc gauge\n"));
}

#[test]
fn step_counters_advance_by_deltas() {
    let m = Metrics::new(MODEL, 4096);
    m.on_step(&stats(100, 40, 1, 1, 0));
    m.on_step(&stats(100, 40, 1, 1, 0));
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 100.0);
    assert_eq!(value(&s, "kiln:prefix_cache_hits_total", &[]), 40.0);
    assert_eq!(value(&s, "kiln:num_preemptions_total", &[]), 1.0);
    assert_eq!(value(&s, "kiln:num_requests_running", &[]), 3.0);
    assert_eq!(value(&s, "kiln:num_requests_waiting", &[]), 2.0);
    assert_eq!(value(&s, "kiln:kv_cache_usage_perc", &[]), 0.25);

    m.on_step(&stats(150, 90, 3, 2, 0));
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 150.0);
    assert_eq!(value(&s, "kiln:prefix_cache_hits_total", &[]), 90.0);
    assert_eq!(value(&s, "kiln:num_preemptions_total", &[]), 3.0);

    // A smaller total is ignored; growth afterwards counts from the largest total seen.
    m.on_step(&stats(120, 10, 0, 3, 0));
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 150.0);
    assert_eq!(value(&s, "kiln:num_preemptions_total", &[]), 3.0);
    m.on_step(&stats(160, 95, 3, 4, 0));
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 160.0);
    assert_eq!(value(&s, "kiln:prefix_cache_hits_total", &[]), 95.0);

    let mut idle = stats(160, 95, 3, 5, 0);
    idle.num_running = 0;
    idle.num_waiting = 0;
    idle.kv_usage = 0.0;
    m.on_step(&idle);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:num_requests_running", &[]), 0.0);
    assert_eq!(value(&s, "kiln:kv_cache_usage_perc", &[]), 0.0);
}

#[test]
fn iteration_tokens_observe_each_step_once() {
    let m = Metrics::new(MODEL, 4096);
    m.on_step(&stats(0, 0, 0, 1, 10));
    m.on_step(&stats(0, 0, 0, 1, 10)); // same step again
    m.on_step(&stats(0, 0, 0, 2, 0)); // a step that scheduled nothing
    m.on_step(&stats(0, 0, 0, 3, 300));
    let s = render(&m);
    let name = "kiln:iteration_tokens_total";
    assert_eq!(value(&s, &format!("{name}_count"), &[]), 2.0);
    assert_eq!(value(&s, &format!("{name}_sum"), &[]), 310.0);
    assert_eq!(bucket_at(&s, name, 8.0), 0.0);
    assert_eq!(bucket_at(&s, name, 16.0), 1.0);
    assert_eq!(bucket_at(&s, name, 256.0), 1.0);
    assert_eq!(bucket_at(&s, name, 512.0), 2.0);
    assert_eq!(bucket_at(&s, name, f64::INFINITY), 2.0);
    let les: Vec<f64> = buckets(&s, name).iter().map(|b| b.0).collect();
    assert_eq!(
        les,
        [
            1.0,
            8.0,
            16.0,
            32.0,
            64.0,
            128.0,
            256.0,
            512.0,
            1024.0,
            2048.0,
            4096.0,
            8192.0,
            16384.0,
            f64::INFINITY
        ]
    );
}

#[test]
fn request_histograms_are_cumulative_with_count_and_sum() {
    let m = Metrics::new(MODEL, 4096);
    let mut slow = finished("length");
    slow.e2e = Duration::from_secs(2);
    slow.num_prompt_tokens = 3000;
    slow.num_generation_tokens = 1000;
    let mut huge = finished("abort");
    huge.e2e = Duration::from_secs(10_000);
    huge.num_prompt_tokens = 5000; // beyond max_model_len: only +Inf
    huge.ttft = None;
    huge.prefill = None;
    huge.decode = None;
    huge.queue = None;
    m.on_request_finished(&finished("stop"));
    m.on_request_finished(&slow);
    m.on_request_finished(&huge);
    let s = render(&m);

    let e2e = "kiln:e2e_request_latency_seconds";
    assert_eq!(value(&s, &format!("{e2e}_count"), &[]), 3.0);
    let sum = value(&s, &format!("{e2e}_sum"), &[]);
    assert!((sum - 10_002.4).abs() < 1e-9, "{sum}");
    assert_eq!(bucket_at(&s, e2e, 0.3), 0.0);
    assert_eq!(bucket_at(&s, e2e, 0.5), 1.0);
    assert_eq!(bucket_at(&s, e2e, 1.5), 1.0);
    assert_eq!(bucket_at(&s, e2e, 2.0), 2.0); // le is inclusive
    assert_eq!(bucket_at(&s, e2e, 7680.0), 2.0);
    assert_eq!(bucket_at(&s, e2e, f64::INFINITY), 3.0);

    // Phases the aborted request never reached are not observed.
    for name in [
        "kiln:time_to_first_token_seconds",
        "kiln:request_queue_time_seconds",
        "kiln:request_prefill_time_seconds",
        "kiln:request_decode_time_seconds",
    ] {
        assert_eq!(value(&s, &format!("{name}_count"), &[]), 2.0, "{name}");
    }
    let ttft = value(&s, "kiln:time_to_first_token_seconds_sum", &[]);
    assert!((ttft - 0.1).abs() < 1e-12, "{ttft}");
    assert_eq!(bucket_at(&s, "kiln:time_to_first_token_seconds", 0.04), 0.0);
    assert_eq!(bucket_at(&s, "kiln:time_to_first_token_seconds", 0.06), 2.0);

    let prompt = "kiln:request_prompt_tokens";
    assert_eq!(value(&s, &format!("{prompt}_sum"), &[]), 8010.0);
    assert_eq!(bucket_at(&s, prompt, 10.0), 1.0);
    assert_eq!(bucket_at(&s, prompt, 2000.0), 1.0);
    assert_eq!(bucket_at(&s, prompt, f64::INFINITY), 3.0);
    let generation = "kiln:request_generation_tokens";
    assert_eq!(bucket_at(&s, generation, 5.0), 2.0);
    assert_eq!(bucket_at(&s, generation, 1000.0), 3.0);
    // 1-2-5 buckets up to max_model_len.
    let les: Vec<f64> = buckets(&s, prompt).iter().map(|b| b.0).collect();
    assert_eq!(
        les,
        [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, f64::INFINITY]
    );

    // Every histogram: buckets ascend, counts never decrease, +Inf equals _count.
    for name in HISTOGRAMS {
        let b = buckets(&s, name);
        assert!(b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{name}: {b:?}");
        let last = b.last().expect("buckets");
        assert_eq!(last.0, f64::INFINITY);
        assert_eq!(last.1, value(&s, &format!("{name}_count"), &[]), "{name}");
    }

    let success = "kiln:request_success_total";
    assert_eq!(value(&s, success, &[("finished_reason", "stop")]), 1.0);
    assert_eq!(value(&s, success, &[("finished_reason", "length")]), 1.0);
    assert_eq!(value(&s, success, &[("finished_reason", "abort")]), 1.0);
    m.on_request_finished(&finished("stop"));
    let s = render(&m);
    assert_eq!(value(&s, success, &[("finished_reason", "stop")]), 2.0);
    assert_eq!(value(&s, success, &[("finished_reason", "length")]), 1.0);
}

#[test]
fn token_counters_and_inter_token_latency() {
    let m = Metrics::new(MODEL, 4096);
    m.on_prompt_tokens(7);
    m.on_generation_token(None);
    m.on_generation_token(Some(Duration::from_millis(20)));
    m.on_generation_token(Some(Duration::from_millis(30)));
    m.on_prompt_tokens(5);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prompt_tokens_total", &[]), 12.0);
    assert_eq!(value(&s, "kiln:generation_tokens_total", &[]), 3.0);
    let itl = "kiln:inter_token_latency_seconds";
    assert_eq!(value(&s, &format!("{itl}_count"), &[]), 2.0);
    let sum = value(&s, &format!("{itl}_sum"), &[]);
    assert!((sum - 0.05).abs() < 1e-12, "{sum}");
    assert_eq!(bucket_at(&s, itl, 0.01), 0.0);
    assert_eq!(bucket_at(&s, itl, 0.025), 1.0);
    assert_eq!(bucket_at(&s, itl, 0.05), 2.0);
}

#[test]
fn instances_do_not_share_state() {
    let a = Metrics::new(MODEL, 4096);
    let b = Metrics::new(MODEL, 4096);
    a.on_prompt_tokens(5);
    a.on_step(&stats(10, 5, 1, 1, 4));
    assert_eq!(value(&render(&a), "kiln:prompt_tokens_total", &[]), 5.0);
    let s = render(&b);
    assert_eq!(value(&s, "kiln:prompt_tokens_total", &[]), 0.0);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 0.0);
    assert_eq!(value(&s, "kiln:iteration_tokens_total_count", &[]), 0.0);
}

#[test]
fn model_name_is_escaped() {
    let name = "dir\\my \"model\"\nv2";
    let m = Metrics::new(name, 16);
    let text = m.render();
    assert!(text.contains(r#"model_name="dir\\my \"model\"\nv2""#), "{text}");
    let s = parse(&text);
    let running: Vec<_> = s.iter().filter(|s| s.name == "kiln:num_requests_running").collect();
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].labels["model_name"], name);
}

#[test]
fn one_two_five_buckets_match_vllm() {
    assert_eq!(build_1_2_5_buckets(100), [1, 2, 5, 10, 20, 50, 100]);
    assert_eq!(build_1_2_5_buckets(4096), [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]);
    assert_eq!(build_1_2_5_buckets(1), [1]);
    assert!(build_1_2_5_buckets(0).is_empty());
    let all = build_1_2_5_buckets(usize::MAX);
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    assert!(all.len() > 50);
}

#[test]
fn metrics_are_send_sync_and_render_concurrently() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Metrics>();
    let m = std::sync::Arc::new(Metrics::new(MODEL, 4096));
    let writer = {
        let m = std::sync::Arc::clone(&m);
        std::thread::spawn(move || {
            for step in 1..=200u64 {
                m.on_step(&stats(step * 10, step, 0, step, 1));
                m.on_generation_token(Some(Duration::from_millis(1)));
            }
        })
    };
    for _ in 0..20 {
        render(&m);
    }
    writer.join().expect("writer thread");
    let s = render(&m);
    assert_eq!(value(&s, "kiln:prefix_cache_queries_total", &[]), 2000.0);
    assert_eq!(value(&s, "kiln:iteration_tokens_total_count", &[]), 200.0);
    assert_eq!(value(&s, "kiln:generation_tokens_total", &[]), 200.0);
}

#[cfg(target_os = "linux")]
#[test]
fn process_metrics_are_plausible() {
    let s = render(&Metrics::new(MODEL, 4096));
    let get = |name: &str| {
        let found: Vec<_> = s.iter().filter(|x| x.name == name).collect();
        assert_eq!(found.len(), 1, "{name}");
        assert!(found[0].labels.is_empty());
        found[0].value
    };
    let rss = get("process_resident_memory_bytes");
    let vsize = get("process_virtual_memory_bytes");
    assert!(rss > 1e5, "rss {rss}");
    assert!(vsize >= rss, "vsize {vsize} < rss {rss}");
    assert!(get("process_cpu_seconds_total") >= 0.0);
    assert!(get("process_open_fds") >= 3.0); // stdin, stdout, stderr at least
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let start = get("process_start_time_seconds");
    assert!(start > 1.6e9 && start <= now + 1.0, "start {start}, now {now}");
    assert!(now - start < 24.0 * 3600.0, "test process started a day ago?");
}

#[cfg(target_os = "linux")]
#[test]
fn process_stats_read_all_fields() {
    let p = ProcessStats::read();
    assert!(p.cpu_seconds.is_some());
    assert!(p.resident_memory_bytes.is_some_and(|b| b > 0));
    assert!(p.virtual_memory_bytes.is_some_and(|b| b > 0));
    assert!(p.start_time_seconds.is_some());
    assert!(p.open_fds.is_some_and(|n| n > 0));
}

#[test]
fn proc_parsers_take_odd_contents() {
    let line = "4242 (a) b) (c) S 1 2 3 4 5 6 7 8 9 10 150 50 0 0 20 0 1 0 123456 987654 321 \
                18446744073709551615 1 2 3";
    let f = parse_stat(line);
    assert_eq!(f.utime, Some(150));
    assert_eq!(f.stime, Some(50));
    assert_eq!(f.starttime, Some(123_456));
    assert_eq!(f.vsize, Some(987_654));
    for bad in [
        "",
        ")",
        "12 (x",
        "12 (x) S 1 2",
        "12 (x) S a b c d e f g h i j k l m n o p q r s t u v",
        "\u{0}\u{ffff})",
    ] {
        let f = parse_stat(bad);
        assert_eq!((f.utime, f.stime, f.starttime, f.vsize), (None, None, None, None), "{bad:?}");
    }
    // A truncated line keeps the fields it has.
    let f = parse_stat("1 (x) S 1 2 3 4 5 6 7 8 9 10 11 12");
    assert_eq!((f.utime, f.stime, f.vsize), (Some(11), Some(12), None));

    let status = "Name:\tkiln\nVmSize:\t  3892 kB\nVmRSS:\t    1940 kB\n";
    assert_eq!(parse_status_kb(status, "VmRSS"), Some(1940));
    assert_eq!(parse_status_kb(status, "VmSize"), Some(3892));
    assert_eq!(parse_status_kb(status, "VmSwap"), None);
    assert_eq!(parse_status_kb("VmRSS:\n", "VmRSS"), None);
    assert_eq!(parse_status_kb("VmRSS: lots kB\n", "VmRSS"), None);
    assert_eq!(parse_status_kb("VmRSS: 12 MB\n", "VmRSS"), None);
    assert_eq!(parse_status_kb("", "VmRSS"), None);

    assert_eq!(parse_boot_time("cpu 1 2 3\nbtime 1700000000\nprocesses 5\n"), Some(1_700_000_000));
    assert_eq!(parse_boot_time("btime\n"), None);
    assert_eq!(parse_boot_time("btime -1\n"), None);
    assert_eq!(parse_boot_time(""), None);
}

#[test]
fn spec_decode_counters_follow_the_engine_totals() {
    let m = Metrics::new(MODEL, 4096);
    let mut st = stats(0, 0, 0, 1, 0);
    st.spec_decode.record(4, 3);
    st.spec_decode.record(4, 1);
    m.on_step(&st);
    m.on_step(&st);
    st.spec_decode.record(2, 2);
    m.on_step(&st);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:spec_decode_num_drafts_total", &[]), 3.0);
    assert_eq!(value(&s, "kiln:spec_decode_num_draft_tokens_total", &[]), 10.0);
    assert_eq!(value(&s, "kiln:spec_decode_num_accepted_tokens_total", &[]), 6.0);
    let per_pos = "kiln:spec_decode_num_accepted_tokens_per_pos_total";
    assert_eq!(value(&s, per_pos, &[("position", "0")]), 3.0);
    assert_eq!(value(&s, per_pos, &[("position", "1")]), 2.0);
    assert_eq!(value(&s, per_pos, &[("position", "2")]), 1.0);
    assert!(
        !s.iter().any(|x| x.name == per_pos && x.labels.get("position").is_some_and(|p| p == "3"))
    );
}

#[test]
fn request_params_and_per_request_tpot() {
    let m = Metrics::new(MODEL, 1024);
    m.on_request_params(2, Some(64), 128);
    m.on_request_params(1, None, 100);
    m.on_request_finished(&finished("stop"));
    let s = render(&m);
    assert_eq!(value(&s, "kiln:request_params_n_count", &[]), 2.0);
    assert_eq!(value(&s, "kiln:request_params_n_sum", &[]), 3.0);
    assert_eq!(value(&s, "kiln:request_params_max_tokens_count", &[]), 1.0);
    assert_eq!(value(&s, "kiln:request_max_num_generation_tokens_sum", &[]), 228.0);
    // 350 ms of decode over 3 gaps.
    let tpot = value(&s, "kiln:request_time_per_output_token_seconds_sum", &[]);
    assert!((tpot - 0.35 / 3.0).abs() < 1e-9, "{tpot}");
    assert_eq!(value(&s, "kiln:request_inference_time_seconds_count", &[]), 1.0);
}

#[test]
fn batch_control_and_slo_series_follow_the_engine() {
    use kiln_engine::{ControllerStats, StepLimits};
    let m = Metrics::new(MODEL, 4096);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:slo_target_misses_total", &[("target", "itl")]), 0.0);
    assert_eq!(value(&s, "kiln:slo_admission_total", &[("action", "rejected")]), 0.0);
    let limits = StepLimits { max_num_batched_tokens: 96, max_num_seqs: 12 };
    let mut now = EngineStats {
        limits,
        controller: Some(ControllerStats {
            limits,
            gain: 0.8,
            itl_misses: 5,
            ttft_misses: 2,
            tpot_misses: 6,
            bank: -0.25,
            ttft_calibration: 1.5,
            num_moves: 3,
        }),
        num_slo_rejected: 4,
        num_slo_demoted: 1,
        ..stats(0, 0, 0, 1, 0)
    };
    m.on_step(&now);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:scheduler_token_budget", &[]), 96.0);
    assert_eq!(value(&s, "kiln:scheduler_max_running", &[]), 12.0);
    assert_eq!(value(&s, "kiln:scheduler_controller_gain", &[]), 0.8);
    assert_eq!(value(&s, "kiln:slo_target_misses_total", &[("target", "itl")]), 5.0);
    assert_eq!(value(&s, "kiln:slo_target_misses_total", &[("target", "ttft")]), 2.0);
    assert_eq!(value(&s, "kiln:slo_target_misses_total", &[("target", "tpot")]), 6.0);
    assert_eq!(value(&s, "kiln:scheduler_controller_bank_seconds", &[]), -0.25);
    assert_eq!(value(&s, "kiln:scheduler_controller_ttft_calibration", &[]), 1.5);
    assert_eq!(value(&s, "kiln:slo_admission_total", &[("action", "rejected")]), 4.0);
    assert_eq!(value(&s, "kiln:slo_admission_total", &[("action", "demoted")]), 1.0);

    let before = now;
    assert_eq!(super::controller_log_line(&before, &now), None);
    if let Some(c) = &mut now.controller {
        c.num_moves += 1;
        c.limits.max_num_seqs = 9;
    }
    let line = super::controller_log_line(&before, &now).unwrap();
    assert!(line.contains("max running 12 -> 9"), "{line}");
}

#[test]
fn second_tier_series_follow_the_engine_totals() {
    let m = Metrics::new(MODEL, 4096);
    let s = render(&m);
    for mode in ["swap", "recompute"] {
        assert_eq!(value(&s, "kiln:num_preemptions_by_mode_total", &[("mode", mode)]), 0.0);
    }
    let mut st = stats(0, 0, 3, 1, 0);
    st.swap = kiln_engine::SwapStats {
        num_slots: 8,
        num_used_slots: 2,
        num_swapped_out_blocks: 5,
        num_swapped_in_blocks: 3,
        num_swap_preemptions: 2,
        num_recompute_preemptions: 1,
        num_spilled_slots: 1,
        num_spilled_blocks: 7,
        num_tier_hit_tokens: 64,
    };
    m.on_step(&st);
    m.on_step(&st);
    st.swap.num_swapped_in_blocks = 5;
    st.swap.num_used_slots = 0;
    st.swap.num_spilled_slots = 0;
    m.on_step(&st);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:kv_swapped_out_blocks_total", &[]), 5.0);
    assert_eq!(value(&s, "kiln:kv_swapped_in_blocks_total", &[]), 5.0);
    assert_eq!(value(&s, "kiln:num_preemptions_by_mode_total", &[("mode", "swap")]), 2.0);
    assert_eq!(value(&s, "kiln:num_preemptions_by_mode_total", &[("mode", "recompute")]), 1.0);
    assert_eq!(value(&s, "kiln:kv_tier_spilled_blocks_total", &[]), 7.0);
    assert_eq!(value(&s, "kiln:kv_tier_prefix_hits_total", &[]), 64.0);
    assert_eq!(value(&s, "kiln:kv_tier_usage_perc", &[]), 0.0);
    (st.swap.num_used_slots, st.swap.num_spilled_slots) = (1, 1);
    m.on_step(&st);
    assert_eq!(value(&render(&m), "kiln:kv_tier_usage_perc", &[]), 0.25);
}

#[test]
fn busy_seconds_follow_the_engine_time_totals() {
    let m = Metrics::new(MODEL, 4096);
    let mut st = stats(0, 0, 3, 1, 0);
    st.total_step_time = Duration::from_millis(1500);
    st.total_forward_time = Duration::from_secs(1);
    m.on_step(&st);
    m.on_step(&st);
    st.total_step_time = Duration::from_millis(2500);
    m.on_step(&st);
    st.total_forward_time = Duration::from_millis(900);
    m.on_step(&st);
    let s = render(&m);
    assert!((value(&s, "kiln:engine_busy_seconds_total", &[]) - 2.5).abs() < 1e-9);
    assert!((value(&s, "kiln:engine_forward_seconds_total", &[]) - 1.0).abs() < 1e-9);
}

#[test]
fn structured_output_series_follow_the_engine_totals() {
    let m = Metrics::new(MODEL, 4096);
    let mut st = stats(0, 0, 3, 1, 0);
    st.structured = kiln_engine::structured::ConstraintStats {
        tokens: 40,
        masks: 6,
        mask_time: Duration::from_millis(12),
        checks: 34,
        check_time: Duration::from_millis(1),
    };
    m.on_step(&st);
    m.on_step(&st);
    st.structured.tokens = 50;
    st.structured.masks = 7;
    st.structured.mask_time = Duration::from_millis(15);
    m.on_step(&st);
    let s = render(&m);
    assert_eq!(value(&s, "kiln:structured_output_tokens_total", &[]), 50.0);
    assert_eq!(value(&s, "kiln:structured_output_masks_total", &[]), 7.0);
    assert!((value(&s, "kiln:structured_output_mask_seconds_total", &[]) - 0.015).abs() < 1e-9);
}

#[test]
fn lora_requests_info_keeps_one_series_of_the_adapters_in_use() {
    let m = Metrics::new(MODEL, 1024);
    let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    m.on_lora(&names(&["sql", "chat"]), &names(&["law"]), Some(4));
    m.on_lora(&names(&["sql"]), &[], Some(4));
    let s = render(&m);
    let series: Vec<&Sample> = s.iter().filter(|x| x.name == "kiln:lora_requests_info").collect();
    assert_eq!(series.len(), 1, "{series:?}");
    let labels =
        [("running_lora_adapters", "sql"), ("waiting_lora_adapters", ""), ("max_lora", "4")];
    let value = value(&s, "kiln:lora_requests_info", &labels);
    assert!(value > 1.7e9, "a Unix time: {value}");
}
