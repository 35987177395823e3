//! Every kernel choice of a collective call: AUTO's choice between the all-reduce algorithms,
//! and the internal `Kernel` a call runs (barrier or LL). plan.rs's `shape` then shapes the
//! chosen kernel (vectors or elements, its grid; whether it is an LL kernel); `plan.rs` asks each
//! once (docs/DESIGN.md, "The collective pipeline"). The validated values of a call (element
//! type, operation, the C-visible algorithm, the FP8 output) are call.rs's, re-exported here.
//!
//! Invariant: every decision reads only values equal on every rank (the call descriptor's
//! shared words, the communicator's settings agreed at init, facts about every rank's GPU
//! agreed at init), never a rank-local pointer: two ranks that chose different kernels would
//! wait for each other until the timeout.

use crate::config;
use crate::error::{Error, Result};

pub use super::call::{Algo, DType, Quant, ReduceOp};

/// What a call runs: one kernel family of kernels/ (src/comm/collective/kernels.rs names its
/// instances). Internal: callers name an `Algo` or a collective, `algo.rs` picks the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    OneShot,
    OneShotLL,
    TwoShot,
    Multimem,
    ReduceScatter,
    /// Reduce-scatter of slices up to AUTO's LL threshold, barrier-free.
    ReduceScatterLL,
    AllGather,
    /// All-reduce + residual + RMSNorm: the barrier kernel (messages above the LL threshold).
    AddRmsNorm,
    /// The fused LL kernel with up to four vectors of a row per thread (hidden up to 16384).
    AddRmsNormLL,
    /// The fused LL kernel with one vector per thread (hidden up to 6144).
    AddRmsNormLL1,
    /// The fused LL kernel with each row split over a thread-block cluster (sm_90+).
    AddRmsNormLLC,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::OneShot => "one_shot",
            Kernel::OneShotLL => "one_shot_ll",
            Kernel::TwoShot => "two_shot",
            Kernel::Multimem => "multimem",
            Kernel::ReduceScatter => "reduce_scatter",
            Kernel::ReduceScatterLL => "reduce_scatter_ll",
            Kernel::AllGather => "all_gather",
            Kernel::AddRmsNorm => "all_reduce_add_rms_norm",
            Kernel::AddRmsNormLL => "all_reduce_add_rms_norm_ll",
            Kernel::AddRmsNormLL1 => "all_reduce_add_rms_norm_ll1",
            Kernel::AddRmsNormLLC => "all_reduce_add_rms_norm_llc",
        }
    }
}

/// Default largest message (bytes) AUTO sends one-shot, by world size. At 2 ranks two-shot
/// catches up with one-shot at a few KiB and beats it above (bench/RESULTS.md, "All-reduce
/// through the C ABI"; docs/DESIGN.md, "AUTO thresholds"), so one-shot keeps only the smallest
/// messages. Wider worlds read (world-1) copies in one-shot, so the crossover drops further
/// (not measured: no machine of more than two GPUs was at hand).
pub fn default_one_shot_max(world: usize) -> u64 {
    match world {
        0..=2 => 16 << 10,
        3..=4 => 8 << 10,
        _ => 4 << 10,
    }
}

/// Default largest message (bytes) AUTO sends with the barrier-free one-shot LL kernel.
/// At 2 ranks LL beats two-shot up to a few MiB and loses above (bench/NOTES.md, "The LL
/// kernels"). A rank pushes (world - 1) copies of its message, so wider worlds switch to
/// two-shot earlier (reasoned, not measured: no machine of more than two GPUs was at hand).
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

/// The all-reduce kernel for an asked algorithm and a message of `bytes`. AUTO: one-shot LL up
/// to `auto.ll_max` (0 turns it off), then barrier one-shot up to `auto.one_shot_max`, then
/// two-shot. Multimem is never chosen automatically. One rank needs no peers: one-shot. An
/// explicit ONE_SHOT_LL larger than the LL slot is refused.
pub fn all_reduce_kernel(
    algo: Algo,
    bytes: u64,
    world: usize,
    ll_slot: u64,
    auto: &AutoThresholds,
) -> Result<Kernel> {
    if algo == Algo::OneShotLL && bytes > ll_slot {
        return Err(Error::invalid(format!(
            "SYMM_ALGO_ONE_SHOT_LL takes messages up to {ll_slot} bytes (SYMMALLOC_LL_BYTES); \
             this one has {bytes} (use SYMM_ALGO_AUTO)"
        )));
    }
    Ok(match algo {
        Algo::OneShot => Kernel::OneShot,
        Algo::TwoShot => Kernel::TwoShot,
        Algo::Multimem => Kernel::Multimem,
        Algo::OneShotLL => Kernel::OneShotLL,
        Algo::Auto if world == 1 => Kernel::OneShot,
        Algo::Auto if bytes <= auto.ll_max => Kernel::OneShotLL,
        Algo::Auto if bytes <= auto.one_shot_max => Kernel::OneShot,
        Algo::Auto => Kernel::TwoShot,
    })
}

/// The reduce-scatter kernel: LL when the input's offset and the slice are whole 16-byte
/// vectors and the slice is within AUTO's LL threshold, the barrier kernel otherwise. Only
/// values equal on every rank go in (the input's offset and the count are compared across
/// ranks, the threshold is a communicator setting): never the output, which is rank-local.
pub fn reduce_scatter_kernel(send_off: u64, slice_bytes: u64, ll_max: u64) -> Kernel {
    if send_off % 16 == 0 && slice_bytes % 16 == 0 && slice_bytes <= ll_max {
        Kernel::ReduceScatterLL
    } else {
        Kernel::ReduceScatter
    }
}

/// The arguments a multimem all-reduce accepts: sum, in place, 16-byte aligned, a whole
/// number of 16-byte vectors (the kernel has no element tail).
pub fn check_multimem_call(
    send: u64,
    recv: u64,
    count: u64,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let bytes = count * dtype.size() as u64;
    let why = if op != ReduceOp::Sum {
        Some(format!("op {} (multimem reduces with add only)", op.name()))
    } else if send != recv {
        Some("out of place (the multicast object covers the output only)".to_string())
    } else if recv % 16 != 0 {
        Some(format!("buffer {recv:#x} is not 16-byte aligned"))
    } else if bytes % 16 != 0 {
        Some(format!(
            "count {count} {} is {bytes} bytes, not a multiple of 16",
            dtype.name()
        ))
    } else {
        None
    };
    match why {
        Some(w) => Err(Error::invalid(format!(
            "SYMM_ALGO_MULTIMEM takes an in-place sum of whole 16-byte vectors: {w}"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SLOT: u64 = 4 << 20;
    fn pick(algo: Algo, bytes: u64, world: usize, slot: u64) -> Result<Kernel> {
        let auto = AutoThresholds::new(world, slot, None, None).unwrap();
        all_reduce_kernel(algo, bytes, world, slot, &auto)
    }

    #[test]
    fn auto_picks_by_size_and_world() {
        let ll = default_ll_max(2);
        assert_eq!(
            pick(Algo::Auto, 8 << 10, 2, SLOT).unwrap(),
            Kernel::OneShotLL
        );
        assert_eq!(pick(Algo::Auto, ll, 2, SLOT).unwrap(), Kernel::OneShotLL);
        assert_eq!(pick(Algo::Auto, ll + 2, 2, SLOT).unwrap(), Kernel::TwoShot);
        assert_eq!(
            pick(Algo::Auto, 8 << 10, 8, SLOT).unwrap(),
            Kernel::OneShotLL
        );
        assert_eq!(pick(Algo::Auto, 1 << 20, 8, SLOT).unwrap(), Kernel::TwoShot);
        assert_eq!(
            pick(Algo::Auto, 4 << 20, 2, SLOT).unwrap(),
            Kernel::OneShotLL
        );
        assert_eq!(
            pick(Algo::Auto, 64 << 20, 1, SLOT).unwrap(),
            Kernel::OneShot
        );
        assert_eq!(pick(Algo::TwoShot, 8, 2, SLOT).unwrap(), Kernel::TwoShot);
        assert_eq!(
            pick(Algo::OneShotLL, SLOT, 2, SLOT).unwrap(),
            Kernel::OneShotLL
        );
        let e = pick(Algo::OneShotLL, SLOT + 2, 2, SLOT).unwrap_err();
        assert!(e.message.contains("up to 4194304 bytes"), "{}", e.message);
        // A small slot caps AUTO's LL range.
        assert_eq!(pick(Algo::Auto, 8 << 10, 2, 4096).unwrap(), Kernel::OneShot);
    }

    #[test]
    fn overridden_thresholds_move_the_crossovers_and_are_checked() {
        // LL off, barrier one-shot up to 64 KiB, two-shot above.
        let auto = AutoThresholds::new(2, SLOT, Some(0), Some(64 << 10)).unwrap();
        let k = |bytes| all_reduce_kernel(Algo::Auto, bytes, 2, SLOT, &auto).unwrap();
        assert_eq!(k(16), Kernel::OneShot);
        assert_eq!(k(64 << 10), Kernel::OneShot);
        assert_eq!(k((64 << 10) + 2), Kernel::TwoShot);
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

    #[test]
    fn reduce_scatter_takes_ll_for_small_aligned_slices_only() {
        let ll_max = 4 << 20;
        let ll = Kernel::ReduceScatterLL;
        assert_eq!(reduce_scatter_kernel(0, 16, ll_max), ll, "one bf16 vector");
        assert_eq!(reduce_scatter_kernel(4096, 2 << 20, ll_max), ll);
        assert_eq!(reduce_scatter_kernel(0, 4 << 20, ll_max), ll, "the edge");
        let barrier = Kernel::ReduceScatter;
        assert_eq!(reduce_scatter_kernel(0, (4 << 20) + 16, ll_max), barrier);
        assert_eq!(
            reduce_scatter_kernel(0, 14, ll_max),
            barrier,
            "not whole vectors"
        );
        assert_eq!(
            reduce_scatter_kernel(8, 16, ll_max),
            barrier,
            "offset unaligned"
        );
        assert_eq!(reduce_scatter_kernel(0, 16, 0), barrier, "LL turned off");
    }

    #[test]
    fn multimem_takes_in_place_sums_of_whole_vectors() {
        let ok = |s, r, n, d, o| check_multimem_call(s, r, n, d, o).is_ok();
        assert!(ok(0x1000, 0x1000, 8, DType::Bf16, ReduceOp::Sum));
        assert!(ok(0x1000, 0x1000, 4, DType::Fp32, ReduceOp::Sum));
        assert!(!ok(0x1000, 0x1000, 8, DType::Bf16, ReduceOp::Max));
        assert!(!ok(0x1000, 0x2000, 8, DType::Bf16, ReduceOp::Sum));
        assert!(!ok(0x1008, 0x1008, 8, DType::Bf16, ReduceOp::Sum));
        let e = check_multimem_call(0x1000, 0x1000, 9, DType::Fp16, ReduceOp::Sum).unwrap_err();
        assert!(
            e.message.contains("count 9 fp16 is 18 bytes"),
            "{}",
            e.message
        );
    }
}
