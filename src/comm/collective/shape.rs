//! Shapes: whether a chosen kernel (algo.rs) moves 16-byte vectors or single elements
//! (`vectors`, every kernel), and how many blocks and threads an all-reduce, reduce-scatter or
//! all-gather kernel runs on (`ll_shape` for the LL kernels, `barrier_shape` for the others).
//! The fused all-reduce + RMSNorm call's kernel and grid are fused_shape.rs's.
//!
//! Invariant: every shape is a pure function of values equal on every rank (the call's shared
//! words, the communicator's settings and the facts about every rank's GPU agreed at init), so
//! block b of every rank meets block b of every other (docs/DESIGN.md, "Kernels and their
//! grids").

use super::algo::Kernel;
use super::kernel_args::{MAX_BLOCKS, THREADS};

/// Whether a kernel moves 16-byte vectors (else single elements). The LL reduce-scatter and
/// the fused kernels exist only with vectors (their plans check the alignment they need);
/// the others take vectors when every offset in `offsets` is 16-byte aligned, and for
/// reduce-scatter and all-gather, whose items are a rank's slice, when the slice is whole
/// vectors. (The heap bases of every rank are aligned far beyond 16 bytes, so offsets decide.)
pub fn vectors(kernel: Kernel, offsets: &[u64], slice_bytes: u64) -> bool {
    let aligned = offsets.iter().all(|o| o % 16 == 0);
    match kernel {
        Kernel::ReduceScatterLL
        | Kernel::AddRmsNorm
        | Kernel::AddRmsNormLL
        | Kernel::AddRmsNormLL1
        | Kernel::AddRmsNormLLC => true,
        Kernel::ReduceScatter | Kernel::AllGather => aligned && slice_bytes % 16 == 0,
        _ => aligned,
    }
}

/// Threads per block for an LL call of `items` 16-byte items: enough to give every block a
/// share (a power of two, at least 64), at most the grid's limit. A pure function of the
/// message, so every rank maps items to the same threads.
pub fn ll_threads(items: u64, (blocks, max_threads): (u32, u32)) -> u32 {
    items
        .div_ceil(blocks as u64)
        .next_power_of_two()
        .clamp(64, max_threads as u64) as u32
}

/// Grid and block of an LL call of `items` 16-byte items: ll_threads per block, and just the
/// blocks that have items (an item per thread), at most the LL grid's; `ll_end` (kernels/ll.cuh)
/// keeps the call counters in step whatever the grid. A pure function of the message and of the
/// communicator's LL grid (equal on every rank).
pub fn ll_shape(items: u64, ll_grid: (u32, u32)) -> (u32, u32) {
    let threads = ll_threads(items, ll_grid);
    let blocks = items
        .div_ceil(threads as u64)
        .clamp(1, ll_grid.0.max(1) as u64);
    (blocks as u32, threads)
}

/// Grid and block of a barrier kernel moving `items` (16-byte vectors, or elements): one item
/// per thread per round, `per_thread` items per round for the unrolled kernels; the two-shot
/// and multimem kernels cover a rank's slice (items / world); the one-shot grid stays within a
/// quarter of the SMs (at most 32 blocks: every block reads every rank). At least one block.
pub fn barrier_shape(kernel: Kernel, items: u64, world: usize, vec: bool, sms: u32) -> (u32, u32) {
    let sliced = matches!(kernel, Kernel::TwoShot | Kernel::Multimem);
    let sg = matches!(kernel, Kernel::ReduceScatter | Kernel::AllGather);
    let per_rank = if sliced {
        items.div_ceil(world as u64)
    } else {
        items
    };
    let cap = if sliced || sg {
        MAX_BLOCKS as u64
    } else {
        (sms as u64 / 4).clamp(1, 32)
    };
    let per_block = THREADS as u64
        * match kernel {
            Kernel::TwoShot if vec => super::kernel_args::TWO_SHOT_UNROLL,
            Kernel::ReduceScatter | Kernel::AllGather if vec => super::kernel_args::SG_UNROLL,
            _ => 1,
        };
    (per_rank.div_ceil(per_block).clamp(1, cap) as u32, THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_need_aligned_shared_offsets_and_whole_slices() {
        assert!(vectors(Kernel::OneShot, &[0, 4096], 0));
        assert!(!vectors(Kernel::OneShot, &[8, 4096], 0));
        assert!(vectors(Kernel::AllGather, &[4096], 32));
        assert!(
            !vectors(Kernel::AllGather, &[4096], 24),
            "a slice of 12 bf16"
        );
        assert!(!vectors(Kernel::OneShotLL, &[8], 6), "the scalar LL kernel");
        assert!(vectors(Kernel::ReduceScatterLL, &[0], 16), "vectors only");
    }

    #[test]
    fn ll_calls_run_on_the_blocks_that_have_items() {
        assert_eq!(ll_shape(1, (128, 512)), (1, 64));
        assert_eq!(ll_shape(512, (128, 512)), (8, 64), "8 KiB bf16");
        assert_eq!(ll_shape(513, (128, 512)), (9, 64));
        assert_eq!(ll_shape(16384, (128, 512)), (128, 128), "256 KiB");
        assert_eq!(ll_shape(1 << 20, (128, 512)), (128, 512), "grid-stride");
        assert_eq!(ll_shape(512, (4, 512)), (4, 128), "a smaller LL grid");
        assert_eq!(
            ll_shape(0, (128, 512)),
            (1, 64),
            "an empty call still bumps the counters"
        );
    }

    #[test]
    fn ll_threads_spread_a_message_over_every_block() {
        assert_eq!(ll_threads(1, (128, 512)), 64, "at least two warps");
        assert_eq!(ll_threads(512, (128, 512)), 64);
        assert_eq!(ll_threads(16384, (128, 512)), 128);
        assert_eq!(ll_threads(65536, (128, 512)), 512);
        assert_eq!(ll_threads(1 << 20, (128, 512)), 512, "capped");
        assert_eq!(ll_threads(65536, (128, 256)), 256);
    }
}
