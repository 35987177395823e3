//! The C ABI of symmetric memory you program yourself (v3, "Programming model"):
//! `symm_rendezvous`, `symm_peer_ptr`, `symm_put`, `symm_signal`, `symm_wait` and
//! `symm_comm_device`. Argument checks, panic guard, status + `symm_last_error()` as everywhere;
//! the work is comm/p2p.rs. Semantics and ordering: the README, "Programming symmetric memory",
//! and docs/DESIGN.md.

use super::guard::guard_status;
use super::types::*;
use super::{stream_of, symm_comm_t, with_comm};
use crate::comm::device_comm::{DeviceComm, SYMM_DEVICE_COMM_V1_SIZE};
use crate::error::Error;
use std::ffi::{c_int, c_void};

/// Collective: every rank passes the same offset (in its symmetric heap) and size. Maps every
/// peer's segments under [ptr, ptr + bytes), which must lie in live `symm_malloc` blocks, and
/// checks that every rank passed the same range: SYMM_ERR_NOT_SYMMETRIC on every rank
/// otherwise (a rank whose own arguments are bad gets SYMM_ERR_INVALID_ARGUMENT naming them,
/// the others SYMM_ERR_NOT_SYMMETRIC). Idempotent. Waits at most SYMMALLOC_TIMEOUT_S.
#[no_mangle]
pub extern "C" fn symm_rendezvous(
    comm: *mut symm_comm_t,
    ptr: *const c_void,
    bytes: usize,
) -> symm_status_t {
    guard_status!("symm_rendezvous", || {
        with_comm(comm, |c| c.rendezvous(ptr as u64, bytes as u64))
    })
}

/// Local, after `symm_rendezvous`: writes to `*out` the address, in this process, of `ptr`'s
/// offset in rank `peer`'s heap (`ptr` itself for this rank). Refused (and `*out` set to NULL)
/// for a pointer outside the heap, one no rendezvoused range holds, a peer out of range, and a
/// segment released (`symm_empty_cache`, `symm_release_pool`) by this rank or the peer since
/// the rendezvous: never a dangling mapping.
#[no_mangle]
pub extern "C" fn symm_peer_ptr(
    comm: *mut symm_comm_t,
    ptr: *const c_void,
    peer: c_int,
    out: *mut *mut c_void,
) -> symm_status_t {
    guard_status!("symm_peer_ptr", || {
        if out.is_null() {
            return Err(Error::invalid("symm_peer_ptr: out is NULL"));
        }
        // SAFETY: out is non-NULL and points at a pointer the caller owns; cleared first so a
        // failure leaves NULL.
        unsafe { out.write(std::ptr::null_mut()) };
        let p = with_comm(comm, |c| c.peer_ptr(ptr as u64, peer as i64))?;
        // SAFETY: as above.
        unsafe { out.write(p as *mut c_void) };
        Ok(())
    })
}

/// Stream-ordered: after the stream's earlier work, copies `bytes` from `src` (any memory the
/// device can read) into rank `peer`'s buffer at the offset of `dst`, with the copy engine (no
/// kernel). [dst, dst + bytes) must lie inside one range every rank rendezvoused (refused
/// otherwise: it would leave the peer's mapped segments). Capturable. Not ordered against
/// other streams' work (collectives included): a `symm_signal` after it on the same stream
/// tells the peer the data is there. `bytes` 0 does nothing.
#[no_mangle]
pub extern "C" fn symm_put(
    comm: *mut symm_comm_t,
    peer: c_int,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_put", || {
        with_comm(comm, |c| {
            c.put(
                peer as i64,
                dst as u64,
                src as u64,
                bytes as u64,
                stream_of(stream),
            )
        })
    })
}

/// Stream-ordered: after the stream's earlier work (puts included), stores `value` into slot
/// `slot` (0 to SYMM_SIGNAL_SLOTS - 1) of rank `peer`'s signal pad, with a memory barrier
/// before it, so a peer that sees the value sees the stream's earlier writes. Values are
/// stored, not added: raise a slot with increasing values (monotonic counters, no reset), or
/// raise it to 1 and have its owner store 0 after its wait (a reset: what a captured graph
/// needs, since a captured signal stores the same value at every replay). A rank's stores into
/// its own slots leave the slot's writer mark, so a timeout names the last other rank that
/// raised it. Capturable.
#[no_mangle]
pub extern "C" fn symm_signal(
    comm: *mut symm_comm_t,
    peer: c_int,
    slot: u32,
    value: u64,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_signal", || {
        with_comm(comm, |c| {
            c.signal(peer as i64, slot, value, stream_of(stream))
        })
    })
}

/// Stream-ordered: holds the stream until this rank's slot `slot` is >= `value` (unsigned);
/// work after it on the stream sees what the signalling rank wrote before its signal. Bounded:
/// past SYMMALLOC_TIMEOUT_S the stream goes on, and the next call on the communicator returns
/// SYMM_ERR_TIMEOUT naming the slot, the values and the last other rank that raised it (the
/// communicator is then unusable). A one-thread kernel on CUDA; on the host backend the call
/// itself waits and reports. Capturable.
#[no_mangle]
pub extern "C" fn symm_wait(
    comm: *mut symm_comm_t,
    slot: u32,
    value: u64,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_wait", || {
        with_comm(comm, |c| c.wait(slot, value, stream_of(stream)))
    })
}

/// Fills the first `size` bytes of `*out` (pass `sizeof(symm_device_comm_t)`) with the
/// communicator as device code sees it: world, rank, every rank's heap base and signal pad in
/// this process, the abort and error words, the timeout (include/symmalloc_device.cuh takes
/// it). Nothing past `size` is written; a size that is not whole 8-byte fields, is below
/// SYMM_DEVICE_COMM_V1_SIZE or is larger than this library's struct is refused.
#[no_mangle]
pub extern "C" fn symm_comm_device(
    comm: *mut symm_comm_t,
    out: *mut DeviceComm,
    size: usize,
) -> symm_status_t {
    guard_status!("symm_comm_device", || {
        if out.is_null() {
            return Err(Error::invalid("symm_comm_device: out is NULL"));
        }
        let have = std::mem::size_of::<DeviceComm>();
        if size < SYMM_DEVICE_COMM_V1_SIZE || size > have || size % 8 != 0 {
            return Err(Error::invalid(format!(
                "symm_comm_device: size {size} is not a symm_device_comm_t size this library \
                 serves; expected a multiple of 8 from {SYMM_DEVICE_COMM_V1_SIZE} to {have} \
                 (sizeof(symm_device_comm_t) of library {}.{}.{}; a larger struct comes from a \
                 newer header)",
                super::SYMMALLOC_VERSION_MAJOR,
                super::SYMMALLOC_VERSION_MINOR,
                super::SYMMALLOC_VERSION_PATCH
            )));
        }
        let mut d = with_comm(comm, |c| Ok(c.device_view()))?;
        d.struct_size = size as u64;
        // SAFETY: out is non-NULL and the caller declared `size` writable bytes there (at most
        // sizeof(DeviceComm), checked); the source is a live DeviceComm; distinct regions.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &d as *const DeviceComm as *const u8,
                out as *mut u8,
                size,
            )
        };
        Ok(())
    })
}
