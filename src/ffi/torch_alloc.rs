//! The C ABI of PyTorch's allocator interface beyond malloc and free, for the C++ allocator of
//! python/symmalloc/csrc (and any framework with the same needs): PyTorch's statistics and
//! their resets, a memory cap, the largest cached block, an allocation that reports its status
//! (so out of memory is told from a bad argument), a free by address alone, the blocks of a
//! snapshot, pool uses, a pool put back to a checkpoint, a live block's request by address, and
//! the segment events of a memory history (PyTorch's SEGMENT_ALLOC, SEGMENT_MAP, SEGMENT_FREE).
//! Heap semantics:
//! heap/introspect.rs, heap/device_stats.rs, heap/device_heap/inspect.rs.
//!
//! Each entry point checks its arguments, runs inside the panic guard and reports failure as a
//! status plus `symm_last_error()`; a failed call changes no allocation.

// Entry points are called from C with raw pointers; see mod.rs.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::guard::guard_status;
use super::types::*;
use crate::error::{Error, Result};
use crate::heap::device_heap::BlockView;
use crate::heap::device_stats::{self, DeviceStats, SegmentEvent};
use crate::heap::{self, pools::PoolId};
use std::ffi::{c_int, c_void};

/// Bytes of the first `symm_device_stats_t` (PyTorch 2.11's `DeviceStats`): the least that
/// `symm_device_stats` serves.
pub const SYMM_DEVICE_STATS_V1_SIZE: usize = 976;

/// One block of a heap, as `symm_heap_blocks` lists it and `symm_pool_restore` takes it back.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct symm_block_info_t {
    pub address: u64,
    pub size: u64,
    /// What the current user asked for (live blocks; 0 otherwise).
    pub requested: u64,
    pub segment_address: u64,
    pub segment_size: u64,
    pub pool_first: u64,
    pub pool_second: u64,
    /// The stream of the last allocation or free (`UINT64_MAX`: never used).
    pub stream: u64,
    /// `SYMM_BLOCK_*`.
    pub state: u32,
    /// 1 for a block of a large segment (requests over 1 MiB), 0 for a small one.
    pub is_large: u32,
}

/// Free and listed for reuse.
pub const SYMM_BLOCK_FREE: u32 = 0;
/// Held by a user.
pub const SYMM_BLOCK_LIVE: u32 = 1;
/// Free, kept whole for the next request of its size on its stream.
pub const SYMM_BLOCK_PARKED: u32 = 2;
/// Free, kept by a thread's cache for that thread's next request of its size.
pub const SYMM_BLOCK_KEPT: u32 = 3;

fn info_of(b: &BlockView) -> symm_block_info_t {
    symm_block_info_t {
        address: b.address,
        size: b.size,
        requested: b.requested,
        segment_address: b.segment_address,
        segment_size: b.segment_size,
        pool_first: b.pool.0,
        pool_second: b.pool.1,
        stream: b.stream,
        state: b.state,
        is_large: b.is_large as u32,
    }
}

fn out_ref<'a, T>(p: *mut T, name: &str, what: &str) -> Result<&'a mut T> {
    if p.is_null() {
        return Err(Error::invalid(format!("{name}: {what} is NULL")));
    }
    // SAFETY: non-NULL; the caller passes a valid, writable, aligned T (the C contract).
    Ok(unsafe { &mut *p })
}

/// Fills the first `size` bytes of `*out` with PyTorch's statistics of `device` (the layout of
/// `c10::CachingDeviceAllocator::DeviceStats`; pass `sizeof(symm_device_stats_t)`), read from
/// the heap's counters without a walk over blocks. A size below the v1 struct, not a multiple
/// of 8, or larger than this library's struct is refused and nothing is written.
#[no_mangle]
pub extern "C" fn symm_device_stats(
    device: c_int,
    out: *mut DeviceStats,
    size: usize,
) -> symm_status_t {
    guard_status!("symm_device_stats", || {
        let have = std::mem::size_of::<DeviceStats>();
        if size < SYMM_DEVICE_STATS_V1_SIZE || size > have || size % 8 != 0 {
            return Err(Error::invalid(format!(
                "symm_device_stats: size {size} is not a symm_device_stats_t size this library \
                 serves; expected a multiple of 8 from {SYMM_DEVICE_STATS_V1_SIZE} to {have}"
            )));
        }
        let out = out_ref(out, "symm_device_stats", "out")?;
        let s = heap::global()?.device_stats(device)?;
        // SAFETY: `out` is valid for `size` bytes (at most sizeof(DeviceStats), checked above);
        // the source is a live DeviceStats; the regions are distinct.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &s as *const DeviceStats as *const u8,
                out as *mut DeviceStats as *mut u8,
                size,
            )
        };
        Ok(())
    })
}

/// Sets every peak of `device`'s statistics to its current value (PyTorch's
/// `reset_peak_memory_stats`; `symm_memory_stats`'s `peak_allocated_bytes` too).
#[no_mangle]
pub extern "C" fn symm_reset_peak_stats(device: c_int) -> symm_status_t {
    guard_status!("symm_reset_peak_stats", || {
        heap::global()?.reset_peak_stats(device)
    })
}

/// Starts `device`'s accumulated statistics (allocated and freed totals, retries, out of
/// memory failures, device allocations) again from zero (PyTorch's
/// `reset_accumulated_memory_stats`).
#[no_mangle]
pub extern "C" fn symm_reset_accumulated_stats(device: c_int) -> symm_status_t {
    guard_status!("symm_reset_accumulated_stats", || {
        heap::global()?.reset_accumulated_stats(device)
    })
}

/// Caps the bytes `device`'s heap holds in segments at `bytes` (0 removes the cap): a request
/// that would need more fails with SYMM_ERR_OUT_OF_MEMORY once the cache has been emptied.
/// Memory held already stays. PyTorch's `set_per_process_memory_fraction` sets it to the
/// fraction of the device's memory.
#[no_mangle]
pub extern "C" fn symm_set_memory_limit(device: c_int, bytes: u64) -> symm_status_t {
    guard_status!("symm_set_memory_limit", || {
        heap::global()?.set_memory_limit(device, bytes)
    })
}

/// The largest free block cached for the default pool of `device`, in `*largest` (PyTorch's
/// `cacheInfo`, which cuDNN's benchmark mode reads to size its workspace).
#[no_mangle]
pub extern "C" fn symm_cache_info(device: c_int, largest: *mut u64) -> symm_status_t {
    guard_status!("symm_cache_info", || {
        let largest = out_ref(largest, "symm_cache_info", "largest")?;
        *largest = heap::global()?.largest_free_block(device)?;
        Ok(())
    })
}

/// As `symm_malloc`, with a status: SYMM_ERR_OUT_OF_MEMORY when the device (or the cap of
/// `symm_set_memory_limit`, or the heap's size) has no room after the cache was emptied, so a
/// caller can raise its out-of-memory error; `*out` is NULL on failure and for size 0.
#[no_mangle]
pub extern "C" fn symm_malloc_checked(
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
    out: *mut *mut c_void,
) -> symm_status_t {
    guard_status!("symm_malloc_checked", || {
        let out = out_ref(out, "symm_malloc_checked", "out")?;
        *out = std::ptr::null_mut();
        if size == 0 {
            return Ok(());
        }
        *out = heap::global()?.malloc(size as u64, device, stream as u64)? as *mut c_void;
        Ok(())
    })
}

/// Frees the block at `ptr` as it was allocated (its size, on its allocation stream): for
/// callers that keep only the address, as PyTorch's `raw_delete` does. NULL does nothing.
#[no_mangle]
pub extern "C" fn symm_free_block(ptr: *mut c_void) -> symm_status_t {
    guard_status!("symm_free_block", || {
        if ptr.is_null() {
            return Ok(());
        }
        heap::global()?.free_block(ptr as u64)
    })
}

/// Lists the blocks of `device` in address order, segment by segment: all pools when
/// `all_pools` is nonzero, else pool (first, second) only. Writes at most `capacity` entries to
/// `out` (which may be NULL when `capacity` is 0) and the number of blocks there are to
/// `*count`; call again with a larger array when `*count > capacity`.
#[no_mangle]
pub extern "C" fn symm_heap_blocks(
    device: c_int,
    all_pools: c_int,
    pool_first: u64,
    pool_second: u64,
    out: *mut symm_block_info_t,
    capacity: usize,
    count: *mut usize,
) -> symm_status_t {
    guard_status!("symm_heap_blocks", || {
        let count = out_ref(count, "symm_heap_blocks", "count")?;
        if out.is_null() && capacity > 0 {
            return Err(Error::invalid(format!(
                "symm_heap_blocks: out is NULL with capacity {capacity}; expected an array of \
                 that many symm_block_info_t"
            )));
        }
        let pool = (all_pools == 0).then_some(PoolId(pool_first, pool_second));
        let blocks = heap::global()?.walk(device, pool)?;
        *count = blocks.len();
        for (i, b) in blocks.iter().take(capacity).enumerate() {
            // SAFETY: out holds `capacity` entries (the caller's contract), i < capacity.
            unsafe { *out.add(i) = info_of(b) };
        }
        Ok(())
    })
}

/// Takes a use of pool (first, second) on `device` without routing allocations to it (a
/// `torch.cuda.MemPool` made); `symm_release_pool` gives it back.
#[no_mangle]
pub extern "C" fn symm_pool_hold(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
) -> symm_status_t {
    guard_status!("symm_pool_hold", || {
        let id = PoolId(pool_first, pool_second);
        if heap::pools::is_reserved(id) {
            return Err(Error::invalid(format!(
                "symm_pool_hold: pool ({pool_first}, {pool_second}) is symmalloc's own"
            )));
        }
        heap::global()?.hold_pool(device, id)
    })
}

/// The uses of pool (first, second) on `device` not given back, in `*uses`.
#[no_mangle]
pub extern "C" fn symm_pool_uses(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    uses: *mut u64,
) -> symm_status_t {
    guard_status!("symm_pool_uses", || {
        let uses = out_ref(uses, "symm_pool_uses", "uses")?;
        *uses = heap::global()?.pool_uses(device, PoolId(pool_first, pool_second))?;
        Ok(())
    })
}

/// Puts pool (first, second) of `device` back to a checkpoint: every block users hold in it is
/// freed (list them first with `symm_heap_blocks`), then each of the `n` blocks (live blocks
/// that `symm_heap_blocks` listed when the checkpoint was taken) is live again at its address,
/// size, request and stream. A block whose memory is no longer free memory of the pool fails
/// with SYMM_ERR_INVALID_ARGUMENT, naming it (blocks before it stay live).
#[no_mangle]
pub extern "C" fn symm_pool_restore(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    blocks: *const symm_block_info_t,
    n: usize,
) -> symm_status_t {
    guard_status!("symm_pool_restore", || {
        if blocks.is_null() && n > 0 {
            return Err(Error::invalid(format!(
                "symm_pool_restore: blocks is NULL with n {n}"
            )));
        }
        let list: Vec<_> = (0..n)
            .map(|i| {
                // SAFETY: `blocks` holds `n` entries (the caller's contract), i < n.
                let b = unsafe { *blocks.add(i) };
                (b.address, b.size, b.requested, b.stream)
            })
            .collect();
        heap::global()?
            .restore_pool(device, PoolId(pool_first, pool_second), &list)
            .map(|_| ())
    })
}

/// A segment event (`symm_segment_events`): what happened to a segment, with absolute addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct symm_segment_event_t {
    /// `SYMM_SEGMENT_*`.
    pub kind: u32,
    /// The device whose heap it happened in.
    pub device: c_int,
    /// The segment's address (MADE, FREED), or of the range mapped (MAPPED).
    pub address: u64,
    /// The segment's bytes (MADE; FREED: all of them, grown chunks too), or the range's
    /// (MAPPED); for LOST, how many events were dropped before the next one.
    pub size: u64,
    /// The address of the segment the event belongs to (0 for LOST).
    pub segment_address: u64,
    pub pool_first: u64,
    pub pool_second: u64,
}

/// Events were dropped (the log was full); `size` counts them.
pub const SYMM_SEGMENT_LOST: u32 = 0;
/// A new segment was mapped.
pub const SYMM_SEGMENT_MADE: u32 = 1;
/// A segment grew in place: a range mapped right after it.
pub const SYMM_SEGMENT_MAPPED: u32 = 2;
/// A segment was given back whole.
pub const SYMM_SEGMENT_FREED: u32 = 3;

fn event_of(device: c_int, e: SegmentEvent, base: u64) -> symm_segment_event_t {
    let (kind, address, size, segment, pool) = match e {
        SegmentEvent::Made { offset, size, pool } => {
            (SYMM_SEGMENT_MADE, base + offset, size, base + offset, pool)
        }
        SegmentEvent::Grown {
            segment,
            offset,
            size,
            pool,
        } => (
            SYMM_SEGMENT_MAPPED,
            base + offset,
            size,
            base + segment,
            pool,
        ),
        SegmentEvent::Freed { offset, size, pool } => {
            (SYMM_SEGMENT_FREED, base + offset, size, base + offset, pool)
        }
        SegmentEvent::Lost { count } => (SYMM_SEGMENT_LOST, 0, count, 0, PoolId(0, 0)),
    };
    symm_segment_event_t {
        kind,
        device,
        address,
        size,
        segment_address: segment,
        pool_first: pool.0,
        pool_second: pool.1,
    }
}

/// Logs every segment made, grown in place or given back, on every device, from now (`on`
/// nonzero) or stops (events logged already stay until taken). For a memory history (PyTorch's
/// `_record_memory_history`, trace trackers): `symm_segment_events` takes them.
#[no_mangle]
pub extern "C" fn symm_segment_log(on: c_int) -> symm_status_t {
    guard_status!("symm_segment_log", || {
        device_stats::set_segment_log(on != 0);
        Ok(())
    })
}

/// Takes up to `capacity` of `device`'s logged segment events (every device's with -1), oldest
/// first (per device), into `out`, and their number into `*count` (call again while it equals
/// `capacity`). A device without a heap has none (none is made).
#[no_mangle]
pub extern "C" fn symm_segment_events(
    device: c_int,
    out: *mut symm_segment_event_t,
    capacity: usize,
    count: *mut usize,
) -> symm_status_t {
    guard_status!("symm_segment_events", || {
        let count = out_ref(count, "symm_segment_events", "count")?;
        *count = 0;
        if out.is_null() && capacity > 0 {
            return Err(Error::invalid(format!(
                "symm_segment_events: out is NULL with capacity {capacity}; expected an array \
                 of that many symm_segment_event_t"
            )));
        }
        let device = (device >= 0).then_some(device);
        let events = heap::global()?.segment_events(device, capacity)?;
        for (i, (d, e, base)) in events.into_iter().enumerate() {
            // SAFETY: out holds `capacity` entries (the caller's contract); segment_events
            // returned at most that many.
            unsafe { *out.add(i) = event_of(d, e, base) };
            *count = i + 1;
        }
        Ok(())
    })
}

/// The device, the request and the allocation stream of the live block at `ptr`, without a walk
/// over blocks (a memory history's free of a block it did not see allocated, the profiler's
/// report of a free). A pointer that is not a live block of symmalloc's fails with
/// SYMM_ERR_INVALID_ARGUMENT and writes nothing.
#[no_mangle]
pub extern "C" fn symm_block_request(
    ptr: *mut c_void,
    device: *mut c_int,
    requested: *mut u64,
    stream: *mut *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_block_request", || {
        let device = out_ref(device, "symm_block_request", "device")?;
        let requested = out_ref(requested, "symm_block_request", "requested")?;
        let stream = out_ref(stream, "symm_block_request", "stream")?;
        let (d, r, s) = heap::global()?.block_request(ptr as u64)?;
        *device = d;
        *requested = r;
        *stream = s as *mut CUstream_st;
        Ok(())
    })
}
