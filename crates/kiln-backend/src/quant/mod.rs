//! The quant codecs every backend shares: GGUF block layouts and their exact dequantization
//! ([`dequantize_row`], the format reference), quantize-on-load ([`quantize_row`]), the
//! codebook types' decoding ([`iq`]) and the block-format helpers ([`formats`]). Backends
//! build their own device layouts from these (the CPU kernels' repacked records, the CUDA
//! backend's dequantized weights).
//!
//! Invariant: [`dequantize_row`] matches gguf-py's dequantizers bit for bit on every type
//! (the CPU kernels' `fixture_matches_gguf_py` test checks it, and that their repacked form
//! dequantizes to the same bits).

mod dequant;
mod fit;
pub mod formats;
pub mod iq;
mod iq_grids;
mod quantize;

pub use dequant::{dequantize_row, q2_at, q3_high_bit};
pub use quantize::quantize_row;
