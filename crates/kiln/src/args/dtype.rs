//! `--dtype` (vLLM's flag): the precision float weight matrices multiply in on the CPU.
//!
//! | value | float matrices |
//! |---|---|
//! | `auto` (default) | bf16 ones in bf16 (as vLLM runs a bf16 checkpoint); others in f32 |
//! | `bfloat16` | every one converted to bf16 as it loads, then in bf16 |
//! | `float32`, `float` | every one in f32 (16-bit weights widened exactly) |
//! | `half`, `float16` | in f32, with a warning: kiln has no f16 arithmetic path |
//!
//! "In bf16" means activations rounded to bf16 and products summed in f32 on the CPU's bf16
//! units (AVX-512 BF16). A CPU without them computes in f32 (a warning says so when `bfloat16`
//! was asked). Quantized matrices are unaffected: their kernels are integer dot products.

use kiln_kernels::FloatMatmul;

/// vLLM's `--dtype` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Dtype {
    #[default]
    Auto,
    Half,
    Float16,
    Bfloat16,
    Float,
    Float32,
}

impl Dtype {
    /// How the CPU backend multiplies float matrices, on a CPU with (`bf16_units`) or without
    /// AVX-512 BF16.
    pub fn float_matmul(self, bf16_units: bool) -> FloatMatmul {
        match self {
            Self::Auto if bf16_units => FloatMatmul::Bf16Stored,
            Self::Bfloat16 if bf16_units => FloatMatmul::Bf16,
            _ => FloatMatmul::F32,
        }
    }

    /// The warning this value deserves on such a CPU, if any.
    pub fn warning(self, bf16_units: bool) -> Option<String> {
        match self {
            Self::Half | Self::Float16 => Some(format!(
                "--dtype {}: kiln's CPU backend has no float16 arithmetic; float matrices \
                 multiply in float32 (f16 weights stay f16 in memory)",
                self.name()
            )),
            Self::Bfloat16 if !bf16_units => Some(
                "--dtype bfloat16: this CPU has no AVX-512 BF16 (or another --isa path was \
                 chosen); float matrices multiply in float32"
                    .to_owned(),
            ),
            _ => None,
        }
    }

    /// The warning this value deserves on the CUDA backend, whose matmuls are bf16 always.
    #[cfg(feature = "cuda")]
    pub fn cuda_warning(self) -> Option<String> {
        (!matches!(self, Self::Auto | Self::Bfloat16)).then(|| {
            format!(
                "--dtype {}: the CUDA backend keeps weights in bf16 and multiplies in bf16",
                self.name()
            )
        })
    }

    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map_or_else(String::new, |v| v.get_name().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_value_means_what_it_says() {
        let with = |d: Dtype| d.float_matmul(true);
        assert_eq!(with(Dtype::Auto), FloatMatmul::Bf16Stored);
        assert_eq!(with(Dtype::Bfloat16), FloatMatmul::Bf16);
        for d in [Dtype::Float, Dtype::Float32, Dtype::Half, Dtype::Float16] {
            assert_eq!(with(d), FloatMatmul::F32, "{d:?}");
        }
        for d in [Dtype::Auto, Dtype::Bfloat16, Dtype::Float32] {
            assert_eq!(d.float_matmul(false), FloatMatmul::F32, "{d:?} without bf16 units");
        }
        assert!(Dtype::Bfloat16.warning(false).is_some_and(|w| w.contains("AVX-512 BF16")));
        assert!(Dtype::Bfloat16.warning(true).is_none());
        assert!(Dtype::Half.warning(true).is_some_and(|w| w.contains("--dtype half")));
        assert!(Dtype::Auto.warning(false).is_none());
        #[cfg(feature = "cuda")]
        assert!(Dtype::Float32.cuda_warning().is_some() && Dtype::Auto.cuda_warning().is_none());
    }
}
