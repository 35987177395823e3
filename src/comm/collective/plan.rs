//! The first half of every collective call: `prepare` turns a checked `Call` into a `Plan`, doing
//! the shared setup once (where the buffers are and what is staged through the scratch: place.rs;
//! which kernel: algo.rs; its vectors and grid: `shape`, below, the fused call's kernel and grid:
//! fused_shape.rs; the call descriptor (launch.rs, `CallDesc`) and the segment exchange with
//! the peers: exchange.rs;
//! the multicast window, for MULTIMEM: peer/mc_window.rs). `launch.rs` then enqueues the plan.
//! NCCL's enqueue.cc (plan, then launch) is the model; docs/DESIGN.md, "The collective pipeline",
//! walks one call through both.
//!
//! Invariants: every decision in a plan reads only values equal on every rank (algo.rs, `shape`,
//! fused_shape.rs), so every rank plans the same kernel and grid for the same call; whether a rank
//! stages is decided before it makes any scratch, and a rank that is about to make a scratch
//! segment or share one first meets its peers (place.rs, `meet_before_sharing`; the host backend),
//! so there ranks that disagree fail at once and make no scratch; the segments a kernel touches are
//! exchanged with the peers (and compared) before the plan exists; nothing is enqueued on the
//! stream here, so a call that fails in `prepare` leaves no work behind.

use super::algo::{self, DType, Kernel, Quant};
use super::call::{Call, Coll, Extents};
use super::fused_shape::{self, FusedShape};
use super::launch::{fused_kernel_id, kernel_id_name, CallDesc, DescKind, Plan, RANK_LOCAL};
use super::{CollSettings, Ctx};
use crate::comm::exec::Executor;
use crate::error::{Error, Result};

impl Ctx<'_> {
    /// Places a checked call's buffers (`ext`: `Call::check`), picks its kernel and grid,
    /// exchanges its segments and compares its descriptor with the peers'. Collective (every
    /// rank calls it in the same order).
    pub(in crate::comm) fn prepare(&mut self, call: &Call, ext: Extents) -> Result<Plan> {
        // The all-reduce's kernel depends only on the message; the others' on where it lies.
        let asked = match call.coll {
            Coll::AllReduce(a) => {
                let k = algo::all_reduce_kernel(
                    a,
                    ext.send,
                    self.world,
                    self.settings.ll_slot,
                    &self.settings.auto,
                )?;
                self.note_auto_choice(a, k, ext.send);
                if k == Kernel::Multimem {
                    self.check_multimem(call)?;
                }
                Some(k)
            }
            _ => None,
        };
        let p = self.placement(call, ext)?;
        let staged = p.staged;
        let base = self.peer.windows.bases[self.rank];
        let (send_off, recv_off) = (p.send - base, p.recv.wrapping_sub(base));
        let mut push_threads = 0;
        let mut fused: Option<FusedShape> = None;
        let (kind, kernel, width) = match call.coll {
            Coll::AllReduce(_) => (DescKind::AllReduce, asked.expect("chosen above"), 0),
            Coll::Barrier => (DescKind::Barrier, Kernel::OneShot, 0),
            Coll::AllGather => (DescKind::AllGather, Kernel::AllGather, 0),
            Coll::ReduceScatter => (
                DescKind::ReduceScatter,
                algo::reduce_scatter_kernel(send_off, ext.slice, self.settings.auto.ll_max),
                0,
            ),
            Coll::AddRmsNorm(r) => {
                // Where plans carry a grid; the CPU's twin of the fused call has none.
                let settings = self.settings;
                if settings.grids {
                    // The LL all-reduce's spread for a message of this size.
                    push_threads = shape::ll_threads(call.count / 8, settings.ll_grid);
                    let q = r.quant.map(|q| q.mode);
                    fused = Some(fused_shape(
                        settings,
                        &mut *self.exec,
                        (r.tokens, r.hidden, push_threads, ext.send),
                        (call.dtype, q),
                    )?);
                }
                let kernel = fused.map_or(Kernel::AddRmsNorm, |s| s.kernel);
                // The output format is part of what ranks agree on (bits 32 and up: 0 for
                // bf16/fp16, 1 + symm_quant_t for FP8).
                let format = r.quant.map_or(0, |q| 1 + q.mode.code() as u64);
                (DescKind::AddRmsNorm, kernel, r.hidden | format << 32)
            }
        };
        let desc = CallDesc {
            kind,
            kernel,
            send_off,
            recv_off: if matches!(call.coll, Coll::AddRmsNorm(_)) {
                RANK_LOCAL
            } else {
                recv_off
            },
            count: call.count,
            dtype: call.dtype,
            op: call.op,
            width,
            staged,
        };
        // Nothing to exchange when the placement cache knows the peers map every segment
        // already, unless every call compares (SYMMALLOC_CHECK_SYMMETRY).
        if !p.shared || self.settings.check_symmetry {
            self.exchange(&p.segs, desc, self.settings.check_symmetry)?;
            self.note_exchanged(&p);
        }
        // Only offsets every rank shares decide (a rank-local one would let ranks pick
        // different kernels): reduce-scatter's input, all-gather's output, both otherwise.
        let shared: &[u64] = match call.coll {
            Coll::ReduceScatter => &[desc.send_off],
            Coll::AllGather => &[desc.recv_off],
            _ => &[desc.send_off, recv_off],
        };
        let vec = shape::vectors(kernel, shared, ext.slice);
        // (0, 0, 1) where the CPU runs the twin, which has no grid.
        let settings = self.settings;
        let (grid, threads, cluster) = if !settings.grids {
            (0, 0, 1)
        } else if let Some(s) = fused {
            (s.grid, s.threads, s.cluster)
        } else if shape::is_ll(kernel) {
            let (g, t) = shape::ll_shape(ext.slice.div_ceil(16), settings.ll_grid);
            (g, t, 1)
        } else {
            let items = if vec { ext.slice / 16 } else { call.count };
            let (g, t) = shape::barrier_shape(kernel, items, self.world, vec, settings.sms);
            (g, t, 1)
        };
        let mc_out = if kernel == Kernel::Multimem {
            // Past the gate: the output segment's multicast window (built collectively once).
            // The chunk under the output (a segment that grew in place has several).
            let at = desc.recv_off;
            let seg = p
                .segs
                .iter()
                .copied()
                .find(|s| s.offset <= at && at + ext.recv <= s.offset + s.size)
                .ok_or_else(|| {
                    Error::unsupported(format!(
                        "SYMM_ALGO_MULTIMEM: the output at heap offset {at:#x} ({} bytes) spans \
                         two chunks of a segment that grew in place; expected it inside one",
                        ext.recv
                    ))
                })?;
            let who = crate::comm::peer::Who {
                rank: self.rank,
                world: self.world,
                device: self.device,
                alloc: self.alloc,
                mesh: self.mesh,
            };
            self.peer.multicast_window(&who, seg)? + (at - seg.offset)
        } else {
            0
        };
        Ok(Plan {
            call: *call,
            kernel,
            desc,
            vec,
            grid,
            threads,
            cluster,
            push_threads,
            stage_in: p.stage_in,
            stage_out: p.stage_out,
            mc_out,
        })
    }

    /// SYMMALLOC_DEBUG=INFO: AUTO's choice, once per message size.
    fn note_auto_choice(&mut self, asked: algo::Algo, k: Kernel, bytes: u64) {
        if asked == algo::Algo::Auto
            && crate::debug_enabled!(crate::debug::Level::Info)
            && self.coll.auto_seen.insert(bytes)
        {
            crate::info!(
                "rank {}/{}: AUTO chose {} for {bytes} bytes",
                self.rank,
                self.world,
                k.name()
            );
        }
    }

    /// MULTIMEM runs only past the multicast gate, on its own terms (algo.rs,
    /// `check_multimem_call`; its window: peer/mc_window.rs).
    fn check_multimem(&self, call: &Call) -> Result<()> {
        let supports = self.exec.multicast()?;
        crate::cuda::multicast_gate::multicast_gate_from_env(supports)
            .map_err(|why| Error::unsupported(format!("SYMM_ALGO_MULTIMEM refused: {why}")))?;
        algo::check_multimem_call(call.send, call.recv, call.count, call.dtype, call.op)
    }
}

/// The fused call's kernel and grid: the LL kernels on a grid every rank's GPU holds at once
/// (fused_shape.rs) up to AUTO's LL threshold, the barrier kernel above it.
fn fused_shape(
    settings: &CollSettings,
    exec: &mut dyn Executor,
    (tokens, hidden, push_threads, bytes): (u64, u64, u32, u64),
    (dtype, quant): (DType, Option<Quant>),
) -> Result<FusedShape> {
    let (ll_max, clusters) = (settings.auto.ll_max, settings.clusters);
    let s = fused_shape::fit_resident(
        settings.ll_grid.0,
        |blocks| {
            fused_shape::fused_ll_shape(
                tokens,
                hidden,
                push_threads,
                bytes,
                ll_max,
                blocks,
                clusters,
            )
        },
        |s| resident_blocks(settings, exec, s, dtype, quant),
    )?;
    Ok(s.unwrap_or_else(|| fused_shape::fused_barrier_shape(tokens, hidden)))
}

/// How many blocks of this shape's kernel every rank's GPU holds at once: blocks per SM (asked
/// of the driver once per kernel and block size; the same on every rank of one architecture)
/// times the fewest SMs of any rank. For clusters this leaves out how a GPU groups its SMs (a
/// cluster cannot span groups, and the grouping differs between chips of one model, so it is no
/// input every rank shares): the cluster kernel holds two blocks per SM at its widest (512
/// threads), twice what the LL grid asks of 128 SMs.
fn resident_blocks(
    settings: &CollSettings,
    exec: &mut dyn Executor,
    s: &FusedShape,
    dtype: DType,
    quant: Option<Quant>,
) -> Result<u64> {
    let id = fused_kernel_id(s.kernel, dtype, quant);
    let per_sm = exec.blocks_per_sm(id, kernel_id_name, s.threads)?;
    Ok(per_sm as u64 * settings.fewest_sms as u64)
}

pub(super) mod shape {
    //! Shapes: whether a chosen kernel (algo.rs) moves 16-byte vectors or single elements
    //! (`vectors`, every kernel), and how many blocks and threads an all-reduce, reduce-scatter or
    //! all-gather kernel runs on (`ll_shape` for the LL kernels, `barrier_shape` for the others).
    //! The fused all-reduce + RMSNorm call's kernel and grid are fused_shape.rs's.
    //!
    //! Invariant: every shape is a pure function of values equal on every rank (the call's shared
    //! words, the communicator's settings and the facts about every rank's GPU agreed at init), so
    //! block b of every rank meets block b of every other (docs/DESIGN.md, "Kernels and their
    //! grids").

    use crate::comm::collective::algo::Kernel;
    use crate::comm::collective::kernel_args::{MAX_BLOCKS, THREADS};

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

    /// Kernels of the LL protocol (they share the LL buffers and call counters): their grid is
    /// `ll_shape`'s.
    pub fn is_ll(kernel: Kernel) -> bool {
        matches!(
            kernel,
            Kernel::OneShotLL
                | Kernel::ReduceScatterLL
                | Kernel::AddRmsNormLL
                | Kernel::AddRmsNormLL1
                | Kernel::AddRmsNormLLC
        )
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
    pub fn barrier_shape(
        kernel: Kernel,
        items: u64,
        world: usize,
        vec: bool,
        sms: u32,
    ) -> (u32, u32) {
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
                Kernel::TwoShot if vec => crate::comm::collective::kernel_args::TWO_SHOT_UNROLL,
                Kernel::ReduceScatter | Kernel::AllGather if vec => {
                    crate::comm::collective::kernel_args::SG_UNROLL
                }
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
}
