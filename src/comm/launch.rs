//! Launching a collective: the host backend's CPU path, or the kernel for (algorithm, type, op,
//! vector width) with its grid and the argument struct every kernel takes.
//!
//! Invariants: the grid is a pure function of the call (every rank picks the same one, so
//! block b meets block b); LL kernels run on at most the communicator's LL grid; kernels
//! of one communicator are ordered (streams.rs), whatever streams carry them.

use super::algo::{Algo, DType, ReduceOp};
use super::exchange::CallDesc;
use super::host_reduce;
use super::kernel_args::*;
use super::kernels;
use super::Communicator;
use crate::cuda;
use crate::error::{Error, Result, Status};

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
/// blocks that have items (an item per thread), at most the LL grid's; kernels/one_shot_ll.cu
/// keeps the call counters in step whatever the grid. A pure function of the message and of the
/// communicator's LL grid (equal on every rank).
pub fn ll_shape(items: u64, ll_grid: (u32, u32)) -> (u32, u32) {
    let threads = ll_threads(items, ll_grid);
    let blocks = items
        .div_ceil(threads as u64)
        .clamp(1, ll_grid.0.max(1) as u64);
    (blocks as u32, threads)
}

/// Whether a reduce-scatter takes the LL kernel: its input's offset and its slice are whole
/// 16-byte vectors and the slice is within AUTO's LL threshold. Only values equal on every rank
/// go in (the offset and count are checked symmetric, the threshold is a communicator setting):
/// never the output, which is rank-local. A rank that chose LL while a peer chose the barrier
/// kernel would wait for words that never come.
pub fn reduce_scatter_takes_ll(send_off: u64, count: u64, esize: u64, ll_max: u64) -> bool {
    send_off % 16 == 0 && (count * esize) % 16 == 0 && count * esize <= ll_max
}

/// Runs a collective on the host backend; a timeout leaves the communicator broken (`sticky`).
pub(super) fn run_host(
    call: &host_reduce::HostCall<'_>,
    epoch: &mut u32,
    sticky: &mut Option<Error>,
) -> Result<()> {
    let r = host_reduce::run(call, epoch);
    if let Err(e) = &r {
        if e.status == Status::ErrTimeout {
            *sticky = Some(e.clone());
        }
    }
    r
}

impl Communicator {
    pub(super) fn run(
        &mut self,
        algo: Algo,
        desc: CallDesc,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
        mc_out: u64,
    ) -> Result<()> {
        // Every rank's buffers in this address space, straight into the kernel's argument
        // layout (no allocation per call); entries past the world stay 0.
        let (mut inputs, mut outputs) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for (r, b) in self.windows.bases.iter().enumerate() {
            inputs[r] = b + desc.send_off;
            outputs[r] = b + desc.recv_off;
        }
        let world = self.world;
        let in_place = desc.send_off == desc.recv_off;
        if self.host {
            let call = host_reduce::HostCall {
                rank: self.rank,
                world: self.world,
                pads: &self.pads,
                inputs: &inputs[..world],
                outputs: &outputs[..world],
                count: desc.count as usize,
                dtype,
                op,
                algo,
                in_place,
                desc: desc.digest(),
                timeout: self.timeout,
                rms: None,
            };
            return run_host(&call, &mut self.host_epoch, &mut self.sticky);
        }
        let esize = dtype.size() as u64;
        // Reduce-scatter and all-gather address slices of count elements: vectors need them
        // whole (all-reduce kernels do the element tail themselves).
        let sg = matches!(algo, Algo::ReduceScatter | Algo::AllGather);
        let vec = inputs[..world]
            .iter()
            .chain(&outputs[..world])
            .all(|p| p % 16 == 0)
            && (!sg || (desc.count * esize) % 16 == 0);
        let items = if vec {
            desc.count * esize / 16
        } else {
            desc.count
        };

        // Small reduce-scatters take the LL kernel (chosen from values equal on every rank).
        let algo = if algo == Algo::ReduceScatter
            && reduce_scatter_takes_ll(desc.send_off, desc.count, esize, self.auto.ll_max)
        {
            Algo::ReduceScatterLL
        } else {
            algo
        };
        let vec = vec || algo == Algo::ReduceScatterLL;
        let items = if algo == Algo::ReduceScatterLL {
            desc.count * esize / 16
        } else {
            items
        };
        let sliced = matches!(algo, Algo::TwoShot | Algo::Multimem);
        let per_rank = if sliced {
            items.div_ceil(self.world as u64)
        } else {
            items
        };
        let cap = if sliced || sg {
            MAX_BLOCKS as u64
        } else {
            (self.sms as u64 / 4).clamp(1, 32)
        };
        // Items one block covers per round.
        let per_block = match algo {
            Algo::TwoShot if vec => THREADS as u64 * TWO_SHOT_UNROLL,
            Algo::ReduceScatter | Algo::AllGather if vec => THREADS as u64 * SG_UNROLL,
            _ => THREADS as u64,
        };
        let (grid, threads) = match algo {
            Algo::OneShotLL => ll_shape((desc.count * esize).div_ceil(16), self.ll_grid),
            Algo::ReduceScatterLL => ll_shape(items, self.ll_grid),
            _ => (per_rank.div_ceil(per_block).clamp(1, cap) as u32, THREADS),
        };
        let mut args = self.symm_args(&desc, mc_out);
        args.in_place = in_place as i32;
        let f = self.kernel(algo, dtype, op, vec)?;
        cuda::module::launch(self.device, f, grid, threads, stream, &args)
    }

    /// The argument struct every kernel starts with: every rank's buffers at the call's offsets
    /// in this address space (entries past the world stay 0), the pads, epochs and error words.
    pub(super) fn symm_args(&self, desc: &CallDesc, mc_out: u64) -> SymmArgs {
        let mut args = SymmArgs {
            count: desc.count,
            desc: desc.digest(),
            timeout_ns: self.timeout.as_nanos() as u64,
            rank: self.rank as i32,
            world: self.world as i32,
            counters: self.internal + COUNTERS_OFFSET,
            error_word: self.errors.device_ptr(),
            ll_slot_kib: (self.ll_slot >> 10) as i32,
            mc_out,
            ..SymmArgs::default()
        };
        for (r, b) in self.windows.bases.iter().enumerate() {
            args.inputs[r] = b + desc.send_off;
            args.outputs[r] = b + desc.recv_off;
        }
        args.pads[..self.world].copy_from_slice(&self.pads);
        args
    }

    /// The kernel for (algorithm, type, op, vector width), looked up in the module once.
    pub(super) fn kernel(
        &mut self,
        algo: Algo,
        dtype: DType,
        op: ReduceOp,
        vec: bool,
    ) -> Result<cuda::module::Function> {
        if let Some(&f) = self.kernels.get(&(algo, dtype, op, vec)) {
            return Ok(f);
        }
        let name = kernels::kernel_name(algo, dtype, op, vec).ok_or_else(|| {
            Error::unsupported(format!(
                "no {} kernel for {} {}",
                algo.name(),
                dtype.name(),
                op.name()
            ))
        })?;
        let f = cuda::module::function(self.device, &name)?;
        self.kernels.insert((algo, dtype, op, vec), f);
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::{ll_shape, ll_threads, reduce_scatter_takes_ll};

    #[test]
    fn reduce_scatter_takes_ll_for_small_aligned_slices_only() {
        let ll_max = 4 << 20;
        assert!(reduce_scatter_takes_ll(0, 8, 2, ll_max), "one bf16 vector");
        assert!(
            reduce_scatter_takes_ll(4096, 1 << 20, 2, ll_max),
            "2 MiB slice"
        );
        assert!(
            reduce_scatter_takes_ll(0, 1 << 20, 4, ll_max),
            "4 MiB fp32 slice: the edge"
        );
        assert!(
            !reduce_scatter_takes_ll(0, (1 << 20) + 4, 4, ll_max),
            "past the threshold"
        );
        assert!(
            !reduce_scatter_takes_ll(0, 7, 2, ll_max),
            "not whole vectors"
        );
        assert!(
            !reduce_scatter_takes_ll(8, 8, 2, ll_max),
            "input offset not 16-byte aligned"
        );
        assert!(!reduce_scatter_takes_ll(0, 8, 2, 0), "LL turned off");
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
