//! The allocator's side of the thread caches (tcache.rs holds a cache itself): finding the
//! calling thread's cache (thread-local, registered with its allocator on first use), the
//! registry of every cache, taking a lent block back before the heap frees it or records a
//! stream on it, keeping a block another thread frees in the cache that lent it, and the drains
//! that return kept blocks to the heap.
//!
//! Invariants (the module header of heap/mod.rs and tcache.rs): lock order heap, registry,
//! cache; a block lent to a cache is taken back from it under the heap's lock before the heap
//! frees it; a cache whose thread exited is marked orphaned and dropped once drained empty.

use super::backend::Stream;
use super::device_heap::DeviceHeap;
use super::spin_lock::SpinLock;
use super::tcache::{self, Reclaim, ThreadCache};
use super::{Allocator, Cache, NEXT_ID};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A thread's cache of one device of one allocator.
struct Mine {
    alloc: u64,
    device: i32,
    cache: Cache,
}

impl Drop for Mine {
    fn drop(&mut self) {
        self.cache.lock().orphan = true; // its blocks go back at the next drain
    }
}

thread_local! {
    static MINE: RefCell<Vec<Mine>> = const { RefCell::new(Vec::new()) };
}

impl Allocator {
    /// Runs `f` on the calling thread's cache of `device` (made and registered on first use);
    /// None when thread caches are off or the thread is exiting.
    pub(super) fn with_cache<R>(
        &self,
        device: i32,
        f: impl FnOnce(&mut ThreadCache) -> R,
    ) -> Option<R> {
        if !self.thread_caches {
            return None;
        }
        MINE.try_with(|mine| {
            let mut mine = mine.try_borrow_mut().ok()?;
            let at = match mine
                .iter()
                .position(|m| m.alloc == self.id && m.device == device)
            {
                Some(i) => i,
                None => {
                    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
                    let cache = Arc::new(SpinLock::new(ThreadCache::new(id, device)));
                    self.registry().insert(id, cache.clone());
                    mine.push(Mine {
                        alloc: self.id,
                        device,
                        cache,
                    });
                    mine.len() - 1
                }
            };
            let mut c = mine[at].cache.lock();
            Some(f(&mut c))
        })
        .ok()
        .flatten()
    }

    pub(super) fn registry(&self) -> std::sync::MutexGuard<'_, super::Registry> {
        self.caches.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The caches of `device` (orphans included).
    pub(super) fn caches_of(&self, device: i32) -> Vec<Cache> {
        self.registry()
            .values()
            .filter(|c| c.lock().device == device)
            .cloned()
            .collect()
    }

    /// Takes the block at `ptr` back from the cache it is lent to, if any, so that the heap may
    /// free it or record a stream on it. `what` names the caller for errors.
    pub(super) fn reclaim(&self, heap: &mut DeviceHeap, ptr: u64, what: &str) -> Result<()> {
        let Some(id) = heap.tracker(ptr) else {
            return Ok(());
        };
        let cache = self.registry().get(&id).cloned();
        let got = match &cache {
            Some(c) => c.lock().reclaim(ptr),
            None => Reclaim::Missing,
        };
        match got {
            Reclaim::Lent(requested) => heap.untrack(ptr, requested),
            Reclaim::Kept => Err(Error::invalid(format!(
                "{what}({ptr:#x}): double free or use after free: the block is already free"
            ))),
            Reclaim::Missing => Err(Error::internal(format!(
                "{what}({ptr:#x}): the block's thread cache {id} does not hold it"
            ))),
        }
    }

    /// A free from a thread other than the one whose cache lent the block (PyTorch's backward
    /// frees on autograd's thread what the forward allocated on the main thread): the lending
    /// cache keeps it for its own thread's next request, under the same rules as its own frees
    /// (whole, on the allocation stream, within the cache's bounds, no pool being released), so
    /// the next forward hits its cache instead of the heap; up to KEEP_REMOTE_BYTES kept in all
    /// (tcache.rs says why). Called with the heap's lock held
    /// (lock order: heap, registry, cache). `freed`: the (size, stream) the caller frees it
    /// with, or None for the block's own (`free_block`). (the kept block's size, the request
    /// freed), or None: the heap frees it (a block lent but not kept is taken back here).
    pub(crate) fn keep_remote(
        &self,
        heap: &mut DeviceHeap,
        ptr: u64,
        freed: Option<(u64, Stream)>,
        device: i32,
    ) -> Result<Option<(u64, u64)>> {
        let Some(id) = heap.tracker(ptr) else {
            return Ok(None);
        };
        let Some(cache) = self.registry().get(&id).cloned() else {
            return Ok(None);
        };
        let mut c = cache.lock();
        // Not lent (kept already: a double free; or missing): the caller's reclaim names it.
        let Some(info) = c.lent_info(ptr) else {
            return Ok(None);
        };
        let (size, stream) = freed.unwrap_or(info);
        // An orphan's thread is gone: nobody would take the block from there.
        if !c.orphan {
            let allowed = !self.releasing[device as usize].load(Ordering::Relaxed);
            if let Some(b) = c.keep_within(ptr, size, stream, allowed, tcache::KEEP_REMOTE_BYTES) {
                return Ok(Some((b, size)));
            }
        }
        // Not kept: taken back now, under the lock already held (one registry lookup, not two);
        // the caller's reclaim then finds it untracked and the heap frees it.
        if let tcache::Reclaim::Lent(requested) = c.reclaim(ptr) {
            drop(c);
            heap.untrack(ptr, requested)?;
        }
        Ok(None)
    }

    /// Returns the kept blocks of `device`'s caches that `which` selects to the heap (the heap's
    /// frees them as if freed there: small ones parked, large ones merged); drops orphaned
    /// caches left empty.
    pub(super) fn drain_caches(
        &self,
        heap: &mut DeviceHeap,
        device: i32,
        which: impl Fn(&tcache::Key) -> bool,
    ) -> Result<()> {
        self.drain_where(heap, device, |_| true, which)
    }

    /// As `drain_caches`, for the caches `whose` selects, all their kept blocks.
    pub(super) fn drain_caches_of(
        &self,
        heap: &mut DeviceHeap,
        device: i32,
        whose: impl Fn(&ThreadCache) -> bool,
    ) -> Result<usize> {
        self.drain_where_counted(heap, device, whose, |_| true)
    }

    /// As `drain_caches`, for the calling thread's own cache only: reached through its
    /// thread-local handle, not the registry (a large request's miss does this each time:
    /// walking the registry cost as much as the rest of the miss).
    pub(super) fn drain_own(
        &self,
        heap: &mut DeviceHeap,
        device: i32,
        which: impl Fn(&tcache::Key) -> bool,
    ) -> Result<()> {
        let back = self
            .with_cache(device, |c| c.drain(&which))
            .unwrap_or_default();
        self.give_back(heap, back)
    }

    /// Blocks drained from caches, back to the heap (freed as if freed there: small ones
    /// parked, large ones merged).
    fn give_back(&self, heap: &mut DeviceHeap, back: Vec<tcache::Kept>) -> Result<()> {
        for k in back {
            heap.untrack(k.ptr, k.recorded)?;
            heap.free(self.backend.as_ref(), k.ptr, k.recorded, k.key.1)?;
        }
        Ok(())
    }

    pub(super) fn drain_where(
        &self,
        heap: &mut DeviceHeap,
        device: i32,
        whose: impl Fn(&ThreadCache) -> bool,
        which: impl Fn(&tcache::Key) -> bool,
    ) -> Result<()> {
        self.drain_where_counted(heap, device, whose, which)
            .map(|_| ())
    }

    /// As `drain_where`; returns how many blocks went back to the heap.
    fn drain_where_counted(
        &self,
        heap: &mut DeviceHeap,
        device: i32,
        whose: impl Fn(&ThreadCache) -> bool,
        which: impl Fn(&tcache::Key) -> bool,
    ) -> Result<usize> {
        if !self.thread_caches {
            return Ok(0);
        }
        let mut reg = self.registry();
        let mut back = Vec::new();
        reg.retain(|_, c| {
            let mut c = c.lock();
            if c.device == device && whose(&c) {
                back.extend(c.drain(&which));
            }
            !(c.orphan && c.is_empty())
        });
        drop(reg);
        let n = back.len();
        self.give_back(heap, back).map(|()| n)
    }
}
