//! The symmetric caching allocator: one `DeviceHeap` per device behind a spin lock, with a
//! cache per thread in front of it (`tcache.rs`; found, taken back from and drained in
//! `caches.rs`), over one backend chosen at first use
//! (`SYMMALLOC_BACKEND`). Pure Rust above the `Backend` trait.
//!
//! The process-wide instance (`global()`) serves the C ABI; tests may build private instances
//! over the host backend with `Allocator::new`.
//!
//! Invariants: a block lent to a thread cache is taken back from it (under the heap's lock)
//! before the heap frees it or records a stream on it; statistics are the heap's corrected by
//! every cache of the device; `validate` checks the heap and that heap and caches agree on
//! every lent block.

mod addr_map;
pub mod backend;
mod caches;
pub mod comm_view;
pub mod cuda_backend;
pub mod device_heap;
pub mod device_stats;
pub mod host_backend;
mod introspect;
pub mod parked;
pub mod policy;
pub mod pools;
pub mod ranges;
pub mod release_log;
pub mod size_class;
pub mod spin_lock;
pub mod stats;
pub mod tcache;

use crate::config::{self, BackendKind};
use crate::error::{Error, Result};
use backend::{Backend, Stream};
use device_heap::{DeviceHeap, SegmentInfo};
use device_stats::UserCounters;
use pools::PoolId;
use spin_lock::{SpinGuard, SpinLock};
use stats::Stats;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tcache::ThreadCache;

type Cache = Arc<SpinLock<ThreadCache>>;

/// The thread caches by id (caches.rs), behind the allocator's registry lock; ids are small
/// sequential integers, hashed with the parked blocks' integer hash rather than SipHash (a
/// remote free and a large request's drain each look one up).
pub(crate) type Registry =
    std::collections::HashMap<u64, Cache, std::hash::BuildHasherDefault<parked::IntHasher>>;

pub struct Allocator {
    backend: Box<dyn Backend>,
    heaps: Vec<OnceLock<SpinLock<DeviceHeap>>>,
    /// Serialises heap creation (reserving address space) per device, and holds, per device
    /// whose heap is not made yet, the peers granted access to it (`grant_peer_access`), which
    /// the heap takes when it is made.
    init_lock: Mutex<Vec<Vec<i32>>>,
    /// Tells this allocator's thread caches from another instance's (tests build several).
    id: u64,
    /// `SYMMALLOC_THREAD_CACHE`: whether threads cache blocks at all.
    thread_caches: bool,
    /// Every thread cache of this allocator, by id.
    caches: Mutex<Registry>,
    /// Per device: a pool is being released, so frees go to the heap (its segments go back at
    /// their last free).
    releasing: Vec<AtomicBool>,
    /// Per device: what users hold (device_stats.rs), counted on every handed-out and
    /// given-back block.
    users: Vec<UserCounters>,
    /// Per device: the heap's address range [base, end), set once when the heap is made (0, 0
    /// before), so a free by address finds its device without a lock.
    spans: Vec<(AtomicU64, AtomicU64)>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

static GLOBAL: OnceLock<std::result::Result<Allocator, Error>> = OnceLock::new();

/// The process's allocator, created on first use with the backend `SYMMALLOC_BACKEND` names.
pub fn global() -> Result<&'static Allocator> {
    GLOBAL
        .get_or_init(|| {
            config::debug_level()?; // an unknown SYMMALLOC_DEBUG fails here, named
            let backend: Box<dyn Backend> = match config::backend_kind()? {
                BackendKind::Cuda => Box::new(cuda_backend::CudaBackend::new()?),
                BackendKind::Host => Box::new(host_backend::HostBackend),
            };
            Allocator::new(backend)
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Allocator {
    pub fn new(backend: Box<dyn Backend>) -> Result<Self> {
        let n = backend.device_count()?;
        Ok(Allocator {
            backend,
            heaps: (0..n).map(|_| OnceLock::new()).collect(),
            init_lock: Mutex::new(vec![Vec::new(); n as usize]),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            thread_caches: config::thread_cache()?,
            caches: Mutex::new(Default::default()),
            releasing: (0..n).map(|_| AtomicBool::new(false)).collect(),
            users: (0..n).map(|_| UserCounters::default()).collect(),
            spans: (0..n)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
        })
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn device_count(&self) -> i32 {
        self.heaps.len() as i32
    }

    pub fn check_device(&self, device: i32) -> Result<()> {
        if device < 0 || device >= self.device_count() {
            return Err(Error::invalid(format!(
                "device {device} does not exist; expected 0..{} ({} backend)",
                self.device_count(),
                self.backend.name()
            )));
        }
        Ok(())
    }

    /// The device's heap, locked; created (address space reserved) on first use.
    pub fn heap(&self, device: i32) -> Result<SpinGuard<'_, DeviceHeap>> {
        self.check_device(device)?;
        let slot = &self.heaps[device as usize];
        if slot.get().is_none() {
            let mut pending = self.init_lock.lock().unwrap_or_else(|p| p.into_inner());
            if slot.get().is_none() {
                let size = match config::heap_size()? {
                    Some(s) => s,
                    None => self.backend.default_heap_size(device)?,
                };
                if size == 0 {
                    return Err(Error::invalid(
                        "SYMMALLOC_HEAP_SIZE=0; expected a positive size",
                    ));
                }
                let mut heap = DeviceHeap::new(self.backend.as_ref(), device, size)?;
                heap.adopt_peers(&std::mem::take(&mut pending[device as usize]));
                let span = &self.spans[device as usize];
                span.0.store(heap.base(), Ordering::Release);
                span.1.store(heap.base() + heap.size(), Ordering::Release);
                crate::info!(
                    "device {device}: {} backend, symmetric heap of {size} bytes at {:#x}",
                    self.backend.name(),
                    heap.base()
                );
                let _ = slot.set(SpinLock::new(heap));
            }
        }
        Ok(slot.get().expect("initialised above").lock())
    }

    /// The count of ended holds of `device`'s heap lock (spin_lock.rs, `releases`), made with
    /// the heap: a reader that finds it unchanged since one of its own holds knows the heap is
    /// as it left it (comm's placement cache).
    pub fn heap_releases(&self, device: i32) -> Result<&AtomicU64> {
        drop(self.heap(device)?);
        Ok(self.heaps[device as usize]
            .get()
            .expect("made by heap() above")
            .releases())
    }

    /// Grants `peer` read/write access to every segment of `device`'s heap, present and future
    /// (device_heap/peers.rs), as PyTorch's `enablePeerAccess(peer, device)` does for its
    /// segments. Idempotent; `device == peer` needs nothing. A heap not made yet is not made
    /// here: the grant waits for it (no address space and no context on a device the process
    /// does not use). On error nothing changes for any allocation.
    pub fn grant_peer_access(&self, device: i32, peer: i32) -> Result<()> {
        let n = self.device_count();
        for (what, d) in [("device", device), ("peer", peer)] {
            if !(0..n).contains(&d) {
                return Err(Error::invalid(format!(
                    "{what} {d} does not exist; expected 0..{n} ({} backend)",
                    self.backend.name()
                )));
            }
        }
        if device == peer {
            return Ok(());
        }
        self.backend.check_peer(device, peer)?;
        let slot = &self.heaps[device as usize];
        if slot.get().is_none() {
            let mut pending = self.init_lock.lock().unwrap_or_else(|p| p.into_inner());
            if slot.get().is_none() {
                let p = &mut pending[device as usize];
                if !p.contains(&peer) {
                    p.push(peer);
                }
                return Ok(());
            }
        }
        let mut heap = slot.get().expect("checked above").lock();
        let r = heap.grant_peer(self.backend.as_ref(), peer);
        heap.debug_validate();
        r
    }

    /// The peers granted access to `device`'s heap, in the order granted, whether the heap is
    /// made or not (none is made here).
    pub fn peers_of(&self, device: i32) -> Result<Vec<i32>> {
        self.check_device(device)?;
        if let Some(h) = self.heaps[device as usize].get() {
            return Ok(h.lock().peers().to_vec());
        }
        let pending = self.init_lock.lock().unwrap_or_else(|p| p.into_inner());
        match self.heaps[device as usize].get() {
            Some(h) => Ok(h.lock().peers().to_vec()),
            None => Ok(pending[device as usize].clone()),
        }
    }

    /// Whether `device`'s heap has been made (address space reserved).
    pub fn has_heap(&self, device: i32) -> bool {
        self.heaps
            .get(device as usize)
            .is_some_and(|h| h.get().is_some())
    }

    /// The device whose heap contains `ptr`, among heaps already created.
    pub fn device_of(&self, ptr: u64) -> Option<i32> {
        self.heaps
            .iter()
            .enumerate()
            .find_map(|(d, h)| h.get()?.lock().contains(ptr).then_some(d as i32))
    }

    /// Allocates into the calling thread's current pool for `device`.
    pub fn malloc(&self, size: u64, device: i32, stream: Stream) -> Result<u64> {
        self.malloc_in(size, device, stream, pools::current(device, stream))
    }

    pub fn malloc_in(&self, size: u64, device: i32, stream: Stream, pool: PoolId) -> Result<u64> {
        let r = self.malloc_cached(size, device, stream, pool);
        if let Err(e) = &r {
            if e.status == crate::error::Status::ErrOutOfMemory {
                // Once per request that failed, as PyTorch counts `num_ooms`.
                if let Ok(mut h) = self.heap(device) {
                    h.counters.num_ooms += 1;
                }
            }
        }
        r
    }

    /// `malloc_in` through the thread caches: a hit there, or the heap's growth ladder
    /// (device_heap/placement.rs, `place`) with the caches' rungs.
    fn malloc_cached(&self, size: u64, device: i32, stream: Stream, pool: PoolId) -> Result<u64> {
        if pools::arena_of(pool).is_some() {
            // A communicator arena's blocks never pass through the thread caches: a cache's
            // drains follow other pools' traffic, which differs between ranks
            // (device_heap/arena.rs).
            let mut heap = self.heap(device)?;
            let r = heap.malloc(self.backend.as_ref(), size, stream, pool, None);
            if let Ok(p) = r {
                self.count_alloc(&heap, device, p, size);
            }
            self.releasing[device as usize].store(heap.releasing_any(), Ordering::Relaxed);
            heap.debug_validate();
            return r;
        }
        let Some(rounded) = size
            .div_ceil(device_heap::ROUND)
            .max(1)
            .checked_mul(device_heap::ROUND)
        else {
            // Larger than any heap: the heap names the size.
            let mut heap = self.heap(device)?;
            return heap.malloc(self.backend.as_ref(), size, stream, pool, None);
        };
        let key = (pool, stream, rounded);
        if let Some(Some((p, bsize))) = self.with_cache(device, |c| c.take_sized(key, size)) {
            self.users[device as usize].alloc(bsize, size);
            return Ok(p);
        }
        let mut heap = self.heap(device)?;
        let mine = self.with_cache(device, |c| c.id); // this thread's cache, if caches are on
        let is_mine = |c: &ThreadCache| Some(c.id) == mine;
        if device_heap::class_of(key.2) == device_heap::Class::Large {
            // Large sizes vary (sequence lengths, packing): best fit gets this thread's kept
            // large blocks of the pool, merged, rather than fresh memory.
            let large = |k: &tcache::Key| {
                k.0 == pool && device_heap::class_of(k.2) == device_heap::Class::Large
            };
            self.drain_own(&mut heap, device, large)?;
        }
        // The ladder (device_heap/placement.rs, `place`) takes cached blocks back at its two
        // rungs for them: this thread's (and exited threads') before new memory, every
        // thread's when out of memory.
        let mut reclaim = |heap: &mut DeviceHeap, step: device_heap::Reclaim| match step {
            device_heap::Reclaim::OwnCaches => {
                self.drain_caches_of(heap, device, |c| is_mine(c) || c.orphan)
            }
            device_heap::Reclaim::AllCaches => {
                self.drain_caches(heap, device, |_| true).map(|()| 0)
            }
        };
        let r = heap.malloc(
            self.backend.as_ref(),
            size,
            stream,
            pool,
            Some(&mut reclaim),
        );
        let r = r.and_then(|p| {
            if let Some(id) = mine {
                let bsize = heap.track(p, id)?;
                self.with_cache(device, |c| c.lend(p, key, bsize, size));
            }
            self.count_alloc(&heap, device, p, size);
            Ok(p)
        });
        self.releasing[device as usize].store(heap.releasing_any(), Ordering::Relaxed);
        heap.debug_validate();
        r
    }

    pub fn free(&self, ptr: u64, size: u64, device: i32, stream: Stream) -> Result<()> {
        if device >= 0 && (device as usize) < self.releasing.len() {
            let allowed = !self.releasing[device as usize].load(Ordering::Relaxed);
            if let Some(Some(bsize)) =
                self.with_cache(device, |c| c.keep_sized(ptr, size, stream, allowed))
            {
                self.users[device as usize].free(bsize, size);
                return Ok(());
            }
        }
        let heap = self.heap(device)?;
        self.free_locked(heap, ptr, size, device, stream)
    }

    /// `free` past the calling thread's own cache, under `heap` (the device's lock).
    pub(crate) fn free_locked(
        &self,
        mut heap: SpinGuard<'_, DeviceHeap>,
        ptr: u64,
        size: u64,
        device: i32,
        stream: Stream,
    ) -> Result<()> {
        if !heap.contains(ptr) {
            drop(heap); // device_of locks every heap, this one included
            let owner = self.device_of(ptr);
            return Err(Error::invalid(match owner {
                Some(d) => format!(
                    "symm_free({ptr:#x}, device={device}): the pointer belongs to device {d}"
                ),
                None => format!("symm_free({ptr:#x}): pointer was not returned by symm_malloc"),
            }));
        }
        let bsize = heap.block_size(ptr);
        if let Some((kept, _)) = self.keep_remote(&mut heap, ptr, Some((size, stream)), device)? {
            self.users[device as usize].free(kept, size);
            return Ok(());
        }
        let r = self
            .reclaim(&mut heap, ptr, "symm_free")
            .and_then(|()| heap.free(self.backend.as_ref(), ptr, size, stream));
        if let (Ok(()), Some(bsize)) = (&r, bsize) {
            self.users[device as usize].free(bsize, size);
        }
        self.releasing[device as usize].store(heap.releasing_any(), Ordering::Relaxed);
        heap.debug_validate();
        r
    }

    pub fn record_stream(&self, ptr: u64, stream: Stream) -> Result<()> {
        let device = self.device_of(ptr).ok_or_else(|| {
            Error::invalid(format!(
                "symm_record_stream({ptr:#x}): pointer was not returned by symm_malloc"
            ))
        })?;
        let mut heap = self.heap(device)?;
        let r = self
            .reclaim(&mut heap, ptr, "symm_record_stream")
            .and_then(|()| heap.record_stream(ptr, stream));
        heap.debug_validate();
        r
    }

    pub fn empty_cache(&self) -> Result<()> {
        for (d, h) in self.heaps.iter().enumerate() {
            let Some(h) = h.get() else { continue };
            let mut heap = h.lock();
            let r = self
                .drain_caches(&mut heap, d as i32, |_| true)
                .and_then(|()| heap.empty_cache(self.backend.as_ref()));
            heap.debug_validate();
            r?;
        }
        Ok(())
    }

    /// Opens a route to `pool` on `device` (pools.rs): the calling thread's allocations, or with
    /// `filter` those of any thread whose stream it accepts. Each route takes a use of the pool
    /// that `release_pool` gives back (PyTorch begins a pool at every capture into it and
    /// releases it once per graph deleted).
    pub fn begin_pool(
        &self,
        device: i32,
        pool: PoolId,
        filter: Option<pools::Filter>,
    ) -> Result<()> {
        let mut heap = self.heap(device)?;
        match filter {
            None => pools::begin(device, pool)?,
            Some(f) => pools::begin_filtered(device, pool, f)?,
        }
        heap.hold_pool(pool);
        Ok(())
    }

    /// Gives back one use of `pool` (`begin_pool`); at the last (or for a pool never begun) its
    /// memory goes: free segments now, the others at their last free.
    pub fn release_pool(&self, device: i32, pool: PoolId) -> Result<()> {
        self.check_device(device)?;
        if !self.has_heap(device) {
            return Ok(()); // nothing was ever allocated there: no pool to release
        }
        let mut heap = self.heap(device)?;
        if !heap.unhold_pool(pool) {
            return Ok(()); // other graphs still replay into it
        }
        let r = self
            .drain_caches(&mut heap, device, |k| k.0 == pool)
            .and_then(|()| heap.release_pool(self.backend.as_ref(), pool));
        self.releasing[device as usize].store(heap.releasing_any(), Ordering::Relaxed);
        heap.debug_validate();
        r
    }

    /// Gives communicator arena `id` of `device` back (device_heap/arena.rs, `release_arena`).
    pub fn release_arena(&self, device: i32, id: u64) -> Result<()> {
        let mut heap = self.heap(device)?;
        let r = heap.release_arena(self.backend.as_ref(), id);
        self.releasing[device as usize].store(heap.releasing_any(), Ordering::Relaxed);
        heap.debug_validate();
        r
    }

    /// The device's statistics: the heap's, with the blocks threads keep counted as free.
    /// (`peak_allocated_bytes` is the heap's: it counts kept blocks as allocated, at most
    /// `tcache::KEEP_BYTES` per thread.)
    /// A device whose heap was never made reads as an empty heap: a read never makes a heap (nor,
    /// on the CUDA backend, a context).
    pub fn stats(&self, device: i32) -> Result<Stats> {
        self.check_device(device)?;
        if !self.has_heap(device) {
            return Ok(Stats::default());
        }
        let heap = self.heap(device)?;
        let mut s = heap.stats;
        for c in self.caches_of(device) {
            c.lock().adjust(&mut s);
        }
        Ok(s)
    }

    pub(crate) fn count_alloc(&self, heap: &DeviceHeap, device: i32, ptr: u64, size: u64) {
        let bsize = heap.block_size(ptr).unwrap_or(size);
        self.users[device as usize].alloc(bsize, size);
    }

    pub fn segment_of(&self, device: i32, ptr: u64) -> Result<(Vec<SegmentInfo>, u64, u64)> {
        self.heap(device)?.segment_of(ptr)
    }

    /// The segment of `device`'s heap that holds `ptr`: (offset, size, number of chunks).
    pub fn segment_span(&self, device: i32, ptr: u64) -> Result<Option<(u64, u64, usize)>> {
        Ok(self.heap(device)?.segment_span(ptr))
    }

    /// Checks the heap's invariants, every cache's, and that they agree on every lent block.
    pub fn validate(&self, device: i32) -> std::result::Result<(), String> {
        let heap = self.heap(device).map_err(|e| e.message)?;
        heap.validate()?;
        let mut lent: std::collections::HashMap<u64, (u64, u64, u64)> = heap
            .tracked_blocks()
            .into_iter()
            .map(|(p, id, size, rec)| (p, (id, size, rec)))
            .collect();
        for c in self.caches_of(device) {
            let c = c.lock();
            c.validate()?;
            for (p, size, rec) in c.blocks() {
                match lent.remove(&p) {
                    Some(h) if h == (c.id, size, rec) => {}
                    h => {
                        return Err(format!(
                            "thread cache {} holds {p:#x} ({size} bytes, request {rec}); the heap \
                             has {h:?}",
                            c.id
                        ))
                    }
                }
            }
        }
        if let Some((p, h)) = lent.iter().next() {
            return Err(format!(
                "block {p:#x} is lent to thread cache {} ({h:?}), which does not hold it",
                h.0
            ));
        }
        Ok(())
    }
}
