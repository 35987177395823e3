//! Collective parameters as validated Rust values (element type, operation, algorithm) and the
//! AUTO choice between one-shot and two-shot.

use crate::config;
use crate::error::{Error, Result};
use crate::ffi::types as t;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    Fp16,
    Fp32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    Auto,
    OneShot,
    TwoShot,
    Multimem,
}

impl DType {
    pub fn from_c(v: t::symm_dtype_t) -> Result<Self> {
        match v {
            t::SYMM_BF16 => Ok(DType::Bf16),
            t::SYMM_FP16 => Ok(DType::Fp16),
            t::SYMM_FP32 => Ok(DType::Fp32),
            _ => Err(Error::invalid(format!(
                "dtype {v} is not a symm_dtype_t; expected SYMM_BF16 (0), SYMM_FP16 (1) or SYMM_FP32 (2)"
            ))),
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::Fp16 => 2,
            DType::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp16 => "fp16",
            DType::Fp32 => "fp32",
        }
    }
}

impl ReduceOp {
    pub fn from_c(v: t::symm_op_t) -> Result<Self> {
        match v {
            t::SYMM_SUM => Ok(ReduceOp::Sum),
            t::SYMM_MAX => Ok(ReduceOp::Max),
            t::SYMM_MIN => Ok(ReduceOp::Min),
            _ => Err(Error::invalid(format!(
                "op {v} is not a symm_op_t; expected SYMM_SUM (0), SYMM_MAX (1) or SYMM_MIN (2)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

impl Algo {
    pub fn from_c(v: t::symm_algo_t) -> Result<Self> {
        match v {
            t::SYMM_ALGO_AUTO => Ok(Algo::Auto),
            t::SYMM_ALGO_ONE_SHOT => Ok(Algo::OneShot),
            t::SYMM_ALGO_TWO_SHOT => Ok(Algo::TwoShot),
            t::SYMM_ALGO_MULTIMEM => Ok(Algo::Multimem),
            _ => Err(Error::invalid(format!(
                "algo {v} is not a symm_algo_t; expected SYMM_ALGO_AUTO (0), ONE_SHOT (1), \
                 TWO_SHOT (2) or MULTIMEM (3)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::OneShot => "one_shot",
            Algo::TwoShot => "two_shot",
            Algo::Multimem => "multimem",
        }
    }
}

/// Default largest message (bytes) AUTO sends one-shot, by world size. Measured on 2x H200
/// (bench/RESULTS.md): two-shot matched one-shot at 8 KiB (6.9 us graphed) and beat it from
/// 32 KiB up, so one-shot keeps only the smallest messages. Wider worlds read (world-1)
/// copies in one-shot, so the crossover drops further (not measured: no wider machine lent).
pub fn default_one_shot_max(world: usize) -> u64 {
    match world {
        0..=2 => 16 << 10,
        3..=4 => 8 << 10,
        _ => 4 << 10,
    }
}

/// AUTO: one-shot up to the threshold (`SYMMALLOC_ONE_SHOT_MAX_BYTES` overrides), two-shot
/// above. Multimem is never chosen automatically. One rank needs no peers: one-shot.
pub fn choose(algo: Algo, bytes: u64, world: usize) -> Result<Algo> {
    if algo != Algo::Auto {
        return Ok(algo);
    }
    if world == 1 {
        return Ok(Algo::OneShot);
    }
    let max = config::auto_threshold("SYMMALLOC_ONE_SHOT_MAX_BYTES")?
        .unwrap_or_else(|| default_one_shot_max(world));
    Ok(if bytes <= max {
        Algo::OneShot
    } else {
        Algo::TwoShot
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn auto_picks_by_size_and_world() {
        assert_eq!(choose(Algo::Auto, 8 << 10, 2).unwrap(), Algo::OneShot);
        assert_eq!(choose(Algo::Auto, 16 << 10, 2).unwrap(), Algo::OneShot);
        assert_eq!(choose(Algo::Auto, 32 << 10, 2).unwrap(), Algo::TwoShot);
        assert_eq!(choose(Algo::Auto, 8 << 10, 8).unwrap(), Algo::TwoShot);
        assert_eq!(choose(Algo::Auto, 64 << 20, 1).unwrap(), Algo::OneShot);
        assert_eq!(choose(Algo::TwoShot, 8, 2).unwrap(), Algo::TwoShot);
        assert!(DType::from_c(7).unwrap_err().message.contains("dtype 7"));
        assert!(ReduceOp::from_c(3).is_err());
        assert!(Algo::from_c(9).is_err());
    }
}
