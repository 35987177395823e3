//! Split slots: room for children's internal blocks inside a parent's own, so that a split makes no
//! device memory and imports none. A communicator made by `symm_comm_init` allocates
//! its internal block with `SYMMALLOC_SPLIT_SLOTS` slots after it (default 2: config/settings.rs;
//! as many as fit in a quarter of its arena): one block, one segment, exchanged with every peer at
//! init like the internal block alone was. A split whose parent has a slot free on every parent
//! rank gives each child that slot (internal.rs carves the child's signal pad and internal block
//! out of it: a memset and a socket round, or nothing at all when every rank of the child bet on
//! that slot and reset it before the split's first round: split.rs); otherwise, or for a parent
//! that has no slots (a child), the child makes its own block as before.
//!
//! Layout of a slot: the p2p signal pad (`SYMM_SIGNAL_PAD_BYTES`), then the internal block
//! (collective/kernel_args.rs), so the bytes that start at 0 are one range and the LL data another
//! (one memset call each). A slot holds the largest internal block any child of the parent can
//! need: children of fewer ranks take larger LL slots by default (config/settings.rs,
//! `default_ll_bytes`).
//!
//! Invariants: a slot is held (its bit set in `held`) by at most one live child of this rank
//! (or by a split's bet until its first round is over); a split gives a child only a slot free
//! on every rank of the parent, NOCOLOR ranks included (their free masks travel in the split's
//! first round), and gives every child of that split the same slot, so the slot's memory is at
//! one heap offset on every rank of each child and no child still running on some rank can
//! write into memory a new child was given. The block
//! (parent's internal block and slots) is freed when the last of the parent and its carved
//! children lets go of it (`Arc`), so a child outlives its parent; its segment's release then
//! reaches the peers through the release log, like any internal block's.

use crate::comm::collective::kernel_args::internal_bytes;
use crate::comm::p2p::device_comm::SYMM_SIGNAL_PAD_BYTES;
use crate::config;
use crate::error::Result;
use crate::heap::Allocator;
use std::sync::{Arc, Mutex};

/// Slots start at multiples of this from the block's start.
const SLOT_ALIGN: u64 = 4096;

/// Bytes of one slot for the children of a communicator of `world` ranks: a signal pad and the
/// largest internal block a child of 1..=`world` ranks needs.
pub(in crate::comm) fn slot_len(world: usize) -> Result<u64> {
    slot_len_with(world, config::ll_bytes)
}

/// `slot_len` with the LL slot of each world size from `ll_bytes`.
fn slot_len_with(world: usize, ll_bytes: impl Fn(usize) -> Result<u64>) -> Result<u64> {
    let mut most = 0;
    for w in 1..=world {
        most = most.max(internal_bytes(w, ll_bytes(w)?));
    }
    Ok((SYMM_SIGNAL_PAD_BYTES + most).next_multiple_of(SLOT_ALIGN))
}

/// How many slots a communicator made by init reserves: `wanted` (`SYMMALLOC_SPLIT_SLOTS`), as
/// many as fit in a quarter of its arena of `arena_len` bytes. A function of settings that are
/// equal on every rank, so equal on every rank.
pub(in crate::comm) fn slots_to_reserve(wanted: u64, slot_len: u64, arena_len: u64) -> usize {
    wanted.min(arena_len / 4 / slot_len.max(1)) as usize
}

/// Where the slots start in a block whose internal block is `internal_len` bytes.
pub(in crate::comm) fn first_slot(internal_len: u64) -> u64 {
    internal_len.next_multiple_of(SLOT_ALIGN)
}

/// A parent's internal block with its slots, shared by the parent and its carved children.
pub struct SlotBlock {
    alloc: &'static Allocator,
    device: i32,
    /// The block (the parent's internal block at its start) and its length.
    ptr: u64,
    len: u64,
    /// Where slot 0 starts (from `ptr`), and each slot's length.
    first: u64,
    slot_len: u64,
    slots: usize,
    /// Bit n: slot n is held by a live child on this rank.
    held: Mutex<u64>,
}

impl SlotBlock {
    /// Takes ownership of the block at `ptr` (`len` bytes, from the arena's internal pool):
    /// freed when the last holder lets go.
    pub(in crate::comm) fn new(
        alloc: &'static Allocator,
        device: i32,
        ptr: u64,
        len: u64,
        first: u64,
        slot_len: u64,
        slots: usize,
    ) -> Arc<SlotBlock> {
        debug_assert!(slots as u64 <= config::MAX_SPLIT_SLOTS);
        debug_assert!(first + slots as u64 * slot_len <= len);
        Arc::new(SlotBlock {
            alloc,
            device,
            ptr,
            len,
            first,
            slot_len,
            slots,
            held: Mutex::new(0),
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, u64> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slots no live child of this rank holds, as a mask (bit n: slot n).
    pub(in crate::comm) fn free_mask(&self) -> u64 {
        let all = if self.slots >= 64 {
            u64::MAX
        } else {
            (1u64 << self.slots) - 1
        };
        all & !*self.held()
    }

    /// The block's start (the parent's internal block).
    pub(in crate::comm) fn start(&self) -> u64 {
        self.ptr
    }

    /// Takes slot `n` (free on this rank) for a child.
    pub(in crate::comm) fn take(self: &Arc<Self>, n: usize) -> SlotHold {
        let mut held = self.held();
        debug_assert!(n < self.slots && *held & (1 << n) == 0);
        *held |= 1 << n;
        SlotHold {
            block: self.clone(),
            slot: n,
        }
    }
}

impl Drop for SlotBlock {
    fn drop(&mut self) {
        // The parent and every carved child are destroyed (each waited for its kernels).
        let _ = self.alloc.free(self.ptr, self.len, self.device, 0);
    }
}

/// A child's slot: given back when the child goes.
pub struct SlotHold {
    block: Arc<SlotBlock>,
    slot: usize,
}

impl SlotHold {
    pub(in crate::comm) fn slot(&self) -> usize {
        self.slot
    }

    /// The slot's start: the child's signal pad; its internal block follows the pad.
    pub(in crate::comm) fn addr(&self) -> u64 {
        self.block.ptr + self.block.first + self.slot as u64 * self.block.slot_len
    }

    pub(in crate::comm) fn slot_len(&self) -> u64 {
        self.block.slot_len
    }
}

impl Drop for SlotHold {
    fn drop(&mut self) {
        *self.block.held() &= !(1 << self.slot);
    }
}

/// Where a communicator's internal block (and p2p signal pad) lives.
pub(in crate::comm) enum Internal {
    /// Blocks of its own, freed at destroy (a child no slot was free for, or no slots).
    Own,
    /// Its own internal block followed by slots for its children (made by init).
    WithSlots(Arc<SlotBlock>),
    /// A slot of its parent's block; `generation` names its release in this rank's release
    /// log (the peers expect that record when this rank destroys the child).
    Carved { hold: SlotHold, generation: u64 },
}

/// What `build` makes: its own block, its own block with `n` slots, or a carved one.
pub(in crate::comm) enum Plan {
    Own,
    Reserve(usize),
    /// Carve the slot: reset it, then one round of the child (internal.rs).
    Carve(SlotHold),
    /// The slot every rank of the child reset before the split's first round, with this rank's
    /// release-log generation for it and each child rank's (split.rs): nothing left to do.
    Ready {
        hold: SlotHold,
        generation: u64,
        peer_gens: Vec<u64>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_fits_the_largest_child_and_the_count_fits_a_quarter_of_the_arena() {
        // Default LL slots: a child of 2 ranks has 4 MiB ones, the largest internal block of
        // any child of 2..=8 ranks (16 MiB + 72 KiB with the pad).
        let default = |w| Ok(config::default_ll_bytes(w));
        for w in 2..=8 {
            assert_eq!(
                slot_len_with(w, default).unwrap(),
                (16 << 20) + (72 << 10),
                "{w}"
            );
        }
        assert_eq!(slot_len_with(1, default).unwrap(), (8 << 20) + (72 << 10));
        // A set SYMMALLOC_LL_BYTES is the same for every world size: the widest child.
        let fixed = |_| Ok(64 << 10);
        assert_eq!(
            slot_len_with(4, fixed).unwrap(),
            (SYMM_SIGNAL_PAD_BYTES + internal_bytes(4, 64 << 10)).next_multiple_of(SLOT_ALIGN)
        );
        let m = 1u64 << 20;
        assert_eq!(slots_to_reserve(2, 17 * m, 256 * m), 2);
        assert_eq!(slots_to_reserve(8, 17 * m, 256 * m), 3);
        assert_eq!(slots_to_reserve(2, 17 * m, 64 * m), 0);
        assert_eq!(slots_to_reserve(0, 17 * m, 256 * m), 0);
        assert_eq!(first_slot(21632), 24576);
    }
}
