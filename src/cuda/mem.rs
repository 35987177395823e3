//! Plain memory operations the communicator needs: device memset and copies, and a small
//! host-mapped word the kernels write errors into.

use super::driver::{check, CtxGuard};
use crate::error::Result;
use cudarc::driver::sys;

pub fn memset_sync(device: i32, ptr: u64, value: u8, bytes: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: ptr..ptr+bytes is device memory of ours, mapped for this device.
    check(
        unsafe { sys::cuMemsetD8_v2(ptr, value, bytes as usize) },
        "cuMemsetD8",
    )?;
    // SAFETY: plain synchronisation of the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

pub fn copy_async(device: i32, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: both ranges are device-accessible memory of `bytes` bytes (checked by callers);
    // the stream is the caller's.
    check(
        unsafe { sys::cuMemcpyAsync(dst, src, bytes as usize, stream as sys::CUstream) },
        "cuMemcpyAsync",
    )
}

/// Copies `dst.len()` bytes of device memory at `src` into `dst` (synchronous).
pub fn read_sync(device: i32, dst: &mut [u8], src: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: src..src+len is device memory of ours (checked by callers), dst a host buffer of
    // that length.
    check(
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) },
        "cuMemcpyDtoH",
    )
}

/// 64 bytes of pinned host memory mapped into the device's address space (a communicator's
/// error words). Cut from pages of `WORDS_PER_PAGE` words, one `cuMemHostAlloc` per page
/// rather than per communicator (pinning memory is a slow driver call); a word goes back to its
/// device's free list when dropped and is zeroed when handed out again. Pages stay for the
/// process's life.
pub struct MappedWord {
    pub host: *mut u32,
    pub device_ptr: u64,
    device: i32,
}

// SAFETY: the word is plain pinned memory; all access is volatile through raw pointers.
unsafe impl Send for MappedWord {}

const WORD_BYTES: usize = 64;
const WORDS_PER_PAGE: usize = 64;

/// Free words by device: (host address, device address).
static FREE_WORDS: std::sync::Mutex<Vec<(i32, usize, u64)>> = std::sync::Mutex::new(Vec::new());

fn free_words() -> std::sync::MutexGuard<'static, Vec<(i32, usize, u64)>> {
    FREE_WORDS.lock().unwrap_or_else(|p| p.into_inner())
}

impl MappedWord {
    pub fn new(device: i32) -> Result<Self> {
        let mut free = free_words();
        if !free.iter().any(|w| w.0 == device) {
            let _ctx = CtxGuard::new(device)?;
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            let bytes = WORD_BYTES * WORDS_PER_PAGE;
            // SAFETY: valid out-pointer; `bytes` requested.
            check(
                unsafe { sys::cuMemHostAlloc(&mut p, bytes, flags) },
                "cuMemHostAlloc",
            )?;
            let mut d: sys::CUdeviceptr = 0;
            // SAFETY: p is a DEVICEMAP allocation; valid out-pointer.
            let got = check(
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) },
                "cuMemHostGetDevicePointer",
            );
            if let Err(e) = got {
                // SAFETY: p came from cuMemHostAlloc just above and is freed once.
                unsafe { sys::cuMemFreeHost(p) };
                return Err(e);
            }
            for i in (0..WORDS_PER_PAGE).rev() {
                let off = i * WORD_BYTES;
                free.push((device, p as usize + off, d + off as u64));
            }
        }
        let at = free
            .iter()
            .rposition(|w| w.0 == device)
            .expect("a page was added above");
        let (_, host, device_ptr) = free.remove(at);
        // SAFETY: host points at WORD_BYTES bytes of a live pinned page that no one else holds
        // (the word was on the free list).
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, WORD_BYTES) };
        Ok(MappedWord {
            host: host as *mut u32,
            device_ptr,
            device,
        })
    }
}

impl Drop for MappedWord {
    fn drop(&mut self) {
        free_words().push((self.device, self.host as usize, self.device_ptr));
    }
}

/// Writes `value` into `bytes` bytes at `ptr` and sets `zero_bytes` bytes at `zero` to 0, then
/// waits for both (one synchronization for the two).
pub fn memset2_sync(
    device: i32,
    zero: u64,
    zero_bytes: u64,
    ptr: u64,
    value: u8,
    bytes: u64,
) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: both ranges are device memory of ours, mapped for this device.
    check(
        unsafe { sys::cuMemsetD8Async(zero, 0, zero_bytes as usize, std::ptr::null_mut()) },
        "cuMemsetD8Async",
    )?;
    // SAFETY: as above.
    check(
        unsafe { sys::cuMemsetD8Async(ptr, value, bytes as usize, std::ptr::null_mut()) },
        "cuMemsetD8Async",
    )?;
    // SAFETY: plain synchronisation of the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

/// Waits for all work on the device (used before a communicator frees what kernels use).
pub fn sync_device(device: i32) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: plain synchronisation of the current context.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}
