//! The embedded kernel fatbin: loaded once per device with `cuModuleLoadData`, functions looked
//! up by name and cached, launched with `cuLaunchKernel` on the caller's stream.

use super::driver::{check, driver, CtxGuard};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Mutex, OnceLock};

/// The fatbin built by build.rs from kernels/*.cu (sm_80 and sm_90 SASS, compute_90 PTX).
pub static FATBIN: &[u8] = include_bytes!(env!("SYMMALLOC_FATBIN"));

struct Loaded {
    module: usize,
    functions: HashMap<String, usize>,
}

static MODULES: OnceLock<Vec<Mutex<Option<Loaded>>>> = OnceLock::new();

/// A kernel function handle of one device's module.
#[derive(Clone, Copy, Debug)]
pub struct Function(usize);

impl Function {
    /// The CUfunction handle, for callers that launch it themselves (benchmarks).
    pub fn raw(self) -> usize {
        self.0
    }
}

/// Looks up `name` in the device's module, loading the module on first use.
pub fn function(device: i32, name: &str) -> Result<Function> {
    let drv = driver()?;
    drv.device(device)?;
    let slots = MODULES.get_or_init(|| drv.devices.iter().map(|_| Mutex::new(None)).collect());
    let mut slot = slots[device as usize]
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let _ctx = CtxGuard::new(device)?;
    if slot.is_none() {
        // Copy into an aligned buffer: the driver reads the fatbin header with aligned loads.
        let mut aligned = vec![0u64; FATBIN.len().div_ceil(8)];
        // SAFETY: aligned holds at least FATBIN.len() bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                FATBIN.as_ptr(),
                aligned.as_mut_ptr() as *mut u8,
                FATBIN.len(),
            )
        };
        let mut m: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: aligned holds a complete fatbin image; m is a valid out-pointer.
        check(
            unsafe { sys::cuModuleLoadData(&mut m, aligned.as_ptr() as *const std::ffi::c_void) },
            "cuModuleLoadData (symmalloc kernels)",
        )?;
        *slot = Some(Loaded {
            module: m as usize,
            functions: HashMap::new(),
        });
    }
    let loaded = slot.as_mut().expect("module loaded above");
    if let Some(f) = loaded.functions.get(name) {
        return Ok(Function(*f));
    }
    let cname = CString::new(name).map_err(|_| Error::internal("kernel name has a NUL"))?;
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: module is live for the process; cname is NUL-terminated.
    check(
        unsafe { sys::cuModuleGetFunction(&mut f, loaded.module as sys::CUmodule, cname.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    loaded.functions.insert(name.to_string(), f as usize);
    Ok(Function(f as usize))
}

/// How many blocks of `block` threads of `f` one SM holds at once (registers, shared memory and
/// threads; `cuOccupancyMaxActiveBlocksPerMultiprocessor`, no dynamic shared memory).
pub fn blocks_per_sm(device: i32, f: Function, block: u32) -> Result<u32> {
    let _ctx = CtxGuard::new(device)?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: n is a valid out-pointer; f is a live function of this device's module.
    check(
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                f.0 as sys::CUfunction,
                block as std::ffi::c_int,
                0,
            )
        },
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    )?;
    Ok(n.max(0) as u32)
}

/// Launches `f` with one by-value argument struct `args` (the kernels take a single struct).
pub fn launch<T>(
    device: i32,
    f: Function,
    grid: u32,
    block: u32,
    stream: u64,
    args: &T,
) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    let mut params = [args as *const T as *mut std::ffi::c_void];
    // SAFETY: params points at one argument whose layout matches the kernel's parameter
    // (a #[repr(C)] mirror of the kernel's struct); the stream is the caller's.
    let res = unsafe {
        sys::cuLaunchKernel(
            f.0 as sys::CUfunction,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream as sys::CUstream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    // Success is tested here; only a failure goes to `check` for its message.
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    check(res, "cuLaunchKernel")
}

/// As `launch`, with the grid in thread-block clusters of `cluster` blocks (sm_90+; `grid` a
/// multiple of `cluster`).
pub fn launch_cluster<T>(
    device: i32,
    f: Function,
    grid: u32,
    block: u32,
    cluster: u32,
    stream: u64,
    args: &T,
) -> Result<()> {
    if cluster == 0 || grid % cluster != 0 {
        return Err(Error::internal(format!(
            "a grid of {grid} blocks is not a whole number of clusters of {cluster}"
        )));
    }
    let _ctx = CtxGuard::new(device)?;
    let mut params = [args as *const T as *mut std::ffi::c_void];
    // SAFETY: an all-zero CUlaunchAttribute is a valid value of the plain-data union; the id
    // and the cluster dimension are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = cluster;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream as sys::CUstream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: config and attr outlive the call; params as in `launch`.
    check(
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.0 as sys::CUfunction,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernelEx",
    )
}
