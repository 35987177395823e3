//! The C ABI of access between devices of one process: `symm_grant_peer_access`, which the C++
//! allocator for PyTorch calls from `enablePeerAccess` so that copies and kernels on one GPU
//! reach tensors in another GPU's heap. Heap semantics: heap/device_heap/peers.rs.
//!
//! The entry point checks its arguments, runs inside the panic guard and reports failure as a
//! status plus `symm_last_error()`; a failed grant changes no allocation.

use super::guard::guard_status;
use super::types::symm_status_t;
use crate::heap;
use std::ffi::c_int;

/// Grants device `peer` read/write access to every segment of `device`'s heap, present and
/// future (segments made or grown later are granted as they are mapped). Idempotent; `device ==
/// peer` succeeds and does nothing. A heap the process has not made yet is not made: the grant
/// is kept for it. This is `enablePeerAccess(peer, device)` in PyTorch's terms (`peer` reads
/// and writes memory of `device`); it does not enable peer access between the CUDA contexts
/// (`cudaDeviceEnablePeerAccess`), which the caller does. Fails with SYMM_ERR_INVALID_ARGUMENT
/// for a device or peer that does not exist and SYMM_ERR_UNSUPPORTED where `peer` cannot reach
/// `device` directly.
#[no_mangle]
pub extern "C" fn symm_grant_peer_access(device: c_int, peer: c_int) -> symm_status_t {
    guard_status!("symm_grant_peer_access", || {
        heap::global()?
            .grant_peer_access(device, peer)
            .map_err(|e| {
                e.context(format!(
                    "symm_grant_peer_access(device={device}, peer={peer})"
                ))
            })
    })
}
