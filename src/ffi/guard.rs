//! The panic guard and the thread-local last error behind every C entry point.
//!
//! Every `extern "C"` function runs its body through one of the `guard_*` helpers: the last
//! error is cleared on entry, an `Err` becomes a status (or NULL) plus the message, and a panic
//! is caught and becomes `SYMM_ERR_INTERNAL` — no panic ever unwinds into C.

use super::types::symm_status_t;
use crate::error::{Error, Result, Status};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

// Thread-local storage may already be torn down when a caller frees memory on a thread's or
// the process's exit path (PyTorch does, at exit): every access uses `try_with`, and the error
// text is then simply not recorded.
pub fn set_last_error(e: &Error) {
    let text = format!("{}: {}", e.status.name(), e.message);
    let c = CString::new(text.replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = c);
}

fn clear_last_error() {
    // Called on every entry: replace the text only when there is one (CString::default
    // allocates).
    let _ = LAST_ERROR.try_with(|l| {
        if !l.borrow().is_empty() {
            *l.borrow_mut() = CString::default();
        }
    });
}

/// Pointer to the calling thread's last error text ("" when the last call succeeded). Valid
/// until the next symmalloc call on this thread.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

fn panic_error(name: &str, payload: Box<dyn std::any::Any + Send>) -> Error {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    Error::internal(format!("{name} panicked: {what} (please report this bug)"))
}

fn run<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(panic_error(name, payload)),
    }
}

/// For functions that return a status.
pub fn guard_status(name: &str, f: impl FnOnce() -> Result<()>) -> symm_status_t {
    match run(name, f) {
        Ok(()) => symm_status_t::SYMM_SUCCESS,
        Err(e) => {
            set_last_error(&e);
            e.status.into()
        }
    }
}

/// For functions that return a pointer: NULL on error.
pub fn guard_ptr<T>(name: &str, f: impl FnOnce() -> Result<*mut T>) -> *mut T {
    match run(name, f) {
        Ok(p) => p,
        Err(e) => {
            set_last_error(&e);
            std::ptr::null_mut()
        }
    }
}

/// For functions that return nothing: failures are visible through `symm_last_error()`.
pub fn guard_void(name: &str, f: impl FnOnce() -> Result<()>) {
    if let Err(e) = run(name, f) {
        set_last_error(&e);
    }
}

impl From<Status> for symm_status_t {
    fn from(s: Status) -> Self {
        use symm_status_t::*;
        match s {
            Status::Success => SYMM_SUCCESS,
            Status::ErrInvalidArgument => SYMM_ERR_INVALID_ARGUMENT,
            Status::ErrOutOfMemory => SYMM_ERR_OUT_OF_MEMORY,
            Status::ErrCuda => SYMM_ERR_CUDA,
            Status::ErrNoDevice => SYMM_ERR_NO_DEVICE,
            Status::ErrNotSymmetric => SYMM_ERR_NOT_SYMMETRIC,
            Status::ErrPeer => SYMM_ERR_PEER,
            Status::ErrTimeout => SYMM_ERR_TIMEOUT,
            Status::ErrUnsupported => SYMM_ERR_UNSUPPORTED,
            Status::ErrInternal => SYMM_ERR_INTERNAL,
        }
    }
}
