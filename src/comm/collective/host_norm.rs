//! The host backend's arithmetic of the fused all-reduce + residual + RMSNorm call, in the
//! kernels' order: a row's sum of squares in the canonical order of kernels/rms_norm.cuh
//! (docs/DESIGN.md, "Determinism"), so a row's bits do not depend on the call it travels in on
//! the host either.
//!
//! Invariant: `row_squares` adds exactly the operations the kernels add, in the same order
//! (the reciprocal square root then differs: the kernels use the GPU's `rsqrtf`); `quantize_row`
//! is kernels/quant.cuh's arithmetic (scales, reciprocal, e4m3 rounding and saturation).

use super::algo::Quant;
use super::call::QUANT_GROUP;
use super::convert::{f32_to_e4m3, E4M3_MAX};

/// A dynamic scale: max(amax / 448, FLT_MIN).
fn amax_scale(amax: f32) -> f32 {
    (amax / E4M3_MAX).max(f32::MIN_POSITIVE)
}

/// max |y| with NaN ignored (as `fmaxf`).
fn amax(y: &[f32]) -> f32 {
    y.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// `s` rounded up to a power of two (UE8M0 scales): a positive normal `s` with a nonzero
/// mantissa goes to the next power of two; a power of two, and +inf, stay (kernels/quant.cuh
/// `ue8m0_ceil`).
pub fn ue8m0_ceil(s: f32) -> f32 {
    let b = s.to_bits();
    if b & 0x7f_ffff == 0 {
        s
    } else {
        f32::from_bits((b & 0x7f80_0000) + 0x80_0000)
    }
}

/// One group of 128 values (or any slice) as kernels/quant.cuh quantizes it per group: the
/// e4m3 bytes and the scale `s = max(amax / 448, FLT_MIN)`, rounded up to a power of two when
/// `ue8m0`; `q = e4m3(y * (1 / s))`.
pub fn quantize_group(y: &[f32], ue8m0: bool) -> (Vec<u8>, f32) {
    let mut sc = amax_scale(amax(y));
    if ue8m0 {
        sc = ue8m0_ceil(sc);
    }
    let inv = 1.0 / sc;
    (y.iter().map(|v| f32_to_e4m3(v * inv)).collect(), sc)
}

/// One row's FP8 output from its fp32 values `y`: the e4m3 bytes and the scales the mode writes
/// (none for a static scale `s`, one per row, or one per 128 elements). `q = e4m3(y * (1 / s))`;
/// a static scale that is not finite and > 0 makes every byte NaN.
pub fn quantize_row(mode: Quant, y: &[f32], s: f32) -> (Vec<u8>, Vec<f32>) {
    let conv = |ys: &[f32], inv: f32| ys.iter().map(|v| f32_to_e4m3(v * inv)).collect::<Vec<u8>>();
    match mode {
        Quant::Static => {
            let inv = if s > 0.0 && s.is_finite() {
                1.0 / s
            } else {
                f32::NAN
            };
            (conv(y, inv), Vec::new())
        }
        Quant::PerToken => {
            let sc = amax_scale(amax(y));
            (conv(y, 1.0 / sc), vec![sc])
        }
        Quant::PerGroup128 => {
            let mut out = Vec::with_capacity(y.len());
            let mut scales = Vec::new();
            for g in y.chunks(QUANT_GROUP as usize) {
                let (q, sc) = quantize_group(g, false);
                out.extend(q);
                scales.push(sc);
            }
            (out, scales)
        }
    }
}

/// Elements per 16-byte vector of a 16-bit type (the fused call takes bf16 and fp16).
const VEC: usize = 8;
/// Vectors per chunk: a warp's lanes.
const CHUNK: usize = 32;

/// The sum of squares of a row of fp32 values (`row.len()` a multiple of 8), in the canonical
/// order: each vector's squares in element order (`fma` after the first), then the pairwise
/// tree in natural order over the vectors, zero-padded to a power of two of at least 32 (the
/// chunk trees, then the tree over the chunk sums).
pub fn row_squares(row: &[f32]) -> f32 {
    let mut level: Vec<f32> = row
        .chunks(VEC)
        .map(|v| v[1..].iter().fold(v[0] * v[0], |s, &x| x.mul_add(x, s)))
        .collect();
    level.resize(level.len().next_power_of_two().max(CHUNK), 0.0);
    while level.len() > 1 {
        level = level.chunks(2).map(|p| p[0] + p[1]).collect();
    }
    level[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels' way round: chunk trees by a 32-lane butterfly (xor 1..16), then the tree
    /// over at most 64 chunk slots, the first level pairing (2l, 2l + 1) when there are more
    /// than 32 chunks (kernels/rms_norm.cuh, `row_tree`).
    fn as_the_kernels_do(row: &[f32]) -> f32 {
        let vsum: Vec<f32> = row
            .chunks(VEC)
            .map(|v| {
                let mut s = v[0] * v[0];
                for &x in &v[1..] {
                    s = x.mul_add(x, s);
                }
                s
            })
            .collect();
        let butterfly = |mut lanes: [f32; 32]| {
            let mut o = 1;
            while o < 32 {
                let prev = lanes;
                for (l, v) in lanes.iter_mut().enumerate() {
                    *v = prev[l] + prev[l ^ o];
                }
                o <<= 1;
            }
            // Every lane holds the same bits (addition commutes).
            assert!(lanes.iter().all(|v| v.to_bits() == lanes[0].to_bits()));
            lanes[0]
        };
        let chunks: Vec<f32> = vsum
            .chunks(CHUNK)
            .map(|c| {
                let mut lanes = [0f32; 32];
                lanes[..c.len()].copy_from_slice(c);
                butterfly(lanes)
            })
            .collect();
        let n = chunks.len();
        let at = |i: usize| if i < n { chunks[i] } else { 0.0 };
        let mut lanes = [0f32; 32];
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = if n > 32 {
                at(2 * l) + at(2 * l + 1)
            } else {
                at(l)
            };
        }
        butterfly(lanes)
    }

    /// The cluster kernel's way round: blocks of B vectors (a power of two), each adding its
    /// chunks as one run, then the C runs' tree over 8 slots.
    fn as_the_cluster_does(row: &[f32], b: usize) -> f32 {
        let v = row.len() / VEC;
        let c = v.div_ceil(b);
        let mut runs = [0f32; 8];
        for (q, run) in runs.iter_mut().enumerate().take(c) {
            let mut part = vec![0f32; b * VEC];
            let lo = q * b * VEC;
            let hi = ((q + 1) * b * VEC).min(row.len());
            part[..hi - lo].copy_from_slice(&row[lo..hi]);
            *run = row_squares(&part);
        }
        let mut level = runs.to_vec();
        while level.len() > 1 {
            level = level.chunks(2).map(|p| p[0] + p[1]).collect();
        }
        level[0]
    }

    fn row(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
            })
            .collect()
    }

    /// UE8M0 rounds a scale up to a power of two: powers of two (FLT_MIN too) and +inf stay,
    /// anything else goes to the next exponent; a group's scale is then exact in 1 / s.
    #[test]
    fn ue8m0_rounds_scales_up_to_powers_of_two() {
        let min = f32::MIN_POSITIVE;
        for (s, want) in [
            (1.0f32, 1.0f32),
            (1.5, 2.0),
            (1.0 + f32::EPSILON, 2.0),
            (0.75, 1.0),
            (1.0 / 448.0, 1.0 / 256.0),
            (min, min),
            (min * 1.25, min * 2.0),
            (2f32.powi(127), 2f32.powi(127)),
            (f32::INFINITY, f32::INFINITY),
        ] {
            assert_eq!(ue8m0_ceil(s).to_bits(), want.to_bits(), "{s:e}");
        }
        let g: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) * 0.37).collect();
        let (q, s) = quantize_group(&g, true);
        let (q0, s0) = quantize_group(&g, false);
        assert_eq!(s, ue8m0_ceil(s0));
        assert!(s >= s0 && s < 2.0 * s0 && s.to_bits() & 0x7f_ffff == 0);
        assert_eq!(q.len(), 128);
        assert_ne!(q, q0, "a coarser scale gives other bytes here");
        // All zeros: the scale clamps to FLT_MIN, the bytes are 0.
        assert_eq!(quantize_group(&[0.0; 128], true), (vec![0u8; 128], min));
    }

    #[test]
    fn the_host_adds_in_the_kernels_order() {
        for hidden in [
            8, 16, 248, 256, 264, 1024, 2056, 4096, 5000, 6144, 7176, 8192, 16376, 16384,
        ] {
            let r = row(hidden as u64, hidden);
            let want = as_the_kernels_do(&r).to_bits();
            assert_eq!(row_squares(&r).to_bits(), want, "hidden {hidden}");
            let vecs = hidden / VEC;
            for b in [64usize, 128, 256, 512] {
                if vecs > 512 && vecs.div_ceil(b) <= 8 && b.is_power_of_two() {
                    assert_eq!(
                        as_the_cluster_does(&r, b).to_bits(),
                        want,
                        "hidden {hidden}, blocks of {b}"
                    );
                }
            }
        }
    }

    /// kernels/quant.cuh's `token_amax`: the cluster kernel's per-token amax, max(RN(m * inv), 0)
    /// from m = max |r * w|, must equal max |y| over y = RN(RN(r * w) * inv) (NaN ignored), the
    /// LL and barrier kernels' and this backend's, bit for bit, or a row's scale would depend on
    /// the kernel its row count picks.
    #[test]
    fn the_cluster_amax_equals_the_direct_one() {
        let direct = |rw: &[f32], inv: f32| rw.iter().fold(0f32, |m, a| m.max((a * inv).abs()));
        let cluster = |rw: &[f32], inv: f32| {
            let m = rw.iter().fold(0f32, |m, a| m.max(a.abs()));
            (m * inv).max(0.0) // f32::max ignores NaN as fmaxf does
        };
        let mut cases = 0;
        for seed in 1..400u64 {
            let r = row(seed, 64);
            let w = row(seed ^ 0x9e37, 64);
            let rw: Vec<f32> = r.iter().zip(&w).map(|(a, b)| a * b).collect();
            for inv in [row(seed ^ 7, 1)[0].abs() + 1e-3, 1e-30, 3.7e12, 1.0 / 3.0] {
                assert_eq!(
                    cluster(&rw, inv).to_bits(),
                    direct(&rw, inv).to_bits(),
                    "seed {seed}, inv {inv}"
                );
                cases += 1;
            }
        }
        // Where m * inv is NaN (0 * inf, inf * 0) or inv is NaN, and NaN or infinite products.
        let edge: [(&[f32], f32); 7] = [
            (&[0.0, -0.0, 0.0], f32::INFINITY),
            (&[1.0, f32::INFINITY, -2.0], 0.0),
            (&[1.0, -3.0], f32::NAN),
            (&[f32::NAN, 2.0, -5.0], 0.5),
            (&[f32::NEG_INFINITY, 1.0], 0.25),
            (&[1e-45, -1e-45], 0.5),
            (&[3.0e38, -3.0e38], 2.0),
        ];
        for (rw, inv) in edge {
            assert_eq!(
                cluster(rw, inv).to_bits(),
                direct(rw, inv).to_bits(),
                "{rw:?} * {inv}"
            );
        }
        assert_eq!(cases, 399 * 4);
    }
}
