//! The symmetric caching allocator: one `DeviceHeap` per device behind a spin lock, over one
//! backend chosen at first use (`SYMMALLOC_BACKEND`). Pure Rust above the `Backend` trait.
//!
//! The process-wide instance (`global()`) serves the C ABI; tests may build private instances
//! over the host backend with `Allocator::new`.

pub mod backend;
pub mod cuda_backend;
pub mod device_heap;
pub mod host_backend;
pub mod parked;
pub mod pools;
pub mod ranges;
pub mod release_log;
pub mod spin_lock;
pub mod stats;

use crate::config::{self, BackendKind};
use crate::error::{Error, Result};
use backend::{Backend, Stream};
use device_heap::{DeviceHeap, SegmentInfo};
use pools::PoolId;
use spin_lock::{SpinGuard, SpinLock};
use stats::Stats;
use std::sync::{Mutex, OnceLock};

pub struct Allocator {
    backend: Box<dyn Backend>,
    heaps: Vec<OnceLock<SpinLock<DeviceHeap>>>,
    /// Serialises heap creation (reserving address space) per device.
    init_lock: Mutex<()>,
}

static GLOBAL: OnceLock<std::result::Result<Allocator, Error>> = OnceLock::new();

/// The process's allocator, created on first use with the backend `SYMMALLOC_BACKEND` names.
pub fn global() -> Result<&'static Allocator> {
    GLOBAL
        .get_or_init(|| {
            let backend: Box<dyn Backend> = match config::backend_kind()? {
                BackendKind::Cuda => Box::new(cuda_backend::CudaBackend::new()?),
                BackendKind::Host => Box::new(host_backend::HostBackend),
            };
            Allocator::new(backend)
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Allocator {
    pub fn new(backend: Box<dyn Backend>) -> Result<Self> {
        let n = backend.device_count()?;
        Ok(Allocator {
            backend,
            heaps: (0..n).map(|_| OnceLock::new()).collect(),
            init_lock: Mutex::new(()),
        })
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn device_count(&self) -> i32 {
        self.heaps.len() as i32
    }

    pub fn check_device(&self, device: i32) -> Result<()> {
        if device < 0 || device >= self.device_count() {
            return Err(Error::invalid(format!(
                "device {device} does not exist; expected 0..{} ({} backend)",
                self.device_count(),
                self.backend.name()
            )));
        }
        Ok(())
    }

    /// The device's heap, locked; created (address space reserved) on first use.
    pub fn heap(&self, device: i32) -> Result<SpinGuard<'_, DeviceHeap>> {
        self.check_device(device)?;
        let slot = &self.heaps[device as usize];
        if slot.get().is_none() {
            let _g = self.init_lock.lock().unwrap_or_else(|p| p.into_inner());
            if slot.get().is_none() {
                let size = match config::heap_size()? {
                    Some(s) => s,
                    None => self.backend.default_heap_size(device)?,
                };
                if size == 0 {
                    return Err(Error::invalid(
                        "SYMMALLOC_HEAP_SIZE=0; expected a positive size",
                    ));
                }
                let heap = DeviceHeap::new(self.backend.as_ref(), device, size)?;
                crate::info!(
                    "device {device}: {} backend, symmetric heap of {size} bytes at {:#x}",
                    self.backend.name(),
                    heap.base()
                );
                let _ = slot.set(SpinLock::new(heap));
            }
        }
        Ok(slot.get().expect("initialised above").lock())
    }

    /// The device whose heap contains `ptr`, among heaps already created.
    pub fn device_of(&self, ptr: u64) -> Option<i32> {
        self.heaps
            .iter()
            .enumerate()
            .find_map(|(d, h)| h.get()?.lock().contains(ptr).then_some(d as i32))
    }

    /// Allocates into the calling thread's current pool for `device`.
    pub fn malloc(&self, size: u64, device: i32, stream: Stream) -> Result<u64> {
        self.malloc_in(size, device, stream, pools::current(device))
    }

    pub fn malloc_in(&self, size: u64, device: i32, stream: Stream, pool: PoolId) -> Result<u64> {
        let mut heap = self.heap(device)?;
        let r = heap.malloc(self.backend.as_ref(), size, stream, pool);
        heap.debug_validate();
        r
    }

    pub fn free(&self, ptr: u64, size: u64, device: i32, stream: Stream) -> Result<()> {
        let mut heap = self.heap(device)?;
        if !heap.contains(ptr) {
            drop(heap); // device_of locks every heap, this one included
            let owner = self.device_of(ptr);
            return Err(Error::invalid(match owner {
                Some(d) => format!(
                    "symm_free({ptr:#x}, device={device}): the pointer belongs to device {d}"
                ),
                None => format!("symm_free({ptr:#x}): pointer was not returned by symm_malloc"),
            }));
        }
        let r = heap.free(self.backend.as_ref(), ptr, size, stream);
        heap.debug_validate();
        r
    }

    pub fn record_stream(&self, ptr: u64, stream: Stream) -> Result<()> {
        let device = self.device_of(ptr).ok_or_else(|| {
            Error::invalid(format!(
                "symm_record_stream({ptr:#x}): pointer was not returned by symm_malloc"
            ))
        })?;
        let mut heap = self.heap(device)?;
        let r = heap.record_stream(ptr, stream);
        heap.debug_validate();
        r
    }

    pub fn empty_cache(&self) -> Result<()> {
        for h in self.heaps.iter().filter_map(OnceLock::get) {
            let mut heap = h.lock();
            let r = heap.empty_cache(self.backend.as_ref());
            heap.debug_validate();
            r?;
        }
        Ok(())
    }

    pub fn release_pool(&self, device: i32, pool: PoolId) -> Result<()> {
        let mut heap = self.heap(device)?;
        let r = heap.release_pool(self.backend.as_ref(), pool);
        heap.debug_validate();
        r
    }

    pub fn stats(&self, device: i32) -> Result<Stats> {
        Ok(self.heap(device)?.stats)
    }

    pub fn segment_of(&self, device: i32, ptr: u64) -> Result<(SegmentInfo, u64, u64)> {
        self.heap(device)?.segment_of(ptr)
    }

    pub fn validate(&self, device: i32) -> std::result::Result<(), String> {
        self.heap(device).map_err(|e| e.message)?.validate()
    }
}
