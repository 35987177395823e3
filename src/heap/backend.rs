//! The narrow contract between the caching allocator and the memory it manages (in the spirit of
//! mimalloc's `prim` layer). Two implementations: CUDA virtual memory and host memfd memory.
//!
//! Contract: `reserve` returns address space that nothing else uses; `create` returns physical
//! memory that `map` places at any granularity-aligned address of a reservation (and that stays
//! alive while mapped or exported); `export` gives a file descriptor another process can
//! `import`; `order` makes `waiter` wait for the work submitted to `on` so far, never by polling;
//! `synchronize` waits for all work submitted to the device (`unmap` and `release` do not: the
//! heap calls it before giving memory back, as PyTorch does before `cuMemUnmap`); `grant` gives
//! another device of the process access to a mapped range (`check_peer` first says whether it
//! may), and the heap repeats it for every chunk it maps later (device_heap/peers.rs).

use crate::error::Result;
use std::os::fd::OwnedFd;

/// A stream handle as the C ABI passes it (`CUstream`); 0 is the legacy default stream.
pub type Stream = u64;

/// A physical allocation: a CUDA generic allocation handle or a host memfd.
#[derive(Debug)]
pub enum Phys {
    Cuda(u64),
    Host(OwnedFd),
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn device_count(&self) -> Result<i32>;
    /// Checks the ordinal and returns the mapping granularity of the device.
    fn granularity(&self, device: i32) -> Result<u64>;
    /// Heap size when `SYMMALLOC_HEAP_SIZE` is unset.
    fn default_heap_size(&self, device: i32) -> Result<u64>;
    fn reserve(&self, device: i32, size: u64) -> Result<u64>;
    fn unreserve(&self, device: i32, base: u64, size: u64) -> Result<()>;
    fn create(&self, device: i32, size: u64) -> Result<Phys>;
    fn map(&self, device: i32, addr: u64, size: u64, phys: &Phys) -> Result<()>;
    fn unmap(&self, device: i32, addr: u64, size: u64) -> Result<()>;
    /// Checks that `peer` may be granted access to `device`'s memory: both ordinals exist and
    /// `peer` can reach `device` directly. Creates no context on either.
    fn check_peer(&self, device: i32, peer: i32) -> Result<()>;
    /// Grants `peer` read/write access to `addr..addr+size`, mapped on `device` by `map`.
    fn grant(&self, device: i32, peer: i32, addr: u64, size: u64) -> Result<()>;
    fn release(&self, phys: Phys) -> Result<()>;
    fn export(&self, device: i32, phys: &Phys) -> Result<OwnedFd>;
    fn import(&self, device: i32, fd: OwnedFd) -> Result<Phys>;
    /// Free physical bytes on the device, when known (for out-of-memory messages).
    fn free_bytes(&self, device: i32) -> Option<u64>;
    fn order(&self, device: i32, waiter: Stream, on: Stream) -> Result<()>;
    fn is_capturing(&self, device: i32, stream: Stream) -> Result<bool>;
    /// Waits for all work submitted to the device; fails while a stream capture is under way.
    fn synchronize(&self, device: i32) -> Result<()>;
}
