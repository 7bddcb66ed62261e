//! The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a float router scores every
//! expert for each token, each token goes to its `k` best, and its output is the weighted sum
//! of those experts' gated MLPs, plus, with a shared expert (Qwen2-MoE), that expert's MLP of
//! the token scaled by the sigmoid of its one-row float gate.
//!
//! Routing is computed on the host exactly as transformers does it: softmax of the router
//! logits in f32, the `k` largest probabilities (ties to the lower expert index), renormalised
//! to sum to one when `norm_topk_prob`; a token's picks are then summed in ascending expert
//! order, as transformers' loop over experts adds them, and the shared expert's term last.
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
use crate::{LoadError, MoeConfig};

use super::mlp::{DenseMlp, MlpIo};

/// The expert every token also runs, with its gate.
struct SharedExpert<B: Backend> {
    mlp: DenseMlp<B>,
    /// `[1, hidden]`, in its stored float type.
    gate: B::Weight,
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
                gate: w.float_matrix(Tensor::Layer(layer, L::SharedExpertGate), 1, h)?,
            }),
            None => None,
        };
        Ok(Self {
            router,
            shared,
            gates: matrices(ExpertMatrix::Gate, i, h)?,
            ups: matrices(ExpertMatrix::Up, i, h)?,
            downs: matrices(ExpertMatrix::Down, h, i)?,
            top_k: moe.experts_per_token,
            norm_topk_prob: moe.norm_topk_prob,
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
        let shared = self.shared.iter().flat_map(|s| {
            let [g, u, d] = s.mlp.weights();
            [&s.gate, g, u, d]
        });
        std::iter::once(&self.router).chain(shared).chain(experts).collect()
    }

    pub(crate) fn forward<'a>(&'a self, be: &B, io: MlpIo<'a, B>) {
        let MlpIo { n, input, out, gate, up, picked, picked_out, permuted, routing, .. } = io;
        let (k, i, h) = (self.top_k, self.intermediate, self.hidden);
        be.logits(input, n, &self.router, None, &mut routing.logits);
        let rows = n * k;
        if let Some(s) = &self.shared {
            be.logits(input, n, &s.gate, None, &mut routing.shared_logits);
            let shared_out = B::view_mut(picked_out, rows * h..(rows + n) * h);
            s.mlp.run(be, n, input, (&mut *gate, &mut *up), permuted, shared_out, None);
        }
        let shared = self.shared.is_some();
        route(routing, n, k, self.norm_topk_prob, shared);
        be.gather_rows(input, h, &routing.tokens, B::view_mut(picked, 0..rows * h));
        let offsets = &routing.offsets;
        be.linear_experts(
            &*picked,
            h,
            offsets,
            &mut [
                ExpertLinearJob { weights: &self.gates, width: i, out: &mut *gate },
                ExpertLinearJob { weights: &self.ups, width: i, out: &mut *up },
            ],
        );
        be.gated_act(self.act, B::view_mut(gate, 0..rows * i), B::view(up, 0..rows * i));
        let down = ExpertLinearJob { weights: &self.downs, width: h, out: &mut *picked_out };
        be.linear_experts(&*gate, i, offsets, &mut [down]);
        let picks = k + usize::from(shared);
        let src = B::view(picked_out, 0..n * picks * h);
        be.combine_rows(src, h, picks, &routing.rows, &routing.weights, out);
    }
}

/// Fills `r`'s picks from its `[n, num_experts]` logits: each token's `k` experts by softmax
/// probability (ties to the lower index), their weights (renormalised when `normalize`), and the
/// expert-sorted layout (see [`ExpertRouting`]); with `shared`, each token's last pick is the
/// shared expert's row, weighted by the sigmoid of its `shared_logits`. Needs
/// `1 <= k <= num_experts`.
pub(crate) fn route(r: &mut ExpertRouting, n: usize, k: usize, normalize: bool, shared: bool) {
    let num_experts = r.logits.vocab_size();
    let stride = k + usize::from(shared);
    r.tokens.clear();
    r.tokens.resize(n * k, 0);
    r.rows.clear();
    r.weights.clear();
    r.offsets.clear();
    r.offsets.resize(num_experts + 1, 0);
    for t in 0..n {
        let logits = r.logits.row(t);
        let first = r.rows.len();
        // The best `k` so far, by logit (softmax keeps the order), best first; a later expert
        // goes behind an equal one. `rows` holds each pick's expert until the layout below.
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
        let (experts, weights) = (&mut r.rows[first..], &mut r.weights[first..]);
        for w in weights.iter_mut() {
            *w = (*w - max).exp() / sum;
        }
        if normalize {
            let total: f32 = weights.iter().sum();
            for w in weights.iter_mut() {
                *w /= total;
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
        if shared {
            let x = r.shared_logits.row(t)[0];
            r.rows.push(n * k + t);
            r.weights.push(1.0 / (1.0 + (-x).exp()));
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

#[cfg(test)]
mod tests;
