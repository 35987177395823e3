//! CUDA virtual memory management: address reservations, physical allocations that can be
//! exported as POSIX file descriptors, mapping with read/write access for one device, and
//! read/write access granted to a peer device of the same process (`grant`).

use super::driver::{check, driver, CtxGuard};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{FromRawFd, OwnedFd};

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

fn prop(device: i32, posix_fd: bool) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero bytes are valid.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    if posix_fd {
        p.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    p
}

/// Allocation granularity (recommended) of a device, in bytes.
pub fn granularity(device: i32) -> Result<usize> {
    let info = driver()?.device(device)?;
    let p = prop(device, info.posix_fd);
    let mut g = 0usize;
    // SAFETY: valid out-pointer and property struct.
    check(
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        },
        "cuMemGetAllocationGranularity",
    )?;
    Ok(g)
}

/// Reserves `size` bytes of device virtual address space aligned to `align`.
pub fn reserve(device: i32, size: u64, align: u64) -> Result<u64> {
    let _ctx = CtxGuard::new(device)?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; no fixed address requested.
    check(
        unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, align as usize, 0, 0) },
        "cuMemAddressReserve",
    )
    .map_err(|e| e.context(format!("reserving {size} bytes of virtual address space")))?;
    Ok(ptr)
}

pub fn unreserve(device: i32, base: u64, size: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: base/size describe a reservation made by reserve().
    check(
        unsafe { sys::cuMemAddressFree(base, size as usize) },
        "cuMemAddressFree",
    )
}

/// Creates `size` bytes of physical memory on `device`; exportable as an fd where supported.
pub fn create(device: i32, size: u64) -> Result<u64> {
    let info = driver()?.device(device)?;
    let _ctx = CtxGuard::new(device)?;
    let p = prop(device, info.posix_fd);
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-pointer and property struct.
    check(
        unsafe { sys::cuMemCreate(&mut h, size as usize, &p, 0) },
        "cuMemCreate",
    )?;
    Ok(h)
}

/// Maps `handle` at `addr` and grants `device` read/write access.
pub fn map(device: i32, addr: u64, size: u64, handle: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: addr..addr+size lies in a reservation of ours; handle is a live allocation.
    check(
        unsafe { sys::cuMemMap(addr, size as usize, 0, handle, 0) },
        "cuMemMap",
    )?;
    let desc = sys::CUmemAccessDesc {
        location: location(device),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range was just mapped; one descriptor passed.
    let res = check(
        unsafe { sys::cuMemSetAccess(addr, size as usize, &desc, 1) },
        "cuMemSetAccess",
    );
    if res.is_err() {
        // SAFETY: undo the mapping made above.
        unsafe { sys::cuMemUnmap(addr, size as usize) };
    }
    res
}

/// Grants `peer` read/write access to `addr..addr+size`, a range mapped by `map` on `device`
/// (what PyTorch's expandable segments do for each peer, `addPeerAccess`). Only `device`'s
/// context is used (the mapping's, which exists); none is created on `peer`.
pub fn grant(device: i32, peer: i32, addr: u64, size: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    let desc = sys::CUmemAccessDesc {
        location: location(peer),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: addr..addr+size is mapped (the caller's chunk); one descriptor passed.
    check(
        unsafe { sys::cuMemSetAccess(addr, size as usize, &desc, 1) },
        "cuMemSetAccess (granting a peer device)",
    )
    .map_err(|e| {
        e.context(format!(
            "granting device {peer} access to memory of device {device}"
        ))
    })
}

pub fn unmap(device: i32, addr: u64, size: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: addr..addr+size was mapped by map().
    check(
        unsafe { sys::cuMemUnmap(addr, size as usize) },
        "cuMemUnmap",
    )
}

pub fn release(handle: u64) -> Result<()> {
    // SAFETY: handle came from create() or import() and is released once.
    check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease")
}

/// Exports a physical allocation as a new POSIX file descriptor (owned by the caller).
pub fn export_fd(device: i32, handle: u64) -> Result<OwnedFd> {
    if !driver()?.device(device)?.posix_fd {
        return Err(Error::unsupported(format!(
            "device {device} cannot export memory as POSIX file descriptors"
        )));
    }
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: fd is a valid out-pointer of the size the POSIX handle type writes (an int).
    check(
        unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut _ as *mut std::ffi::c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        "cuMemExportToShareableHandle",
    )?;
    // SAFETY: the driver returned a fresh descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Imports a peer's allocation from a file descriptor (the fd stays owned by the caller).
pub fn import_fd(device: i32, fd: &OwnedFd) -> Result<u64> {
    use std::os::fd::AsRawFd;
    let _ctx = CtxGuard::new(device)?;
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX fds the "handle" argument is the fd value itself, cast to a pointer.
    check(
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        "cuMemImportFromShareableHandle",
    )?;
    Ok(h)
}
