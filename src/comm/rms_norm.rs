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
        let args = RmsArgs {
            s: self.symm_args(&desc, 0),
            residual: c.residual,
            weight: c.weight,
            out: c.out,
            hidden: c.hidden,
            eps: c.eps,
            // The LL all-reduce's spread for a message of this size (pushes from every block).
            push_threads: super::launch::ll_threads(count / 8, self.ll_grid),
        };
        // Just enough threads for a row; a block per row (grid-stride over the tokens). Up to
        // AUTO's LL threshold the LL kernel runs, on the communicator's fixed LL grid (as every
        // LL call does: its blocks' call counters stay in step). Both choices are functions of
        // the call and of settings equal on every rank.
        let threads = (c.hidden / 8)
            .div_ceil(RMS_VECS)
            .next_power_of_two()
            .clamp(64, THREADS as u64) as u32;
        let (algo, grid, threads) = if let Some(t) =
            ll_threads_for(bytes, c.hidden, threads, self.auto.ll_max, self.ll_grid.1)
        {
            (Algo::AddRmsNormLL, self.ll_grid.0, t)
        } else {
            (
                Algo::AddRmsNorm,
                c.tokens.min(MAX_BLOCKS as u64) as u32,
                threads,
            )
        };
        let f = self.kernel(algo, dtype, ReduceOp::Sum, true)?;
        cuda::module::launch(self.device, f, grid, threads, stream, &args)
    }
}

/// The LL kernel's threads per block when the fused call takes it: x within AUTO's LL threshold
/// and a row within the LL grid's block size. It takes up to a vector per thread (more polls in
/// flight, one push pass), at least the `barrier_threads` a row needs. `None`: the barrier
/// kernel. Every input is equal on every rank, so every rank picks the same kernel.
pub fn ll_threads_for(
    bytes: u64,
    hidden: u64,
    barrier_threads: u32,
    ll_max: u64,
    ll_max_threads: u32,
) -> Option<u32> {
    if bytes > ll_max || barrier_threads > ll_max_threads {
        return None;
    }
    let wide = (hidden / 8)
        .next_power_of_two()
        .clamp(64, ll_max_threads as u64) as u32;
    Some(wide.max(barrier_threads))
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
    use super::ll_threads_for;

    #[test]
    fn fused_call_takes_ll_within_the_threshold_and_a_row_per_block() {
        let (ll_max, max_threads) = (4 << 20, 512);
        // hidden 4096: 512 vectors, a vector per thread; the barrier kernel would use 128.
        assert_eq!(
            ll_threads_for(8192, 4096, 128, ll_max, max_threads),
            Some(512)
        );
        // hidden 16384: 2048 vectors over at most 512 threads (4 each, as the barrier kernel).
        assert_eq!(
            ll_threads_for(32768, 16384, 512, ll_max, max_threads),
            Some(512)
        );
        assert_eq!(
            ll_threads_for(64, 8, 64, ll_max, max_threads),
            Some(64),
            "at least two warps"
        );
        assert_eq!(
            ll_threads_for(ll_max, 4096, 128, ll_max, max_threads),
            Some(512),
            "the edge"
        );
        assert_eq!(
            ll_threads_for(ll_max + 1, 4096, 128, ll_max, max_threads),
            None
        );
        assert_eq!(
            ll_threads_for(8192, 16384, 512, ll_max, 256),
            None,
            "row wider than a block"
        );
        assert_eq!(
            ll_threads_for(8192, 4096, 128, 0, max_threads),
            None,
            "LL turned off"
        );
    }
}
