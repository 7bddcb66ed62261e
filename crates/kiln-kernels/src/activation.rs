//! Gated MLP activations: `gate = act(gate) * up`, element-wise over `[rows, intermediate]`,
//! vectorised through [`crate::vmath`].

use crate::thread_pool::SharedMut;
use crate::vmath::{self, Gate};
use crate::{SimdLevel, ThreadPool};

/// Elements per parallel task.
const CHUNK: usize = 16 * 1024;

pub use kiln_backend::GateActivation;

/// The function at one point (the same bits as the vectorised [`gated_act_inplace`]).
#[inline]
pub fn activate(act: GateActivation, x: f32) -> f32 {
    match act {
        GateActivation::Silu => vmath::silu(x),
        GateActivation::GeluTanh => vmath::gelu_tanh(x),
    }
}

fn gate_of(act: GateActivation) -> Gate {
    match act {
        GateActivation::Silu => Gate::Silu,
        GateActivation::GeluTanh => Gate::GeluTanh,
    }
}

/// `gate[i] = act(gate[i]) * up[i]`.
pub fn gated_act_inplace(pool: &ThreadPool, act: GateActivation, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    let len = gate.len();
    let g = SharedMut::new(gate);
    let level = SimdLevel::detect();
    pool.run(len.div_ceil(CHUNK), |task| {
        let start = task * CHUNK;
        let end = (start + CHUNK).min(len);
        // SAFETY: each task owns elements start..end.
        let gs = unsafe { g.slice(start, end - start) };
        vmath::gated_at(level, gate_of(act), gs, &up[start..end]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let silu = GateActivation::Silu;
        assert!((activate(silu, 0.0)).abs() < 1e-7);
        assert!((activate(silu, 2.0) - 1.761_594_2).abs() < 1e-6);
        let gelu = GateActivation::GeluTanh;
        assert!((activate(gelu, 1.0) - 0.841_192).abs() < 1e-5);
        assert!((activate(gelu, -3.0) - -0.003_637_3).abs() < 1e-5);
        let pool = ThreadPool::new(2);
        let mut g: Vec<f32> = (0..40_000).map(|i| i as f32 / 10_000.0 - 2.0).collect();
        let up = vec![2.0; g.len()];
        let want: Vec<f32> = g.iter().map(|v| activate(silu, *v) * 2.0).collect();
        gated_act_inplace(&pool, silu, &mut g, &up);
        assert_eq!(g, want);
    }
}
