//! The fused all-reduce + RMSNorm call's kernel and grid (`all_reduce_add_rms_norm`): up to
//! AUTO's LL threshold one of its LL kernels (one vector per thread, four, or a row split over
//! a thread-block cluster) on a grid every rank's GPU holds at once (`fit_resident` over
//! `fused_ll_shape`), above it the barrier kernel (`fused_barrier_shape`). Whether a kernel
//! moves vectors, and the other kernels' grids, are plan.rs's (`shape`). (The comments of
//! kernels/rms_norm.cuh and rms_norm_cluster.cuh name shape.rs for these choices: they are
//! here.)
//!
//! Invariant: every shape is a pure function of values equal on every rank (the call's shape,
//! the communicator's settings and the facts about every rank's GPU agreed at init), so every
//! rank runs the same fused kernel on the same grid (docs/DESIGN.md, "Kernels and their
//! grids").

use super::algo::Kernel;
use super::kernel_args::{MAX_BLOCKS, RMS_LL1_THREADS, RMS_LLC_THREADS, RMS_VECS, THREADS};
use crate::error::{Error, Result};

/// The fused barrier kernel: a block per row (grid-stride over the tokens, at most the pad's
/// blocks), with just enough threads for a row of up to RMS_VECS vectors per thread.
pub fn fused_barrier_shape(tokens: u64, hidden: u64) -> FusedShape {
    FusedShape {
        kernel: Kernel::AddRmsNorm,
        grid: tokens.min(MAX_BLOCKS as u64) as u32,
        threads: (hidden / 8)
            .div_ceil(RMS_VECS)
            .next_power_of_two()
            .clamp(64, THREADS as u64) as u32,
        cluster: 1,
    }
}

/// The LL kernel's shape on a grid every rank's GPU holds at once. An LL block waits for items
/// that the peer's blocks push, whichever block pulls them: if part of the grid waited for an SM
/// on both ranks, the resident blocks could wait for it until the timeout (docs/DESIGN.md, "Kernels and their grids"). `shape_for(blocks)` is the shape on an LL grid of `blocks` (fused_ll_shape), and
/// `resident(shape)` how many blocks of its kernel fit at once; a shape that does not fit is
/// asked again on that many blocks (rows then share blocks, or clusters shrink or give way to
/// one block per row), until one fits. Equal inputs on every rank give the same shape.
pub fn fit_resident(
    ll_blocks: u32,
    mut shape_for: impl FnMut(u32) -> Option<FusedShape>,
    mut resident: impl FnMut(&FusedShape) -> Result<u64>,
) -> Result<Option<FusedShape>> {
    let mut blocks = ll_blocks.max(1);
    loop {
        let Some(shape) = shape_for(blocks) else {
            return Ok(None);
        };
        let fits = resident(&shape)?;
        if shape.grid as u64 <= fits {
            return Ok(Some(shape));
        }
        if fits == 0 || blocks == 1 {
            return Err(Error::internal(format!(
                "the fused kernel {} with {} threads per block does not fit this GPU's SMs",
                shape.kernel.name(),
                shape.threads
            )));
        }
        blocks = (fits as u32).min(blocks - 1);
    }
}

/// How the fused call's LL kernel runs: which kernel, its grid, its block and, for the cluster
/// kernel, the blocks per cluster (1 otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedShape {
    pub kernel: Kernel,
    pub grid: u32,
    pub threads: u32,
    pub cluster: u32,
}

/// The rows the cluster kernel takes: more than LLC_MIN_VECS vectors (hidden > 3072) and at most
/// LLC_MAX_VECS (hidden 16384, clusters of 8, the portable maximum). Inside those bounds a row
/// split over a cluster (the exchange through st.async) beat one block per row, and at 4096
/// clusters of 4 blocks of 128 threads (LLC_NARROW_SPAN) did; at 3072 clusters lost at few rows,
/// so 3072 stays one block per row (bench/NOTES.md, "The fused all-reduce + RMSNorm kernels").
const LLC_MIN_VECS: u64 = 384;
const LLC_MAX_VECS: u64 = 2048;
/// Vectors per block of the cluster kernel while the LL grid has room for ceil(vecs / LLC_SPAN)
/// blocks per row. Rows wider than the one-vector kernel's (hidden > 6144) take fewer, wider
/// blocks (up to RMS_LLC_THREADS vectors) when it has not: there they beat one four-vector block
/// per row, while at 6144 and below clusters of 2 lost to the one-vector kernel (bench/NOTES.md,
/// "The fused all-reduce + RMSNorm kernels"). Rows of at most LLC_NARROW vectors
/// (hidden <= 4096) take blocks of LLC_NARROW_SPAN: clusters of 4 at 4096.
const LLC_SPAN: u64 = 256;
const LLC_NARROW: u64 = 512;
const LLC_NARROW_SPAN: u64 = 128;

/// The LL kernel's shape when the fused call takes it (x within AUTO's LL threshold `ll_max`),
/// or `None` for the barrier kernel.
/// - Rows of more than LLC_MIN_VECS and at most LLC_MAX_VECS vectors (3072 < hidden <= 16384),
///   when every rank's GPU has thread-block clusters (`clusters`) and every row gets a cluster
///   of its own within the LL grid: `AddRmsNormLLC`, each row split over C blocks of a cluster
///   (C = ceil(vecs / span): span LLC_NARROW_SPAN for rows of at most LLC_NARROW vectors,
///   LLC_SPAN above; or as many as the grid holds per row for rows wider than
///   RMS_LL1_THREADS; at least 2 and at least ceil(vecs / RMS_LLC_THREADS)), a vector per
///   thread (a power of two of them per block), so no one SM moves the row.
/// - Otherwise a vector of the row per thread (`AddRmsNormLL1`, up to RMS_LL1_THREADS threads, in
///   whole warps), so no thread's polls wait behind another of its own; wider rows take four
///   vectors per thread (`AddRmsNormLL`, THREADS threads).
/// - Grid: enough blocks to push x with `push_threads` per block (the LL all-reduce's spread) and
///   to give every row a block (a cluster), at most the communicator's LL grid `ll_blocks`
///   (whole clusters); more would have nothing to do.
///
/// Every input is equal on every rank, so every rank picks the same kernel and grid.
pub fn fused_ll_shape(
    tokens: u64,
    hidden: u64,
    push_threads: u32,
    bytes: u64,
    ll_max: u64,
    ll_blocks: u32,
    clusters: bool,
) -> Option<FusedShape> {
    if bytes > ll_max || tokens == 0 {
        return None;
    }
    let vecs = hidden / 8;
    let ll_blocks = ll_blocks.max(1) as u64;
    let push_blocks = (tokens * vecs).div_ceil(push_threads.max(1) as u64);
    // Blocks per row: ceil(vecs / span); for rows too wide for the one-vector kernel, fewer
    // (wider blocks) when the LL grid has no room for that many per row.
    let span = if vecs <= LLC_NARROW {
        LLC_NARROW_SPAN
    } else {
        LLC_SPAN
    };
    let c_span = vecs.div_ceil(span);
    let c = if vecs > RMS_LL1_THREADS {
        c_span.min(ll_blocks / tokens)
    } else {
        c_span
    };
    if clusters
        && vecs > LLC_MIN_VECS
        && vecs <= LLC_MAX_VECS
        && c >= vecs.div_ceil(RMS_LLC_THREADS).max(2)
        && tokens * c <= ll_blocks
    {
        // A power of two: each block's chunks of 32 vectors are an aligned run of the sum of
        // squares' canonical tree (kernels/rms_norm.cuh), which it may add first.
        let threads = vecs.div_ceil(c).next_power_of_two().max(64);
        let grid = (tokens * c)
            .max(push_blocks)
            .next_multiple_of(c)
            .min(ll_blocks - ll_blocks % c);
        return Some(FusedShape {
            kernel: Kernel::AddRmsNormLLC,
            grid: grid as u32,
            threads: threads as u32,
            cluster: c as u32,
        });
    }
    let (kernel, threads) = if vecs <= RMS_LL1_THREADS {
        (Kernel::AddRmsNormLL1, vecs.next_multiple_of(32).max(64))
    } else {
        (Kernel::AddRmsNormLL, THREADS as u64)
    };
    let grid = tokens.max(push_blocks).clamp(1, ll_blocks);
    Some(FusedShape {
        kernel,
        grid: grid as u32,
        threads: threads as u32,
        cluster: 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kernel: Kernel, grid: u32, threads: u32, cluster: u32) -> Option<FusedShape> {
        Some(FusedShape {
            kernel,
            grid,
            threads,
            cluster,
        })
    }

    #[test]
    fn fused_call_takes_ll_within_the_threshold_on_a_fitted_grid() {
        let ll_max = 4 << 20;
        let f = |tokens, hidden, push, bytes, ll_max, blocks| {
            fused_ll_shape(tokens, hidden, push, bytes, ll_max, blocks, false)
        };
        // [1, 4096] bf16: 512 vectors, one per thread; pushed 64 per block (the LL all-reduce's
        // spread), so 8 blocks, of which block 0 pulls the row and block 7 checks the
        // call descriptors.
        assert_eq!(
            f(1, 4096, 64, 8192, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 8, 512, 1)
        );
        // hidden 6144: 768 vectors, a block of 768 threads (the widest with a vector per
        // thread); 12 pushing blocks.
        assert_eq!(
            f(1, 6144, 64, 12288, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 12, 768, 1)
        );
        // hidden 8192: two vectors per thread in the four-vector kernel's 512 threads.
        assert_eq!(
            f(1, 8192, 64, 16384, ll_max, 128),
            shape(Kernel::AddRmsNormLL, 16, 512, 1)
        );
        // hidden 16384: four vectors per thread.
        assert_eq!(
            f(1, 16384, 64, 32768, ll_max, 128),
            shape(Kernel::AddRmsNormLL, 32, 512, 1)
        );
        // 6 rows of 4096: the push takes 48 blocks of 64 (the LL all-reduce's spread).
        assert_eq!(
            f(6, 4096, 64, 6 * 8192, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 48, 512, 1)
        );
        // 100 short rows (hidden 256): a block per row, more than the push needs (50).
        assert_eq!(
            f(100, 256, 64, 100 * 512, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 100, 64, 1)
        );
        // More rows than the LL grid: every block of it, rows grid-stride.
        assert_eq!(
            f(512, 4096, 512, 512 * 8192, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 128, 512, 1)
        );
        assert_eq!(
            f(1, 8, 64, 16, ll_max, 128),
            shape(Kernel::AddRmsNormLL1, 1, 64, 1),
            "at least two warps, at least one block"
        );
        assert_eq!(
            f(1, 4096, 64, 8192, ll_max, 4),
            shape(Kernel::AddRmsNormLL1, 4, 512, 1),
            "a smaller LL grid caps the blocks"
        );
        assert_eq!(
            f(512, 4096, 512, ll_max, ll_max, 128).map(|s| s.kernel),
            Some(Kernel::AddRmsNormLL1),
            "the edge"
        );
        assert_eq!(f(513, 4096, 512, ll_max + 1, ll_max, 128), None);
        assert_eq!(f(1, 4096, 64, 8192, 0, 128), None, "LL turned off");
    }

    #[test]
    fn rows_wider_than_3072_split_over_a_cluster_where_every_gpu_has_clusters() {
        let ll_max = 4 << 20;
        let f = |tokens, hidden, push, blocks, clusters| {
            let bytes = tokens * hidden * 2;
            fused_ll_shape(tokens, hidden, push, bytes, ll_max, blocks, clusters)
        };
        // [1, 8192]: 4 blocks of 256 threads per row; the push wants 16 blocks.
        assert_eq!(
            f(1, 8192, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 16, 256, 4)
        );
        // [32, 8192]: 128 blocks, a cluster for every row.
        assert_eq!(
            f(32, 8192, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 128, 256, 4)
        );
        // [2, 6400]: 800 vectors over 4 blocks of 200 (256 threads: a power of two).
        assert_eq!(
            f(2, 6400, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 28, 256, 4)
        );
        // 33 rows of 4 blocks would outgrow the LL grid: 3 wider blocks per row (342 vectors),
        // then 2 (512) up to 64 rows; 65 rows take one block per row.
        assert_eq!(
            f(33, 8192, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 126, 512, 3)
        );
        assert_eq!(
            f(64, 8192, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 128, 512, 2)
        );
        assert_eq!(
            f(65, 8192, 256, 128, true).map(|s| s.kernel),
            Some(Kernel::AddRmsNormLL)
        );
        // [1, 6144]: clusters of 3; [1, 16384]: clusters of 8 (the push wants 32 blocks).
        assert_eq!(
            f(1, 6144, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 12, 256, 3)
        );
        assert_eq!(
            f(1, 16384, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 32, 256, 8)
        );
        // [32, 6144]: 96 blocks; the grid stays a whole number of clusters under the LL grid.
        assert_eq!(
            f(32, 6144, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 96, 256, 3)
        );
        assert_eq!(
            f(42, 6144, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 126, 256, 3)
        );
        // [1, 4096]: clusters of 4 blocks of 128 threads (the push wants 8 blocks); [16, 4096]:
        // 64 blocks for the rows (the push at 256 per block wants 32); [32, 4096] fills the LL
        // grid, and 33 rows take one block per row, as does 3072 (faster one block per row at
        // 1-4 rows), and rows the one-vector kernel takes when the grid has no room for their
        // clusters of 3 ([43, 6144]).
        assert_eq!(
            f(1, 4096, 64, 128, true),
            shape(Kernel::AddRmsNormLLC, 8, 128, 4)
        );
        assert_eq!(
            f(16, 4096, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 64, 128, 4)
        );
        assert_eq!(
            f(32, 4096, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 128, 128, 4)
        );
        assert_eq!(
            f(33, 4096, 256, 128, true),
            shape(Kernel::AddRmsNormLL1, 66, 512, 1)
        );
        assert_eq!(
            f(4, 3072, 64, 128, true),
            shape(Kernel::AddRmsNormLL1, 24, 384, 1)
        );
        assert_eq!(
            f(43, 6144, 64, 128, true),
            shape(Kernel::AddRmsNormLL1, 128, 768, 1)
        );
        // [17, 16384]: clusters of 7 (293 vectors each, 512 threads); at 33 rows a row would
        // need blocks wider than the kernel's 512 threads.
        assert_eq!(
            f(17, 16384, 256, 128, true),
            shape(Kernel::AddRmsNormLLC, 126, 512, 7)
        );
        assert_eq!(
            f(33, 16384, 256, 128, true).map(|s| s.kernel),
            Some(Kernel::AddRmsNormLL)
        );
        // A GPU without clusters somewhere in the job, or an LL grid smaller than the clusters.
        assert_eq!(
            f(1, 8192, 64, 128, false),
            shape(Kernel::AddRmsNormLL, 16, 512, 1)
        );
        assert_eq!(
            f(1, 8192, 64, 2, true),
            shape(Kernel::AddRmsNormLLC, 2, 512, 2)
        );
        assert_eq!(
            f(1, 8192, 64, 1, true),
            shape(Kernel::AddRmsNormLL, 1, 512, 1)
        );
    }

    #[test]
    fn cluster_blocks_are_a_power_of_two_of_threads_that_cover_the_row() {
        // The cluster kernel adds a block's chunks of the sum of squares as one aligned run of
        // the canonical tree (kernels/rms_norm.cuh): that needs a power of two of threads per
        // block, every vector of the row in some block, at most RMS_LLC_THREADS threads.
        for hidden in (3080..=16384).step_by(8) {
            for tokens in [1, 2, 5, 17, 33, 64] {
                for blocks in [2, 16, 100, 128] {
                    let bytes = tokens * hidden * 2;
                    let Some(s) = fused_ll_shape(tokens, hidden, 256, bytes, 1 << 30, blocks, true)
                    else {
                        continue;
                    };
                    if s.kernel != Kernel::AddRmsNormLLC {
                        continue;
                    }
                    let what = format!("[{tokens}, {hidden}] on {blocks} blocks: {s:?}");
                    assert!(s.threads.is_power_of_two(), "{what}");
                    assert!((s.threads * s.cluster) as u64 >= hidden / 8, "{what}");
                    assert!(s.threads as u64 <= RMS_LLC_THREADS, "{what}");
                    assert!(
                        s.cluster as u64 <= super::super::kernel_args::MAX_CLUSTER,
                        "{what}"
                    );
                }
            }
        }
    }

    #[test]
    fn fused_grids_fit_what_every_gpu_holds_at_once() {
        let ll_max = 4 << 20;
        let shape_at = |tokens: u64, hidden: u64, push: u32| {
            move |blocks: u32| {
                fused_ll_shape(
                    tokens,
                    hidden,
                    push,
                    tokens * hidden * 2,
                    ll_max,
                    blocks,
                    true,
                )
            }
        };
        let all = |_: &FusedShape| Ok(u64::MAX);
        // Room for everything: the shape on the whole LL grid.
        assert_eq!(
            fit_resident(128, shape_at(128, 8192, 256), all).unwrap(),
            shape(Kernel::AddRmsNormLL, 128, 512, 1)
        );
        // One four-vector block per SM and 108 SMs (an A100): 108 blocks, rows shared.
        let a100 = |_: &FusedShape| Ok(108);
        assert_eq!(
            fit_resident(128, shape_at(128, 8192, 256), a100).unwrap(),
            shape(Kernel::AddRmsNormLL, 108, 512, 1)
        );
        // [32, 8192] in clusters of 4 needs 128 blocks; with room for 100, clusters of 3 (99).
        let hundred = |_: &FusedShape| Ok(100);
        assert_eq!(
            fit_resident(128, shape_at(32, 8192, 256), hundred).unwrap(),
            shape(Kernel::AddRmsNormLLC, 99, 512, 3)
        );
        // A shape the kernel's own rule turns down stays turned down (above the LL threshold).
        assert_eq!(
            fit_resident(128, |_| None, |_: &FusedShape| Ok(0)).unwrap(),
            None
        );
        // A kernel that fits no SM at all is an error that names it, not a loop.
        let err = fit_resident(128, shape_at(1, 4096, 64), |_: &FusedShape| Ok(0)).unwrap_err();
        assert!(
            err.to_string().contains("does not fit"),
            "unexpected error: {err}"
        );
    }
}
