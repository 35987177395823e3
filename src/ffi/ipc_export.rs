//! Sharing a live block with another process (PyTorch's CUDA IPC, `shareIpcHandle`): the
//! physical chunks under the block as file descriptors the other process takes with
//! `pidfd_getfd(2)` and maps (`cuMemImportFromShareableHandle` + `cuMemMap`, or `mmap` on the
//! host backend), as PyTorch's expandable segments share theirs.
//!
//! Owns: the exported descriptors, one per chunk generation, kept open by this library (the
//! receiver copies them out of this process by number, later, so they must stay open).
//!
//! Invariants:
//! - Only the start of a live block is exported (PyTorch's `shareIpcHandle` takes a storage's
//!   data pointer); anything else is SYMM_ERR_INVALID_ARGUMENT and changes nothing.
//! - A descriptor is keyed by (device, chunk offset, chunk generation): a chunk given back and a
//!   new one made at the same offset never share one. Descriptors of chunks the heap no longer
//!   holds are closed at the device's next export (until then they keep that physical memory
//!   alive, at most the chunks given back between two exports).
//! - The heap is only read; the export takes the heap's lock, then this module's.

use super::guard::guard_status;
use super::types::symm_status_t;
use crate::error::{Error, Result};
use crate::heap;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{LazyLock, Mutex};

/// One physical chunk under an exported block, in address order.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct symm_export_chunk_t {
    /// Address of the chunk's first byte in this process.
    pub address: u64,
    /// Bytes of the chunk (one physical allocation; a multiple of the mapping granularity).
    pub size: u64,
    /// A descriptor of the chunk's physical memory, open in this process and owned by the
    /// library: do not close it. It stays open while the chunk is part of the heap.
    pub fd: i32,
    /// The device whose heap holds the chunk.
    pub device: i32,
}

/// (device, chunk offset, generation) -> the descriptor exported for it.
type Exported = HashMap<(i32, u64, u64), OwnedFd>;

static EXPORTED: LazyLock<Mutex<Exported>> = LazyLock::new(Default::default);

/// Closes the descriptors of chunks the heaps no longer hold; returns how many were closed.
pub fn close_stale() -> Result<usize> {
    let lock = || EXPORTED.lock().unwrap_or_else(|p| p.into_inner());
    let mut devices: Vec<i32> = lock().keys().map(|k| k.0).collect();
    if devices.is_empty() {
        return Ok(0); // nothing exported: no heap to look at (none is made here)
    }
    devices.sort_unstable();
    devices.dedup();
    let alloc = heap::global()?;
    let mut closed = 0;
    for device in devices {
        // The heap's lock, then this module's, as in export_block.
        let heap = alloc.heap(device)?;
        let mut exported = lock();
        let before = exported.len();
        exported.retain(|&(d, off, generation), _| {
            d != device
                || heap
                    .segment_info(off)
                    .is_some_and(|c| c.generation == generation)
        });
        closed += before - exported.len();
    }
    Ok(closed)
}

/// The chunks under the live block that starts at `ptr`, each with a descriptor of its memory.
pub fn export_block(ptr: u64) -> Result<Vec<symm_export_chunk_t>> {
    let alloc = heap::global()?;
    let Some(device) = alloc.device_by_address(ptr) else {
        return Err(Error::invalid(format!(
            "symm_segment_export({ptr:#x}): the pointer is not in symmalloc's heap; expected \
             the start of a live block from symm_malloc"
        )));
    };
    // A live block's start, not a freed one (a thread cache's kept block included).
    alloc.block_request(ptr).map_err(|e| {
        Error::invalid(format!(
            "symm_segment_export({ptr:#x}): expected the start of a live block: {}",
            e.message
        ))
    })?;
    let heap = alloc.heap(device)?;
    let (chunks, _, _) = heap.segment_of(ptr)?;
    let base = heap.base();
    let mut exported = EXPORTED.lock().unwrap_or_else(|p| p.into_inner());
    // Close what belongs to chunks this heap no longer holds.
    exported.retain(|&(d, off, generation), _| {
        d != device
            || heap
                .segment_info(off)
                .is_some_and(|c| c.generation == generation)
    });
    let mut out = Vec::with_capacity(chunks.len());
    for c in chunks {
        let key = (device, c.offset, c.generation);
        let fd = match exported.get(&key) {
            Some(fd) => fd.as_raw_fd(),
            None => {
                let fd = heap.export_segment(alloc.backend(), c.offset)?;
                let raw = fd.as_raw_fd();
                exported.insert(key, fd);
                raw
            }
        };
        out.push(symm_export_chunk_t {
            address: base + c.offset,
            size: c.size,
            fd,
            device,
        });
    }
    Ok(out)
}

/// The physical chunks under the live block that starts at `ptr`, for another process to map
/// (PyTorch's CUDA IPC): each chunk's address, size, device and a descriptor of its memory that
/// stays open in this process while the chunk is part of the heap (the other process takes it
/// with `pidfd_getfd(2)`; the library owns it: do not close it). Writes up to `capacity` chunks
/// to `chunks` (NULL with capacity 0 asks for the count) and the number the block has to
/// `*count`; a block with more chunks than `capacity` writes the first `capacity`. A pointer
/// that is not the start of a live block of the heap (outside it, inside a block, or freed)
/// fails with SYMM_ERR_INVALID_ARGUMENT and changes nothing.
#[no_mangle]
pub extern "C" fn symm_segment_export(
    ptr: *const c_void,
    chunks: *mut symm_export_chunk_t,
    capacity: usize,
    count: *mut usize,
) -> symm_status_t {
    guard_status!("symm_segment_export", || {
        if count.is_null() {
            return Err(Error::invalid("symm_segment_export: count is NULL"));
        }
        if chunks.is_null() && capacity > 0 {
            return Err(Error::invalid(format!(
                "symm_segment_export: chunks is NULL with capacity {capacity}; expected an \
                 array of that many symm_export_chunk_t, or capacity 0"
            )));
        }
        let got = export_block(ptr as u64)?;
        for (i, c) in got.iter().take(capacity).enumerate() {
            // SAFETY: the caller gives `capacity` writable elements at `chunks` (non-NULL,
            // checked above, since capacity > 0 here).
            unsafe { chunks.add(i).write(*c) };
        }
        // SAFETY: checked non-NULL above.
        unsafe { count.write(got.len()) };
        Ok(())
    })
}

/// Closes the descriptors `symm_segment_export` keeps for chunks the heap has given back since
/// (each keeps its chunk's physical memory alive while open), and writes how many it closed to
/// `*closed` (NULL: not written). Another process's mapping of such a chunk stays valid: it
/// holds the memory on its own. Cheap when nothing was exported (no heap is made).
#[no_mangle]
pub extern "C" fn symm_segment_export_close_stale(closed: *mut usize) -> symm_status_t {
    guard_status!("symm_segment_export_close_stale", || {
        let n = close_stale()?;
        if !closed.is_null() {
            // SAFETY: a non-NULL `closed` points to a writable size_t (the caller's contract).
            unsafe { closed.write(n) };
        }
        Ok(())
    })
}
