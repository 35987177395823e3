//! Test data for the GPU tests: element encoding, reproducible inputs, float64 references,
//! error measures and hashes.

use super::Rng;
use symmalloc::comm::convert::*;
use symmalloc::ffi::types::*;

pub fn esize(dtype: u32) -> usize {
    if dtype == SYMM_FP32 {
        4
    } else {
        2
    }
}

pub fn encode(dtype: u32, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * esize(dtype));
    for &x in v {
        match dtype {
            SYMM_BF16 => out.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
            SYMM_FP16 => out.extend_from_slice(&f32_to_f16(x).to_le_bytes()),
            _ => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    out
}

pub fn decode(dtype: u32, b: &[u8]) -> Vec<f32> {
    b.chunks(esize(dtype))
        .map(|c| match dtype {
            SYMM_BF16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            SYMM_FP16 => f16_to_f32(u16::from_le_bytes([c[0], c[1]])),
            _ => f32::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

/// Rank r's inputs for one case, reproducible on every rank.
pub fn inputs(seed: u64, rank: i32, n: usize, dtype: u32) -> Vec<f32> {
    let mut g = Rng::new(seed ^ ((rank as u64 + 1) << 48));
    let v: Vec<f32> = (0..n).map(|_| g.unit() * 4.0).collect();
    decode(dtype, &encode(dtype, &v)) // the values as the dtype holds them
}

pub fn reference(seed: u64, world: i32, n: usize, dtype: u32, op: u32) -> Vec<f64> {
    let all: Vec<Vec<f32>> = (0..world).map(|r| inputs(seed, r, n, dtype)).collect();
    (0..n)
        .map(|i| {
            let vals = all.iter().map(|v| v[i] as f64);
            match op {
                SYMM_SUM => vals.sum(),
                SYMM_MAX => vals.fold(f64::MIN, f64::max),
                _ => vals.fold(f64::MAX, f64::min),
            }
        })
        .collect()
}

pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (*g as f64 - w) * (*g as f64 - w);
        den += w * w;
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn tol(dtype: u32) -> f64 {
    match dtype {
        SYMM_BF16 => 1e-2,
        SYMM_FP16 => 2e-3,
        _ => 1e-5,
    }
}

pub fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |x, &c| {
        (x ^ c as u64).wrapping_mul(0x100000001b3)
    })
}
