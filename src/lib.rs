//! symmalloc: a symmetric-memory CUDA allocator with NVLink all-reduce kernels, shipped as
//! C-ABI shared objects. Layers (each module's header states what it owns):
//!
//! - `ffi`: the C ABI, the only `#[no_mangle]` code;
//! - `comm`: communicator, peer windows, collectives;
//! - `heap`: the caching allocator over a narrow backend trait (CUDA VMM or host memfd);
//! - `ipc`: single-node bootstrap over Unix sockets;
//! - `cuda`: checked wrappers over the driver API (dynamically loaded);
//! - `config`, `debug`, `error`: environment variables, diagnostics, errors (the bottom layer).
//!
//! The crate's Rust surface is `ffi` and `Error`/`Result`/`Status`. The other layers are public
//! only with the cargo feature `testing`, for the tests, examples, benchmarks and the demo (they
//! get it through the crate's dev-dependency on itself, Cargo.toml); they are no API. Without
//! the feature, what only those users call is unused here, so `dead_code` and `unused_imports`
//! are allowed then; the lints run with the feature (`cargo clippy --all-targets`), where, as
//! before this split, every layer is public.

#![cfg_attr(not(feature = "testing"), allow(dead_code, unused_imports))]

pub mod ffi;

// The layers below `ffi`: public with the feature `testing`, private without.
#[cfg(feature = "testing")]
pub mod comm;
#[cfg(not(feature = "testing"))]
mod comm;
#[cfg(feature = "testing")]
pub mod config;
#[cfg(not(feature = "testing"))]
mod config;
#[cfg(feature = "testing")]
pub mod cuda;
#[cfg(not(feature = "testing"))]
mod cuda;
#[cfg(feature = "testing")]
pub mod debug;
#[cfg(not(feature = "testing"))]
mod debug;
#[cfg(feature = "testing")]
pub mod error;
#[cfg(not(feature = "testing"))]
mod error;
#[cfg(feature = "testing")]
pub mod heap;
#[cfg(not(feature = "testing"))]
mod heap;
#[cfg(feature = "testing")]
pub mod ipc;
#[cfg(not(feature = "testing"))]
mod ipc;

pub use error::{Error, Result, Status};
