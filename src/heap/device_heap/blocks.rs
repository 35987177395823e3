//! The way through a segment's blocks: they sit in a hash map by offset (mod.rs, `blocks`), so
//! order comes from the segment. A segment's blocks are walked from its offset, each starting
//! where the one before ends; a block's neighbours are its `prev` link and `offset + size`.
//! Also the block under an address and the chunks under it (`segment_of`, `locate`: what a
//! collective shares with its peers), worked out here alone, so a lookup goes nowhere else in
//! the heap but the range allocator's size.
//!
//! Invariants (mod.rs; checked by `validate`): the walk from a segment's offset reaches every
//! block of the segment and only those; `prev` names the block the walk met just before.

use super::*;

/// Where a buffer lies: the chunks of its segment under its block (one, unless the segment grew
/// in place under the block); `None` when outside the heap.
pub type Located = Option<Vec<SegmentInfo>>;

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

    /// The chunks under the live block that holds `ptr` (in address order), and the block's
    /// bounds.
    pub fn segment_of(&self, ptr: u64) -> Result<(Vec<SegmentInfo>, u64, u64)> {
        let off = ptr.wrapping_sub(self.base);
        let (boff, b) = self
            .block_holding(off)
            .filter(|(_, b)| matches!(b.state, State::Live(_)))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "address {ptr:#x} is not inside a live symm_malloc block"
                ))
            })?;
        let chunks = self.segments[&b.segment]
            .chunks
            .iter()
            .filter(|c| c.off < boff + b.size && boff < c.off + c.len)
            .map(info)
            .collect();
        Ok((chunks, self.base + boff, b.size))
    }

    /// Where `ptr..ptr+bytes` lies: the chunks under the live block that holds it (one, unless
    /// the segment grew in place under the block); `None` when `ptr` is outside the heap, an
    /// error when it is inside the heap but not inside one live block, or runs past its end.
    pub fn locate(&self, ptr: u64, bytes: u64) -> Result<Located> {
        self.locate_below(self.base + self.ranges.size(), ptr, bytes)
    }

    /// `locate` for two buffers.
    pub fn locate_pair(&self, a: (u64, u64), b: (u64, u64)) -> Result<(Located, Located)> {
        let end = self.base + self.ranges.size();
        Ok((
            self.locate_below(end, a.0, a.1)?,
            self.locate_below(end, b.0, b.1)?,
        ))
    }

    /// `locate` in a heap that ends at `end`.
    fn locate_below(&self, end: u64, ptr: u64, bytes: u64) -> Result<Located> {
        if ptr < self.base || ptr >= end {
            return Ok(None);
        }
        let (segs, bstart, bsize) = self.segment_of(ptr)?;
        if ptr + bytes > bstart + bsize {
            return Err(Error::invalid(format!(
                "buffer {ptr:#x} of {bytes} bytes runs past the end of its symm_malloc block \
                 ({bsize} bytes at {bstart:#x}); expected count * element size to fit"
            )));
        }
        Ok(Some(segs))
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

pub(super) fn info(c: &Chunk) -> SegmentInfo {
    SegmentInfo {
        offset: c.off,
        size: c.len,
        generation: c.generation,
    }
}
