//! The host backend (`SYMMALLOC_BACKEND=host`): the same heap over host memory, so the whole
//! library runs and is tested on machines without a GPU. Address space is a `PROT_NONE`
//! reservation; physical memory is a memfd mapped `MAP_SHARED|MAP_FIXED`, exported by `dup`.
//! Streams do not exist here: ordering is a no-op and nothing is ever capturing. Every virtual
//! device of the process reads host memory alike, so a peer grant only checks the ordinals
//! (the heap keeps the grants as bookkeeping that its validator checks: device_heap/peers.rs).

use super::backend::{Backend, Phys, Stream};
use crate::error::{Error, Result, Status};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Number of virtual devices the host backend exposes.
pub const HOST_DEVICES: i32 = 8;
/// Mapping granularity: 2 MiB, the same as CUDA's, so offsets match across backends.
pub const HOST_GRANULARITY: u64 = 2 << 20;

pub struct HostBackend;

fn os_err(what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    let status = if e.raw_os_error() == Some(libc::ENOMEM) {
        Status::ErrOutOfMemory
    } else {
        Status::ErrInternal
    };
    Error::new(status, format!("{what} failed: {e}"))
}

fn host_fd(phys: &Phys) -> Result<&OwnedFd> {
    match phys {
        Phys::Host(fd) => Ok(fd),
        Phys::Cuda(_) => Err(Error::internal("CUDA memory handed to the host backend")),
    }
}

impl HostBackend {
    fn check_device(&self, device: i32) -> Result<()> {
        if (0..HOST_DEVICES).contains(&device) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "device {device} does not exist; expected 0..{HOST_DEVICES} (host backend)"
            )))
        }
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }
    fn device_count(&self) -> Result<i32> {
        Ok(HOST_DEVICES)
    }
    fn granularity(&self, device: i32) -> Result<u64> {
        self.check_device(device)?;
        Ok(HOST_GRANULARITY)
    }
    fn default_heap_size(&self, device: i32) -> Result<u64> {
        self.check_device(device)?;
        Ok(16 << 30)
    }
    fn reserve(&self, _device: i32, size: u64) -> Result<u64> {
        // Over-reserve by one granule so the base can be aligned like CUDA's.
        let len = size + HOST_GRANULARITY;
        // SAFETY: anonymous PROT_NONE reservation; no existing mapping is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap (reserving host heap)"));
        }
        // Keep exactly the aligned `size` bytes, so unreserve() gives everything back.
        let start = p as u64;
        let base = start.next_multiple_of(HOST_GRANULARITY);
        for (at, n) in [
            (start, base - start),
            (base + size, start + len - (base + size)),
        ] {
            if n > 0 {
                // SAFETY: at..at+n is an unused edge of the reservation made just above.
                unsafe { libc::munmap(at as *mut libc::c_void, n as usize) };
            }
        }
        Ok(base)
    }
    fn unreserve(&self, _device: i32, base: u64, size: u64) -> Result<()> {
        // SAFETY: base..base+size is exactly a reservation made by reserve().
        if unsafe { libc::munmap(base as *mut libc::c_void, size as usize) } != 0 {
            return Err(os_err("munmap (host reservation)"));
        }
        Ok(())
    }
    fn create(&self, _device: i32, size: u64) -> Result<Phys> {
        // SAFETY: memfd_create with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"symmalloc-segment".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(os_err("ftruncate (sizing a host segment)"));
        }
        Ok(Phys::Host(fd))
    }
    fn map(&self, _device: i32, addr: u64, size: u64, phys: &Phys) -> Result<()> {
        let fd = host_fd(phys)?;
        // SAFETY: addr..addr+size lies inside one of our PROT_NONE reservations (the heap or a
        // peer window), so MAP_FIXED replaces only memory we own.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap (mapping a host segment)"));
        }
        Ok(())
    }
    fn unmap(&self, _device: i32, addr: u64, size: u64) -> Result<()> {
        // Put the reservation back instead of leaving a hole another mmap could take.
        // SAFETY: addr..addr+size is a mapping we made inside our reservation.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap (unmapping a host segment)"));
        }
        Ok(())
    }
    fn check_peer(&self, device: i32, peer: i32) -> Result<()> {
        self.check_device(device)?;
        self.check_device(peer)
    }
    fn grant(&self, device: i32, peer: i32, _addr: u64, _size: u64) -> Result<()> {
        self.check_peer(device, peer)
    }
    fn release(&self, phys: Phys) -> Result<()> {
        drop(phys);
        Ok(())
    }
    fn export(&self, _device: i32, phys: &Phys) -> Result<OwnedFd> {
        host_fd(phys)?
            .try_clone()
            .map_err(|e| Error::internal(format!("dup: {e}")))
    }
    fn import(&self, _device: i32, fd: OwnedFd) -> Result<Phys> {
        Ok(Phys::Host(fd))
    }
    fn free_bytes(&self, _device: i32) -> Option<u64> {
        None
    }
    fn order(&self, _device: i32, _waiter: Stream, _on: Stream) -> Result<()> {
        Ok(())
    }
    fn is_capturing(&self, _device: i32, _stream: Stream) -> Result<bool> {
        Ok(false)
    }
    fn synchronize(&self, _device: i32) -> Result<()> {
        Ok(()) // host memory: every operation has finished when it returns
    }
}
