use super::*;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { temperature: 1.0, max_tokens: 100, ..Default::default() };
    f(&mut p);
    p
}

fn histogram(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = Sampler::new(p.clone(), &[], 1);
    let mut counts = vec![0; logits.len()];
    for _ in 0..n {
        counts[s.sample_random(logits) as usize] += 1;
    }
    counts
}

#[test]
fn greedy_is_argmax_with_lowest_index_on_ties() {
    let mut s = Sampler::new(SamplingParams::greedy(4), &[], 0);
    assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]), TokenId(1));
    assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
}

#[test]
fn top_k_top_p_and_min_p_restrict_the_support() {
    let logits = [2.0f32, 1.9, 1.8, -5.0, -6.0];
    let counts = histogram(&params(|p| p.top_k = 2), &logits, 2000);
    assert!(counts[0] > 0 && counts[1] > 0 && counts[2..].iter().all(|c| *c == 0));
    // Probabilities ~ [0.367, 0.332, 0.300, 0.0003, 0.0001]: top_p 0.6 keeps two tokens.
    let counts = histogram(&params(|p| p.top_p = 0.6), &logits, 2000);
    assert!(counts[0] > 0 && counts[1] > 0 && counts[2..].iter().all(|c| *c == 0));
    let counts = histogram(&params(|p| p.min_p = 0.5), &logits, 2000);
    assert!(counts[..3].iter().all(|c| *c > 0) && counts[3..].iter().all(|c| *c == 0));
}

#[test]
fn sampling_follows_the_distribution() {
    let logits = [0.0f32, (3.0f32).ln()];
    let counts = histogram(&params(|_| {}), &logits, 20_000);
    let frac = counts[1] as f64 / 20_000.0;
    assert!((frac - 0.75).abs() < 0.02, "{frac}");
    // Temperature 0.5 squares the odds: 9:1.
    let counts = histogram(&params(|p| p.temperature = 0.5), &logits, 20_000);
    let frac = counts[1] as f64 / 20_000.0;
    assert!((frac - 0.9).abs() < 0.02, "{frac}");
}

#[test]
fn top_p_beyond_the_first_guess_still_reaches_its_mass() {
    let logits = vec![0.0f32; 2000];
    let counts = histogram(&params(|p| p.top_p = 0.9), &logits, 20_000);
    let support = counts.iter().filter(|c| **c > 0).count();
    assert!((1700..=1800).contains(&support), "{support}");
}

#[test]
fn same_seed_same_tokens_and_seed_matters() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let run = |seed: u64| {
        let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[], 999);
        (0..20).map(|_| s.sample(&mut logits.clone()).0).collect::<Vec<_>>()
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

#[test]
fn penalties_follow_vllm_semantics() {
    let p = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    let mut s = Sampler::new(p, &[0], 0);
    s.observe(1);
    s.observe(1);
    let mut logits = [4.0f32, -1.0, 3.0];
    s.apply_bias_and_penalties(&mut logits);
    // Token 0 (prompt): 4 / 2. Token 1 (output twice): -1 * 2 - 0.5 - 0.5.
    assert_eq!(logits, [2.0, -3.0, 3.0]);
}

#[test]
fn logit_bias_moves_the_argmax() {
    let p = SamplingParams { logit_bias: vec![(TokenId(3), 5.0)], ..SamplingParams::greedy(4) };
    let mut s = Sampler::new(p, &[], 0);
    assert_eq!(s.sample(&mut [0.1, 3.0, 2.0, -1.0]), TokenId(3));
}

#[test]
fn min_tokens_masks_eos_and_stop_ids_until_reached() {
    let p = SamplingParams {
        min_tokens: 2,
        stop_token_ids: vec![TokenId(2)],
        ..SamplingParams::greedy(8)
    };
    let mut s = Sampler::new(p, &[], 0).with_eos_token_ids(&[1]);
    let logits = [0.0f32, 9.0, 8.0, 1.0];
    assert_eq!(s.sample(&mut logits.clone()), TokenId(3));
    assert_eq!(s.sample(&mut logits.clone()), TokenId(3));
    assert_eq!(s.sample(&mut logits.clone()), TokenId(1));
    // ignore_eos: EOS is not a stop, so it is not masked either.
    let p = SamplingParams { min_tokens: 1, ignore_eos: true, ..SamplingParams::greedy(8) };
    let mut s = Sampler::new(p, &[], 0).with_eos_token_ids(&[1]);
    assert_eq!(s.sample(&mut logits.clone()), TokenId(1));
}

#[test]
fn logprobs_are_taken_on_the_raw_logits() {
    let p = SamplingParams {
        logprobs: Some(2),
        logit_bias: vec![(TokenId(0), 10.0)],
        ..SamplingParams::greedy(4)
    };
    let mut s = Sampler::new(p, &[], 0);
    let raw = [1.0f32, 2.0, 0.0];
    let (token, lp) = s.sample_with_logprobs(&mut raw.clone());
    assert_eq!(token, TokenId(0));
    let lp = lp.unwrap();
    assert_eq!(lp, crate::logprobs::logprobs(&raw, TokenId(0), 2));
    assert_eq!(lp.chosen.rank, 2);
    assert_eq!(lp.top[0].token, TokenId(1));
}
