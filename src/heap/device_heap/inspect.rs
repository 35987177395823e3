//! What PyTorch's allocator interface asks of one heap beyond allocation: a block's own request
//! and stream (a free by address alone), the segments and blocks for a memory snapshot, a
//! pool's live blocks (CUDA-graph trees' checks and checkpoints) and taking one exact block
//! again (a checkpoint restored).
//!
//! Invariants: reads change nothing; `take_at` only splits a free block of the pool at the
//! requested bounds and marks the middle live, as `take` does, so every invariant of mod.rs
//! holds after it.

use super::*;
use crate::heap::device_stats::slot;

/// One block as a snapshot shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockView {
    pub address: u64,
    pub size: u64,
    /// The request of a live block; 0 otherwise.
    pub requested: u64,
    /// 1 live, 0 free, 2 parked (kept whole for its size).
    pub state: u32,
    pub segment_address: u64,
    pub segment_size: u64,
    pub pool: PoolId,
    pub is_large: bool,
    /// The stream of the last allocation or free (UNUSED for never-used memory).
    pub stream: Stream,
}

impl DeviceHeap {
    /// The request and allocation stream of the live block at `ptr`.
    pub fn live_info(&self, ptr: u64) -> Result<(u64, Stream)> {
        let (off, requested) = self.live_block(ptr, "symm_free_block")?;
        let stream = self.blocks[&off]
            .streams
            .first()
            .copied()
            .expect("a live block has its allocation stream");
        Ok((requested, stream))
    }

    /// Every block of every segment, in address order (`pool` only when given).
    pub fn walk(&self, pool: Option<PoolId>) -> Vec<BlockView> {
        let mut out = Vec::new();
        for (&soff, s) in &self.segments {
            if pool.is_some_and(|p| p != s.pool) {
                continue;
            }
            for (boff, b) in self.segment_blocks(soff) {
                let (state, requested) = match b.state {
                    State::Live(r) => (1, r),
                    State::Free => (0, 0),
                    State::Parked => (2, 0),
                };
                out.push(BlockView {
                    address: self.base + boff,
                    size: b.size,
                    requested,
                    state,
                    segment_address: self.base + soff,
                    segment_size: s.size,
                    pool: s.pool,
                    is_large: s.class == Class::Large,
                    stream: b.streams.first().copied().unwrap_or(UNUSED),
                });
            }
        }
        out
    }

    /// Returns `pool`'s parked blocks to its free lists.
    pub fn drain_parked_of(&mut self, pool: PoolId) {
        self.drain_parked(Some(pool));
    }

    /// Uses taken on `pool` (`hold_pool`) and not given back.
    pub fn pool_uses(&self, pool: PoolId) -> u64 {
        self.pools.get(&pool).map_or(0, |p| p.uses)
    }

    /// Makes the block `[ptr, ptr + size)` of `pool` live again for `requested` bytes on
    /// `stream`: it must lie inside one free block of a segment of `pool` (the caller has
    /// returned the pool's parked and thread-kept blocks to the free lists).
    pub fn take_at(
        &mut self,
        backend: &dyn Backend,
        ptr: u64,
        size: u64,
        requested: u64,
        stream: Stream,
        pool: PoolId,
    ) -> Result<()> {
        let off = ptr.wrapping_sub(self.base);
        let found = self
            .block_holding(off)
            .map(|(o, b)| (o, b.size, b.is_free(), b.pool));
        let Some((boff, bsize, free, bpool)) = found else {
            return Err(Error::invalid(format!(
                "checkpoint block {ptr:#x} lies outside every segment of device {}",
                self.device
            )));
        };
        if !free || bpool != pool || off + size > boff + bsize || size == 0 {
            return Err(Error::invalid(format!(
                "checkpoint block {ptr:#x} of {size} bytes is not free memory of pool {pool} \
                 (the block there: {:#x}, {bsize} bytes, free {free}, pool {bpool})",
                self.base + boff
            )));
        }
        if boff < off {
            // Split the free front off; the rest becomes its own free block at `off`.
            self.unlist_free(boff);
            let b = self.blocks.get_mut(&boff).expect("free block");
            b.size = off - boff;
            let (segment, class, streams) = (b.segment, b.class, b.streams.clone());
            self.blocks.insert(
                off,
                Block {
                    size: bsize - (off - boff),
                    segment,
                    pool,
                    class,
                    prev: boff,
                    state: State::Free,
                    streams,
                },
            );
            self.relink_next(off);
            self.counters.blocks[slot(class)] += 1;
            self.list_free(boff);
            self.list_free(off);
        }
        self.take_exact(backend, off, size, requested, stream)
    }
}
