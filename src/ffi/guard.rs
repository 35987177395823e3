//! The boundary every C entry point goes through, in the entry point's own frame: the panic
//! guard and the thread-local last error (`guard_status!`, `guard_ptr!`, `guard_void!`), the
//! checked conversions of the C enum values (`dtype`, `op`, `algo`, `quant`), and the live
//! handles of the C ABI (`give`, `is_live`, `take`).
//!
//! The guard: every `extern "C"` function runs its body through one of the `guard_*!` macros: the
//! last error is cleared on entry, an `Err` becomes a status (or NULL) plus the message, and a
//! panic is caught and becomes `SYMM_ERR_INTERNAL` — no panic ever unwinds into C. They are
//! macros so the body runs where the entry point is written (std's `catch_unwind` calls it):
//! a call does not go into this file and back out to its entry point's file; on success nothing
//! here runs after the body.
//!
//! The handles: one registry for every kind of object src/ffi hands to C as a pointer
//! (`symm_comm_t`, `symm_moe_t`), so a stale, foreign or wrongly typed pointer is an error naming
//! it, never a use after free. Invariants:
//! - An address is registered exactly while it is a `Box` of its kind made by `give` and not yet
//!   returned by `take`; nothing else frees a handle.
//! - Each address has one kind: a handle passed where another kind is expected is not live.
//! - `take` returns the box once per `give`: a second destroy is refused, nothing is freed twice.
//! - The lock is held only to look up, insert or remove an address, never while a handle's object
//!   is used; using one handle from two threads at once (a call racing its destroy) is the
//!   caller's error, as in NCCL.

use super::types::*;
use crate::comm::algo::{Algo, DType, Quant, ReduceOp};
use crate::error::{Error, Result, Status};
use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{LazyLock, Mutex, MutexGuard};

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

/// Called on every entry (the `guard_*!` macros): replaces the text only when there is one
/// (CString::default allocates).
#[doc(hidden)]
pub fn clear_last_error() {
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

/// What a failed body leaves: its error recorded as the last error (the `guard_*!` macros).
#[doc(hidden)]
pub fn failed(e: Error) -> Error {
    set_last_error(&e);
    e
}

/// What a panicking body leaves: `SYMM_ERR_INTERNAL`, recorded as the last error.
#[doc(hidden)]
pub fn panicked(name: &str, payload: Box<dyn Any + Send>) -> Error {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    failed(Error::internal(format!(
        "{name} panicked: {what} (please report this bug)"
    )))
}

/// `guard_status!(name, || body)`: for functions that return a status.
macro_rules! guard_status {
    ($name:expr, $f:expr) => {{
        $crate::ffi::guard::clear_last_error();
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe($f)) {
            Ok(Ok(())) => $crate::ffi::types::symm_status_t::SYMM_SUCCESS,
            Ok(Err(e)) => $crate::ffi::guard::failed(e).status.into(),
            Err(p) => $crate::ffi::guard::panicked($name, p).status.into(),
        }
    }};
}
pub(crate) use guard_status;

/// `guard_ptr!(name, || body)`: for functions that return a pointer: NULL on error.
macro_rules! guard_ptr {
    ($name:expr, $f:expr) => {{
        $crate::ffi::guard::clear_last_error();
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe($f)) {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                $crate::ffi::guard::failed(e);
                ::std::ptr::null_mut()
            }
            Err(p) => {
                $crate::ffi::guard::panicked($name, p);
                ::std::ptr::null_mut()
            }
        }
    }};
}
pub(crate) use guard_ptr;

/// `guard_void!(name, || body)`: for functions that return nothing: failures are visible
/// through `symm_last_error()`.
macro_rules! guard_void {
    ($name:expr, $f:expr) => {{
        $crate::ffi::guard::clear_last_error();
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe($f)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                $crate::ffi::guard::failed(e);
            }
            Err(p) => {
                $crate::ffi::guard::panicked($name, p);
            }
        }
    }};
}
pub(crate) use guard_void;

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

// The live handles.

/// What a registered address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Comm,
    Moe,
    #[cfg(test)]
    Test,
}

/// A type the C ABI hands out as a pointer.
pub trait Handle {
    const KIND: Kind;
}

static LIVE: LazyLock<Mutex<HashMap<usize, Kind>>> = LazyLock::new(Default::default);

fn live() -> MutexGuard<'static, HashMap<usize, Kind>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Boxes `value` and registers its address: the pointer to give to C.
pub fn give<T: Handle>(value: T) -> *mut T {
    let p = Box::into_raw(Box::new(value));
    let old = live().insert(p as usize, T::KIND);
    debug_assert!(old.is_none(), "a fresh Box at a registered address");
    p
}

/// Whether `p` is a live handle of `T`'s kind (false for NULL).
pub fn is_live<T: Handle>(p: *const T) -> bool {
    live().get(&(p as usize)) == Some(&T::KIND)
}

/// Unregisters `p` and returns its box; None (nothing changed) when `p` is not a live handle of
/// `T`'s kind.
pub fn take<T: Handle>(p: *mut T) -> Option<Box<T>> {
    let mut set = live();
    if set.get(&(p as usize)) != Some(&T::KIND) {
        return None;
    }
    set.remove(&(p as usize));
    drop(set);
    // SAFETY: p was registered with T's kind, so it is a Box<T> from `give` not yet taken back;
    // it is now unregistered, so this is its only owner.
    Some(unsafe { Box::from_raw(p) })
}

// The C enum values, checked.

/// A `symm_dtype_t` from C, checked.
pub fn dtype(v: symm_dtype_t) -> Result<DType> {
    match v {
        SYMM_BF16 => Ok(DType::Bf16),
        SYMM_FP16 => Ok(DType::Fp16),
        SYMM_FP32 => Ok(DType::Fp32),
        _ => Err(Error::invalid(format!(
            "dtype {v} is not a symm_dtype_t; expected SYMM_BF16 (0), SYMM_FP16 (1) or SYMM_FP32 (2)"
        ))),
    }
}

/// A `symm_op_t` from C, checked.
pub fn op(v: symm_op_t) -> Result<ReduceOp> {
    match v {
        SYMM_SUM => Ok(ReduceOp::Sum),
        SYMM_MAX => Ok(ReduceOp::Max),
        SYMM_MIN => Ok(ReduceOp::Min),
        _ => Err(Error::invalid(format!(
            "op {v} is not a symm_op_t; expected SYMM_SUM (0), SYMM_MAX (1) or SYMM_MIN (2)"
        ))),
    }
}

/// A `symm_algo_t` from C, checked.
pub fn algo(v: symm_algo_t) -> Result<Algo> {
    match v {
        SYMM_ALGO_AUTO => Ok(Algo::Auto),
        SYMM_ALGO_ONE_SHOT => Ok(Algo::OneShot),
        SYMM_ALGO_TWO_SHOT => Ok(Algo::TwoShot),
        SYMM_ALGO_MULTIMEM => Ok(Algo::Multimem),
        SYMM_ALGO_ONE_SHOT_LL => Ok(Algo::OneShotLL),
        _ => Err(Error::invalid(format!(
            "algo {v} is not a symm_algo_t; expected SYMM_ALGO_AUTO (0), ONE_SHOT (1), \
             TWO_SHOT (2), MULTIMEM (3) or ONE_SHOT_LL (4)"
        ))),
    }
}

/// A `symm_quant_t` from C, checked.
pub fn quant(v: symm_quant_t) -> Result<Quant> {
    match v {
        SYMM_QUANT_FP8_STATIC => Ok(Quant::Static),
        SYMM_QUANT_FP8_PER_TOKEN => Ok(Quant::PerToken),
        SYMM_QUANT_FP8_PER_GROUP_128 => Ok(Quant::PerGroup128),
        _ => Err(Error::invalid(format!(
            "quant {v} is not a symm_quant_t; expected SYMM_QUANT_FP8_STATIC (0), \
             SYMM_QUANT_FP8_PER_TOKEN (1) or SYMM_QUANT_FP8_PER_GROUP_128 (2)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Probe(u64);
    impl Handle for Probe {
        const KIND: Kind = Kind::Test;
    }
    struct Other;
    impl Handle for Other {
        const KIND: Kind = Kind::Moe;
    }

    #[test]
    fn a_handle_is_live_from_give_to_take_once() {
        let p = give(Probe(7));
        assert!(is_live(p));
        let b = take(p).expect("live");
        assert_eq!(b.0, 7);
        assert!(!is_live(p), "taken back: no longer live");
        assert!(take(p).is_none(), "a second take is refused");
    }

    #[test]
    fn null_foreign_and_wrongly_typed_pointers_are_not_live() {
        assert!(!is_live(std::ptr::null::<Probe>()));
        let local = Probe(1);
        assert!(!is_live(&local as *const Probe));
        let p = give(Probe(2));
        // The same address seen as another kind.
        assert!(!is_live(p as *const Other));
        assert!(take(p as *mut Other).is_none());
        assert!(is_live(p), "a refused take changes nothing");
        drop(take(p));
    }

    #[test]
    fn concurrent_gives_and_takes_keep_every_handle_once() {
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let p = give(Probe(t * 1000 + i));
                        assert!(is_live(p));
                        let b = take(p);
                        assert_eq!(b.as_ref().map(|b| b.0), Some(t * 1000 + i));
                        // While `b` lives no other give can reuse the address.
                        assert!(take(p).is_none());
                        drop(b);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn out_of_range_values_are_named() {
        assert_eq!(algo(4).unwrap(), Algo::OneShotLL);
        assert!(dtype(7).unwrap_err().message.contains("dtype 7"));
        assert!(op(3).unwrap_err().message.contains("op 3"));
        assert!(algo(9).unwrap_err().message.contains("algo 9"));
        assert_eq!(quant(2).unwrap(), Quant::PerGroup128);
        assert!(quant(3).unwrap_err().message.contains("quant 3"));
    }
}
