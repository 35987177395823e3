//! All-reduce fused with residual add and RMSNorm (kernels/rms_norm.cu; host_reduce.rs on the
//! host backend): `residual = allreduce(x) + residual`, `out = rms_norm(residual) * weight`,
//! over `[tokens, hidden]` rows, bf16 or fp16 with fp32 arithmetic.
//!
//! Only `x` is read by peers, so only `x` must be symmetric (in the heap, or staged through the
//! scratch, counted in `staged_collectives`); `residual`, `weight` and `out` are this rank's own
//! and may live anywhere on the device. `hidden` travels in the call descriptor, so ranks that
//! disagree on it get SYMM_ERR_NOT_SYMMETRIC. Every rank computes every row from all ranks' x
//! in one fixed order, so every rank's result is bitwise identical. Messages up to AUTO's LL
//! threshold (`SYMMALLOC_LL_MAX_BYTES`) take the barrier-free LL kernel, larger ones the
//! barrier kernel; both reduce in the same order.

use super::algo::{Algo, DType, ReduceOp};
use super::exchange::{CallDesc, RANK_LOCAL};
use super::host_reduce::{HostCall, HostRms};
use super::kernel_args::{
    RmsArgs, MAX_BLOCKS, RMS_LL1_THREADS, RMS_LLC_THREADS, RMS_MAX_HIDDEN, RMS_VECS, THREADS,
};
use super::{byte_size, launch::run_host, Communicator};
use crate::cuda;
use crate::error::{Error, Result};

/// The fused call's own buffers and shape.
pub struct RmsCall {
    pub x: u64,
    pub residual: u64,
    pub weight: u64,
    pub out: u64,
    pub tokens: u64,
    pub hidden: u64,
    pub eps: f32,
}

impl Communicator {
    pub fn all_reduce_add_rms_norm(
        &mut self,
        c: &RmsCall,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        self.begin_call(stream)?;
        check(c, dtype)?;
        if c.tokens == 0 {
            return Ok(());
        }
        let es = dtype.size() as u64;
        let count = byte_size(c.tokens, c.hidden, 1)?;
        let bytes = byte_size(count, es, 1)?;
        let row = c.hidden * es;
        let own = [
            (c.residual, bytes, "residual"),
            (c.out, bytes, "out"),
            (c.weight, row, "weight"),
        ];
        for (i, &(p, n, name)) in own.iter().enumerate() {
            for &(q, m, other) in own[..i].iter().chain([(c.x, bytes, "x")].iter()) {
                if p < q + m && q < p + n {
                    return Err(Error::invalid(format!(
                        "all_reduce_add_rms_norm: {name} ({p:#x}, {n} bytes) overlaps {other} \
                         ({q:#x}, {m} bytes); expected separate buffers"
                    )));
                }
            }
        }
        let (x, staged, seg) = match self.locate(c.x, bytes)? {
            Some(seg) => (c.x, false, seg),
            None => {
                let s = self.ensure_scratch(bytes)?;
                (
                    s,
                    true,
                    self.locate(s, bytes)?.expect("scratch is in the heap"),
                )
            }
        };
        let base = self.windows.bases[self.rank];
        let desc = CallDesc {
            send_off: x - base,
            recv_off: RANK_LOCAL,
            count,
            dtype: dtype as u64,
            op: c.hidden,
            algo: Algo::AddRmsNorm as u64,
        };
        self.exchange(&[seg], desc, self.check_symmetry)?;
        self.order_streams(stream)?;
        if staged {
            self.stage_in(x, c.x, bytes, stream)?;
        }
        crate::trace!(
            "rank {}/{}: all_reduce_add_rms_norm {} x {} {} x +{:#x} stream {stream:#x}{}",
            self.rank,
            self.world,
            c.tokens,
            c.hidden,
            dtype.name(),
            desc.send_off,
            if staged { " (staged)" } else { "" }
        );
        let rms = HostRms {
            residual: c.residual,
            weight: c.weight,
            out: c.out,
            hidden: c.hidden as usize,
            eps: c.eps,
        };
        if self.host {
            let inputs: Vec<u64> = self
                .windows
                .bases
                .iter()
                .map(|b| b + desc.send_off)
                .collect();
            let call = HostCall {
                rank: self.rank,
                world: self.world,
                pads: &self.pads,
                inputs: &inputs,
                outputs: &[],
                count: count as usize,
                dtype,
                op: ReduceOp::Sum,
                algo: Algo::AddRmsNorm,
                in_place: false,
                desc: desc.digest(),
                timeout: self.timeout,
                rms: Some(rms),
            };
            return run_host(&call, &mut self.host_epoch, &mut self.sticky);
        }
        // The LL all-reduce's spread for a message of this size (pushes from every block).
        let push_threads = super::launch::ll_threads(count / 8, self.ll_grid);
        let args = RmsArgs {
            s: self.symm_args(&desc, 0),
            residual: c.residual,
            weight: c.weight,
            out: c.out,
            hidden: c.hidden,
            tokens: c.tokens,
            eps: c.eps,
            push_threads,
        };
        // Up to AUTO's LL threshold the LL kernel, on a grid fitted to the call; above it the
        // barrier kernel with just enough threads for a row and a block per row (grid-stride
        // over the tokens). Every input of both choices is equal on every rank.
        let (tokens, hidden, ll_max, clusters) =
            (c.tokens, c.hidden, self.auto.ll_max, self.clusters);
        let shape = fit_resident(
            self.ll_grid.0,
            |blocks| {
                fused_ll_shape(
                    tokens,
                    hidden,
                    push_threads,
                    bytes,
                    ll_max,
                    blocks,
                    clusters,
                )
            },
            |s| self.resident_blocks(s, dtype),
        )?
        .unwrap_or(FusedShape {
            algo: Algo::AddRmsNorm,
            grid: c.tokens.min(MAX_BLOCKS as u64) as u32,
            threads: (c.hidden / 8)
                .div_ceil(RMS_VECS)
                .next_power_of_two()
                .clamp(64, THREADS as u64) as u32,
            cluster: 1,
        });
        let f = self.kernel(shape.algo, dtype, ReduceOp::Sum, true)?;
        if shape.cluster > 1 {
            return cuda::module::launch_cluster(
                self.device,
                f,
                shape.grid,
                shape.threads,
                shape.cluster,
                stream,
                &args,
            );
        }
        cuda::module::launch(self.device, f, shape.grid, shape.threads, stream, &args)
    }
}

impl Communicator {
    /// How many blocks of this shape's kernel every rank's GPU holds at once: blocks per SM
    /// (asked of the driver once per kernel and block size; the same on every rank of one
    /// architecture) times the fewest SMs of any rank. For clusters this leaves out how a GPU
    /// groups its SMs (a cluster cannot span groups, and the grouping differs between chips of one
    /// model, so it is no input every rank shares): the cluster kernel holds two blocks per SM at
    /// its widest (512 threads), twice what the LL grid asks of 128 SMs.
    fn resident_blocks(&mut self, s: &FusedShape, dtype: DType) -> Result<u64> {
        let key = (s.algo, dtype, s.threads);
        let per_sm = match self.resident.get(&key) {
            Some(&n) => n,
            None => {
                let f = self.kernel(s.algo, dtype, ReduceOp::Sum, true)?;
                let n = cuda::module::blocks_per_sm(self.device, f, s.threads)?;
                self.resident.insert(key, n);
                n
            }
        };
        Ok(per_sm as u64 * self.fewest_sms as u64)
    }
}

/// The LL kernel's shape on a grid every rank's GPU holds at once. An LL block waits for items
/// that the peer's blocks push, whichever block pulls them: if part of the grid waited for an SM
/// on both ranks, the resident blocks could wait for it until the timeout (bench/NOTES.md,
/// session 10). `shape_for(blocks)` is the shape on an LL grid of `blocks` (fused_ll_shape), and
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
                shape.algo.name(),
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
    pub algo: Algo,
    pub grid: u32,
    pub threads: u32,
    pub cluster: u32,
}

/// The rows the cluster kernel takes: more than LLC_MIN_VECS vectors (hidden > 4096) and at most
/// LLC_MAX_VECS (hidden 16384, clusters of 8, the portable maximum). Measured on one H200 with one
/// rank (bench/RESULTS.md, session 10; the exchange through st.async): at 6144 (clusters of 3)
/// 0.10-0.21 µs faster than one block per row, at 16384 (clusters of 8) 1.6 µs faster up to 16
/// rows; at 8192 0.10-0.12 µs faster than the cluster barrier it replaced up to 16 rows and 0.05
/// slower at 32; at 4096 (clusters of 2) 0.2-0.3 µs slower than one block per row.
const LLC_MIN_VECS: u64 = 512;
const LLC_MAX_VECS: u64 = 2048;
/// Vectors per block of the cluster kernel while the LL grid has room for ceil(vecs / LLC_SPAN)
/// blocks per row. Rows wider than the one-vector kernel's (hidden > 6144) take fewer, wider
/// blocks (up to RMS_LLC_THREADS vectors) when it has not: at [33-64, 8192] and [32-42, 12288]
/// 0.4-1.4 µs faster than one four-vector block per row, and at [17-32, 16384] 1.5-1.7; at 6144
/// and below clusters of 2 were 0.1-0.4 µs slower than the one-vector kernel (session 10).
const LLC_SPAN: u64 = 256;

/// The LL kernel's shape when the fused call takes it (x within AUTO's LL threshold `ll_max`),
/// or `None` for the barrier kernel.
/// - Rows of more than LLC_MIN_VECS and at most LLC_MAX_VECS vectors (4096 < hidden <= 16384),
///   when every rank's GPU has thread-block clusters (`clusters`) and every row gets a cluster
///   of its own within the LL grid: `AddRmsNormLLC`, each row split over C blocks of a cluster
///   (C = ceil(vecs / LLC_SPAN), or as many as the grid holds per row for rows wider than
///   RMS_LL1_THREADS; at least 2 and at least ceil(vecs / RMS_LLC_THREADS)), a vector per
///   thread, so no one SM moves the row.
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
    // Blocks per row: ceil(vecs / LLC_SPAN); for rows too wide for the one-vector kernel, fewer
    // (wider blocks) when the LL grid has no room for that many per row.
    let c_span = vecs.div_ceil(LLC_SPAN);
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
        let threads = vecs.div_ceil(c).next_multiple_of(32).max(64);
        let grid = (tokens * c)
            .max(push_blocks)
            .next_multiple_of(c)
            .min(ll_blocks - ll_blocks % c);
        return Some(FusedShape {
            algo: Algo::AddRmsNormLLC,
            grid: grid as u32,
            threads: threads as u32,
            cluster: c as u32,
        });
    }
    let (algo, threads) = if vecs <= RMS_LL1_THREADS {
        (Algo::AddRmsNormLL1, vecs.next_multiple_of(32).max(64))
    } else {
        (Algo::AddRmsNormLL, THREADS as u64)
    };
    let grid = tokens.max(push_blocks).clamp(1, ll_blocks);
    Some(FusedShape {
        algo,
        grid: grid as u32,
        threads: threads as u32,
        cluster: 1,
    })
}

/// What the kernel needs of the shape, types and pointers, each named when it is wrong.
fn check(c: &RmsCall, dtype: DType) -> Result<()> {
    if dtype == DType::Fp32 {
        return Err(Error::unsupported(
            "all_reduce_add_rms_norm takes bf16 or fp16 (fp32 accumulation inside); fp32 is not \
             supported",
        ));
    }
    if c.hidden == 0 || c.hidden % 8 != 0 || c.hidden > RMS_MAX_HIDDEN {
        return Err(Error::invalid(format!(
            "all_reduce_add_rms_norm: hidden {} is not supported; expected a multiple of 8 from 8 \
             to {RMS_MAX_HIDDEN}",
            c.hidden
        )));
    }
    if !(c.eps.is_finite() && c.eps >= 0.0) {
        return Err(Error::invalid(format!(
            "all_reduce_add_rms_norm: eps {} is not a finite non-negative number",
            c.eps
        )));
    }
    for (p, name) in [
        (c.x, "x"),
        (c.residual, "residual"),
        (c.weight, "weight"),
        (c.out, "out"),
    ] {
        if p == 0 || p % 16 != 0 {
            return Err(Error::invalid(format!(
                "all_reduce_add_rms_norm: {name} {p:#x} must be a non-NULL, 16-byte aligned \
                 pointer"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{fit_resident, fused_ll_shape, FusedShape};
    use crate::comm::algo::Algo;

    fn shape(algo: Algo, grid: u32, threads: u32, cluster: u32) -> Option<FusedShape> {
        Some(FusedShape {
            algo,
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
            shape(Algo::AddRmsNormLL1, 8, 512, 1)
        );
        // hidden 6144: 768 vectors, a block of 768 threads (the widest with a vector per
        // thread); 12 pushing blocks.
        assert_eq!(
            f(1, 6144, 64, 12288, ll_max, 128),
            shape(Algo::AddRmsNormLL1, 12, 768, 1)
        );
        // hidden 8192: two vectors per thread in the four-vector kernel's 512 threads.
        assert_eq!(
            f(1, 8192, 64, 16384, ll_max, 128),
            shape(Algo::AddRmsNormLL, 16, 512, 1)
        );
        // hidden 16384: four vectors per thread.
        assert_eq!(
            f(1, 16384, 64, 32768, ll_max, 128),
            shape(Algo::AddRmsNormLL, 32, 512, 1)
        );
        // 6 rows of 4096: the push takes 48 blocks of 64 (the LL all-reduce's spread).
        assert_eq!(
            f(6, 4096, 64, 6 * 8192, ll_max, 128),
            shape(Algo::AddRmsNormLL1, 48, 512, 1)
        );
        // 100 short rows (hidden 256): a block per row, more than the push needs (50).
        assert_eq!(
            f(100, 256, 64, 100 * 512, ll_max, 128),
            shape(Algo::AddRmsNormLL1, 100, 64, 1)
        );
        // More rows than the LL grid: every block of it, rows grid-stride.
        assert_eq!(
            f(512, 4096, 512, 512 * 8192, ll_max, 128),
            shape(Algo::AddRmsNormLL1, 128, 512, 1)
        );
        assert_eq!(
            f(1, 8, 64, 16, ll_max, 128),
            shape(Algo::AddRmsNormLL1, 1, 64, 1),
            "at least two warps, at least one block"
        );
        assert_eq!(
            f(1, 4096, 64, 8192, ll_max, 4),
            shape(Algo::AddRmsNormLL1, 4, 512, 1),
            "a smaller LL grid caps the blocks"
        );
        assert_eq!(
            f(512, 4096, 512, ll_max, ll_max, 128).map(|s| s.algo),
            Some(Algo::AddRmsNormLL1),
            "the edge"
        );
        assert_eq!(f(513, 4096, 512, ll_max + 1, ll_max, 128), None);
        assert_eq!(f(1, 4096, 64, 8192, 0, 128), None, "LL turned off");
    }

    #[test]
    fn rows_wider_than_4096_split_over_a_cluster_where_every_gpu_has_clusters() {
        let ll_max = 4 << 20;
        let f = |tokens, hidden, push, blocks, clusters| {
            let bytes = tokens * hidden * 2;
            fused_ll_shape(tokens, hidden, push, bytes, ll_max, blocks, clusters)
        };
        // [1, 8192]: 4 blocks of 256 threads per row; the push wants 16 blocks.
        assert_eq!(
            f(1, 8192, 64, 128, true),
            shape(Algo::AddRmsNormLLC, 16, 256, 4)
        );
        // [32, 8192]: 128 blocks, a cluster for every row.
        assert_eq!(
            f(32, 8192, 256, 128, true),
            shape(Algo::AddRmsNormLLC, 128, 256, 4)
        );
        // [2, 6400]: 800 vectors over 4 blocks of 200 (224 threads).
        assert_eq!(
            f(2, 6400, 64, 128, true),
            shape(Algo::AddRmsNormLLC, 28, 224, 4)
        );
        // 33 rows of 4 blocks would outgrow the LL grid: 3 wider blocks per row (342 vectors),
        // then 2 (512) up to 64 rows; 65 rows take one block per row.
        assert_eq!(
            f(33, 8192, 256, 128, true),
            shape(Algo::AddRmsNormLLC, 126, 352, 3)
        );
        assert_eq!(
            f(64, 8192, 256, 128, true),
            shape(Algo::AddRmsNormLLC, 128, 512, 2)
        );
        assert_eq!(
            f(65, 8192, 256, 128, true).map(|s| s.algo),
            Some(Algo::AddRmsNormLL)
        );
        // [1, 6144]: clusters of 3; [1, 16384]: clusters of 8 (the push wants 32 blocks).
        assert_eq!(
            f(1, 6144, 64, 128, true),
            shape(Algo::AddRmsNormLLC, 12, 256, 3)
        );
        assert_eq!(
            f(1, 16384, 64, 128, true),
            shape(Algo::AddRmsNormLLC, 32, 256, 8)
        );
        // [32, 6144]: 96 blocks; the grid stays a whole number of clusters under the LL grid.
        assert_eq!(
            f(32, 6144, 256, 128, true),
            shape(Algo::AddRmsNormLLC, 96, 256, 3)
        );
        assert_eq!(
            f(42, 6144, 64, 128, true),
            shape(Algo::AddRmsNormLLC, 126, 256, 3)
        );
        // 4096 is faster one block per row, and so are rows the one-vector kernel takes when
        // the grid has no room for their clusters of 3 ([43, 6144]).
        assert_eq!(
            f(1, 4096, 64, 128, true),
            shape(Algo::AddRmsNormLL1, 8, 512, 1)
        );
        assert_eq!(
            f(43, 6144, 64, 128, true),
            shape(Algo::AddRmsNormLL1, 128, 768, 1)
        );
        // [17, 16384]: clusters of 7 (293 vectors each); at 33 rows a row would need blocks
        // wider than the kernel's 512 threads.
        assert_eq!(
            f(17, 16384, 256, 128, true),
            shape(Algo::AddRmsNormLLC, 126, 320, 7)
        );
        assert_eq!(
            f(33, 16384, 256, 128, true).map(|s| s.algo),
            Some(Algo::AddRmsNormLL)
        );
        // A GPU without clusters somewhere in the job, or an LL grid smaller than the clusters.
        assert_eq!(
            f(1, 8192, 64, 128, false),
            shape(Algo::AddRmsNormLL, 16, 512, 1)
        );
        assert_eq!(
            f(1, 8192, 64, 2, true),
            shape(Algo::AddRmsNormLLC, 2, 512, 2)
        );
        assert_eq!(
            f(1, 8192, 64, 1, true),
            shape(Algo::AddRmsNormLL, 1, 512, 1)
        );
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
            shape(Algo::AddRmsNormLL, 128, 512, 1)
        );
        // One four-vector block per SM and 108 SMs (an A100): 108 blocks, rows shared.
        let a100 = |_: &FusedShape| Ok(108);
        assert_eq!(
            fit_resident(128, shape_at(128, 8192, 256), a100).unwrap(),
            shape(Algo::AddRmsNormLL, 108, 512, 1)
        );
        // [32, 8192] in clusters of 4 needs 128 blocks; with room for 100, clusters of 3 (99).
        let hundred = |_: &FusedShape| Ok(100);
        assert_eq!(
            fit_resident(128, shape_at(32, 8192, 256), hundred).unwrap(),
            shape(Algo::AddRmsNormLLC, 99, 352, 3)
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
