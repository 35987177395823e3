//! A host-memory heap backend that follows CUDA's capture rules, shared by tests/heap_pools.rs
//! and bench/replay.rs (`alloc_bench --replay-capture`), which include this file by path: the
//! streams the caller marks as capturing answer `is_capturing`, and the calls that would break
//! a capture on CUDA (ordering a capturing stream, synchronizing while one captures) are
//! recorded, the synchronize refused as cuCtxSynchronize refuses it.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use symmalloc::error::{Error, Result};
use symmalloc::heap::backend::{Backend, Phys, Stream};
use symmalloc::heap::host_backend::HostBackend;
use symmalloc::heap::Allocator;

/// What the capture backend saw: streams being captured, every `order` call, and calls that
/// would have broken a capture on CUDA.
#[derive(Default)]
pub struct Seen {
    pub capturing: HashSet<Stream>,
    pub orders: Vec<(Stream, Stream)>,
    pub broken: Vec<String>,
}

/// Host memory with CUDA's capture rules: `order` involving a capturing stream and
/// `synchronize` while any stream captures are what break a capture (recorded, and the
/// synchronize fails as cuCtxSynchronize does).
pub struct CaptureBackend {
    host: HostBackend,
    seen: Arc<Mutex<Seen>>,
}

impl Backend for CaptureBackend {
    fn name(&self) -> &'static str {
        "host-capture"
    }
    fn device_count(&self) -> Result<i32> {
        self.host.device_count()
    }
    fn granularity(&self, device: i32) -> Result<u64> {
        self.host.granularity(device)
    }
    fn default_heap_size(&self, device: i32) -> Result<u64> {
        self.host.default_heap_size(device)
    }
    fn reserve(&self, device: i32, size: u64) -> Result<u64> {
        self.host.reserve(device, size)
    }
    fn unreserve(&self, device: i32, base: u64, size: u64) -> Result<()> {
        self.host.unreserve(device, base, size)
    }
    fn create(&self, device: i32, size: u64) -> Result<Phys> {
        self.host.create(device, size)
    }
    fn map(&self, device: i32, addr: u64, size: u64, phys: &Phys) -> Result<()> {
        self.host.map(device, addr, size, phys)
    }
    fn unmap(&self, device: i32, addr: u64, size: u64) -> Result<()> {
        self.host.unmap(device, addr, size)
    }
    fn check_peer(&self, device: i32, peer: i32) -> Result<()> {
        self.host.check_peer(device, peer)
    }
    fn grant(&self, device: i32, peer: i32, addr: u64, size: u64) -> Result<()> {
        self.host.grant(device, peer, addr, size)
    }
    fn release(&self, phys: Phys) -> Result<()> {
        self.host.release(phys)
    }
    fn export(&self, device: i32, phys: &Phys) -> Result<OwnedFd> {
        self.host.export(device, phys)
    }
    fn import(&self, device: i32, fd: OwnedFd) -> Result<Phys> {
        self.host.import(device, fd)
    }
    fn free_bytes(&self, device: i32) -> Option<u64> {
        self.host.free_bytes(device)
    }
    fn order(&self, _device: i32, waiter: Stream, on: Stream) -> Result<()> {
        let mut s = self.seen.lock().unwrap();
        if s.capturing.contains(&waiter) || s.capturing.contains(&on) {
            s.broken
                .push(format!("order({waiter:#x} after {on:#x}) during a capture"));
        }
        s.orders.push((waiter, on));
        Ok(())
    }
    fn is_capturing(&self, _device: i32, stream: Stream) -> Result<bool> {
        Ok(self.seen.lock().unwrap().capturing.contains(&stream))
    }
    fn synchronize(&self, _device: i32) -> Result<()> {
        let mut s = self.seen.lock().unwrap();
        if s.capturing.is_empty() {
            Ok(())
        } else {
            s.broken.push("synchronize during a capture".into());
            Err(Error::new(
                symmalloc::error::Status::ErrCuda,
                "cuCtxSynchronize: operation not permitted when stream is capturing",
            ))
        }
    }
}

/// A heap on that backend, and what it saw.
pub fn capture_backend() -> (Allocator, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let a = Allocator::new(Box::new(CaptureBackend {
        host: HostBackend,
        seen: seen.clone(),
    }))
    .unwrap();
    (a, seen)
}
