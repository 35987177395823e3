//! libsymmalloc_pluggable.so: the bare-name shim for dlopen-style loaders such as PyTorch's
//! `CUDAPluggableAllocator(path, "malloc", "free")`.
//!
//! It exports exactly `malloc`, `free`, `begin_pool`, `begin_allocate_to_pool`, `end_pool` and
//! `release_pool`, each forwarding to the `symm_*` function of the same role in
//! `libsymmalloc.so`, which it loads from its own directory (so a process has one allocator
//! state however it loaded the library). `begin_allocate_to_pool` is PyTorch's
//! begin-allocate-to-pool hook with its filter (std_function.rs), for
//! `symm_begin_pool_filtered`. A failed `malloc` says why on stderr: PyTorch does not check a
//! pluggable allocator's result, and would otherwise run kernels on a NULL pointer. Loaded by
//! hand (no pool hook ever called), the first allocation from a capturing stream says once on
//! stderr that captures get no pool and names `symmalloc.install_global()`. (The C++ allocator
//! of python/symmalloc/csrc, which install_global() installs, does not go through this shim.)
//! Load it only with `dlopen(RTLD_LOCAL)`: never link or LD_PRELOAD it, or these
//! names take over the process heap. Its own Rust code still binds to libc's malloc because
//! the library is linked without -Bsymbolic and `malloc` is resolved through the global scope.
//! In a test build (`cargo test --lib`) the six functions keep Rust's mangled names, so the
//! harness keeps libc's heap.

mod std_function;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type PoolFn = unsafe extern "C" fn(c_int, u64, u64);
type FilterFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type DropFn = unsafe extern "C" fn(*mut c_void);
type FilteredPoolFn =
    unsafe extern "C" fn(c_int, u64, u64, Option<FilterFn>, *mut c_void, Option<DropFn>) -> c_int;

struct Api {
    malloc: MallocFn,
    free: FreeFn,
    begin_pool: PoolFn,
    begin_pool_filtered: FilteredPoolFn,
    end_pool: PoolFn,
    release_pool: PoolFn,
    last_error: unsafe extern "C" fn() -> *const c_char,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn own_dir() -> Result<String, String> {
    // SAFETY: dladdr reads the loader's tables for an address inside this library.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(own_dir as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return Err("dladdr could not locate libsymmalloc_pluggable.so".into());
        }
        let path = CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned();
        Ok(match path.rfind('/') {
            Some(i) => path[..i].to_string(),
            None => ".".to_string(),
        })
    }
}

/// The library's file name beside the shim: `make build`, `make install` and the wheel
/// (python/setup.py names its libraries so) all lay it out under this name.
const LIBRARY_NAME: &str = "libsymmalloc.so";

fn load() -> Result<Api, String> {
    let dir = own_dir()?;
    let path = format!("{dir}/{LIBRARY_NAME}");
    let cpath = CString::new(path.clone()).map_err(|_| "library path has a NUL".to_string())?;
    // SAFETY: dlopen with a NUL-terminated path; the handle is kept for the process's life.
    let h = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a NUL-terminated message or NULL.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "unknown".into()
        } else {
            // SAFETY: non-NULL dlerror results are NUL-terminated.
            unsafe { CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!("symmalloc_pluggable: cannot load {path}: {why}"));
    }
    let sym = |name: &CStr| -> Result<*mut c_void, String> {
        // SAFETY: h is a live handle; name is NUL-terminated.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        if p.is_null() {
            Err(format!("symmalloc_pluggable: {path} lacks {name:?}"))
        } else {
            Ok(p)
        }
    };
    // SAFETY: the symbols are the symm_* functions with exactly these signatures
    // (include/symmalloc.h).
    unsafe {
        Ok(Api {
            malloc: std::mem::transmute::<*mut c_void, MallocFn>(sym(c"symm_malloc")?),
            free: std::mem::transmute::<*mut c_void, FreeFn>(sym(c"symm_free")?),
            begin_pool: std::mem::transmute::<*mut c_void, PoolFn>(sym(c"symm_begin_pool")?),
            begin_pool_filtered: std::mem::transmute::<*mut c_void, FilteredPoolFn>(sym(
                c"symm_begin_pool_filtered",
            )?),
            end_pool: std::mem::transmute::<*mut c_void, PoolFn>(sym(c"symm_end_pool")?),
            release_pool: std::mem::transmute::<*mut c_void, PoolFn>(sym(c"symm_release_pool")?),
            last_error: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *const c_char>(
                sym(c"symm_last_error")?,
            ),
        })
    }
}

fn api() -> Option<&'static Api> {
    match API.get_or_init(load) {
        Ok(a) => Some(a),
        Err(e) => {
            // No symm_last_error without the library: say it once on stderr.
            static SAID: OnceLock<()> = OnceLock::new();
            SAID.get_or_init(|| eprintln!("{e}"));
            None
        }
    }
}

/// Whether a pool hook (`begin_pool`, `begin_allocate_to_pool`) was ever called: then the
/// loader routes captures to pools (symmalloc.install_global() sets the hooks), and allocations
/// are no longer checked for a capture.
static POOL_HOOK_SEEN: AtomicBool = AtomicBool::new(false);
static CAPTURE_WARNED: AtomicBool = AtomicBool::new(false);

type IsCapturingFn = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;

/// The driver's `cuStreamIsCapturing`, loaded once (None without a driver).
fn is_capturing_fn() -> Option<IsCapturingFn> {
    static F: OnceLock<Option<IsCapturingFn>> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: dlopen/dlsym with NUL-terminated names; the handle lives for the process.
        unsafe {
            let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                return None;
            }
            let f = libc::dlsym(h, c"cuStreamIsCapturing".as_ptr());
            (!f.is_null()).then(|| std::mem::transmute::<*mut c_void, IsCapturingFn>(f))
        }
    })
}

/// A process that loaded this shim by hand (`CUDAPluggableAllocator(path, "malloc", "free")`
/// and `change_current_allocator`, no hooks) has no pool for a graph capture: the capture's
/// blocks come from the default pool, eager work may reuse them while the graph still writes
/// them, and the capture never hears of empty_cache. Said once, loudly, at the first allocation
/// from a capturing stream while no pool hook was ever called; checked (one driver call per
/// allocation) only until then.
fn warn_capture_without_pool(stream: *mut c_void) {
    if POOL_HOOK_SEEN.load(Ordering::Relaxed) || CAPTURE_WARNED.load(Ordering::Relaxed) {
        return;
    }
    let Some(f) = is_capturing_fn() else { return };
    let mut status: c_int = 0;
    // SAFETY: a stream handle from the caller and a valid out pointer.
    if unsafe { f(stream, &mut status) } != 0 || status == 0 {
        return;
    }
    if !CAPTURE_WARNED.swap(true, Ordering::Relaxed) {
        eprintln!(
            "symmalloc_pluggable: WARNING: an allocation arrived from a capturing CUDA stream \
             with no graph pool begun: this process loaded libsymmalloc_pluggable.so by hand \
             (CUDAPluggableAllocator without symmalloc's hooks), so graph captures allocate \
             from the default pool (eager work may reuse a graph's memory) and never hear of \
             empty_cache. Call symmalloc.install_global() instead (README, \"Global mode\")."
        );
    }
}

/// `symm_malloc` under PyTorch's expected name.
///
/// # Safety
/// Called by a dlopen loader with PyTorch's allocator signature.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let Some(a) = api() else {
        return std::ptr::null_mut();
    };
    warn_capture_without_pool(stream);
    // SAFETY: forwarding the caller's arguments unchanged.
    let p = unsafe { (a.malloc)(size, device, stream) };
    if p.is_null() && size > 0 {
        // SAFETY: symm_last_error returns the thread's NUL-terminated message.
        let why = unsafe { CStr::from_ptr((a.last_error)()) };
        eprintln!(
            "symmalloc_pluggable: malloc({size} bytes, device {device}) failed: {}; PyTorch \
             does not check a pluggable allocator's result and goes on with a NULL pointer",
            why.to_string_lossy()
        );
    }
    p
}

/// `symm_free` under PyTorch's expected name.
///
/// # Safety
/// As `symm_free`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    if let Some(a) = api() {
        // SAFETY: forwarding the caller's arguments unchanged.
        unsafe { (a.free)(ptr, size, device, stream) }
    }
}

/// `symm_begin_pool`.
///
/// # Safety
/// As `symm_begin_pool`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn begin_pool(device: c_int, first: u64, second: u64) {
    POOL_HOOK_SEEN.store(true, Ordering::Relaxed);
    if let Some(a) = api() {
        // SAFETY: forwarding.
        unsafe { (a.begin_pool)(device, first, second) }
    }
}

/// PyTorch's begin-allocate-to-pool hook, `void(int, MempoolId_t, std::function<bool(cudaStream_t)>)`
/// (`CUDAPluggableAllocator::set_begin_allocate_to_pool`): the pool id arrives as two integers
/// and the filter, a C++ object passed by value, as a pointer to it. The filter is moved out
/// (std_function.rs) and handed to `symm_begin_pool_filtered`, which asks it for every
/// allocation while the pool is open, from any thread. A filter that is not a libstdc++
/// `std::function` (checked as far as can be) falls back to `symm_begin_pool` (the calling
/// thread's allocations), said once on stderr.
///
/// # Safety
/// `filter` points to a live `std::function<bool(cudaStream_t)>` that the callee may move from
/// (PyTorch's by-value parameter), or is NULL.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn begin_allocate_to_pool(
    device: c_int,
    first: u64,
    second: u64,
    filter: *mut c_void,
) {
    POOL_HOOK_SEEN.store(true, Ordering::Relaxed);
    let Some(a) = api() else { return };
    // SAFETY: the caller's contract above.
    match unsafe { std_function::Filter::take(filter) } {
        Ok(f) => {
            let ctx = Box::into_raw(Box::new(f)) as *mut c_void;
            // SAFETY: ctx is a boxed Filter, which call_filter and drop_filter expect; its
            // ownership passes to the library (dropped through drop_filter).
            unsafe {
                (a.begin_pool_filtered)(
                    device,
                    first,
                    second,
                    Some(std_function::call_filter),
                    ctx,
                    Some(std_function::drop_filter),
                )
            };
        }
        Err(why) => {
            static SAID: OnceLock<()> = OnceLock::new();
            SAID.get_or_init(|| {
                eprintln!(
                    "symmalloc_pluggable: begin_allocate_to_pool: {why}; routing the calling \
                     thread's allocations to the pool instead (a graph's backward then \
                     allocates outside it)"
                )
            });
            // SAFETY: forwarding.
            unsafe { (a.begin_pool)(device, first, second) }
        }
    }
}

/// `symm_end_pool`.
///
/// # Safety
/// As `symm_end_pool`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn end_pool(device: c_int, first: u64, second: u64) {
    if let Some(a) = api() {
        // SAFETY: forwarding.
        unsafe { (a.end_pool)(device, first, second) }
    }
}

/// `symm_release_pool`.
///
/// # Safety
/// As `symm_release_pool`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn release_pool(device: c_int, first: u64, second: u64) {
    if let Some(a) = api() {
        // SAFETY: forwarding.
        unsafe { (a.release_pool)(device, first, second) }
    }
}
