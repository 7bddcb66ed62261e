//! The feed-forward block of a decoder layer: dense, or a mixture of experts
//! ([`super::moe`]: a router, per-expert gate/up/down, top-k combine). [`Mlp`] is an enum so
//! that other kinds join as variants without touching the families that use these.

use kiln_backend::{Backend, ExpertRouting, GateActivation, LinearJob};

use super::input_order::InputOrders;
use super::lora::SliceLora;
use super::moe::MoeMlp;
use crate::lora::LoraTarget;
use crate::names::{LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{LoadError, MoeConfig};

/// A gated MLP: `down(act(gate(x)) * up(x))`.
pub(crate) struct DenseMlp<B: Backend> {
    gate_proj: B::Weight,
    up_proj: B::Weight,
    down_proj: B::Weight,
    gate_bias: Option<B::Vector>,
    up_bias: Option<B::Vector>,
    down_bias: Option<B::Vector>,
    act: GateActivation,
    intermediate: usize,
    /// The hidden width (the input of gate/up, the output of down).
    down_width: usize,
    /// The input orders of gate/up and of down ([`super::input_order`]).
    in_orders: InputOrders<2>,
    down_order: InputOrders<1>,
}

/// The feed-forward block of a layer.
pub(crate) enum Mlp<B: Backend> {
    Dense(DenseMlp<B>),
    Moe(Box<MoeMlp<B>>),
}

/// Buffers of one MLP call over `n` tokens: the normed input `[n, hidden]`, the output
/// `[n, hidden]`, and the gate/up intermediates (`[n, intermediate]`; with `k` experts per
/// token, `[n·k, expert intermediate]`, and at least `[n, shared intermediate]`). A mixture of
/// experts also takes its picked rows (`[n·k, hidden]`) and their outputs (`[n·k, hidden]`,
/// `[n·(k + 1), hidden]` with a shared expert, whose rows come last) and the host routing
/// scratch. `permuted` holds a permuted input (`[n, width]`, [`input_order`]).
pub(crate) struct MlpIo<'a, B: Backend> {
    pub n: usize,
    pub input: B::View<'a>,
    pub out: B::ViewMut<'a>,
    pub gate: &'a mut B::Buffer,
    pub up: &'a mut B::Buffer,
    pub picked: &'a mut B::Buffer,
    pub picked_out: &'a mut B::Buffer,
    pub permuted: &'a mut B::Buffer,
    pub routing: &'a mut ExpertRouting,
    /// The rows' LoRA adapters (dense MLPs only: adapters of expert layers are refused at
    /// load).
    pub lora: Option<&'a SliceLora<'a, B>>,
}

impl<B: Backend> Mlp<B> {
    /// The dense MLP of `layer`: `[intermediate, hidden]` gate/up, `[hidden, intermediate]`
    /// down, with biases when `bias`.
    pub(crate) fn load_dense(
        w: &Weights<'_, B>,
        layer: usize,
        (h, i): (usize, usize),
        bias: bool,
        act: GateActivation,
    ) -> Result<Self, LoadError> {
        let t = |x: L| Tensor::Layer(layer, x);
        let (gate_proj, gate_order) = w.ordered_matrix(t(L::Gate), i, h)?;
        let (up_proj, up_order) = w.ordered_matrix(t(L::Up), i, h)?;
        let (down_proj, down_order) = w.ordered_matrix(t(L::Down), h, i)?;
        Ok(Self::Dense(DenseMlp {
            gate_proj,
            up_proj,
            down_proj,
            in_orders: InputOrders::new([gate_order, up_order]),
            down_order: InputOrders::new([down_order]),
            gate_bias: w.optional_vector(t(L::GateBias), i, bias)?,
            up_bias: w.optional_vector(t(L::UpBias), i, bias)?,
            down_bias: w.optional_vector(t(L::DownBias), h, bias)?,
            act,
            intermediate: i,
            down_width: h,
        }))
    }

    /// The mixture of experts of `layer` (see [`MoeMlp::load`]).
    pub(crate) fn load_moe(
        w: &Weights<'_, B>,
        layer: usize,
        hidden: usize,
        moe: &MoeConfig,
        act: GateActivation,
    ) -> Result<Self, LoadError> {
        MoeMlp::load(w, layer, hidden, moe, act).map(|m| Self::Moe(Box::new(m)))
    }

    /// Every weight matrix (the bytes the model holds).
    pub(crate) fn matrices(&self) -> Vec<&B::Weight> {
        match self {
            Self::Dense(m) => m.weights().to_vec(),
            Self::Moe(m) => m.matrices(),
        }
    }

    /// Its widest permuted input (0 without one; experts have none).
    pub(crate) fn permuted_width(&self) -> usize {
        match self {
            Self::Dense(m) => m.in_orders.width().max(m.down_order.width()),
            Self::Moe(_) => 0,
        }
    }

    /// The matrices one token reads (all of them but the experts it is not sent to).
    pub(crate) fn active_matrices(&self) -> Vec<&B::Weight> {
        match self {
            Self::Dense(_) => self.matrices(),
            Self::Moe(m) => m.active_matrices(),
        }
    }

    /// `io.out = mlp(io.input)` over `io.n` tokens.
    pub(crate) fn forward<'a>(&'a self, backend: &B, io: MlpIo<'a, B>) {
        match self {
            Self::Dense(m) => m.forward(backend, io),
            Self::Moe(m) => m.forward(backend, io),
        }
    }
}

impl<B: Backend> DenseMlp<B> {
    /// A mixture of experts' shared expert of `layer`: `[i, h]` gate and up, `[h, i]` down,
    /// no biases.
    pub(super) fn load_shared(
        w: &Weights<'_, B>,
        layer: usize,
        (h, i): (usize, usize),
        act: GateActivation,
    ) -> Result<Self, LoadError> {
        let t = |x: L| Tensor::Layer(layer, x);
        Ok(Self {
            gate_proj: w.matrix(t(L::SharedGate), i, h)?,
            up_proj: w.matrix(t(L::SharedUp), i, h)?,
            down_proj: w.matrix(t(L::SharedDown), h, i)?,
            gate_bias: None,
            up_bias: None,
            down_bias: None,
            act,
            intermediate: i,
            down_width: h,
            in_orders: InputOrders::new([None, None]),
            down_order: InputOrders::new([None]),
        })
    }

    /// Its three matrices.
    pub(super) fn weights(&self) -> [&B::Weight; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }

    fn forward<'a>(&'a self, backend: &B, io: MlpIo<'a, B>) {
        let MlpIo { n, input, out, gate, up, permuted, lora, .. } = io;
        self.run(backend, n, input, (gate, up), permuted, out, lora);
    }

    /// `out = mlp(input)` over `n` tokens; `gate` and `up` hold `[n, intermediate]`,
    /// `permuted` a permuted input.
    pub(super) fn run<'o>(
        &'o self,
        backend: &B,
        n: usize,
        input: B::View<'_>,
        (gate, up): (&mut B::Buffer, &mut B::Buffer),
        permuted: &mut B::Buffer,
        out: B::ViewMut<'o>,
        lora: Option<&SliceLora<'_, B>>,
    ) {
        let (len, i) = (n * self.intermediate, self.intermediate);
        self.in_orders.linear(
            backend,
            (input, n),
            permuted,
            &mut [
                LinearJob {
                    weight: &self.gate_proj,
                    bias: self.gate_bias.as_ref(),
                    out: B::view_mut(gate, 0..len),
                },
                LinearJob {
                    weight: &self.up_proj,
                    bias: self.up_bias.as_ref(),
                    out: B::view_mut(up, 0..len),
                },
            ],
        );
        // The model's input width: the down projection's output width.
        let h = self.down_width;
        if let Some(lora) = lora {
            let x = (input, h);
            lora.apply(backend, LoraTarget::Gate, x, (B::view_mut(gate, 0..len), i));
            lora.apply(backend, LoraTarget::Up, x, (B::view_mut(up, 0..len), i));
        }
        backend.gated_act(self.act, B::view_mut(gate, 0..len), B::view(up, 0..len));
        let down = LinearJob { weight: &self.down_proj, bias: self.down_bias.as_ref(), out };
        let x = (B::view(gate, 0..len), n);
        let mut jobs = [down];
        self.down_order.linear(backend, x, permuted, &mut jobs);
        if let Some(lora) = lora {
            let [LinearJob { out, .. }] = jobs;
            lora.apply(backend, LoraTarget::Down, (B::view(gate, 0..len), i), (out, h));
        }
    }
}
