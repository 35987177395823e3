//! A new communicator's internal block (signal pad, epochs, abort word, LL buffers:
//! collective/kernel_args.rs) and p2p signal pad (p2p/), made and shared with the peers at the end
//! of `build` (init.rs), in one of three ways (slots.rs has the plans):
//! - its own blocks from its arena, exchanged with every peer (a child no slot was free for);
//! - the same, with split slots after the internal block in one block (`symm_comm_init`);
//! - carved out of a slot of its parent's block, which every peer has mapped since the
//!   parent's init: a memset, a fresh release-log generation and one socket round, no device
//!   memory made or imported.
//!
//! Invariants: before any peer can touch them (the exchange, or the carved child's meeting
//! round), the pads, epochs, counters and descriptor words are 0 and the LL data words all
//! ones; a peer's copy of this communicator knows what its release looks like (the segment
//! generations of the internal block and pad, or the carved block's release-log generation),
//! so a peer that destroys its copy is seen (peer/retire.rs).

use super::init::{describe_settings, Settings};
use super::slots::{self, Internal, Plan, SlotBlock, SlotHold};
use crate::comm::collective::algo::{DType, Kernel, ReduceOp};
use crate::comm::collective::kernel_args::*;
use crate::comm::collective::launch::{CallDesc, DescKind};
use crate::comm::collective::place::locate;
use crate::comm::p2p::device_comm::SYMM_SIGNAL_PAD_BYTES;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::heap::device_heap::{SegmentInfo, ROUND, SMALL_MAX};
use std::time::{Duration, Instant};

impl Communicator {
    /// The internal block, the first exchange, the last meeting; on failure, everything made
    /// so far goes back.
    pub(in crate::comm) fn finish_init(
        mut self: Box<Self>,
        settings: &Settings,
        plan: Plan,
        started: Instant,
        (claimed, bet): (Duration, bool),
    ) -> Result<Box<Communicator>> {
        match self.make_internal(plan, settings) {
            Ok((made, how)) => {
                let devices: Vec<i32> = self.group.members.iter().map(|m| m.device).collect();
                crate::info!(
                    "rank {}/{}: communicator on device {} (ranks' devices {devices:?}, {} \
                     backend); arena {}{}; {}; timeout {:.1} s; arena claimed in {} us{}, {how} \
                     in {} us, exchanged in {} us",
                    self.rank,
                    self.world,
                    self.device,
                    self.exec.backend(),
                    self.group.arena,
                    self.group
                        .lineage
                        .as_deref()
                        .map_or(String::new(), |l| format!("; {l}")),
                    describe_settings(&settings.words()),
                    settings.timeout.as_secs_f64(),
                    claimed.as_micros(),
                    if bet {
                        " (before the split's first round)"
                    } else {
                        ""
                    },
                    made.as_micros(),
                    (started.elapsed() - claimed - made).as_micros()
                );
                Ok(self)
            }
            Err(e) => {
                let _ = self.destroy();
                Err(e)
            }
        }
    }

    /// Makes (or carves) and shares the internal block; how long making it took, and how it
    /// was made (for the INFO line).
    fn make_internal(&mut self, plan: Plan, settings: &Settings) -> Result<(Duration, String)> {
        let started = Instant::now();
        let internal_len = internal_bytes(self.world, self.settings.ll_slot);
        let reserve = match plan {
            Plan::Carve(hold) => return self.carve_internal(hold, None, internal_len, started),
            Plan::Ready {
                hold,
                generation,
                peer_gens,
            } => {
                return self.carve_internal(
                    hold,
                    Some((generation, peer_gens)),
                    internal_len,
                    started,
                )
            }
            Plan::Own => 0,
            Plan::Reserve(n) => n,
        };
        let device = self.device;
        let how = if reserve > 0 {
            // One block: the internal block, then the slots; at least a large block, so it
            // never shares a small segment with the signal pad (whose release is what peers
            // see when this rank destroys the communicator while children hold the block).
            let first = slots::first_slot(internal_len);
            let len = (first + reserve as u64 * settings.slot_len).max(SMALL_MAX + ROUND);
            let block = self.own_malloc(len)?;
            self.group.internal = block;
            self.group.block = Internal::WithSlots(SlotBlock::new(
                self.alloc,
                device,
                block,
                len,
                first,
                settings.slot_len,
                reserve,
            ));
            format!(
                "internal block with {reserve} split slot(s) of {} bytes made",
                settings.slot_len
            )
        } else {
            self.group.internal = self.own_malloc(internal_len)?;
            "internal block made".to_string()
        };
        let internal = self.group.internal;
        self.reset(internal, LL_DATA_OFFSET, internal, internal_len)?;
        self.peer.pads = self.peer.windows.at_every_rank(internal);
        let desc = CallDesc {
            kind: DescKind::Init,
            kernel: Kernel::OneShot,
            send_off: 0,
            recv_off: 0,
            count: 0,
            dtype: DType::Fp32,
            op: ReduceOp::Sum,
            width: 0,
            staged: false,
        };
        let seg = self.locate_own(internal, internal_len, "internal block")?;
        self.group.internal_seg = seg.offset;
        // The p2p signal pads (p2p/), from the arena too, zeroed before any peer can see
        // them (the exchange below is the first time a peer maps them).
        let pad = self.own_malloc(SYMM_SIGNAL_PAD_BYTES)?;
        self.p2p.pad = pad;
        self.exec.zero(pad, SYMM_SIGNAL_PAD_BYTES)?;
        let pad_seg = self.locate_own(pad, SYMM_SIGNAL_PAD_BYTES, "signal pad")?;
        self.p2p.pad_seg = pad_seg.offset;
        self.p2p.pads = self.peer.windows.at_every_rank(pad);
        let made = started.elapsed();
        if pad_seg.offset == seg.offset {
            self.ctx().exchange(&[seg], desc, true)?;
        } else {
            self.ctx().exchange(&[seg, pad_seg], desc, true)?;
        }
        // The peers' generations of their internal blocks' segments: their release names the
        // peer's destroy (peer/retire.rs).
        for (r, p) in self.peer.windows.peers.iter().enumerate() {
            if let Some(p) = p {
                self.peer.releases.internal_gens[r] = p.generation_at(seg.offset).unwrap_or(0);
                self.peer.releases.pad_gens[r] = p.generation_at(pad_seg.offset).unwrap_or(0);
            }
        }
        // A split's last round (split.rs) is the children's meeting; a fresh one meets here.
        if self.group.lineage.is_none() {
            self.mesh.barrier("init")?;
        }
        Ok((made, how))
    }

    /// The carved way (module header): the slot's pad and internal block reset, then one
    /// round in which every rank of the child checks that all took the same slot at the same
    /// offset and learns the release-log generation each peer will record at its destroy.
    /// `ready`: every rank reset the slot before the split's first round, which carried the
    /// generations (this rank's, then every child rank's) and checked the rest: no round.
    fn carve_internal(
        &mut self,
        hold: SlotHold,
        ready: Option<(u64, Vec<u64>)>,
        internal_len: u64,
        started: Instant,
    ) -> Result<(Duration, String)> {
        let rank = self.rank;
        let (slot, pad, slot_len) = (hold.slot(), hold.addr(), hold.slot_len());
        let internal = pad + SYMM_SIGNAL_PAD_BYTES;
        let heap_base = crate::heap::comm_view::CommView::new(self.alloc, self.device).base()?;
        let generation = match &ready {
            Some((g, _)) => *g,
            None => {
                crate::heap::comm_view::CommView::new(self.alloc, self.device).fresh_generation()?
            }
        };
        self.group.block = Internal::Carved { hold, generation };
        if SYMM_SIGNAL_PAD_BYTES + internal_len > slot_len {
            return Err(Error::internal(format!(
                "split slot {slot} is too small for an internal block of {internal_len} bytes"
            )));
        }
        if ready.is_none() {
            // The slot's pad and the internal block's zeroed words are one range.
            self.reset(
                pad,
                SYMM_SIGNAL_PAD_BYTES + LL_DATA_OFFSET,
                internal,
                internal_len,
            )?;
        }
        self.group.internal = internal;
        self.p2p.pad = pad;
        self.peer.pads = self.peer.windows.at_every_rank(internal);
        self.p2p.pads = self.peer.windows.at_every_rank(pad);
        let seg = self.locate_own(internal, internal_len, "split slot")?;
        // A peer's destroy of the child is its record (offset of this internal block, its
        // generation); the whole block's segment goes only after the parent and all children
        // (then its record is seen too).
        self.group.internal_seg = internal - heap_base;
        self.p2p.pad_seg = seg.offset;
        let made = started.elapsed();
        let (gens, how) = match ready {
            Some((_, gens)) => (
                gens,
                ", readied before the split's first round (no new memory, no round)",
            ),
            None => (
                self.carve_round(slot, generation, seg.offset)?,
                " (no new memory)",
            ),
        };
        for r in (0..self.world).filter(|&r| r != rank) {
            self.peer.releases.internal_gens[r] = gens[r];
            self.peer.releases.pad_gens[r] = self
                .peer
                .windows
                .mapped_generation(r, seg.offset)
                .unwrap_or(0);
        }
        Ok((
            made,
            format!("internal block carved from split slot {slot} of its parent's{how}"),
        ))
    }

    /// The carve round: every rank of the child checks that all took slot `slot` at the same
    /// offset and map every peer's block of the parent (the segment at `seg`); returns the
    /// release-log generation each rank will record for its carved block (this rank's:
    /// `generation`).
    fn carve_round(&self, slot: usize, generation: u64, seg: u64) -> Result<Vec<u64>> {
        let rank = self.rank;
        // Every peer maps the parent's block (exchanged at the parent's init) unless it
        // released it; a rank that finds one missing refuses in the round, so all fail alike.
        let missing: Vec<usize> = (0..self.world)
            .filter(|&r| r != rank && self.peer.windows.mapped_generation(r, seg).is_none())
            .collect();
        let mut msg = Vec::new();
        for w in [
            missing.is_empty() as u64,
            slot as u64,
            self.group.internal_seg,
            generation,
        ] {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        let all = self.mesh.all_gather(&msg, &[], "split slot")?;
        let word = |m: &[u8], i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                m.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        let mut gens = Vec::with_capacity(self.world);
        for (r, (m, _)) in all.iter().enumerate() {
            let (Some(ok), Some(s), Some(off), Some(g)) =
                (word(m, 0), word(m, 1), word(m, 2), word(m, 3))
            else {
                return Err(Error::peer(format!("rank {r} sent a malformed split slot")));
            };
            if ok != 1 {
                return Err(Error::peer(format!(
                    "rank {r} does not map every peer's block of the parent communicator (a \
                     peer released it?)"
                )));
            }
            if (s, off) != (slot as u64, self.group.internal_seg) {
                return Err(Error::internal(format!(
                    "rank {r} carved split slot {s} at heap offset {off:#x}, rank {rank} slot \
                     {slot} at {:#x}",
                    self.group.internal_seg
                )));
            }
            gens.push(g);
        }
        Ok(gens)
    }

    /// A whole split slot of this communicator's block readied for any child's internal block
    /// (split.rs bets on it before the first round): its pad and the internal block's zeroed
    /// words to 0, the rest of the slot as LL data.
    pub(in crate::comm) fn reset_slot(&self, hold: &SlotHold) -> Result<()> {
        let pad = hold.addr();
        self.reset(
            pad,
            SYMM_SIGNAL_PAD_BYTES + LL_DATA_OFFSET,
            pad + SYMM_SIGNAL_PAD_BYTES,
            hold.slot_len() - SYMM_SIGNAL_PAD_BYTES,
        )
    }

    /// Readies an internal block (`internal`, `internal_len` bytes) before any peer can touch
    /// it: `zero_len` bytes from `zero_at` (its pad, epochs, LL counters and descriptor words,
    /// and for a carved one the p2p pad before them) to 0, its LL data words to all ones. The
    /// host backend's collectives (collective/host_reduce.rs) use the pad alone, never the LL
    /// buffers: those are left untouched there (no page of them is ever faulted in).
    fn reset(&self, zero_at: u64, zero_len: u64, internal: u64, internal_len: u64) -> Result<()> {
        // zero_at..zero_at + zero_len and the LL data lie in a live block of this rank (the
        // internal block, or the held slot: the callers).
        self.exec.reset_internal(
            zero_at,
            zero_len,
            (
                internal + LL_DATA_OFFSET,
                LL_EMPTY_BYTE,
                internal_len - LL_DATA_OFFSET,
            ),
        )
    }

    /// The one chunk under a communicator's own block (`what`: its internal block, its signal
    /// pads), which lies in its arena, whose segments never grow in place.
    pub(in crate::comm) fn locate_own(
        &self,
        ptr: u64,
        bytes: u64,
        what: &str,
    ) -> Result<SegmentInfo> {
        match locate(self.alloc, self.device, ptr, bytes)?.as_deref() {
            Some(&[one]) => Ok(one),
            other => Err(Error::internal(format!(
                "the {what} at {ptr:#x} lies in {} chunks of the heap; expected one",
                other.map_or(0, |c| c.len())
            ))),
        }
    }
}
