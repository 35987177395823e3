//! The way through a segment's blocks: they sit in a hash map by offset (mod.rs, `blocks`), so
//! order comes from the segment. A segment's blocks are walked from its offset, each starting
//! where the one before ends; a block's neighbours are its `prev` link and `offset + size`.
//!
//! Invariants (mod.rs; checked by `validate`): the walk from a segment's offset reaches every
//! block of the segment and only those; `prev` names the block the walk met just before.

use super::*;

/// A segment's blocks in address order (`DeviceHeap::segment_blocks`).
pub(super) struct SegmentBlocks<'a> {
    blocks: &'a crate::heap::addr_map::AddrMap<Block>,
    at: u64,
    end: u64,
}

impl<'a> Iterator for SegmentBlocks<'a> {
    type Item = (u64, &'a Block);
    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.end {
            return None;
        }
        let off = self.at;
        let b = self.blocks.get(&off)?;
        self.at += b.size.max(1);
        Some((off, b))
    }
}

impl DeviceHeap {
    /// The blocks of the segment at `seg`, in address order. (A gap in the tiling ends the walk
    /// early; `validate` reports it.)
    pub(super) fn segment_blocks(&self, seg: u64) -> SegmentBlocks<'_> {
        let end = self.segments.get(&seg).map_or(seg, |s| seg + s.size);
        SegmentBlocks {
            blocks: &self.blocks,
            at: seg,
            end,
        }
    }

    /// The block that holds offset `off`, anywhere in it.
    pub(super) fn block_holding(&self, off: u64) -> Option<(u64, &Block)> {
        if let Some(b) = self.blocks.get(&off) {
            return Some((off, b));
        }
        let (&soff, s) = self.segments.range(..=off).next_back()?;
        if off >= soff + s.size {
            return None;
        }
        self.segment_blocks(soff).find(|&(o, b)| off < o + b.size)
    }

    /// The block after the one at `off` in its segment, if any.
    pub(super) fn next_block(&self, off: u64) -> Option<u64> {
        let b = &self.blocks[&off];
        let next = off + b.size;
        self.blocks
            .get(&next)
            .is_some_and(|n| n.segment == b.segment)
            .then_some(next)
    }

    /// Points the block after the one at `off` (if any) back at `off`.
    pub(super) fn relink_next(&mut self, off: u64) {
        if let Some(n) = self.next_block(off) {
            self.blocks.get_mut(&n).expect("next block").prev = off;
        }
    }
}
