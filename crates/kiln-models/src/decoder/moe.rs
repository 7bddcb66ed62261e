//! The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek): a float router scores
//! every expert for each token, each token goes to its `k` best, and its output is the weighted
//! sum of those experts' gated MLPs, plus, with a shared expert, that expert's MLP of the token,
//! scaled by the sigmoid of its one-row float gate (Qwen2-MoE) or whole (DeepSeek).
//!
//! Routing is computed on the host exactly as transformers does it ([`crate::Routing`]):
//! softmax of the router logits in f32 and the `k` largest probabilities (ties to the lower
//! expert index); or DeepSeek's group-limited choices (softmax or sigmoid scores, the latter
//! chosen with the correction bias). The picks' weights are renormalised to sum to one when
//! `norm_topk_prob` and scaled by `routed_scaling_factor`; a token's picks are then summed in
//! ascending expert order, as transformers' loop over experts adds them, and the shared
//! expert's term last.
//!
//! The matmuls are grouped by expert: the step's picks are sorted by expert (then token) and
//! gathered into one `[n·k, hidden]` buffer, so each expert's weights are read once per step
//! for all of its tokens, all experts in one backend call (`linear_experts`) per matrix kind.
//! The shared expert runs on the step's rows as a dense MLP into the rows after the picks'.
//! Every backend op computes each row on its own, and the combine sums a token's own picks in
//! a fixed order, so a token's output never depends on which other tokens chose the same
//! experts (batched == alone, bit for bit).

use std::cmp::Ordering;

use kiln_backend::{Backend, ExpertLinearJob, ExpertRouting, GateActivation};

use crate::names::{ExpertMatrix, LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{LoadError, MoeConfig, Routing};

use super::mlp::{DenseMlp, MlpIo};

/// The expert every token also runs, with its gate.
struct SharedExpert<B: Backend> {
    mlp: DenseMlp<B>,
    /// `[1, hidden]`, in its stored float type; `None`: the expert's output is added whole.
    gate: Option<B::Weight>,
}

pub(crate) struct MoeMlp<B: Backend> {
    /// `[num_experts, hidden]`, in its stored float type.
    router: B::Weight,
    /// Expert `e`'s `[i, h]` gate and up and `[h, i]` down matrices are element `e` of each.
    gates: Vec<B::Weight>,
    ups: Vec<B::Weight>,
    downs: Vec<B::Weight>,
    shared: Option<SharedExpert<B>>,
    top_k: usize,
    norm_topk_prob: bool,
    routing: Routing,
    routed_scaling_factor: f32,
    /// `[num_experts]` the correction bias of sigmoid group routing, on the host.
    score_bias: Option<Vec<f32>>,
    /// `[num_experts]` the router's bias, added to its logits on the host (gpt-oss).
    logit_bias: Option<Vec<f32>>,
    /// Per expert, the `[i]` gate and up and `[h]` down biases (gpt-oss).
    biases: Option<[Vec<B::Vector>; 3]>,
    act: GateActivation,
    /// One expert's FFN width.
    intermediate: usize,
    hidden: usize,
}

impl<B: Backend> MoeMlp<B> {
    pub(crate) fn load(
        w: &Weights<'_, B>,
        layer: usize,
        hidden: usize,
        moe: &MoeConfig,
        act: GateActivation,
    ) -> Result<Self, LoadError> {
        let (h, i, n) = (hidden, moe.expert_intermediate_size, moe.num_experts);
        let router = w.float_matrix(Tensor::Layer(layer, L::Router), n, h)?;
        let matrices = |which, rows, cols| {
            (0..n)
                .map(|e| w.expert_matrix((layer, which), (e, n), rows, cols))
                .collect::<Result<Vec<_>, LoadError>>()
        };
        let shared = match moe.shared_expert_intermediate_size {
            Some(si) => Some(SharedExpert {
                mlp: DenseMlp::load_shared(w, layer, (h, si), act)?,
                gate: if moe.shared_expert_gate {
                    Some(w.float_matrix(Tensor::Layer(layer, L::SharedExpertGate), 1, h)?)
                } else {
                    None
                },
            }),
            None => None,
        };
        let logit_bias = if moe.router_bias {
            Some(w.source.vector(&w.naming.name(Tensor::Layer(layer, L::RouterLogitBias)), n)?)
        } else {
            None
        };
        let biases = if moe.expert_bias {
            Some([
                w.expert_biases((layer, ExpertMatrix::Gate), n, i)?,
                w.expert_biases((layer, ExpertMatrix::Up), n, i)?,
                w.expert_biases((layer, ExpertMatrix::Down), n, h)?,
            ])
        } else {
            None
        };
        let score_bias = match moe.routing {
            Routing::SigmoidBiased { .. } => {
                let name = w.naming.name(Tensor::Layer(layer, L::RouterBias));
                let bias = w.source.vector(&name, n)?;
                if bias.iter().any(|b| !b.is_finite()) {
                    return Err(LoadError::Backend { name, message: "a non-finite bias".into() });
                }
                Some(bias)
            }
            _ => None,
        };
        Ok(Self {
            router,
            shared,
            gates: matrices(ExpertMatrix::Gate, i, h)?,
            ups: matrices(ExpertMatrix::Up, i, h)?,
            downs: matrices(ExpertMatrix::Down, h, i)?,
            top_k: moe.experts_per_token,
            norm_topk_prob: moe.norm_topk_prob,
            routing: moe.routing,
            routed_scaling_factor: moe.routed_scaling_factor,
            score_bias,
            logit_bias,
            biases,
            act,
            intermediate: i,
            hidden: h,
        })
    }

    /// Every matrix: the router, the shared expert's, then each expert's gate, up and down.
    pub(crate) fn matrices(&self) -> Vec<&B::Weight> {
        self.active_matrices_of(self.gates.len())
    }

    /// The matrices one token reads: the router, the shared expert's and `k` experts' (the
    /// bytes of an expert are the same for all of them).
    pub(crate) fn active_matrices(&self) -> Vec<&B::Weight> {
        self.active_matrices_of(self.top_k)
    }

    /// The router, the shared expert's and the first `experts` experts' matrices.
    fn active_matrices_of(&self, experts: usize) -> Vec<&B::Weight> {
        let e = self.gates.iter().zip(&self.ups).zip(&self.downs).take(experts);
        let experts = e.flat_map(|((g, u), d)| [g, u, d]);
        let shared = self.shared.iter().flat_map(|s| s.gate.iter().chain(s.mlp.weights()));
        std::iter::once(&self.router).chain(shared).chain(experts).collect()
    }

    pub(crate) fn forward<'a>(&'a self, be: &B, io: MlpIo<'a, B>) {
        let MlpIo { n, input, out, gate, up, picked, picked_out, permuted, routing, .. } = io;
        let (k, i, h) = (self.top_k, self.intermediate, self.hidden);
        be.logits(input, n, &self.router, None, &mut routing.logits);
        if let Some(bias) = &self.logit_bias {
            for t in 0..n {
                for (x, b) in routing.logits.row_mut(t).iter_mut().zip(bias) {
                    *x += b;
                }
            }
        }
        let rows = n * k;
        if let Some(s) = &self.shared {
            if let Some(gate) = &s.gate {
                be.logits(input, n, gate, None, &mut routing.shared_logits);
            }
            let shared_out = B::view_mut(picked_out, rows * h..(rows + n) * h);
            s.mlp.run(be, n, input, (&mut *gate, &mut *up), permuted, shared_out, None);
        }
        let shared = self.shared.is_some();
        let rule = RouteRule {
            k,
            routing: self.routing,
            normalize: self.norm_topk_prob,
            scale: self.routed_scaling_factor,
            bias: self.score_bias.as_deref(),
            shared: self.shared.as_ref().map(|s| s.gate.is_some()),
        };
        route(routing, n, &rule);
        be.gather_rows(input, h, &routing.tokens, B::view_mut(picked, 0..rows * h));
        let offsets = &routing.offsets;
        let bias = |kind: usize| self.biases.as_ref().map(|b| b[kind].as_slice());
        be.linear_experts(
            &*picked,
            h,
            offsets,
            &mut [
                ExpertLinearJob {
                    weights: &self.gates,
                    width: i,
                    biases: bias(0),
                    out: &mut *gate,
                },
                ExpertLinearJob { weights: &self.ups, width: i, biases: bias(1), out: &mut *up },
            ],
        );
        be.gated_act(self.act, B::view_mut(gate, 0..rows * i), B::view(up, 0..rows * i));
        let down = ExpertLinearJob {
            weights: &self.downs,
            width: h,
            biases: bias(2),
            out: &mut *picked_out,
        };
        be.linear_experts(&*gate, i, offsets, &mut [down]);
        let picks = k + usize::from(shared);
        let src = B::view(picked_out, 0..n * picks * h);
        be.combine_rows(src, h, picks, &routing.rows, &routing.weights, out);
    }
}

/// How one layer routes its tokens.
pub(crate) struct RouteRule<'a> {
    /// Picks per token (`1..=num_experts`).
    pub k: usize,
    pub routing: Routing,
    /// Renormalise the picks' weights to sum to one.
    pub normalize: bool,
    /// Multiplies every pick's weight.
    pub scale: f32,
    /// `[num_experts]` the correction bias of [`Routing::SigmoidBiased`].
    pub bias: Option<&'a [f32]>,
    /// With a shared expert: whether its weight is the sigmoid of its gate's logit (else 1).
    pub shared: Option<bool>,
}

/// Fills `r`'s picks from its `[n, num_experts]` logits: each token's `k` experts by the
/// rule's [`Routing`] (ties to the lower index), their weights (renormalised when `normalize`,
/// then scaled), and the expert-sorted layout (see [`ExpertRouting`]); with a shared expert,
/// each token's last pick is its row, weighted by the sigmoid of its `shared_logits` or by 1.
pub(crate) fn route(r: &mut ExpertRouting, n: usize, rule: &RouteRule<'_>) {
    let num_experts = r.logits.vocab_size();
    let k = rule.k;
    let stride = k + usize::from(rule.shared.is_some());
    r.tokens.clear();
    r.tokens.resize(n * k, 0);
    r.rows.clear();
    r.weights.clear();
    r.offsets.clear();
    r.offsets.resize(num_experts + 1, 0);
    let mut scratch = GroupScratch::default();
    for t in 0..n {
        let first = r.rows.len();
        match rule.routing {
            Routing::Softmax => pick_softmax(r, t, k),
            Routing::SoftmaxGroupLimited { groups, topk_groups }
            | Routing::SigmoidBiased { groups, topk_groups } => {
                scratch.pick(r, t, rule, (groups, topk_groups));
            }
        }
        let (experts, weights) = (&mut r.rows[first..], &mut r.weights[first..]);
        if rule.normalize {
            let total: f32 = weights.iter().sum();
            // Group routing divides by `sum + 1e-20`, as DeepSeek's code does.
            let total = if rule.routing == Routing::Softmax { total } else { total + 1e-20 };
            for w in weights.iter_mut() {
                *w /= total;
            }
        }
        if rule.scale != 1.0 {
            for w in weights.iter_mut() {
                *w *= rule.scale;
            }
        }
        // Ascending expert order, the order the combine sums in (insertion sort: k is small).
        for j in 1..k {
            let mut i = j;
            while i > 0 && experts[i - 1] > experts[i] {
                experts.swap(i - 1, i);
                weights.swap(i - 1, i);
                i -= 1;
            }
        }
        for &e in &*experts {
            r.offsets[e + 1] += 1;
        }
        if let Some(gated) = rule.shared {
            r.rows.push(n * k + t);
            let weight = if gated {
                let x = r.shared_logits.row(t)[0];
                1.0 / (1.0 + (-x).exp())
            } else {
                1.0
            };
            r.weights.push(weight);
        }
    }
    for e in 0..num_experts {
        r.offsets[e + 1] += r.offsets[e];
    }
    // Counting sort by expert, tokens ascending within each expert: `offsets[e]` serves as
    // expert `e`'s cursor, ending at the next expert's start, and is shifted back after.
    for (p, e) in r.rows.iter_mut().enumerate() {
        if p % stride == k {
            continue; // the shared expert's row, already final
        }
        let row = r.offsets[*e];
        r.offsets[*e] += 1;
        r.tokens[row] = p / stride;
        *e = row;
    }
    r.offsets.copy_within(0..num_experts, 1);
    r.offsets[0] = 0;
}

/// Token `t`'s `k` best experts by softmax probability, appended to `r.rows` (experts) and
/// `r.weights` (their probabilities), best first.
fn pick_softmax(r: &mut ExpertRouting, t: usize, k: usize) {
    let logits = r.logits.row(t);
    let first = r.rows.len();
    // The best `k` so far, by logit (softmax keeps the order), best first; a later expert
    // goes behind an equal one.
    for (e, &x) in logits.iter().enumerate() {
        let len = r.rows.len() - first;
        if len == k && x.partial_cmp(&r.weights[first + k - 1]) != Some(Ordering::Greater) {
            continue;
        }
        let at = r.weights[first..].iter().position(|&b| b < x).unwrap_or(len);
        r.rows.insert(first + at, e);
        r.weights.insert(first + at, x);
        r.rows.truncate(first + k);
        r.weights.truncate(first + k);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
    for w in &mut r.weights[first..] {
        *w = (*w - max).exp() / sum;
    }
}

/// Per-token buffers of group routing, `[num_experts]` each.
#[derive(Default)]
struct GroupScratch {
    scores: Vec<f32>,
    choice: Vec<f32>,
    order: Vec<usize>,
    /// `[groups]` each group and its score, best first; whether it is kept.
    ranked: Vec<(usize, f32)>,
    kept: Vec<bool>,
}

impl GroupScratch {
    /// Token `t`'s picks under DeepSeek's group-limited routing: scores (softmax, or sigmoid
    /// plus the bias for the choice), the `topk_groups` best groups (by their best choice, or
    /// their two best summed with sigmoid scores; ties to the lower group), then the `k` best
    /// choices among those groups' experts (ties to the lower expert), weighted by their
    /// scores.
    fn pick(
        &mut self,
        r: &mut ExpertRouting,
        t: usize,
        rule: &RouteRule<'_>,
        (groups, topk_groups): (usize, usize),
    ) {
        let logits = r.logits.row(t);
        let e = logits.len();
        self.scores.clear();
        let sigmoid = matches!(rule.routing, Routing::SigmoidBiased { .. });
        if sigmoid {
            self.scores.extend(logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())));
        } else {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
            self.scores.extend(logits.iter().map(|&x| (x - max).exp() / sum));
        }
        self.choice.clear();
        self.choice.extend_from_slice(&self.scores);
        if let Some(bias) = rule.bias.filter(|_| sigmoid) {
            for (c, b) in self.choice.iter_mut().zip(bias) {
                *c += b;
            }
        }
        let size = e / groups;
        let group_score = |g: usize| {
            let members = &self.choice[g * size..(g + 1) * size];
            let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &x in members {
                if x > best {
                    (best, second) = (x, best);
                } else if x > second {
                    second = x;
                }
            }
            if sigmoid { best + second } else { best }
        };
        self.ranked.clear();
        self.ranked.extend((0..groups).map(|g| (g, group_score(g))));
        self.ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        self.kept.clear();
        self.kept.resize(groups, false);
        for &(g, _) in &self.ranked[..topk_groups] {
            self.kept[g] = true;
        }
        let kept = &self.kept;
        self.order.clear();
        self.order.extend((0..e).filter(|&x| kept[x / size]));
        let choice = &self.choice;
        self.order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        for &x in &self.order[..rule.k] {
            r.rows.push(x);
            r.weights.push(self.scores[x]);
        }
    }
}

#[cfg(test)]
mod tests;
