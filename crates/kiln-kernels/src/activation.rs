//! MLP activations: gated, `gate = act(gate) * up`, element-wise over `[rows, intermediate]`,
//! and ungated (an encoder's `act(x)`), vectorised through [`crate::vmath`].

use crate::thread_pool::SharedMut;
use crate::vmath::{self, Gate};
use crate::{SimdLevel, ThreadPool};

/// Elements per parallel task.
const CHUNK: usize = 16 * 1024;

pub use kiln_backend::GateActivation;

/// `act(gate) * up` at one point (the same bits as [`gated_act_inplace`]).
#[inline]
pub fn gated(act: GateActivation, gate: f32, up: f32) -> f32 {
    match act {
        GateActivation::Silu => vmath::silu(gate) * up,
        GateActivation::GeluTanh => vmath::gelu_tanh(gate) * up,
        GateActivation::Gelu => vmath::gelu(gate) * up,
        GateActivation::ClampedSwiglu { alpha, limit } => {
            GateActivation::clamped_swiglu(alpha, limit, gate, up)
        }
    }
}

/// The vectorised form of `act`, when it has one.
fn gate_of(act: GateActivation) -> Option<Gate> {
    match act {
        GateActivation::Silu => Some(Gate::Silu),
        GateActivation::GeluTanh => Some(Gate::GeluTanh),
        GateActivation::Gelu => Some(Gate::Gelu),
        GateActivation::ClampedSwiglu { .. } => None,
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
        match gate_of(act) {
            Some(vectorised) => vmath::gated_at(level, vectorised, gs, &up[start..end]),
            None => {
                for (x, &u) in gs.iter_mut().zip(&up[start..end]) {
                    *x = gated(act, *x, u);
                }
            }
        }
    });
}

/// `x[i] = act(x[i])`; `Err` naming `act` when it has no ungated form (gpt-oss's clamped
/// SwiGLU needs its up half).
pub fn act_inplace(pool: &ThreadPool, act: GateActivation, x: &mut [f32]) -> Result<(), String> {
    let f = gate_of(act).ok_or_else(|| format!("{act:?} is a gated activation only"))?;
    let len = x.len();
    let xs = SharedMut::new(x);
    let level = SimdLevel::detect();
    pool.run(len.div_ceil(CHUNK), |task| {
        let start = task * CHUNK;
        let end = (start + CHUNK).min(len);
        // SAFETY: each task owns elements start..end.
        vmath::activate_at(level, f, unsafe { xs.slice(start, end - start) });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let silu = GateActivation::Silu;
        assert!((gated(silu, 0.0, 1.0)).abs() < 1e-7);
        assert!((gated(silu, 2.0, 1.0) - 1.761_594_2).abs() < 1e-6);
        let gelu = GateActivation::GeluTanh;
        assert!((gated(gelu, 1.0, 1.0) - 0.841_192).abs() < 1e-5);
        assert!((gated(gelu, -3.0, 1.0) - -0.003_637_3).abs() < 1e-5);
        // gpt-oss: the gate clamped at 7 from above, the up at ±7, plus one.
        let oss = GateActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 };
        let want = 7.0 / (1.0 + (-1.702f32 * 7.0).exp()) * (-7.0 + 1.0);
        assert_eq!(gated(oss, 9.0, -8.0), want);
        let pool = ThreadPool::new(2);
        for act in [silu, oss] {
            let mut g: Vec<f32> = (0..40_000).map(|i| i as f32 / 10_000.0 - 2.0).collect();
            let up = vec![2.0; g.len()];
            let want: Vec<f32> = g.iter().map(|v| gated(act, *v, 2.0)).collect();
            gated_act_inplace(&pool, act, &mut g, &up);
            assert_eq!(g, want);
        }
    }
}
