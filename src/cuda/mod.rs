//! CUDA driver layer: the only code that calls `cudarc::driver::sys`. Raw calls stay here behind
//! checked wrappers that return `crate::error::Result`; no other module names a `cu*` function.
//!
//! Invariants: the driver is initialised once per process (`driver()`); every call that needs a
//! context runs inside a `CtxGuard` that pushes the device's primary context and pops it again,
//! so the caller's current context is never changed behind its back.

pub mod driver;
pub mod mem;
pub mod module;
pub mod multicast;
pub mod multicast_gate;
pub mod stream_ops;
#[cfg(feature = "testing")]
pub mod util;

pub use vmm::granularity;
pub mod vmm;

pub use driver::{check, device_count, driver, CtxGuard, DeviceInfo};
