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
    /// One-shot without barriers: values carry their own arrival flags (kernels/one_shot_ll.cu).
    OneShotLL,
    /// Not all-reduce algorithms: the collectives of kernels/scatter_gather.cu (never chosen by
    /// AUTO, never named by a symm_algo_t).
    ReduceScatter,
    /// Reduce-scatter of slices up to AUTO's LL threshold, barrier-free (launch.rs picks it).
    ReduceScatterLL,
    AllGather,
    /// All-reduce fused with residual add and RMSNorm (kernels/rms_norm.cu): the barrier
    /// kernel, and the LL kernels for messages up to AUTO's LL threshold (a vector per thread
    /// up to hidden 6144, up to four per thread above).
    AddRmsNorm,
    AddRmsNormLL,
    AddRmsNormLL1,
    /// The fused LL kernel with each row split over a thread-block cluster (sm_90+).
    AddRmsNormLLC,
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
            t::SYMM_ALGO_ONE_SHOT_LL => Ok(Algo::OneShotLL),
            _ => Err(Error::invalid(format!(
                "algo {v} is not a symm_algo_t; expected SYMM_ALGO_AUTO (0), ONE_SHOT (1), \
                 TWO_SHOT (2), MULTIMEM (3) or ONE_SHOT_LL (4)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::OneShot => "one_shot",
            Algo::TwoShot => "two_shot",
            Algo::Multimem => "multimem",
            Algo::OneShotLL => "one_shot_ll",
            Algo::ReduceScatter => "reduce_scatter",
            Algo::ReduceScatterLL => "reduce_scatter_ll",
            Algo::AllGather => "all_gather",
            Algo::AddRmsNorm => "all_reduce_add_rms_norm",
            Algo::AddRmsNormLL => "all_reduce_add_rms_norm_ll",
            Algo::AddRmsNormLL1 => "all_reduce_add_rms_norm_ll1",
            Algo::AddRmsNormLLC => "all_reduce_add_rms_norm_llc",
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

/// Default largest message (bytes) AUTO sends with the barrier-free one-shot LL kernel.
/// Measured on 2x H200 (bench/RESULTS.md): LL beat two-shot at every size up to 4 MiB (6.2
/// against 9.8 us graphed at 1 MiB, 16.6 against 18.4 at 4 MiB) and lost from 16 MiB (61
/// against 55). A rank pushes (world - 1) copies of its message, so wider worlds switch to
/// two-shot earlier (reasoned, not measured: no wider machine was lent).
pub fn default_ll_max(world: usize) -> u64 {
    match world {
        0..=2 => 4 << 20,
        3..=4 => 256 << 10,
        _ => 64 << 10,
    }
}

/// AUTO's size thresholds, fixed for a communicator's life: read from the environment once,
/// at init, and checked there to be equal on every rank (ranks that picked different
/// algorithms for one call would fail it as asymmetric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoThresholds {
    /// Largest message for the one-shot LL kernel (`SYMMALLOC_LL_MAX_BYTES`); at most the slot.
    pub ll_max: u64,
    /// Largest message for the barrier one-shot (`SYMMALLOC_ONE_SHOT_MAX_BYTES`).
    pub one_shot_max: u64,
}

impl AutoThresholds {
    /// Overrides (None: the default for `world`) checked against the LL slot `ll_slot`.
    pub fn new(
        world: usize,
        ll_slot: u64,
        ll_max: Option<u64>,
        one_shot_max: Option<u64>,
    ) -> Result<Self> {
        let ll_max = match ll_max {
            Some(v) if v > ll_slot => {
                return Err(Error::invalid(format!(
                    "SYMMALLOC_LL_MAX_BYTES={v} exceeds the LL slot of {ll_slot} bytes \
                     (SYMMALLOC_LL_BYTES); expected 0..={ll_slot}"
                )))
            }
            Some(v) => v,
            None => default_ll_max(world).min(ll_slot),
        };
        let one_shot_max = one_shot_max.unwrap_or_else(|| default_one_shot_max(world));
        Ok(AutoThresholds {
            ll_max,
            one_shot_max,
        })
    }

    /// `SYMMALLOC_LL_MAX_BYTES` and `SYMMALLOC_ONE_SHOT_MAX_BYTES` from the environment.
    pub fn from_env(world: usize, ll_slot: u64) -> Result<Self> {
        Self::new(
            world,
            ll_slot,
            config::auto_threshold("SYMMALLOC_LL_MAX_BYTES")?,
            config::auto_threshold("SYMMALLOC_ONE_SHOT_MAX_BYTES")?,
        )
    }
}

/// AUTO: one-shot LL up to `auto.ll_max` (0 turns it off), then barrier one-shot up to
/// `auto.one_shot_max`, then two-shot. Multimem is never chosen automatically. One rank needs
/// no peers: one-shot. An explicit ONE_SHOT_LL larger than the LL slot is refused.
pub fn choose(
    algo: Algo,
    bytes: u64,
    world: usize,
    ll_slot: u64,
    auto: &AutoThresholds,
) -> Result<Algo> {
    if algo == Algo::OneShotLL && bytes > ll_slot {
        return Err(Error::invalid(format!(
            "SYMM_ALGO_ONE_SHOT_LL takes messages up to {ll_slot} bytes (SYMMALLOC_LL_BYTES); \
             this one has {bytes} (use SYMM_ALGO_AUTO)"
        )));
    }
    if algo != Algo::Auto {
        return Ok(algo);
    }
    if world == 1 {
        return Ok(Algo::OneShot);
    }
    Ok(if bytes <= auto.ll_max {
        Algo::OneShotLL
    } else if bytes <= auto.one_shot_max {
        Algo::OneShot
    } else {
        Algo::TwoShot
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    const SLOT: u64 = 4 << 20;
    fn pick(algo: Algo, bytes: u64, world: usize, slot: u64) -> Result<Algo> {
        let auto = AutoThresholds::new(world, slot, None, None).unwrap();
        choose(algo, bytes, world, slot, &auto)
    }

    #[test]
    fn auto_picks_by_size_and_world() {
        let ll = default_ll_max(2);
        assert_eq!(pick(Algo::Auto, 8 << 10, 2, SLOT).unwrap(), Algo::OneShotLL);
        assert_eq!(pick(Algo::Auto, ll, 2, SLOT).unwrap(), Algo::OneShotLL);
        assert_eq!(pick(Algo::Auto, ll + 2, 2, SLOT).unwrap(), Algo::TwoShot);
        assert_eq!(pick(Algo::Auto, 8 << 10, 8, SLOT).unwrap(), Algo::OneShotLL);
        assert_eq!(pick(Algo::Auto, 1 << 20, 8, SLOT).unwrap(), Algo::TwoShot);
        assert_eq!(pick(Algo::Auto, 4 << 20, 2, SLOT).unwrap(), Algo::OneShotLL);
        assert_eq!(pick(Algo::Auto, 64 << 20, 1, SLOT).unwrap(), Algo::OneShot);
        assert_eq!(pick(Algo::TwoShot, 8, 2, SLOT).unwrap(), Algo::TwoShot);
        assert_eq!(
            pick(Algo::OneShotLL, SLOT, 2, SLOT).unwrap(),
            Algo::OneShotLL
        );
        let e = pick(Algo::OneShotLL, SLOT + 2, 2, SLOT).unwrap_err();
        assert!(e.message.contains("up to 4194304 bytes"), "{}", e.message);
        // A small slot caps AUTO's LL range.
        assert_eq!(pick(Algo::Auto, 8 << 10, 2, 4096).unwrap(), Algo::OneShot);
        assert_eq!(Algo::from_c(4).unwrap(), Algo::OneShotLL);
        assert!(DType::from_c(7).unwrap_err().message.contains("dtype 7"));
        assert!(ReduceOp::from_c(3).is_err());
        assert!(Algo::from_c(9).is_err());
    }

    #[test]
    fn overridden_thresholds_move_the_crossovers_and_are_checked() {
        // LL off, barrier one-shot up to 64 KiB, two-shot above.
        let auto = AutoThresholds::new(2, SLOT, Some(0), Some(64 << 10)).unwrap();
        assert_eq!(
            choose(Algo::Auto, 16, 2, SLOT, &auto).unwrap(),
            Algo::OneShot
        );
        assert_eq!(
            choose(Algo::Auto, 64 << 10, 2, SLOT, &auto).unwrap(),
            Algo::OneShot
        );
        assert_eq!(
            choose(Algo::Auto, (64 << 10) + 2, 2, SLOT, &auto).unwrap(),
            Algo::TwoShot
        );
        // An LL threshold above the slot is refused, naming both numbers.
        let e = AutoThresholds::new(2, SLOT, Some(SLOT + 1), None).unwrap_err();
        assert!(
            e.message.contains("SYMMALLOC_LL_MAX_BYTES=4194305")
                && e.message.contains("expected 0..=4194304"),
            "{}",
            e.message
        );
        // Defaults are capped by a small slot.
        assert_eq!(
            AutoThresholds::new(2, 4096, None, None).unwrap().ll_max,
            4096
        );
    }
}
