//! What exact int8 dot products cost on this core's AVX2 pipes:
//! `cargo run --release -p kiln-kernels --example avx2_probe`. One thread; every time is in
//! units of one `vpmaddubsw` (six independent per iteration, the best of three runs), so the
//! numbers compare instruction mixes on this machine without a cycle counter. Per 32
//! multiply-adds of one activation row ("row-quad": 8 output lanes × 4 elements):
//! - `two multiplies`: `vpmaddubsw` and the `vpmaddwd` that widens it, nothing else (the
//!   multiplies every exact 8-bit path on AVX2 issues);
//! - `q8 mix`: the register work of the AVX2 Q8_0 tile — per quad the stored levels flipped
//!   (`vpxor`) and their `vpabsb`, shared by its 3 rows, and per row `vpsignb`, `vpmaddubsw`,
//!   `vpmaddwd`, `vpaddd`;
//! - `q8 mix without vpsignb`: the same less the sign (what an unsigned-activation path would
//!   pay; exact only if no pair sum can saturate, which Q8_0 weights do not guarantee);
//! - `int16`: two `vpmaddwd` + `vpaddd` on 16-bit weights and activations (exact, no sign);
//! - the last two: the 3-row Q8_0 tile and a 4-row 16-bit tile with their weight loads and
//!   activation broadcasts from memory (L1), per row-quad.
//!
//! Registers and pointers pass through empty `asm!` blocks so that the compiler can neither
//! merge the rows' identical work nor hoist it out of the loop.

#[cfg(target_arch = "x86_64")]
fn main() {
    if !std::arch::is_x86_feature_detected!("avx2") {
        eprintln!("avx2_probe: this CPU has no AVX2");
        std::process::exit(1);
    }
    for _ in 0..3 {
        // SAFETY: AVX2 was detected above.
        let line = unsafe { probe::run() };
        println!("{line}");
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("avx2_probe: x86-64 only");
}

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::time::Instant;

    const ITERS: usize = 100_000_000;

    /// Keeps each place opaque to the optimizer, in a register.
    macro_rules! opaque {
        ($($v:expr),*) => { $( asm!("/* {0} */", inout(ymm_reg) $v, options(nomem, nostack)); )* };
    }

    /// Keeps each pointer, and the memory behind it, opaque to the optimizer (so loads
    /// through it are redone each pass).
    macro_rules! opaque_ptr {
        ($($p:ident),*) => { $( asm!("/* {0} */", inout(reg) $p, options(nostack)); )* };
    }

    /// Seconds per iteration of `body`, run `iters` times in the calling function (a macro, so
    /// that the body compiles with its AVX2 features and keeps its values in registers).
    macro_rules! per_iter {
        ($iters:expr, $body:block) => {{
            let start = Instant::now();
            for _ in 0..$iters $body
            start.elapsed().as_secs_f64() / $iters as f64
        }};
    }

    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn run() -> String {
        // SAFETY: register operations (`tiles` reads only its own vectors); AVX2 is the
        // caller's.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut w = _mm256_set1_epi8(-7);
            let mut x: [__m256i; 6] = std::array::from_fn(|r| _mm256_set1_epi8(r as i8 * 3 - 8));
            let mut a = [_mm256_setzero_si256(); 6];
            // The unit: the fastest of three runs (the first run after a pause can be slow).
            let mut one = f64::INFINITY;
            for _ in 0..3 {
                let t = per_iter!(ITERS, {
                    for r in 0..6 {
                        opaque!(x[r]);
                        a[r] = _mm256_maddubs_epi16(w, x[r]);
                        opaque!(a[r]);
                    }
                }) / 6.0;
                one = one.min(t);
            }
            // The two multiplies of an 8-bit row-quad and nothing else, per row.
            let multiplies = per_iter!(ITERS, {
                for r in 0..6 {
                    opaque!(x[r]);
                    a[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x[r]), ones);
                    opaque!(a[r]);
                }
            }) / 6.0;
            // The Q8_0 tile's register work for its 3 rows (the stored levels flipped and their
            // `vpabsb` once per quad), with or without the sign step.
            let flip = _mm256_set1_epi8(-128);
            macro_rules! rows {
                ($sign:expr) => {
                    per_iter!(ITERS, {
                        opaque!(w);
                        let wq = _mm256_xor_si256(w, flip);
                        let aw = _mm256_abs_epi8(wq);
                        for r in 0..3 {
                            opaque!(x[r]);
                            let s = if $sign { _mm256_sign_epi8(x[r], wq) } else { x[r] };
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, s), ones);
                            a[r] = _mm256_add_epi32(a[r], p);
                            opaque!(a[r]);
                        }
                    }) / 3.0
                };
            }
            let (q8, nosign) = (rows!(true), rows!(false));
            let int16 =
                2.0 * per_iter!(ITERS, {
                    opaque!(w);
                    for r in 0..6 {
                        opaque!(x[r]);
                        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(w, x[r]));
                        opaque!(a[r]);
                    }
                }) / 6.0;
            let (tile8, tile16) = tiles();
            format!(
                "vpmaddubsw {:.3} ns | per row-quad, in vpmaddubsw: two multiplies {:.2}, q8 mix \
                 {:.2}, q8 mix without vpsignb {:.2}, int16 {:.2} | from memory: q8 tile of 3 \
                 rows {:.2}, int16 tile of 4 rows {:.2}",
                one * 1e9,
                multiplies / one,
                q8 / one,
                nosign / one,
                int16 / one,
                tile8 / one,
                tile16 / one
            )
        }
    }

    /// Seconds per row-quad of the 3-row Q8_0 tile and of a 4-row 16-bit tile, each over 64
    /// quads of weights with activations broadcast from memory.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::needless_range_loop)] // rows indexed as in the kernel's tiles
    unsafe fn tiles() -> (f64, f64) {
        // [quad][32] stored Q8_0 levels (w + 128), and 16-bit weights ([quad][2][16]).
        let w8: Vec<u8> = (0..64 * 32).map(|i| (i * 13 % 251) as u8).collect();
        let w16: Vec<i16> = (0..64 * 32).map(|i| (i * 13 % 251) as i16 - 125).collect();
        // [row][256] activations as i8 and as i16.
        let x8: Vec<i8> = (0..4 * 256).map(|i| (i * 7 % 200) as i8).collect();
        let x16: Vec<i16> = (0..4 * 256).map(|i| (i * 7 % 200) as i16 - 100).collect();
        let iters = ITERS / 64;
        // SAFETY: every read is inside the vectors above; AVX2 is the caller's.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let flip = _mm256_set1_epi8(-128);
            let bcast = |p: *const u8| _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
            let mut a = [_mm256_setzero_si256(); 4];
            let (mut pw8, mut px8) = (w8.as_ptr(), x8.as_ptr());
            let q8 = per_iter!(iters, {
                // The loads may not be hoisted: their addresses are opaque every pass.
                opaque_ptr!(pw8, px8);
                for q in 0..64 {
                    let wq = _mm256_loadu_si256(pw8.add(32 * q).cast());
                    let wq = _mm256_xor_si256(wq, flip);
                    let aw = _mm256_abs_epi8(wq);
                    for r in 0..3 {
                        let x = bcast(px8.add(256 * r + 4 * q).cast());
                        let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, wq));
                        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(p, ones));
                    }
                }
                opaque!(a[0], a[1], a[2]);
            }) / (64.0 * 3.0);
            let (mut pw16, mut px16) = (w16.as_ptr(), x16.as_ptr());
            let int16 = per_iter!(iters, {
                opaque_ptr!(pw16, px16);
                for q in 0..64 {
                    let w0 = _mm256_loadu_si256(pw16.add(32 * q).cast());
                    let w1 = _mm256_loadu_si256(pw16.add(32 * q + 16).cast());
                    for r in 0..4 {
                        let x = px16.add(256 * r + 4 * q).cast::<u8>();
                        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(w0, bcast(x)));
                        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(w1, bcast(x.add(4))));
                    }
                }
                opaque!(a[0], a[1], a[2], a[3]);
            }) / (64.0 * 4.0);
            (q8, int16)
        }
    }
}
