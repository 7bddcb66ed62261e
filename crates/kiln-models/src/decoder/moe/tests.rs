use kiln_backend::ExpertRouting;

use super::{RouteRule, route};
use crate::Routing;

/// The rule of softmax routing with `k` picks.
fn softmax_rule(k: usize, normalize: bool, shared: Option<bool>) -> RouteRule<'static> {
    RouteRule { k, routing: Routing::Softmax, normalize, scale: 1.0, bias: None, shared }
}

/// Routing of `logits` (`[n, experts]`, one row per token).
fn routed(logits: &[&[f32]], k: usize, normalize: bool) -> ExpertRouting {
    let mut r = ExpertRouting::default();
    r.logits.reset(logits.len(), logits[0].len());
    for (t, row) in logits.iter().enumerate() {
        r.logits.row_mut(t).copy_from_slice(row);
    }
    route(&mut r, logits.len(), &softmax_rule(k, normalize, None));
    r
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = x.iter().map(|v| (v - max).exp()).sum();
    x.iter().map(|v| (v - max).exp() / sum).collect()
}

#[test]
fn picks_the_top_k_and_sorts_rows_by_expert() {
    // Token 0 picks experts 3 and 1; token 1 picks 1 and 0; token 2 picks 2 and 3.
    let rows: [&[f32]; 3] = [&[0.0, 2.0, -1.0, 3.0], &[1.5, 4.0, 0.0, -2.0], &[0.0, 0.0, 5.0, 1.0]];
    let r = routed(&rows, 2, false);
    // Expert segments: 0: [t1], 1: [t0, t1], 2: [t2], 3: [t0, t2].
    assert_eq!(r.offsets, [0, 1, 3, 4, 6]);
    assert_eq!(r.tokens, [1, 0, 1, 2, 0, 2]);
    // Each token's picks in ascending expert order point at their sorted rows.
    assert_eq!(r.rows, [1, 4, 0, 2, 3, 5]);
    let p0 = softmax(rows[0]);
    assert_eq!(&r.weights[..2], &[p0[1], p0[3]]);
    let p2 = softmax(rows[2]);
    assert_eq!(&r.weights[4..], &[p2[2], p2[3]]);
}

#[test]
fn a_shared_expert_is_each_tokens_last_pick() {
    let rows: [&[f32]; 3] = [&[0.0, 2.0, -1.0, 3.0], &[1.5, 4.0, 0.0, -2.0], &[0.0, 0.0, 5.0, 1.0]];
    let mut r = ExpertRouting::default();
    r.logits.reset(3, 4);
    r.shared_logits.reset(3, 1);
    for (t, row) in rows.iter().enumerate() {
        r.logits.row_mut(t).copy_from_slice(row);
        r.shared_logits.row_mut(t)[0] = t as f32 - 1.0;
    }
    route(&mut r, 3, &softmax_rule(2, false, Some(true)));
    // The routed layout is the one without a shared expert; each token then takes row
    // 6 + t (after the 3·2 picked rows) with weight sigmoid(gate).
    let plain = routed(&rows, 2, false);
    assert_eq!(r.offsets, plain.offsets);
    assert_eq!(r.tokens, plain.tokens);
    assert_eq!(r.rows, [1, 4, 6, 0, 2, 7, 3, 5, 8]);
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    for t in 0..3 {
        assert_eq!(r.weights[3 * t..3 * t + 2], plain.weights[2 * t..2 * t + 2]);
        assert_eq!(r.weights[3 * t + 2], sigmoid(t as f32 - 1.0));
    }
}

#[test]
fn normalized_weights_sum_to_one() {
    let r = routed(&[&[0.3, -1.0, 2.0, 0.7, 0.1]], 3, true);
    let p = softmax(&[0.3, -1.0, 2.0, 0.7, 0.1]);
    // transformers divides by the sum of the picks in probability order (2, 3, 0).
    let total = p[2] + p[3] + p[0];
    // Experts 0, 2, 3 in index order, divided by the sum of the picks.
    assert_eq!(r.weights, [p[0] / total, p[2] / total, p[3] / total]);
    assert_eq!(r.offsets, [0, 1, 1, 2, 3, 3]);
}

#[test]
fn ties_go_to_the_lower_expert() {
    let r = routed(&[&[1.0, 2.0, 2.0, 2.0]], 2, false);
    assert_eq!(r.offsets, [0, 0, 1, 2, 2], "experts 1 and 2, not 3");
    let nan = routed(&[&[f32::NAN, f32::NAN, f32::NAN]], 2, false);
    assert_eq!(nan.offsets.last(), Some(&2), "NaN logits still give k distinct picks");
}

#[test]
fn a_tokens_picks_do_not_depend_on_the_others() {
    let a: &[f32] = &[0.1, 0.9, -0.4, 0.5, 0.2, -0.1];
    let b: &[f32] = &[1.0, -1.0, 0.4, 0.3, 2.2, 0.0];
    let alone = routed(&[a], 2, true);
    let batched = routed(&[b, a, b], 2, true);
    assert_eq!(&batched.weights[2..4], &alone.weights[..]);
    let experts = |r: &ExpertRouting, t: usize| -> Vec<usize> {
        (0..2).map(|j| r.offsets.partition_point(|&o| o <= r.rows[t * 2 + j]) - 1).collect()
    };
    assert_eq!(experts(&batched, 1), experts(&alone, 0));
}

/// Routing of one token's `logits` by `rule`: its experts (ascending) and weights.
fn picks(logits: &[f32], rule: &RouteRule<'_>) -> (Vec<usize>, Vec<f32>) {
    let mut r = ExpertRouting::default();
    r.logits.reset(1, logits.len());
    r.logits.row_mut(0).copy_from_slice(logits);
    route(&mut r, 1, rule);
    let experts = r.rows[..rule.k].iter().map(|&row| {
        (0..logits.len()).find(|&e| (r.offsets[e]..r.offsets[e + 1]).contains(&row)).unwrap()
    });
    (experts.collect(), r.weights[..rule.k].to_vec())
}

#[test]
fn group_limited_softmax_searches_the_best_groups_only() {
    // Groups {0,1}, {2,3}, {4,5}: best experts 1 (group 0, 3.0), then 2 (group 1, 2.5), then
    // 4 (group 2, 2.4); with one group kept the picks are both of group 0, expert 0 over 2.
    let logits = [1.0, 3.0, 2.5, -1.0, 2.4, 0.0];
    let groups = |topk_groups| Routing::SoftmaxGroupLimited { groups: 3, topk_groups };
    let rule = |routing| RouteRule {
        k: 2,
        routing,
        normalize: false,
        scale: 1.5,
        bias: None,
        shared: None,
    };
    let p = softmax(&logits);
    let (experts, weights) = picks(&logits, &rule(groups(1)));
    assert_eq!(experts, [0, 1]);
    assert_eq!(weights, [p[0] * 1.5, p[1] * 1.5]);
    // Two groups kept: the global best two.
    assert_eq!(picks(&logits, &rule(groups(2))).0, [1, 2]);
}

#[test]
fn sigmoid_routing_chooses_with_the_bias_and_weights_without_it() {
    let logits = [0.0, 1.0, 2.0, -1.0];
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    // The bias lifts expert 3 above expert 1 for the choice; groups {0,1} and {2,3} rank by
    // their two best choices: {2,3} = σ(2) + σ(-1) + 3 beats {0,1}.
    let bias = [0.0, 0.0, 0.0, 3.0];
    let routing = Routing::SigmoidBiased { groups: 2, topk_groups: 1 };
    let rule =
        RouteRule { k: 2, routing, normalize: true, scale: 2.5, bias: Some(&bias), shared: None };
    let (experts, weights) = picks(&logits, &rule);
    assert_eq!(experts, [2, 3]);
    let (a, b) = (sigmoid(2.0), sigmoid(-1.0));
    let total = a + b + 1e-20;
    assert_eq!(weights, [a / total * 2.5, b / total * 2.5]);
}
