use super::*;
use crate::structured::ConstraintStats;

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

/// Pearson's chi-square statistic of `counts` against probabilities `p`.
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &p)| {
            let expected = p * n as f64;
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

/// Verifying point-mass drafts is rejection sampling: over 20k seeds the first token follows the
/// target's first distribution whatever the draft, the second (after the accepted draft) the
/// second distribution, and each seed yields the tokens of sampling without drafts.
#[test]
fn verifying_drafts_keeps_the_target_distribution() {
    let p0 = [0.3, 0.25, 0.2, 0.1, 0.1, 0.05];
    let p1 = [0.05, 0.1, 0.4, 0.15, 0.2, 0.1];
    let rows: Vec<f32> = p0.iter().chain(&p1).map(|&p: &f64| p.ln() as f32).collect();
    let drafts = [1u32];
    let (mut first, mut second) = (vec![0; 6], vec![0; 6]);
    let mut out = Vec::new();
    for seed in 0..20_000u64 {
        let p = params(|p| p.seed = Some(seed));
        let mut s = Sampler::new(p.clone(), &[], 0);
        out.clear();
        s.verify(&mut rows.clone(), &drafts, &[u32::MAX], &mut out, &mut Vec::new());
        let tokens: Vec<u32> = out.iter().map(|(t, _)| t.0).collect();
        // Without drafts: one row at a time, as long as the drafts held.
        let mut alone = Sampler::new(p, &[], 0);
        let mut expected = vec![alone.sample(&mut rows[..6].to_vec()).0];
        if expected[0] == drafts[0] {
            expected.push(alone.sample(&mut rows[6..].to_vec()).0);
        }
        assert_eq!(tokens, expected, "seed {seed}");
        first[tokens[0] as usize] += 1;
        if tokens[0] == drafts[0] {
            assert_eq!(tokens.len(), 2);
            second[tokens[1] as usize] += 1;
        } else {
            assert_eq!(tokens.len(), 1, "stops at the first rejection");
        }
    }
    // 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
    assert!(chi_square(&first, &p0) < 20.5, "{first:?}");
    assert!(chi_square(&second, &p1) < 20.5, "{second:?}");
    assert!((4000..6000).contains(&second.iter().sum::<usize>()), "{second:?}");
}

#[test]
fn all_drafts_accepted_yields_one_more_token() {
    let mut s = Sampler::new(SamplingParams::greedy(8), &[], 0);
    // Rows: argmax 2, then 0, then 1.
    let mut rows = vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0];
    let mut out = Vec::new();
    let mut path = Vec::new();
    s.verify(&mut rows, &[2, 0], &[u32::MAX, 0], &mut out, &mut path);
    assert_eq!(out.iter().map(|(t, _)| t.0).collect::<Vec<_>>(), [2, 0, 1]);
    assert_eq!(path, [0, 1]);
    let mut rows = vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0];
    out.clear();
    path.clear();
    s.verify(&mut rows, &[1, 0], &[u32::MAX, 0], &mut out, &mut path);
    assert_eq!(out.iter().map(|(t, _)| t.0).collect::<Vec<_>>(), [2]);
    assert!(path.is_empty());
}

/// `[vocab]` logits for a step, deterministic, with `noise` of a second pattern added.
fn wavy_row(step: usize, vocab: usize, noise: f32) -> Vec<f32> {
    (0..vocab)
        .map(|i| {
            let base = ((i * 7 + step * 13) as f32 * 0.61).sin() * 2.0;
            base + noise * ((i * 3 + step * 5) as f32 * 1.7).cos()
        })
        .collect()
}

/// A drafting copy draws, from the rows its sampler then verifies, exactly the tokens the
/// sampler yields: every draft is accepted, whatever the params (filters, penalties, bias,
/// `min_tokens`, greedy), round after round as the sampler moves on.
#[test]
fn a_drafting_copy_draws_what_the_sampler_samples() {
    let vocab = 64;
    let kinds = [
        params(|_| {}),
        params(|p| (p.top_k, p.presence_penalty) = (5, 0.4)),
        params(|p| (p.top_p, p.repetition_penalty, p.temperature) = (0.8, 1.3, 0.7)),
        params(|p| {
            (p.min_p, p.min_tokens, p.logprobs) = (0.1, 30, Some(2));
            p.stop_token_ids = vec![TokenId(1)];
            p.logit_bias = vec![(TokenId(9), 1.5)];
        }),
        SamplingParams { frequency_penalty: 0.5, ..SamplingParams::greedy(100) },
    ];
    let (mut out, mut path) = (Vec::new(), Vec::new());
    for (i, p) in kinds.iter().enumerate() {
        let mut s = Sampler::new(p.clone(), &[3, 4, 5], i as u64).with_eos_token_ids(&[0]);
        for round in 0..20 {
            let rows: Vec<f32> = (0..5).flat_map(|j| wavy_row(round * 5 + j, vocab, 0.0)).collect();
            let mut drafter = s.for_drafting();
            let drafts: Vec<u32> =
                rows.chunks(vocab).take(4).map(|r| drafter.sample(&mut r.to_vec()).0).collect();
            out.clear();
            path.clear();
            s.verify(&mut rows.clone(), &drafts, &[u32::MAX, 0, 1, 2], &mut out, &mut path);
            assert_eq!(path, [0, 1, 2, 3], "params {i}, round {round}: a draft was rejected");
            assert_eq!(out.len(), 5);
        }
    }
}

/// From a nearby distribution (the draft's logits off by up to 0.1), a draft drawn with the
/// sampler's random numbers is accepted far more often than the draft's argmax, which is
/// accepted with the target's probability of that token.
#[test]
fn drafts_drawn_with_the_samplers_random_numbers_are_mostly_accepted() {
    let (vocab, n) = (64, 2000);
    let target = wavy_row(0, vocab, 0.0);
    let draft = wavy_row(0, vocab, 0.1);
    let (mut drawn, mut argmaxed) = (0, 0);
    for seed in 0..n {
        let s = Sampler::new(params(|_| {}), &[], seed);
        let drafted = s.for_drafting().sample(&mut draft.clone()).0;
        let sampled = s.clone().sample(&mut target.clone()).0;
        drawn += usize::from(sampled == drafted);
        argmaxed += usize::from(sampled == argmax(&draft));
    }
    let (drawn, argmaxed) = (drawn as f64 / n as f64, argmaxed as f64 / n as f64);
    assert!(drawn > 0.9 && argmaxed < 0.3, "drawn {drawn}, argmax {argmaxed}");
}

/// A token tree is walked from the root into the child holding each sampled token: with two
/// branches at the root, over 20k seeds the first token follows the root's distribution and the
/// second the distribution of the branch it chose, each seed yielding the tokens of sampling
/// those rows alone; greedy, the second branch's path is accepted whole.
#[test]
fn verifying_a_tree_follows_the_sampled_branch() {
    let p0 = [0.3, 0.25, 0.2, 0.1, 0.1, 0.05];
    let pa = [0.05, 0.1, 0.4, 0.15, 0.2, 0.1];
    let pb = [0.4, 0.1, 0.1, 0.1, 0.2, 0.1];
    let rows: Vec<f32> = p0.iter().chain(&pa).chain(&pb).map(|&p: &f64| p.ln() as f32).collect();
    // Node 0 (token 1) and node 1 (token 2) both follow the root.
    let (drafts, parents) = ([1u32, 2], [u32::MAX, u32::MAX]);
    let (mut first, mut after_a, mut after_b) = (vec![0; 6], vec![0; 6], vec![0; 6]);
    for seed in 0..20_000u64 {
        let p = params(|p| p.seed = Some(seed));
        let mut s = Sampler::new(p.clone(), &[], 0);
        let (mut out, mut path) = (Vec::new(), Vec::new());
        s.verify(&mut rows.clone(), &drafts, &parents, &mut out, &mut path);
        let tokens: Vec<u32> = out.iter().map(|(t, _)| t.0).collect();
        let mut alone = Sampler::new(p, &[], 0);
        let mut expected = vec![alone.sample(&mut rows[..6].to_vec()).0];
        match expected[0] {
            1 => expected.push(alone.sample(&mut rows[6..12].to_vec()).0),
            2 => expected.push(alone.sample(&mut rows[12..].to_vec()).0),
            _ => {}
        }
        assert_eq!(tokens, expected, "seed {seed}");
        first[tokens[0] as usize] += 1;
        match tokens[0] {
            1 => after_a[tokens[1] as usize] += 1,
            2 => after_b[tokens[1] as usize] += 1,
            _ => assert!(path.is_empty()),
        }
    }
    assert!(chi_square(&first, &p0) < 20.5, "{first:?}");
    assert!(chi_square(&after_a, &pa) < 20.5, "{after_a:?}");
    assert!(chi_square(&after_b, &pb) < 20.5, "{after_b:?}");
    // Greedy: argmax 2 at the root takes node 1; its child (node 2, token 0) is the argmax
    // there too; the deeper row yields one more token.
    let mut s = Sampler::new(SamplingParams::greedy(8), &[], 0);
    let one_hot = |i: usize| (0..3).map(move |j| if i == j { 1.0 } else { 0.0 });
    let mut rows: Vec<f32> = [2, 1, 0, 1].into_iter().flat_map(one_hot).collect();
    let (mut out, mut path) = (Vec::new(), Vec::new());
    s.verify(&mut rows, &[1, 2, 0], &[u32::MAX, u32::MAX, 1], &mut out, &mut path);
    assert_eq!(out.iter().map(|(t, _)| t.0).collect::<Vec<_>>(), [2, 0, 1]);
    assert_eq!(path, [1, 2]);
}

/// Extreme values of every parameter the API accepts, and hostile logit rows: sampling never
/// panics, returns a token of the row that is not NaN, and a temperature too small to divide by
/// samples the greedy token (the issue: `temperature: 1e-38` sampled `<unused6241>`).
#[test]
fn extreme_parameters_never_overflow_or_yield_nan() {
    let temperatures = [1e-45f32, 1e-38, 1e-30, 1e-6, 1e-5, 0.01, 1.0, 2.0, 1e10, 1e30, f32::MAX];
    let top_ps = [f32::MIN_POSITIVE, 1e-30, 0.5, 0.999_999, 1.0];
    let top_ks = [0usize, 1, 2, 7, usize::MAX];
    let min_ps = [0.0f32, 1e-45, 1e-10, 0.5, 1.0];
    let repetition = [1e-38f32, 1e-3, 1.0, 2.0, 1e30, f32::MAX];
    let penalties = [-2.0f32, 0.0, 2.0];
    let mut rng = Rng::new(7);
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    let rows: [Vec<f32>; 5] = [
        vec![3.0, 1.0, -2.0, 0.5, 2.9, -1e30, 1e30, 0.0],
        vec![f32::MAX, -f32::MAX, f32::MAX, 0.0, 1.0, -1.0, 5.0, 6.0],
        vec![f32::NEG_INFINITY; 8],
        vec![f32::NAN, 1.0, f32::INFINITY, 2.0, f32::NEG_INFINITY, 0.0, 3.0, -3.0],
        vec![1e-38, -1e-38, 0.0, 1e-45, 4.0, 4.0, -4.0, 1e4],
    ];
    for case in 0..4000 {
        let p = SamplingParams {
            temperature: temperatures[pick(temperatures.len())],
            top_p: top_ps[pick(top_ps.len())],
            top_k: top_ks[pick(top_ks.len())],
            min_p: min_ps[pick(min_ps.len())],
            repetition_penalty: repetition[pick(repetition.len())],
            presence_penalty: penalties[pick(penalties.len())],
            frequency_penalty: penalties[pick(penalties.len())],
            logit_bias: vec![(TokenId(pick(8) as u32), [-100.0, 100.0][pick(2)])],
            max_tokens: 100,
            seed: Some(case),
            ..Default::default()
        };
        p.validate().unwrap();
        let row = &rows[pick(rows.len())];
        let mut s = Sampler::new(p.clone(), &[0, 1, 4, 6], 0);
        for _ in 0..3 {
            let mut logits = row.clone();
            let token = s.sample(&mut logits).0 as usize;
            assert!(token < row.len(), "case {case}: token {token} with {p:?}");
            assert!(!row[token].is_nan(), "case {case}: NaN logit sampled with {p:?}");
            if p.temperature < GREEDY_TEMPERATURE {
                assert_eq!(token as u32, argmax(&logits), "case {case}: not greedy with {p:?}");
            }
        }
    }
}

#[test]
fn tiny_temperature_is_greedy() {
    let logits = [0.5f32, 2.0, 1.99, -3.0, 1.0];
    for t in [1e-38f32, 1e-45, 1e-7] {
        for seed in 0..50 {
            let p = params(|p| {
                p.temperature = t;
                p.seed = Some(seed);
            });
            let mut s = Sampler::new(p, &[], 0);
            assert_eq!(s.sample(&mut logits.clone()), TokenId(1), "temperature {t}");
        }
    }
    // Just above the greedy threshold, the shifted logits stay finite and the best still wins.
    let p = params(|p| p.temperature = 2e-5);
    assert_eq!(Sampler::new(p, &[], 0).sample(&mut logits.clone()), TokenId(1));
}

/// Greedy under a constraint picks what masking every row first picks (the argmax of the
/// masked logits), on random logits over every kind of grammar, with both the one-token check
/// and the mask exercised.
#[test]
fn constrained_greedy_picks_the_masked_argmax() {
    use crate::structured::test_vocab::{TOKENS, constraint, specs};
    let (vocab, eos) = (TOKENS.len() + 1, TOKENS.len() as u32);
    let mut rng = crate::Rng::new(3);
    let mut work = ConstraintStats::default();
    for spec in specs() {
        let mut s = Sampler::new(SamplingParams::greedy(64), &[], 0)
            .with_constraint(Some(constraint(&spec)));
        let mut reference = constraint(&spec);
        for step in 0..40 {
            let logits: Vec<f32> = (0..vocab).map(|_| rng.next_f64() as f32 * 4.0).collect();
            let mut masked = logits.clone();
            reference.mask(&mut masked);
            let expected = argmax(&masked);
            assert_eq!(s.sample(&mut logits.clone()).0, expected, "{spec:?}, step {step}");
            if expected == eos {
                break;
            }
            reference.accept(expected);
        }
        work += s.take_constraint_stats().unwrap();
    }
    assert!(work.checks > 20 && work.masks > 20 && work.masks < work.tokens, "{work:?}");
}

/// Sampling under a constraint without filters keeps an unmasked draw the grammar allows and
/// draws again from the masked logits otherwise: over 20k seeds the tokens follow the masked
/// distribution (`p(t) / A` over the allowed tokens), and a seed fixes the token; also where
/// end of sequence, which the constraint leaves to the mask, is one of the allowed tokens.
#[test]
fn constrained_sampling_follows_the_masked_distribution() {
    use crate::structured::test_vocab::{TOKENS, constraint};
    let spec = kiln_core::StructuredOutput::Regex("(0|1|2|a|b)x?".into());
    let base = constraint(&spec);
    let allowed: Vec<u32> = ["0", "1", "2", "a", "b"]
        .iter()
        .map(|a| TOKENS.iter().position(|t| t == a).unwrap() as u32)
        .collect();
    // Uneven logits; the allowed ones raised so that about 40 % of the mass is allowed.
    let plain: Vec<f32> = (0..=TOKENS.len()).map(|t| ((t * 7) % 11) as f32 * 0.3).collect();
    let mut logits = plain.clone();
    for &t in &allowed {
        logits[t as usize] += 2.0;
    }
    let weights: Vec<f64> = allowed.iter().map(|&t| f64::from(logits[t as usize]).exp()).collect();
    let mass: f64 = weights.iter().sum();
    let expected: Vec<f64> = weights.iter().map(|w| w / mass).collect();
    let sample = |seed: u64, p: SamplingParams, logits: &[f32]| {
        let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..p }, &[], 0)
            .with_constraint(Some(base.clone()));
        (s.sample(&mut logits.to_vec()).0, s.take_constraint_stats().unwrap())
    };
    let mut counts = vec![0; allowed.len()];
    let mut work = ConstraintStats::default();
    for seed in 0..20_000 {
        let (token, w) = sample(seed, params(|_| {}), &logits);
        assert_eq!(sample(seed, params(|_| {}), &logits).0, token, "seed {seed}");
        let i = allowed.iter().position(|&t| t == token).expect("an allowed token");
        counts[i] += 1;
        work += w;
    }
    // 4 degrees of freedom: P(chi2 > 18.5) = 0.001.
    assert!(chi_square(&counts, &expected) < 18.5, "{counts:?} against {expected:?}");
    assert!(work.masks > 5000 && work.masks < 15_000, "both paths taken: {work:?}");
    // Where the grammar may end, end of sequence (which the constraint leaves to the mask)
    // competes with `x`: the same masked distribution.
    let mut after_a = base.clone();
    after_a.accept(allowed[3]);
    let (x, eos) = (TOKENS.iter().position(|t| *t == "x").unwrap(), TOKENS.len());
    // Unmasked, `x` has 12 % of the mass and is admitted when drawn; end of sequence has
    // 20 %, and is kept only through the mask (redrawing it instead would give 0.546).
    let mut ending = vec![0.0f32; TOKENS.len() + 1];
    (ending[x], ending[eos]) = (2.0, 2.5);
    let mut counts = [0usize; 2];
    for seed in 0..20_000 {
        let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[], 0)
            .with_constraint(Some(after_a.clone()));
        let token = s.sample(&mut ending.clone()).0 as usize;
        counts[usize::from(token == eos)] += 1;
        assert!(token == x || token == eos, "{token}");
    }
    let p_eos = 1.0 / (1.0 + (-0.5f64).exp());
    // 1 degree of freedom: P(chi2 > 10.8) = 0.001.
    assert!(chi_square(&counts, &[1.0 - p_eos, p_eos]) < 10.8, "{counts:?}");
}

/// With top-k the mask comes first: top-2 of the allowed tokens, not an unmasked draw kept
/// when allowed. Here the unmasked top 2 are `5` (refused) and `a`; the masked top 2 are `a`
/// and `1`, drawn 0.599 : 0.401 (keeping allowed unmasked draws would give `a` 0.79).
#[test]
fn constrained_top_k_ranks_the_allowed_tokens() {
    use crate::structured::test_vocab::{TOKENS, constraint};
    let id = |text: &str| TOKENS.iter().position(|t| *t == text).unwrap();
    let base = constraint(&kiln_core::StructuredOutput::Regex("(0|1|2|a|b)x?".into()));
    let mut logits = vec![-5.0f32; TOKENS.len() + 1];
    (logits[id("5")], logits[id("a")], logits[id("1")]) = (3.0, 2.9, 2.5);
    let mut counts = [0usize; 2];
    for seed in 0..4000 {
        let p = params(|p| (p.seed, p.top_k) = (Some(seed), 2));
        let mut s = Sampler::new(p, &[], 0).with_constraint(Some(base.clone()));
        let token = s.sample(&mut logits.clone()).0 as usize;
        assert!(token == id("a") || token == id("1"), "{token}");
        counts[usize::from(token == id("1"))] += 1;
    }
    let p_a = 1.0 / (1.0 + (-0.4f64).exp());
    assert!(chi_square(&counts, &[p_a, 1.0 - p_a]) < 10.8, "{counts:?}");
}

/// Thousands of tokens the constraint admits in a row (a long bounded string) leave the
/// parser healthy: the masks it computes at least every `MASK_AT_LEAST_EVERY` tokens renew
/// llguidance's lexer budget, and the output completes its language.
#[test]
fn a_long_run_of_admitted_tokens_completes_its_language() {
    use crate::structured::test_vocab::{TOKENS, constraint};
    let id = |text: &str| TOKENS.iter().position(|t| *t == text).unwrap() as u32;
    let spec = kiln_core::StructuredOutput::Regex("[a-c]{0,3000}x".into());
    let mut s =
        Sampler::new(SamplingParams::greedy(4000), &[], 0).with_constraint(Some(constraint(&spec)));
    let mut logits = vec![0.0f32; TOKENS.len() + 1];
    (logits[id("abc") as usize], logits[id("a") as usize], logits[id("x") as usize]) =
        (3.0, 2.0, 1.0);
    let mut text = String::new();
    for _ in 0..4000 {
        let token = s.sample(&mut logits.clone()).0;
        if token as usize == TOKENS.len() {
            break;
        }
        text.push_str(TOKENS[token as usize]);
    }
    assert_eq!(text, format!("{}x", "abc".repeat(1000)));
    let work = s.take_constraint_stats().unwrap();
    assert!(work.masks >= 1000 / crate::structured::MASK_AT_LEAST_EVERY as u64, "{work:?}");
}

/// The race's shortcuts never skip a winner: over many keys it picks exactly the argmin of
/// `-ln(U) / w` computed for every candidate, in any candidate order, and its draws follow
/// `w / sum(w)` (chi-square, 15 degrees of freedom: 99.9 % quantile 37.7).
#[test]
fn the_race_is_the_exact_argmin_in_any_order_and_follows_the_weights() {
    let scaled: Vec<(u32, f32)> =
        (0..16u32).map(|t| (t, -(t as f32) * 0.4 - if t % 5 == 0 { 3.0 } else { 0.0 })).collect();
    let mut reversed = scaled.clone();
    reversed.reverse();
    let mut counts = [0usize; 16];
    let n = 40_000u64;
    for key in 0..n {
        let brute = scaled
            .iter()
            .map(|&(t, l)| {
                (-kiln_core::keyed_uniform(key, u64::from(t)).ln() / f64::from(l.exp()), t)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, t)| t);
        let won = race(scaled.iter().copied(), key);
        assert_eq!(won, brute, "key {key}");
        assert_eq!(race(reversed.iter().copied(), key), won, "key {key}: order mattered");
        counts[won.unwrap() as usize] += 1;
    }
    let total: f64 = scaled.iter().map(|&(_, l)| f64::from(l.exp())).sum();
    let p: Vec<f64> = scaled.iter().map(|&(_, l)| f64::from(l.exp()) / total).collect();
    let chi = chi_square(&counts, &p);
    assert!(chi < 37.7, "chi-square {chi}: {counts:?}");
    // Edge weights: several of exactly 1 (one of them from -0.0), the smallest normal and
    // subnormal ones, one that underflows to 0 (never wins), and tiny differences from 1.
    let edges: Vec<(u32, f32)> = [0.0, -0.0, 0.0, -87.0, -103.0, -200.0, -1e-30, -1e-7]
        .into_iter()
        .enumerate()
        .map(|(t, l)| (t as u32, l))
        .collect();
    for key in 0..n {
        let brute = edges
            .iter()
            .filter(|&&(_, l)| l.exp() > 0.0)
            .map(|&(t, l)| {
                (-kiln_core::keyed_uniform(key, u64::from(t)).ln() / f64::from(l.exp()), t)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, t)| t);
        assert_eq!(race(edges.iter().copied(), key), brute, "edge weights, key {key}");
        assert_ne!(brute, Some(5), "a weight of 0 won");
    }
    // No candidate with a weight: no winner.
    assert_eq!(race([(3, f32::NEG_INFINITY)].into_iter(), 1), None);
    assert_eq!(race(std::iter::empty(), 1), None);
}
