//! The CUDA backend: heap address space from `cuMemAddressReserve`, physical memory from
//! `cuMemCreate` (POSIX-fd exportable), cross-stream ordering with one reusable event per device.

use super::backend::{Backend, Phys, Stream};
use crate::cuda::{self, driver::OrderingEvent, vmm};
use crate::error::{Error, Result};
use std::os::fd::OwnedFd;
use std::sync::{Mutex, OnceLock};

pub struct CudaBackend {
    events: Vec<OnceLock<Mutex<OrderingEvent>>>,
}

impl CudaBackend {
    pub fn new() -> Result<Self> {
        let drv = cuda::driver()?;
        Ok(CudaBackend {
            events: drv.devices.iter().map(|_| OnceLock::new()).collect(),
        })
    }
}

fn cuda_handle(phys: &Phys) -> Result<u64> {
    match phys {
        Phys::Cuda(h) => Ok(*h),
        Phys::Host(_) => Err(Error::internal("host memory handed to the CUDA backend")),
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device_count(&self) -> Result<i32> {
        cuda::device_count()
    }
    fn granularity(&self, device: i32) -> Result<u64> {
        let info = cuda::driver()?.device(device)?;
        if !info.vmm {
            return Err(Error::unsupported(format!(
                "device {device} ({}) does not support CUDA virtual memory management",
                info.name
            )));
        }
        // 2 MiB or the device's granularity, whichever is larger, so offsets match PyTorch's
        // segment sizes on every device.
        Ok((vmm::granularity(device)? as u64).max(2 << 20))
    }
    fn default_heap_size(&self, device: i32) -> Result<u64> {
        let info = cuda::driver()?.device(device)?;
        Ok((info.total_mem * 2).next_multiple_of(1 << 30))
    }
    fn reserve(&self, device: i32, size: u64) -> Result<u64> {
        vmm::reserve(device, size, self.granularity(device)?)
    }
    fn unreserve(&self, device: i32, base: u64, size: u64) -> Result<()> {
        vmm::unreserve(device, base, size)
    }
    fn create(&self, device: i32, size: u64) -> Result<Phys> {
        vmm::create(device, size).map(Phys::Cuda)
    }
    fn map(&self, device: i32, addr: u64, size: u64, phys: &Phys) -> Result<()> {
        vmm::map(device, addr, size, cuda_handle(phys)?)
    }
    fn unmap(&self, device: i32, addr: u64, size: u64) -> Result<()> {
        vmm::unmap(device, addr, size)
    }
    fn check_peer(&self, device: i32, peer: i32) -> Result<()> {
        let drv = cuda::driver()?;
        let (d, p) = (drv.device(device)?, drv.device(peer)?);
        if !drv.can_access_peer(peer, device)? {
            return Err(Error::unsupported(format!(
                "device {peer} ({}) cannot access memory of device {device} ({}) directly \
                 (cuDeviceCanAccessPeer: no NVLink or PCIe peer-to-peer path)",
                p.name, d.name
            )));
        }
        Ok(())
    }
    fn grant(&self, device: i32, peer: i32, addr: u64, size: u64) -> Result<()> {
        vmm::grant(device, peer, addr, size)
    }
    fn release(&self, phys: Phys) -> Result<()> {
        vmm::release(cuda_handle(&phys)?)
    }
    fn export(&self, device: i32, phys: &Phys) -> Result<OwnedFd> {
        vmm::export_fd(device, cuda_handle(phys)?)
    }
    fn import(&self, device: i32, fd: OwnedFd) -> Result<Phys> {
        vmm::import_fd(device, &fd).map(Phys::Cuda)
    }
    fn free_bytes(&self, device: i32) -> Option<u64> {
        cuda::driver::mem_info(device).ok().map(|(free, _)| free)
    }
    fn order(&self, device: i32, waiter: Stream, on: Stream) -> Result<()> {
        let slot = self
            .events
            .get(device as usize)
            .ok_or_else(|| Error::invalid(format!("device {device} out of range")))?;
        if slot.get().is_none() {
            let ev = OrderingEvent::new(device)?;
            let _ = slot.set(Mutex::new(ev));
        }
        let ev = slot
            .get()
            .expect("set above")
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        ev.order(device, waiter, on)
    }
    fn is_capturing(&self, device: i32, stream: Stream) -> Result<bool> {
        cuda::driver::is_capturing(device, stream)
    }
    fn synchronize(&self, device: i32) -> Result<()> {
        crate::cuda::mem::sync_device(device)
    }
}
