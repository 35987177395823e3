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
use super::kernel_args::{RmsArgs, MAX_BLOCKS, RMS_MAX_HIDDEN, RMS_VECS, THREADS};
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
        self.check_error_word()?;
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
        let mut args = RmsArgs {
            s: self.symm_args(&desc, 0),
            residual: c.residual,
            weight: c.weight,
            out: c.out,
            hidden: c.hidden,
            eps: c.eps,
            push_threads: 0,
            cluster: 1,
            reserved: 0,
        };
        // Up to AUTO's LL threshold the LL kernel runs, on the communicator's fixed LL grid (as
        // every LL call does: its blocks' call counters stay in step), a row over a cluster of
        // blocks where the GPUs have clusters; else the barrier kernel, a block per row
        // (grid-stride over the tokens) with just enough threads for a row. Every choice is a
        // function of the call and of settings equal on every rank.
        let ll = ll_shape(
            bytes,
            c.tokens,
            c.hidden,
            self.auto.ll_max,
            self.ll_grid,
            self.clusters,
        );
        let (algo, grid, threads, cluster) = if let Some(s) = ll {
            args.push_threads = super::launch::ll_threads(count / 8, self.ll_grid);
            args.cluster = s.cluster;
            (Algo::AddRmsNormLL, self.ll_grid.0, s.threads, s.cluster)
        } else {
            let threads = (c.hidden / 8)
                .div_ceil(RMS_VECS)
                .next_power_of_two()
                .clamp(64, THREADS as u64) as u32;
            let grid = c.tokens.min(MAX_BLOCKS as u64) as u32;
            (Algo::AddRmsNorm, grid, threads, 1)
        };
        let f = self.kernel(algo, dtype, ReduceOp::Sum, true)?;
        cuda::module::launch_clustered(self.device, f, grid, threads, cluster, stream, &args)
    }
}

/// How the LL kernel runs a call: blocks per row and threads per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlShape {
    pub cluster: u32,
    pub threads: u32,
}

/// The LL kernel's shape when the fused call takes it (x within AUTO's LL threshold), `None`
/// for the barrier kernel. A row is split over a cluster of up to 8 blocks (`clusters`: every
/// rank's GPU has them) while every row still gets a cluster of its own and each block keeps at
/// least 64 vectors (1 KiB) of it: one token of hidden 4096 takes 8 blocks of 64 threads where
/// one block of 512 took it whole. A block takes its segment a vector per thread where it can
/// (every load in flight at once), at most `RMS_VECS` per thread. Every input is equal on every
/// rank, so every rank picks the same kernel and the same reduction order.
pub fn ll_shape(
    bytes: u64,
    tokens: u64,
    hidden: u64,
    ll_max: u64,
    (blocks, max_threads): (u32, u32),
    clusters: bool,
) -> Option<LlShape> {
    if bytes > ll_max {
        return None;
    }
    let vecs = hidden / 8;
    let mut cluster = 1u32;
    while clusters
        && cluster < 8
        && blocks % (2 * cluster) == 0
        && (blocks / (2 * cluster)) as u64 >= tokens
        && vecs / (2 * cluster as u64) >= 64
    {
        cluster *= 2;
    }
    let seg = vecs.div_ceil(cluster as u64);
    let threads = seg.next_power_of_two().clamp(64, max_threads as u64);
    (seg <= threads * RMS_VECS).then_some(LlShape {
        cluster,
        threads: threads as u32,
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
    use super::{ll_shape, LlShape};

    fn shape(cluster: u32, threads: u32) -> Option<LlShape> {
        Some(LlShape { cluster, threads })
    }

    #[test]
    fn fused_call_spreads_a_row_over_a_cluster_while_every_row_has_one() {
        let (ll_max, grid) = (4 << 20, (128, 512));
        // One token of hidden 4096 (512 vectors): 8 blocks of 64 vectors, a vector per thread.
        assert_eq!(ll_shape(8192, 1, 4096, ll_max, grid, true), shape(8, 64));
        // 32 tokens of hidden 8192: 32 clusters of 4 fill the 128 blocks (256 vectors each).
        assert_eq!(
            ll_shape(32 * 16384, 32, 8192, ll_max, grid, true),
            shape(4, 256)
        );
        // 6 tokens of hidden 6144: 768 vectors over 8 blocks, 96 each on 128 threads.
        assert_eq!(
            ll_shape(6 * 12288, 6, 6144, ll_max, grid, true),
            shape(8, 128)
        );
        // 128 tokens: a block per row, as without clusters.
        assert_eq!(
            ll_shape(128 * 8192, 128, 4096, ll_max, grid, true),
            shape(1, 512)
        );
        // hidden 2048 (256 vectors): at least 64 vectors per block caps the cluster at 4.
        assert_eq!(ll_shape(4096, 1, 2048, ll_max, grid, true), shape(4, 64));
        // A grid the cluster does not divide keeps it smaller.
        assert_eq!(
            ll_shape(8192, 1, 4096, ll_max, (100, 512), true),
            shape(4, 128)
        );
        assert_eq!(
            ll_shape(8192, 1, 4096, ll_max, (127, 512), true),
            shape(1, 512)
        );
    }

    #[test]
    fn without_clusters_a_block_takes_a_row_and_wide_rows_fall_to_the_barrier_kernel() {
        let (ll_max, grid) = (4 << 20, (128, 512));
        assert_eq!(ll_shape(8192, 1, 4096, ll_max, grid, false), shape(1, 512));
        // hidden 16384: 2048 vectors over 512 threads, 4 each.
        assert_eq!(
            ll_shape(32768, 1, 16384, ll_max, grid, false),
            shape(1, 512)
        );
        assert_eq!(
            ll_shape(64, 1, 8, ll_max, grid, false),
            shape(1, 64),
            "two warps at least"
        );
        assert_eq!(
            ll_shape(ll_max, 512, 4096, ll_max, grid, false),
            shape(1, 512),
            "the edge"
        );
        assert_eq!(ll_shape(ll_max + 1, 512, 4096, ll_max, grid, true), None);
        assert_eq!(
            ll_shape(32768, 1, 16384, ll_max, (128, 256), false),
            None,
            "row wider than a block"
        );
        assert_eq!(
            ll_shape(8192, 1, 4096, 0, grid, true),
            None,
            "LL turned off"
        );
    }
}
