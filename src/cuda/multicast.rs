//! NVLink multicast objects (NVSwitch, sm_90+): the raw calls behind `SYMM_ALGO_MULTIMEM`.
//!
//! Safety rule (README, "Multicast safety rule"): creating a multicast object on a shared host that forbids it can
//! take the host's GPUs out of service. So every function here that touches a multicast
//! object first asks the gate (`multicast_gate::multicast_gate_from_env`) again, whatever its
//! caller already checked: with `NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` or
//! `NVSHMEM_DISABLE_NVLS=1` set, or `SYMMALLOC_ENABLE_MULTICAST=1` missing, nothing reaches
//! the driver. `tests/multicast_guard.rs` checks that this file is the only caller of
//! `cuMulticastCreate` and that the gate comes first.
//!
//! Contract: a handle from `create`/`import` is released once with `vmm::release`; memory is
//! bound with `bind_mem` only after every participating device was added (the caller meets
//! its peers in between), and unbound before the handle is released.

use super::driver::{check, driver, CtxGuard};
use super::multicast_gate::multicast_gate_from_env;
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// Refuses unless the safety gate allows multicast on `device` right now.
pub fn ensure_allowed(device: i32) -> Result<()> {
    let supports = driver()?.device(device)?.multicast;
    multicast_gate_from_env(supports)
        .map_err(|why| Error::unsupported(format!("multicast refused on device {device}: {why}")))
}

fn props(devices: u32, size: u64) -> sys::CUmulticastObjectProp {
    sys::CUmulticastObjectProp {
        numDevices: devices,
        size: size as usize,
        handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0
            as u64,
        flags: 0,
    }
}

/// The minimum granularity of a multicast object over `devices` devices: sizes and bind
/// offsets are multiples of it (the recommended one is far larger than a heap segment).
pub fn granularity(device: i32, devices: u32, size: u64) -> Result<u64> {
    ensure_allowed(device)?;
    let _ctx = CtxGuard::new(device)?;
    let p = props(devices, size);
    let mut g = 0usize;
    // SAFETY: valid out-pointer and property struct.
    check(
        unsafe {
            sys::cuMulticastGetGranularity(
                &mut g,
                &p,
                sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
            )
        },
        "cuMulticastGetGranularity",
    )?;
    Ok(g as u64)
}

/// Creates a multicast object of `size` bytes (a multiple of `granularity`) for `devices`
/// devices, exportable as a POSIX file descriptor. Called by one rank only.
pub fn create(device: i32, devices: u32, size: u64) -> Result<u64> {
    ensure_allowed(device)?;
    let _ctx = CtxGuard::new(device)?;
    let p = props(devices, size);
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-pointer and property struct; the gate above allowed multicast.
    check(
        unsafe { sys::cuMulticastCreate(&mut h, &p) },
        "cuMulticastCreate",
    )?;
    Ok(h)
}

/// Adds `device` to the object; every participating device must be added before any binds.
pub fn add_device(device: i32, handle: u64) -> Result<()> {
    ensure_allowed(device)?;
    let _ctx = CtxGuard::new(device)?;
    let dev = driver()?.device(device)?.cu_device;
    // SAFETY: handle is a live multicast object; dev is this process's device.
    check(
        unsafe { sys::cuMulticastAddDevice(handle, dev) },
        "cuMulticastAddDevice",
    )
}

/// Binds `size` bytes of the physical allocation `phys` (from `phys_offset`) at `mc_offset`.
pub fn bind_mem(
    device: i32,
    handle: u64,
    mc_offset: u64,
    phys: u64,
    phys_offset: u64,
    size: u64,
) -> Result<()> {
    ensure_allowed(device)?;
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: handle is a live multicast object this device was added to; phys is a live
    // allocation of this device of at least phys_offset + size bytes.
    check(
        unsafe {
            sys::cuMulticastBindMem(
                handle,
                mc_offset as usize,
                phys,
                phys_offset as usize,
                size as usize,
                0,
            )
        },
        "cuMulticastBindMem",
    )
}

/// Undoes `bind_mem` for this device.
pub fn unbind(device: i32, handle: u64, mc_offset: u64, size: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    let dev = driver()?.device(device)?.cu_device;
    // SAFETY: the range was bound by bind_mem on this device.
    check(
        unsafe { sys::cuMulticastUnbind(handle, dev, mc_offset as usize, size as usize) },
        "cuMulticastUnbind",
    )
}
