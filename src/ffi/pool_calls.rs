//! The C ABI of pools and the cache: routing allocations to pools (`symm_begin_pool`,
//! `symm_begin_pool_filtered`, `symm_end_pool`), releasing pools, `symm_record_stream` and
//! `symm_empty_cache`. These are the hooks PyTorch's `CUDAPluggableAllocator` takes (the
//! pluggable shim adapts PyTorch's begin hook, whose filter is a C++ `std::function`, to
//! `symm_begin_pool_filtered`). Heap semantics: heap/pools.rs (routes) and
//! heap/device_heap/release.rs (what goes back when).
//!
//! Each entry point checks its arguments, runs inside the panic guard and reports failure
//! through `symm_last_error()` (and a status where the signature has one: PyTorch's hook
//! signatures return nothing).

// Entry points are called from C with raw pointers; see mod.rs.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use super::guard::{guard_status, guard_void};
use super::types::*;
use crate::error::Error;
use crate::heap::{self, pools};
use std::ffi::{c_int, c_void};

/// A pool's filter (`symm_begin_pool_filtered`): nonzero when an allocation on `stream` belongs
/// to the pool. Called from any thread that allocates on the pool's device while the pool is
/// open; it must not call symmalloc.
#[allow(non_camel_case_types)]
pub type symm_pool_filter_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, stream: *mut CUstream_st) -> c_int>;

/// Frees a filter's `ctx` once its pool's route has ended (or was refused).
#[allow(non_camel_case_types)]
pub type symm_pool_filter_drop_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// Routes the calling thread's allocations on `device` to pool (first, second) until the
/// matching `symm_end_pool`. Pools nest. Each begin takes a use of the pool that
/// `symm_release_pool` gives back. ABI-compatible with PyTorch's begin-allocate-to-pool hook,
/// but it ignores that hook's filter: PyTorch's graph capture needs
/// `symm_begin_pool_filtered` (through the shim's `begin_allocate_to_pool`).
#[no_mangle]
pub extern "C" fn symm_begin_pool(device: c_int, pool_first: u64, pool_second: u64) {
    guard_void!("symm_begin_pool", || {
        heap::global()?.begin_pool(device, pools::PoolId(pool_first, pool_second), None)
    })
}

/// The filter and its context, owned by a route. Drops the context through `drop`.
struct ForeignFilter {
    filter: unsafe extern "C" fn(*mut c_void, *mut CUstream_st) -> c_int,
    ctx: *mut c_void,
    drop: symm_pool_filter_drop_fn,
}

// SAFETY: `symm_begin_pool_filtered`'s contract: the filter may be called, and the context
// dropped, from any thread.
unsafe impl Send for ForeignFilter {}
// SAFETY: as above; the filter only reads its context.
unsafe impl Sync for ForeignFilter {}

impl ForeignFilter {
    fn accepts(&self, stream: u64) -> bool {
        // SAFETY: the caller of symm_begin_pool_filtered gave a filter callable with its ctx
        // until `drop` runs, which happens only when this value is dropped.
        unsafe { (self.filter)(self.ctx, stream as *mut CUstream_st) != 0 }
    }
}

impl Drop for ForeignFilter {
    fn drop(&mut self) {
        if let Some(d) = self.drop {
            // SAFETY: called once, after the last call of the filter.
            unsafe { d(self.ctx) }
        }
    }
}

/// Routes every allocation on `device` whose stream `filter(ctx, stream)` accepts, from any
/// thread, to pool (first, second) until `symm_end_pool(device, first, second)`. This is
/// PyTorch's begin-allocate-to-pool contract: a graph capture's filter accepts the capturing
/// stream, on whichever thread allocates (the autograd engine allocates the backward from its
/// own thread). The pool takes a use, as with `symm_begin_pool`. `ctx` belongs to symmalloc
/// from this call on: `drop(ctx)` (if not NULL) runs once the route ends, or before this call
/// returns when it fails. A NULL filter is refused (SYMM_ERR_INVALID_ARGUMENT).
#[no_mangle]
pub extern "C" fn symm_begin_pool_filtered(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    filter: symm_pool_filter_fn,
    ctx: *mut c_void,
    drop: symm_pool_filter_drop_fn,
) -> symm_status_t {
    guard_status!("symm_begin_pool_filtered", || {
        let Some(filter) = filter else {
            if let Some(d) = drop {
                // SAFETY: the context is ours to drop (the contract above).
                unsafe { d(ctx) }
            }
            return Err(Error::invalid(
                "symm_begin_pool_filtered: filter is NULL; expected a function (use \
                 symm_begin_pool to route the calling thread)",
            ));
        };
        let f = ForeignFilter { filter, ctx, drop };
        heap::global()?.begin_pool(
            device,
            pools::PoolId(pool_first, pool_second),
            Some(Box::new(move |s| f.accepts(s))),
        )
    })
}

/// Ends the pool route for `device` that the calling thread opened last, which must be
/// (first, second); a thread that opened none for `device` ends the newest route to
/// (first, second) from any thread. The pool's free blocks that thread caches kept or that
/// wait parked then go back to its free lists, merged with their neighbours (heap/introspect.rs,
/// `settle_pool`).
#[no_mangle]
pub extern "C" fn symm_end_pool(device: c_int, pool_first: u64, pool_second: u64) {
    guard_void!("symm_end_pool", || {
        let heap = heap::global()?;
        heap.check_device(device)?;
        let pool = pools::PoolId(pool_first, pool_second);
        pools::end(device, pool)?;
        heap.settle_pool(device, pool)
    })
}

/// Gives back one use of the pool (each `symm_begin_pool` takes one; PyTorch releases a
/// graph's pool when the graph is deleted, once per graph sharing it). At the last use, or for
/// a pool never begun, its physical memory goes: free segments now, the others when their last
/// block is freed.
#[no_mangle]
pub extern "C" fn symm_release_pool(device: c_int, pool_first: u64, pool_second: u64) {
    guard_void!("symm_release_pool", || {
        let id = pools::PoolId(pool_first, pool_second);
        if pools::is_reserved(id) {
            return Err(Error::invalid(format!(
                "pool ({pool_first}, {pool_second}) is symmalloc's own (first word 2^64-1 or \
                 2^64-2); not releasable"
            )));
        }
        heap::global()?.release_pool(device, id)
    })
}

/// The next reuse of `ptr`'s block also waits for the work submitted to `stream` so far.
#[no_mangle]
pub extern "C" fn symm_record_stream(ptr: *mut c_void, stream: *mut CUstream_st) {
    guard_void!("symm_record_stream", || {
        if ptr.is_null() {
            return Err(Error::invalid("symm_record_stream: ptr is NULL"));
        }
        heap::global()?.record_stream(ptr as u64, stream as u64)
    })
}

/// Returns every cached segment without live blocks, on every device.
#[no_mangle]
pub extern "C" fn symm_empty_cache() {
    guard_void!("symm_empty_cache", || heap::global()?.empty_cache())
}
