//! Blocks lent to thread caches (heap/tcache.rs): live blocks, as far as this heap is
//! concerned, whose frees and reuses a thread cache handles without the heap's lock.
//!
//! Invariants (checked by `validate`): every tracked offset is a live block, tracked by exactly
//! one cache; `free` and `record_stream` refuse a tracked block (the allocator takes it back
//! from its cache first, with `untrack`), so the heap never frees memory a cache still holds.

use super::*;

impl DeviceHeap {
    /// Lends the live block at `ptr` to thread cache `cache`; returns its size in the heap.
    pub fn track(&mut self, ptr: u64, cache: u64) -> Result<u64> {
        let (off, _) = self.live_block(ptr, "track")?;
        if self.tracked.insert(off, cache).is_some() {
            return Err(Error::internal(format!(
                "block {ptr:#x} is already in a thread cache"
            )));
        }
        Ok(self.blocks[&off].size)
    }

    /// The thread cache the block at `ptr` is lent to, if any.
    pub fn tracker(&self, ptr: u64) -> Option<u64> {
        self.tracked.get(&ptr.wrapping_sub(self.base)).copied()
    }

    /// Takes the block at `ptr` back from its thread cache, live for `requested` bytes (what its
    /// current user asked for; the heap recorded the first user's request).
    pub fn untrack(&mut self, ptr: u64, requested: u64) -> Result<()> {
        let (off, recorded) = self.live_block(ptr, "untrack")?;
        if self.tracked.remove(&off).is_none() {
            return Err(Error::internal(format!(
                "block {ptr:#x} is not in a thread cache"
            )));
        }
        self.blocks.get_mut(&off).expect("live block").state = State::Live(requested);
        self.stats.requested_bytes = self.stats.requested_bytes - recorded + requested;
        Ok(())
    }

    /// Every lent block: (address, cache, size in the heap, request the heap recorded).
    pub fn tracked_blocks(&self) -> Vec<(u64, u64, u64, u64)> {
        self.tracked
            .iter()
            .map(|(&off, &cache)| {
                let b = &self.blocks[&off];
                (self.base + off, cache, b.size, b.requested().unwrap_or(0))
            })
            .collect()
    }

    pub(super) fn refuse_tracked(&self, off: u64, what: &str) -> Result<()> {
        if self.tracked.contains_key(&off) {
            return Err(Error::internal(format!(
                "{what}({:#x}): the block is lent to a thread cache",
                self.base + off
            )));
        }
        Ok(())
    }
}
