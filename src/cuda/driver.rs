//! Driver initialisation, result checking, primary contexts and device queries.

use crate::error::{Error, Result, Status};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Converts a driver result into `Result`, naming the call that failed.
pub fn check(res: sys::CUresult, what: &str) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut msg: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it NULL).
    unsafe { sys::cuGetErrorString(res, &mut msg) };
    let text = if msg.is_null() {
        String::from("unknown error")
    } else {
        // SAFETY: non-NULL results of cuGetErrorString are NUL-terminated static strings.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    };
    let status = match res {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Status::ErrOutOfMemory,
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => {
            Status::ErrNoDevice
        }
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => Status::ErrUnsupported,
        _ => Status::ErrCuda,
    };
    Err(Error::new(
        status,
        format!("{what} failed: {res:?} ({text})"),
    ))
}

/// Process-wide driver state: initialised once; an error here is sticky and reported by every
/// entry point (no libcuda, no device, driver too old).
pub struct Driver {
    pub devices: Vec<DeviceInfo>,
}

#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    pub cc_major: i32,
    pub cc_minor: i32,
    pub sm_count: i32,
    pub vmm: bool,
    pub posix_fd: bool,
    pub multicast: bool,
    pub total_mem: u64,
    /// The driver's `CUdevice` for this ordinal.
    pub cu_device: sys::CUdevice,
    /// The device's primary context, retained on first use (`context`), never before: a
    /// retained primary context is a live context on that GPU (hundreds of MiB of its memory), so
    /// retaining every device's at start-up put one on each GPU for every rank's process.
    ctx: std::sync::Arc<OnceLock<std::result::Result<usize, Error>>>,
}

impl DeviceInfo {
    /// The device's primary context (retained for the process's life on first use).
    pub fn context(&self) -> Result<usize> {
        self.ctx
            .get_or_init(|| {
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: valid out-pointer; cu_device came from cuDeviceGet.
                check(
                    unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.cu_device) },
                    "cuDevicePrimaryCtxRetain",
                )
                .map(|()| ctx as usize)
            })
            .clone()
    }
}

static DRIVER: OnceLock<std::result::Result<Driver, Error>> = OnceLock::new();

/// The initialised driver, or why it is not usable. Never panics: a missing libcuda is checked
/// before any cudarc call (cudarc's dynamic loading panics when the library is absent).
pub fn driver() -> Result<&'static Driver> {
    DRIVER
        .get_or_init(init_driver)
        .as_ref()
        .map_err(Clone::clone)
}

fn init_driver() -> Result<Driver> {
    // SAFETY: is_culib_present only tries to dlopen libcuda and drops the handle.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            Status::ErrNoDevice,
            "no CUDA driver: libcuda.so could not be loaded (is an NVIDIA driver installed? \
             set SYMMALLOC_BACKEND=host to run on host memory)",
        ));
    }
    // SAFETY: plain driver call with a flags value of 0.
    check(unsafe { sys::cuInit(0) }, "cuInit")?;
    let mut n = 0;
    // SAFETY: n is a valid out-pointer.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    if n == 0 {
        return Err(Error::new(
            Status::ErrNoDevice,
            "the CUDA driver reports 0 devices",
        ));
    }
    let mut devices = Vec::new();
    for ordinal in 0..n {
        devices.push(query_device(ordinal)?);
    }
    Ok(Driver { devices })
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: v is a valid out-pointer; dev came from cuDeviceGet.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

fn query_device(ordinal: i32) -> Result<DeviceInfo> {
    use sys::CUdevice_attribute as A;
    let mut dev = 0;
    // SAFETY: valid out-pointer, ordinal < device count.
    check(
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut name = [0 as std::ffi::c_char; 128];
    // SAFETY: the buffer holds 128 bytes, as passed.
    check(
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: cuDeviceGetName NUL-terminates within the given length.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total = 0usize;
    // SAFETY: valid out-pointer.
    check(
        unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) },
        "cuDeviceTotalMem",
    )?;
    Ok(DeviceInfo {
        ordinal,
        name,
        cc_major: attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        cc_minor: attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        sm_count: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        vmm: attr(
            dev,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0,
        posix_fd: attr(
            dev,
            A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0,
        multicast: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)? != 0,
        total_mem: total as u64,
        cu_device: dev,
        ctx: Default::default(),
    })
}

/// Number of CUDA devices (0 when the driver is unusable, with the reason in the error).
pub fn device_count() -> Result<i32> {
    Ok(driver()?.devices.len() as i32)
}

impl Driver {
    pub fn device(&self, ordinal: i32) -> Result<&DeviceInfo> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "device {ordinal} does not exist; expected 0..{} (CUDA reports {} device(s))",
                    self.devices.len(),
                    self.devices.len()
                ))
            })
    }

    /// Whether `a` can read and write `b`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, a: i32, b: i32) -> Result<bool> {
        if a == b {
            return Ok(true);
        }
        let mut v = 0;
        // SAFETY: valid out-pointer; both ordinals checked by the caller through device().
        check(
            unsafe { sys::cuDeviceCanAccessPeer(&mut v, a, b) },
            "cuDeviceCanAccessPeer",
        )?;
        Ok(v != 0)
    }

    /// Whether the device's primary context is active in this process (whoever retained it),
    /// read without creating it.
    pub fn primary_context_active(&self, device: i32) -> Result<bool> {
        let dev = self.device(device)?.cu_device;
        let (mut flags, mut active) = (0u32, 0i32);
        // SAFETY: valid out-pointers; dev came from cuDeviceGet.
        check(
            unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) },
            "cuDevicePrimaryCtxGetState",
        )?;
        Ok(active != 0)
    }
}

/// Makes a device's primary context current for the guard's lifetime: pushed (and popped at
/// the end) only when another context, or none, is current. PyTorch's threads already have the
/// primary context current, so the allocator's driver calls there (capture queries, stream
/// ordering, growth) cost no push and pop: the side-stream `record_stream` path made ten driver
/// calls per allocation with them, six without (bench/NOTES.md, "The allocator").
pub struct CtxGuard {
    pushed: bool,
}

impl CtxGuard {
    pub fn new(device: i32) -> Result<CtxGuard> {
        let ctx = driver()?.device(device)?.context()?;
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; reads the calling thread's current context.
        if unsafe { sys::cuCtxGetCurrent(&mut cur) } == sys::CUresult::CUDA_SUCCESS
            && cur == ctx as sys::CUcontext
        {
            return Ok(CtxGuard { pushed: false });
        }
        // SAFETY: ctx is the retained primary context of this device.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(ctx as sys::CUcontext) },
            "cuCtxPushCurrent",
        )?;
        Ok(CtxGuard { pushed: true })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context pushed in new(); the out-pointer is valid.
            unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

/// Free and total bytes of a device (for out-of-memory messages).
pub fn mem_info(device: i32) -> Result<(u64, u64)> {
    let _ctx = CtxGuard::new(device)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers under a current context.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free as u64, total as u64))
}

/// Whether `stream` is being captured into a CUDA graph.
pub fn is_capturing(device: i32, stream: u64) -> Result<bool> {
    let _ctx = CtxGuard::new(device)?;
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: stream is a caller-provided CUstream (0 = legacy default); valid out-pointer.
    check(
        unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut st) },
        "cuStreamIsCapturing",
    )?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The id of the capture `stream` belongs to, `None` when it is not being captured.
pub fn capture_id(device: i32, stream: u64) -> Result<Option<u64>> {
    let _ctx = CtxGuard::new(device)?;
    let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: stream is a caller-provided CUstream (0 = legacy default); the status and id
    // out-pointers are valid and the optional outputs are NULL (not wanted).
    check(
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream as sys::CUstream,
                &mut st,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
        "cuStreamGetCaptureInfo",
    )?;
    Ok((st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id))
}

/// A reusable event for cross-stream ordering. cuStreamWaitEvent waits on the event's most
/// recent record at the time of the wait, so one event can be re-recorded freely afterwards.
pub struct OrderingEvent(usize);

impl OrderingEvent {
    pub fn new(device: i32) -> Result<Self> {
        let _ctx = CtxGuard::new(device)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer under a current context.
        check(
            unsafe { sys::cuEventCreate(&mut ev, flags) },
            "cuEventCreate",
        )?;
        Ok(OrderingEvent(ev as usize))
    }

    /// Makes `waiter` wait for all work submitted to `on` so far.
    pub fn order(&self, device: i32, waiter: u64, on: u64) -> Result<()> {
        let _ctx = CtxGuard::new(device)?;
        let ev = self.0 as sys::CUevent;
        // SAFETY: ev is a live event of this device; streams are caller-provided handles.
        check(
            unsafe { sys::cuEventRecord(ev, on as sys::CUstream) },
            "cuEventRecord",
        )?;
        // SAFETY: as above.
        check(
            unsafe { sys::cuStreamWaitEvent(waiter as sys::CUstream, ev, 0) },
            "cuStreamWaitEvent",
        )
    }
}
