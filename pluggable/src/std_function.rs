//! PyTorch's pool filter, a libstdc++ `std::function<bool(cudaStream_t)>`, owned and called
//! from Rust (PyTorch's begin-allocate-to-pool hook passes one by value, that is as a pointer
//! to an object the callee may move from).
//!
//! Layout (GCC's bits/std_function.h, the same since GCC 4.5 and under both libstdc++ string
//! ABIs), 32 bytes: `_Any_data _M_functor` (16 bytes: the callable stored in place, or a
//! pointer to it); `_M_manager`, `bool (*)(_Any_data& dest, const _Any_data& src,
//! _Manager_operation op)`; `_M_invoker`, `bool (*)(const _Any_data&, cudaStream_t&&)`. An empty
//! function has a null manager. Moving one copies the 32 bytes and nulls the source's manager
//! and invoker, as libstdc++'s move constructor does (a callable is stored in place only when it
//! is trivially copyable, so the copy is valid); destroying one calls the manager with
//! `__destroy_functor` (3).
//!
//! PyTorch's Linux wheels are built with GCC and libstdc++. Another library's `std::function`
//! (libc++: a buffer and a pointer to it) is refused as far as it can be told: the manager and
//! the invoker must both be code in a loaded object (`dladdr`); libc++'s words there are the
//! callable's captures and a pointer to its buffer, which are not.
//!
//! Invariants: a `Filter` owns its callable (the source was emptied) and destroys it exactly
//! once; its invoker is called with the callable's storage, never after the drop.

use std::ffi::{c_int, c_void};

type Storage = [*mut c_void; 2];
type Manager = unsafe extern "C" fn(*mut Storage, *const Storage, c_int) -> bool;
type Invoker = unsafe extern "C" fn(*const Storage, *mut *mut c_void) -> bool;

/// libstdc++'s `_Manager_operation::__destroy_functor`.
const DESTROY_FUNCTOR: c_int = 3;

#[repr(C)]
struct StdFunction {
    functor: Storage,
    manager: Option<Manager>,
    invoker: Option<Invoker>,
}

/// A filter moved out of PyTorch's `std::function`.
pub struct Filter(StdFunction);

// SAFETY: PyTorch's filters (a graph capture's, which asks the CUDA runtime about the stream;
// use_mem_pool's, which compares thread ids) are called by its own allocator from whichever
// thread allocates, and hold no thread-affine state.
unsafe impl Send for Filter {}

fn is_code(p: *const c_void) -> bool {
    // SAFETY: dladdr only reads the loader's tables for the address.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        libc::dladdr(p, &mut info) != 0 && !info.dli_fbase.is_null()
    }
}

impl Filter {
    /// Moves the callable out of the `std::function` at `src`, which is left empty.
    ///
    /// # Safety
    /// `src` is NULL or points to a live `std::function<bool(cudaStream_t)>` the caller may
    /// move from.
    pub unsafe fn take(src: *mut c_void) -> Result<Filter, String> {
        if src.is_null() {
            return Err("the filter is NULL".into());
        }
        let f = src as *mut StdFunction;
        // SAFETY: src points to 32 readable bytes (the caller's contract); function pointers
        // are read as raw words first, so no invalid value is made.
        let (m, i) = unsafe {
            let w = src as *const *const c_void;
            (*w.add(2), *w.add(3))
        };
        if m.is_null() || i.is_null() {
            return Err("the filter is an empty std::function".into());
        }
        if !is_code(m) || !is_code(i) {
            return Err(format!(
                "the filter is not a libstdc++ std::function (its manager {m:p} and invoker \
                 {i:p} are not both code of a loaded library)"
            ));
        }
        // SAFETY: a libstdc++ std::function (checked above as far as it can be): the move
        // libstdc++ does, a copy of the 32 bytes and the source's manager and invoker nulled,
        // so the caller's destructor of the source does nothing.
        unsafe {
            let out = std::ptr::read(f);
            (*f).manager = None;
            (*f).invoker = None;
            Ok(Filter(out))
        }
    }

    /// Whether an allocation on `stream` belongs to the pool.
    pub fn accepts(&self, stream: *mut c_void) -> bool {
        let mut s = stream;
        let invoker = self.0.invoker.expect("take() checked the invoker");
        // SAFETY: the invoker of this callable, called with its storage and a pointer to the
        // argument (`cudaStream_t&&`). A C++ exception thrown by the filter (PyTorch's checks a
        // CUDA call) cannot cross this frame: the process aborts, where PyTorch's own
        // allocator would raise it.
        unsafe { invoker(&self.0.functor, &mut s) }
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        if let Some(m) = self.0.manager {
            let at = std::ptr::addr_of_mut!(self.0.functor);
            // SAFETY: destroys the callable this Filter owns, once (dest and source are the same
            // object, as in libstdc++'s destructor).
            unsafe { m(at, at, DESTROY_FUNCTOR) };
        }
    }
}

/// `symm_pool_filter_fn` over a boxed `Filter`.
///
/// # Safety
/// `ctx` is a `Box<Filter>` made by the shim and not yet dropped.
pub unsafe extern "C" fn call_filter(ctx: *mut c_void, stream: *mut c_void) -> c_int {
    // SAFETY: the caller's contract.
    let f = unsafe { &*(ctx as *const Filter) };
    f.accepts(stream) as c_int
}

/// `symm_pool_filter_drop_fn` over a boxed `Filter`.
///
/// # Safety
/// `ctx` is a `Box<Filter>` made by the shim; called once.
pub unsafe extern "C" fn drop_filter(ctx: *mut c_void) {
    // SAFETY: the caller's contract.
    drop(unsafe { Box::from_raw(ctx as *mut Filter) });
}
