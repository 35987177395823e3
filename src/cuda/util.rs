//! Small driver helpers for the demo, the GPU tests and the benchmarks: host<->device copies,
//! streams, events, graph capture and the self-test kernel (kernels/selftest.cu). The library
//! itself uses none of them: they exist only with the cargo feature `testing`, which the tests,
//! examples and benchmarks get through the crate's dev-dependency on itself and the demo asks
//! for (Cargo.toml).

use super::driver::{check, CtxGuard};
use super::module;
use crate::error::Result;
use cudarc::driver::sys;

pub fn htod(device: i32, dst: u64, src: &[u8]) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: dst is device memory of at least src.len() bytes (caller's contract).
    check(
        unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const _, src.len()) },
        "cuMemcpyHtoD",
    )
}

pub fn dtoh(device: i32, dst: &mut [u8], src: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: src is device memory of at least dst.len() bytes (caller's contract).
    check(
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut _, src, dst.len()) },
        "cuMemcpyDtoH",
    )
}

pub fn stream_create(device: i32) -> Result<u64> {
    let _ctx = CtxGuard::new(device)?;
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; non-blocking stream.
    check(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate")?;
    Ok(s as u64)
}

pub fn stream_sync(device: i32, stream: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: stream is a live stream of this device (or 0).
    check(
        unsafe { sys::cuStreamSynchronize(stream as sys::CUstream) },
        "cuStreamSynchronize",
    )
}

/// The self-test kernel's name in the embedded module (kernels/selftest.cu).
pub const SELFTEST_SAXPY: &str = "symm_selftest_saxpy";

/// The parameter of `symm_selftest_saxpy` (kernels/selftest.cu's SaxpyArgs).
#[repr(C)]
pub struct SaxpyArgs {
    pub x: u64,
    pub y: u64,
    pub n: u64,
    pub a: f32,
    pub reserved: f32,
}

/// Launches `symm_selftest_saxpy`: y = a * x + y over n floats.
pub fn saxpy(device: i32, stream: u64, a: f32, x: u64, y: u64, n: u64) -> Result<()> {
    let f = module::function(device, SELFTEST_SAXPY)?;
    let grid = n.div_ceil(256).max(1) as u32;
    module::launch(
        device,
        f,
        grid,
        256,
        stream,
        &SaxpyArgs {
            x,
            y,
            n,
            a,
            reserved: 0.0,
        },
    )
}

/// A timing event pair.
pub struct Timer {
    device: i32,
    start: sys::CUevent,
    stop: sys::CUevent,
}

impl Timer {
    pub fn new(device: i32) -> Result<Self> {
        let _ctx = CtxGuard::new(device)?;
        let (mut a, mut b): (sys::CUevent, sys::CUevent) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers.
        check(unsafe { sys::cuEventCreate(&mut a, 0) }, "cuEventCreate")?;
        // SAFETY: as above.
        check(unsafe { sys::cuEventCreate(&mut b, 0) }, "cuEventCreate")?;
        Ok(Timer {
            device,
            start: a,
            stop: b,
        })
    }
    pub fn start(&self, stream: u64) -> Result<()> {
        let _ctx = CtxGuard::new(self.device)?;
        // SAFETY: live event and stream.
        check(
            unsafe { sys::cuEventRecord(self.start, stream as sys::CUstream) },
            "cuEventRecord",
        )
    }
    /// Records the stop event, waits for it and returns the elapsed milliseconds.
    pub fn stop_ms(&self, stream: u64) -> Result<f32> {
        let _ctx = CtxGuard::new(self.device)?;
        let mut ms = 0f32;
        // SAFETY: live events and stream; valid out-pointer.
        unsafe {
            check(
                sys::cuEventRecord(self.stop, stream as sys::CUstream),
                "cuEventRecord",
            )?;
            check(sys::cuEventSynchronize(self.stop), "cuEventSynchronize")?;
            check(
                sys::cuEventElapsedTime_v2(&mut ms, self.start, self.stop),
                "cuEventElapsedTime",
            )?;
        }
        Ok(ms)
    }
}

/// A CUDA graph captured from a stream.
pub struct Graph {
    device: i32,
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

pub fn capture_begin(device: i32, stream: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: stream is a live non-default stream; thread-local capture mode.
    check(
        unsafe {
            sys::cuStreamBeginCapture_v2(
                stream as sys::CUstream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        },
        "cuStreamBeginCapture",
    )
}

pub fn capture_end(device: i32, stream: u64) -> Result<Graph> {
    let _ctx = CtxGuard::new(device)?;
    let mut g: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing (capture_begin); valid out-pointer.
    check(
        unsafe { sys::cuStreamEndCapture(stream as sys::CUstream, &mut g) },
        "cuStreamEndCapture",
    )?;
    let mut e: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: g is the captured graph; valid out-pointer.
    check(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, 0) },
        "cuGraphInstantiate",
    )?;
    Ok(Graph {
        device,
        exec: e,
        graph: g,
    })
}

impl Graph {
    pub fn launch(&self, stream: u64) -> Result<()> {
        let _ctx = CtxGuard::new(self.device)?;
        // SAFETY: exec is a live executable graph.
        check(
            unsafe { sys::cuGraphLaunch(self.exec, stream as sys::CUstream) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both were created by capture_end and are destroyed once.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// Plain `cuMemAlloc` memory (for comparisons in tests and benchmarks).
pub fn raw_alloc(device: i32, bytes: usize) -> Result<u64> {
    let _ctx = CtxGuard::new(device)?;
    let mut p = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc")?;
    Ok(p)
}

/// Frees memory from `raw_alloc`.
pub fn raw_free(device: i32, ptr: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: ptr came from cuMemAlloc (raw_alloc) and is freed once.
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")
}

/// Stream-ordered host-to-device copy (the host buffer must stay alive until the stream syncs).
pub fn htod_async(device: i32, dst: u64, src: &[u8], stream: u64) -> Result<()> {
    let _ctx = CtxGuard::new(device)?;
    // SAFETY: dst holds src.len() bytes; the caller keeps src alive until the stream syncs.
    check(
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.as_ptr() as *const _,
                src.len(),
                stream as sys::CUstream,
            )
        },
        "cuMemcpyHtoDAsync",
    )
}
