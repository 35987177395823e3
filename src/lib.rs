//! symmalloc: a symmetric-memory CUDA allocator with NVLink all-reduce kernels, shipped as
//! C-ABI shared objects. Layers (each module's header states what it owns):
//!
//! - `ffi`: the C ABI, the only `#[no_mangle]` code;
//! - `heap`: the caching allocator over a narrow backend trait (CUDA VMM or host memfd);
//! - `ipc`: single-node bootstrap over Unix sockets;
//! - `comm`: communicator, peer windows, collectives;
//! - `cuda`: checked wrappers over the driver API (dynamically loaded);
//! - `config`, `debug`, `error`: environment variables, diagnostics, errors (the bottom layer).

pub mod comm;
pub mod config;
pub mod cuda;
pub mod debug;
pub mod error;
pub mod ffi;
pub mod heap;
pub mod ipc;

pub use error::{Error, Result, Status};
