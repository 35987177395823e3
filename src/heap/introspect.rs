//! The allocator's answers to PyTorch's allocator interface beyond malloc and free (the C++
//! allocator of python/symmalloc/csrc calls them through ffi/torch_alloc.rs): PyTorch's
//! statistics and their resets, the memory cap of `set_per_process_memory_fraction`, the
//! largest cached block (`cacheInfo`), a free by address alone (PyTorch's `raw_delete`), the
//! blocks of a snapshot, a pool's live blocks and a pool put back to a checkpoint (CUDA-graph
//! trees).
//!
//! Invariants: reads leave placement untouched (placement stays a function of the calls, the
//! same on every rank); blocks that thread caches keep are free to their users and shown so;
//! reads (statistics and their resets, the largest cached block, blocks, pool uses, segment
//! events, a block by address) never make a heap: a device the process never allocated on
//! answers as an empty heap, and gets no address space and, on CUDA, no context.

use super::device_heap::{class_of, BlockView, Class, DeviceHeap};
use super::device_stats::{self, DeviceStats, HeapCounters, SegmentEvent};
use super::pools::{PoolId, DEFAULT_POOL};
use super::spin_lock::SpinGuard;
use super::{Allocator, Stream};
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::sync::atomic::Ordering;

/// A live block of a pool: (address, block size, request, allocation stream).
pub type LiveBlock = (u64, u64, u64, Stream);

impl Allocator {
    /// The device's heap, locked, when one was made; `None` otherwise (module header: reads
    /// never make one).
    fn made_heap(&self, device: i32) -> Result<Option<SpinGuard<'_, DeviceHeap>>> {
        self.check_device(device)?;
        Ok(self.heaps[device as usize].get().map(|h| h.lock()))
    }

    /// Whether `device`'s heap was made (by an allocation, a pool or a memory cap on it).
    pub fn heap_made(&self, device: i32) -> bool {
        self.check_device(device).is_ok() && self.heaps[device as usize].get().is_some()
    }

    /// PyTorch's statistics of `device` (device_stats.rs): from counters, no walk over blocks.
    pub fn device_stats(&self, device: i32) -> Result<DeviceStats> {
        let heap = self.made_heap(device)?;
        let users = &self.users[device as usize];
        Ok(match heap {
            Some(mut heap) => heap.counters.read(users),
            None => HeapCounters::default().read(users),
        })
    }

    /// PyTorch's `resetPeakStats`: every peak becomes the current value.
    pub fn reset_peak_stats(&self, device: i32) -> Result<()> {
        if let Some(mut heap) = self.made_heap(device)? {
            heap.counters.reset_peak(&self.users[device as usize]);
            heap.stats.peak_allocated_bytes = heap.stats.allocated_bytes;
        }
        Ok(())
    }

    /// PyTorch's `resetAccumulatedStats`: the allocated and freed totals and the event counts
    /// start again from zero.
    pub fn reset_accumulated_stats(&self, device: i32) -> Result<()> {
        if let Some(mut heap) = self.made_heap(device)? {
            heap.counters
                .reset_accumulated(&self.users[device as usize]);
        }
        Ok(())
    }

    /// Takes up to `max` of the logged segment events (device_stats.rs) of `device`, or of every
    /// device in turn with `None`, oldest first per device, as (device, event, heap base): none,
    /// without a lock, when no heap holds any.
    pub fn segment_events(
        &self,
        device: Option<i32>,
        max: usize,
    ) -> Result<Vec<(i32, SegmentEvent, u64)>> {
        if let Some(d) = device {
            self.check_device(d)?;
        }
        let mut out = Vec::new();
        if !device_stats::events_pending() {
            return Ok(out);
        }
        for d in device.map_or(0..self.device_count(), |d| d..d + 1) {
            if out.len() >= max {
                break;
            }
            if let Some(mut heap) = self.made_heap(d)? {
                let base = heap.base();
                let events = heap.counters.take_events(max - out.len());
                out.extend(events.into_iter().map(|e| (d, e, base)));
            }
        }
        Ok(out)
    }

    /// The device, request and allocation stream of the live block at `ptr` (PyTorch's lookup
    /// of a block by address, for a free's trace entry), without a walk.
    pub fn block_request(&self, ptr: u64) -> Result<(i32, u64, Stream)> {
        let Some(device) = self.device_by_address(ptr) else {
            return Err(Error::invalid(format!(
                "symm_block_request({ptr:#x}): pointer was not returned by symm_malloc"
            )));
        };
        let (requested, stream) = self.live_info(device, ptr)?;
        Ok((device, requested, stream))
    }

    /// Caps the bytes `device`'s heap holds in segments (0: no cap; device_heap `set_limit`).
    pub fn set_memory_limit(&self, device: i32, bytes: u64) -> Result<()> {
        self.heap(device)?.set_limit(bytes);
        Ok(())
    }

    /// The largest block a request to `device`'s default pool could get from the cache
    /// (PyTorch's `cacheInfo`, which cuDNN's benchmark mode reads to size its workspace). As a
    /// large request does first, this thread's kept large blocks go back to the free lists, merged
    /// with their neighbours.
    pub fn largest_free_block(&self, device: i32) -> Result<u64> {
        let Some(mut heap) = self.made_heap(device)? else {
            return Ok(0);
        };
        let mine = self.with_cache(device, |c| c.id);
        self.drain_where(
            &mut heap,
            device,
            |c| Some(c.id) == mine,
            |k| k.0 == DEFAULT_POOL && class_of(k.2) == Class::Large,
        )?;
        let most = heap.largest_free_block();
        heap.debug_validate();
        Ok(most)
    }

    /// The device whose heap holds `ptr`, without a lock (heaps already made only).
    pub fn device_by_address(&self, ptr: u64) -> Option<i32> {
        self.spans
            .iter()
            .position(|(b, e)| ptr >= b.load(Ordering::Acquire) && ptr < e.load(Ordering::Acquire))
            .map(|d| d as i32)
    }

    /// The current user's request and the allocation stream of the live block at `ptr`.
    fn live_info(&self, device: i32, ptr: u64) -> Result<(u64, Stream)> {
        if let Some(Some(info)) = self.with_cache(device, |c| c.lent_info(ptr)) {
            return Ok(info);
        }
        let heap = self.heap(device)?;
        if let Some(id) = heap.tracker(ptr) {
            let cache = self.registry().get(&id).cloned();
            if let Some(info) = cache.and_then(|c| c.lock().lent_info(ptr)) {
                return Ok(info);
            }
            return Err(Error::invalid(format!(
                "symm_free_block({ptr:#x}): double free or use after free: the block is \
                 already free"
            )));
        }
        heap.live_info(ptr)
    }

    /// Frees the block at `ptr` as it was allocated (its request, on its allocation stream):
    /// PyTorch's `raw_delete`, whose deleter knows only the address.
    pub fn free_block(&self, ptr: u64) -> Result<()> {
        let Some(device) = self.device_by_address(ptr) else {
            return Err(Error::invalid(format!(
                "symm_free_block({ptr:#x}): pointer was not returned by symm_malloc"
            )));
        };
        if let Some(Some((requested, stream))) = self.with_cache(device, |c| c.lent_info(ptr)) {
            return self.free(ptr, requested, device, stream);
        }
        // Lent by another thread's cache (autograd's thread frees what the forward allocated):
        // kept there, or taken back and freed, under one hold of the heap's lock.
        let mut heap = self.heap(device)?;
        if let Some((kept, requested)) = self.keep_remote(&mut heap, ptr, None, device)? {
            drop(heap);
            self.users[device as usize].free(kept, requested);
            return Ok(());
        }
        if heap.tracker(ptr).is_some() {
            // Still with a cache, but not lent: kept already.
            return Err(Error::invalid(format!(
                "symm_free_block({ptr:#x}): double free or use after free: the block is \
                 already free"
            )));
        }
        let (requested, stream) = heap.live_info(ptr)?;
        self.free_locked(heap, ptr, requested, device, stream)
    }

    /// The addresses of every block kept by `device`'s thread caches.
    fn kept(&self, device: i32) -> HashSet<u64> {
        let mut kept = HashSet::new();
        for c in self.caches_of(device) {
            kept.extend(c.lock().kept_ptrs());
        }
        kept
    }

    /// Every block of `device` (of `pool` when given), in address order, with the blocks that
    /// thread caches keep shown free to users (state 3).
    pub fn walk(&self, device: i32, pool: Option<PoolId>) -> Result<Vec<BlockView>> {
        let kept = self.kept(device);
        let Some(heap) = self.made_heap(device)? else {
            return Ok(Vec::new());
        };
        let mut blocks = heap.walk(pool);
        drop(heap);
        for b in &mut blocks {
            if b.state == 1 && kept.contains(&b.address) {
                b.state = 3;
                b.requested = 0;
            }
        }
        // A lent block's current user may have asked for another size than the heap recorded.
        for b in &mut blocks {
            if b.state == 1 {
                if let Ok((requested, _)) = self.live_info(device, b.address) {
                    b.requested = requested;
                }
            }
        }
        Ok(blocks)
    }

    /// The blocks users hold in `pool` on `device`.
    pub fn pool_live(&self, device: i32, pool: PoolId) -> Result<Vec<LiveBlock>> {
        Ok(self
            .walk(device, Some(pool))?
            .into_iter()
            .filter(|b| b.state == 1)
            .map(|b| (b.address, b.size, b.requested, b.stream))
            .collect())
    }

    /// Takes a use of `pool` without a route (PyTorch's `createOrIncrefPool`, a MemPool made).
    pub fn hold_pool(&self, device: i32, pool: PoolId) -> Result<()> {
        self.heap(device)?.hold_pool(pool);
        Ok(())
    }

    /// Uses of `pool` not given back (PyTorch's `getPoolUseCount`).
    pub fn pool_uses(&self, device: i32, pool: PoolId) -> Result<u64> {
        Ok(self.made_heap(device)?.map_or(0, |h| h.pool_uses(pool)))
    }

    /// At the end of a route into `pool` (a graph capture or a MemPool context ends): the
    /// pool's blocks that thread caches keep and that are parked go back to its best-fit sets,
    /// merged with their free neighbours. The pool's layout after a capture is then the one a
    /// checkpoint restore (`restore_pool`) rebuilds, and PyTorch's snapshot of the graph's pool
    /// shows its free memory as PyTorch's allocator does (one block per free run).
    pub fn settle_pool(&self, device: i32, pool: PoolId) -> Result<()> {
        let mut heap = self.heap(device)?;
        self.drain_caches(&mut heap, device, |k| k.0 == pool)?;
        heap.drain_parked_of(pool);
        heap.debug_validate();
        Ok(())
    }

    /// Puts `pool` back to a checkpoint (PyTorch's `setCheckpointPoolState`): every block users
    /// hold in it now is freed (their addresses are returned), then each block of `blocks`
    /// (taken by `pool_live` earlier) is live again at its address, size and stream.
    pub fn restore_pool(
        &self,
        device: i32,
        pool: PoolId,
        blocks: &[LiveBlock],
    ) -> Result<Vec<u64>> {
        let now = self.pool_live(device, pool)?;
        let mut freed = Vec::with_capacity(now.len());
        for &(ptr, _, requested, stream) in &now {
            self.free(ptr, requested, device, stream)?;
            freed.push(ptr);
        }
        let mut heap = self.heap(device)?;
        self.drain_caches(&mut heap, device, |k| k.0 == pool)?;
        heap.drain_parked_of(pool);
        let be = self.backend.as_ref();
        for &(ptr, size, requested, stream) in blocks {
            heap.take_at(be, ptr, size, requested, stream, pool)?;
            self.users[device as usize].alloc(size, requested);
        }
        heap.debug_validate();
        Ok(freed)
    }
}
