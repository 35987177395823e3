//! The C ABI: the only `#[no_mangle]` code. Each entry point checks its arguments, runs inside
//! a panic guard, and reports failure as a status (or NULL) plus `symm_last_error()`.
//! Contract: include/symmalloc.h (generated from this file) and the README (design, ABI policy).

// Entry points are called from C with raw pointers; each dereference is checked for NULL and
// carries a SAFETY note. Marking them `unsafe fn` would change nothing for C callers.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod groups;
pub mod guard;
pub mod ipc_export;
pub mod moe;
pub mod moe_calls;
pub mod p2p;
pub mod peer_access;
pub mod pool_calls;
pub mod quant;
pub mod torch_alloc;
pub mod types;

use crate::comm::Communicator;
use crate::error::{Error, Result, Status};
use crate::heap::{self, stats::Stats};
use crate::ipc::{unique_id::ID_BYTES, UniqueId};
use guard::{guard_ptr, guard_status, guard_void};
pub use ipc_export::*;
pub use pool_calls::*;
use std::ffi::{c_char, c_int, c_void};
pub use torch_alloc::*;
use types::*;

/// A communicator over ranks of a single-node job; several may live on one device.
#[allow(non_camel_case_types)]
pub struct symm_comm_t {
    inner: Option<Box<Communicator>>,
}

impl guard::Handle for symm_comm_t {
    const KIND: guard::Kind = guard::Kind::Comm;
}

fn stream_of(s: *mut CUstream_st) -> u64 {
    s as u64
}

/// Allocates `size` bytes of symmetric memory on `device`, ordered on `stream` (NULL = legacy
/// default stream). Returns NULL for `size` 0 (not an error) and on failure (see
/// `symm_last_error()`). Signature matches PyTorch's CUDAPluggableAllocator.
#[no_mangle]
pub extern "C" fn symm_malloc(size: usize, device: c_int, stream: *mut CUstream_st) -> *mut c_void {
    guard_ptr!("symm_malloc", || {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let a = heap::global()?;
        Ok(a.malloc(size as u64, device, stream_of(stream))? as *mut c_void)
    })
}

/// Frees a block from `symm_malloc`; `size` must be the size it was allocated with. Freeing
/// NULL does nothing. Errors (unknown pointer, double free, wrong size) leave every allocation
/// intact and are reported through `symm_last_error()`.
#[no_mangle]
pub extern "C" fn symm_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) {
    guard_void!("symm_free", || {
        if ptr.is_null() {
            return Ok(());
        }
        heap::global()?.free(ptr as u64, size as u64, device, stream_of(stream))
    })
}

/// The library's version (semantic versioning; the crate's). The header carries the version
/// it was generated from; `symm_version()` says which library was loaded.
pub const SYMMALLOC_VERSION_MAJOR: i32 = 0;
pub const SYMMALLOC_VERSION_MINOR: i32 = 2;
pub const SYMMALLOC_VERSION_PATCH: i32 = 0;
/// `MAJOR * 10000 + MINOR * 100 + PATCH`, as `symm_version()` returns it.
pub const SYMMALLOC_VERSION_CODE: i32 =
    SYMMALLOC_VERSION_MAJOR * 10000 + SYMMALLOC_VERSION_MINOR * 100 + SYMMALLOC_VERSION_PATCH;
/// Bytes of the first `symm_memory_stats_t` (its ten v1 fields): the least that
/// `symm_memory_stats_sized` serves, and exactly what `symm_memory_stats` writes.
pub const SYMM_MEMORY_STATS_V1_SIZE: usize = 80;

/// The loaded library's version, `SYMMALLOC_VERSION_CODE` of the header it was built with.
#[no_mangle]
pub extern "C" fn symm_version() -> c_int {
    SYMMALLOC_VERSION_CODE
}

fn write_stats(device: c_int, out: *mut Stats, size: usize, name: &str) -> Result<()> {
    if out.is_null() {
        return Err(Error::invalid(format!("{name}: out is NULL")));
    }
    let have = std::mem::size_of::<Stats>();
    if size < SYMM_MEMORY_STATS_V1_SIZE || size > have || size % 8 != 0 {
        return Err(Error::invalid(format!(
            "{name}: size {size} is not a symm_memory_stats_t size this library serves; \
             expected a multiple of 8 from {SYMM_MEMORY_STATS_V1_SIZE} (v1) to {have} \
             (sizeof(symm_memory_stats_t) of library {}.{}.{}; a larger struct comes from a \
             newer header)",
            SYMMALLOC_VERSION_MAJOR, SYMMALLOC_VERSION_MINOR, SYMMALLOC_VERSION_PATCH
        )));
    }
    let s = heap::global()?.stats(device)?;
    // SAFETY: out is non-NULL and the caller declared `size` writable bytes there (checked to be
    // at most sizeof(Stats)); the source is a live Stats; the regions are distinct.
    unsafe { std::ptr::copy_nonoverlapping(&s as *const Stats as *const u8, out as *mut u8, size) };
    Ok(())
}

/// Fills the ten v1 fields of `*out` (`SYMM_MEMORY_STATS_V1_SIZE` bytes: `allocated_bytes` to
/// `staged_collectives`) with the statistics of `device`, and nothing past them, so a caller
/// built against any version of the header is safe. The fields added since are filled by
/// `symm_memory_stats_sized`.
#[no_mangle]
pub extern "C" fn symm_memory_stats(device: c_int, out: *mut Stats) -> symm_status_t {
    guard_status!("symm_memory_stats", || {
        write_stats(device, out, SYMM_MEMORY_STATS_V1_SIZE, "symm_memory_stats")
    })
}

/// Fills the first `size` bytes of `*out` with the statistics of `device`; pass
/// `sizeof(symm_memory_stats_t)`. Nothing past `size` is written. A size that is not a whole
/// number of fields, is below the v1 struct, or is larger than this library's struct (a newer
/// header) is refused with SYMM_ERR_INVALID_ARGUMENT and nothing is written.
#[no_mangle]
pub extern "C" fn symm_memory_stats_sized(
    device: c_int,
    out: *mut Stats,
    size: usize,
) -> symm_status_t {
    guard_status!("symm_memory_stats_sized", || {
        write_stats(device, out, size, "symm_memory_stats_sized")
    })
}

/// The calling thread's last error message ("" after a successful call). Valid until the
/// thread's next symmalloc call.
#[no_mangle]
pub extern "C" fn symm_last_error() -> *const c_char {
    guard::last_error_ptr()
}

/// A fixed description of a status code.
#[no_mangle]
pub extern "C" fn symm_status_string(status: symm_status_t) -> *const c_char {
    // The argument crosses as an integer; an out-of-range value must not be trusted.
    Status::from_raw(status as i32)
        .map_or(c"unknown symm_status_t value", Status::describe)
        .as_ptr()
}

/// Makes a new random job id; send its bytes to every rank. The id records this host (boot id
/// and network namespace, or SYMMALLOC_HOST_ID): make it on the host whose ranks will use it.
#[no_mangle]
pub extern "C" fn symm_get_unique_id(out: *mut symm_unique_id_t) -> symm_status_t {
    guard_status!("symm_get_unique_id", || {
        if out.is_null() {
            return Err(Error::invalid("symm_get_unique_id: out is NULL"));
        }
        let bytes = UniqueId::generate()?.to_bytes();
        let mut id = symm_unique_id_t {
            internal: [0; ID_BYTES],
        };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as c_char;
        }
        // SAFETY: out is non-NULL and points at a symm_unique_id_t.
        unsafe { out.write(id) };
        Ok(())
    })
}

fn register(comm: Box<Communicator>, out: *mut *mut symm_comm_t) -> Result<()> {
    let p = guard::give(symm_comm_t { inner: Some(comm) });
    // SAFETY: out was checked non-NULL by the caller.
    unsafe { out.write(p) };
    Ok(())
}

/// Creates the communicator of `rank` (of `world_size`, 1 to 8) on `device`. Collective: every
/// rank calls it with the same id. Waits at most SYMMALLOC_TIMEOUT_S for the peers. Reads the
/// communicator settings (SYMMALLOC_LL_*, SYMMALLOC_ONE_SHOT_MAX_BYTES,
/// SYMMALLOC_CHECK_SYMMETRY) and fails with SYMM_ERR_INVALID_ARGUMENT unless every rank has
/// the same. A communicator joins the ranks of one host: a rank on another host than the id's
/// fails at once with SYMM_ERR_INVALID_ARGUMENT naming both hosts, and the bootstrap handshake
/// refuses a peer on another host the same way on both sides.
#[no_mangle]
pub extern "C" fn symm_comm_init(
    comm: *mut *mut symm_comm_t,
    world_size: c_int,
    rank: c_int,
    device: c_int,
    id: *const symm_unique_id_t,
) -> symm_status_t {
    guard_status!("symm_comm_init", || {
        if comm.is_null() || id.is_null() {
            return Err(Error::invalid(
                "symm_comm_init: comm and id must not be NULL",
            ));
        }
        // SAFETY: comm is non-NULL; clear the output first so failures leave NULL.
        unsafe { comm.write(std::ptr::null_mut()) };
        // SAFETY: id is non-NULL and points at 128 readable bytes.
        let raw = unsafe { (*id).internal };
        let bytes: [u8; ID_BYTES] = raw.map(|c| c as u8);
        let uid = UniqueId::from_bytes(&bytes)?;
        register(Communicator::init(world_size, rank, device, &uid)?, comm)
    })
}

/// Creates the communicator from launcher variables: torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE,
/// TORCHELASTIC_RUN_ID or MASTER_ADDR+MASTER_PORT) or Open MPI (OMPI_COMM_WORLD_LOCAL_RANK,
/// OMPI_COMM_WORLD_LOCAL_SIZE). The device is the local rank. The id is `SYMMALLOC_UNIQUE_ID`
/// (hex) when set, else derived from those variables (see `ipc::env::unique_id`).
#[no_mangle]
pub extern "C" fn symm_comm_init_from_env(comm: *mut *mut symm_comm_t) -> symm_status_t {
    guard_status!("symm_comm_init_from_env", || {
        if comm.is_null() {
            return Err(Error::invalid(
                "symm_comm_init_from_env: comm must not be NULL",
            ));
        }
        // SAFETY: comm is non-NULL.
        unsafe { comm.write(std::ptr::null_mut()) };
        let get = crate::config::var;
        let env = crate::ipc::env::from_env(&get)?;
        let host = crate::ipc::host::Host::current()?;
        let uid = crate::ipc::env::unique_id(&get, &env.job_key, &host)?;
        register(
            Communicator::init(env.world, env.rank, env.device, &uid)?,
            comm,
        )
    })
}

fn with_comm<T>(
    comm: *mut symm_comm_t,
    f: impl FnOnce(&mut Communicator) -> Result<T>,
) -> Result<T> {
    if comm.is_null() {
        return Err(Error::invalid("comm is NULL"));
    }
    if !guard::is_live(comm) {
        return Err(Error::invalid(format!(
            "comm {comm:p} is not a live communicator (destroyed already, or never created)"
        )));
    }
    // SAFETY: comm is a live handle (ffi/guard.rs), so it points at a symm_comm_t we allocated and have not
    // freed; the caller must not use one communicator from two threads at once (as in NCCL).
    let c = unsafe { &mut *comm };
    f(c.inner
        .as_mut()
        .ok_or_else(|| Error::internal("communicator without state"))?)
}

/// Destroys a communicator (local: no peer needs to take part). Destroying twice is an error.
#[no_mangle]
pub extern "C" fn symm_comm_destroy(comm: *mut symm_comm_t) -> symm_status_t {
    guard_status!("symm_comm_destroy", || {
        if comm.is_null() {
            return Err(Error::invalid("symm_comm_destroy: comm is NULL"));
        }
        let Some(mut b) = guard::take(comm) else {
            return Err(Error::invalid(format!(
                "symm_comm_destroy({comm:p}): not a live communicator (destroyed twice?)"
            )));
        };
        match b.inner.take() {
            Some(c) => c.destroy(),
            None => Ok(()),
        }
    })
}

/// All-reduce with automatic algorithm choice. In place when send == recv.
#[no_mangle]
pub extern "C" fn symm_all_reduce(
    comm: *mut symm_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: symm_dtype_t,
    op: symm_op_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    symm_all_reduce_algo(comm, SYMM_ALGO_AUTO, send, recv, count, dtype, op, stream)
}

/// All-reduce with an explicit algorithm (AUTO, ONE_SHOT, TWO_SHOT, MULTIMEM, ONE_SHOT_LL).
/// Stream-ordered and capturable into CUDA graphs. Buffers inside the symmetric heap are used
/// in place; others are staged through a communicator buffer (counted in
/// `staged_collectives`). ONE_SHOT_LL takes messages up to `SYMMALLOC_LL_BYTES`; MULTIMEM runs
/// only where the multicast safety rule allows it (in-place sums of whole 16-byte vectors).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_all_reduce_algo(
    comm: *mut symm_comm_t,
    algo: symm_algo_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: symm_dtype_t,
    op: symm_op_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_all_reduce", || {
        let (algo, dtype, op) = (guard::algo(algo)?, guard::dtype(dtype)?, guard::op(op)?);
        with_comm(comm, |c| {
            c.all_reduce(
                algo,
                send as u64,
                recv as u64,
                count as u64,
                dtype,
                op,
                stream_of(stream),
            )
        })
    })
}

/// Reduce-scatter: rank r receives elements [r * recv_count, (r + 1) * recv_count) of the
/// reduction of every rank's `send` (world * recv_count elements) in `recv` (recv_count).
/// bf16, fp16, fp32; sum, max, min. Stream-ordered and capturable; buffers inside the heap
/// are used in place, others staged. In place: recv = send + rank * recv_count; any other
/// overlap is SYMM_ERR_INVALID_ARGUMENT. Every rank must call it with the same count, type,
/// op and buffer offsets (SYMM_ERR_NOT_SYMMETRIC otherwise).
#[no_mangle]
pub extern "C" fn symm_reduce_scatter(
    comm: *mut symm_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    dtype: symm_dtype_t,
    op: symm_op_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_reduce_scatter", || {
        let (dtype, op) = (guard::dtype(dtype)?, guard::op(op)?);
        with_comm(comm, |c| {
            c.reduce_scatter(
                send as u64,
                recv as u64,
                recv_count as u64,
                dtype,
                op,
                stream_of(stream),
            )
        })
    })
}

/// All-gather: rank r's `send` (send_count elements) lands at element r * send_count of every
/// rank's `recv` (world * send_count). Any type (bf16, fp16, fp32: the bits are copied).
/// Stream-ordered and capturable; buffers inside the heap are used in place, others staged. In
/// place: send = recv + rank * send_count; any other overlap is SYMM_ERR_INVALID_ARGUMENT.
#[no_mangle]
pub extern "C" fn symm_all_gather(
    comm: *mut symm_comm_t,
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    dtype: symm_dtype_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_all_gather", || {
        let dtype = guard::dtype(dtype)?;
        with_comm(comm, |c| {
            c.all_gather(
                send as u64,
                recv as u64,
                send_count as u64,
                dtype,
                stream_of(stream),
            )
        })
    })
}

/// All-reduce fused with residual add and RMSNorm, for tensor-parallel inference: with
/// `r = sum over ranks of x + residual` (fp32), writes `residual = r` and
/// `out = r * rsqrt(mean(r^2) + eps) * weight`, row by row. `x`, `residual` and `out` are
/// `[tokens, hidden]`, `weight` is `[hidden]`; bf16 or fp16. `hidden` is a multiple of 8 up to
/// 16384, every pointer 16-byte aligned, and no two buffers overlap (SYMM_ERR_INVALID_ARGUMENT
/// otherwise, naming the value). Only `x` is read by peers: it must be symmetric (in the heap,
/// or it is staged); the others are this rank's own. Stream-ordered and capturable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_all_reduce_add_rms_norm(
    comm: *mut symm_comm_t,
    x: *const c_void,
    residual: *mut c_void,
    weight: *const c_void,
    out: *mut c_void,
    tokens: usize,
    hidden: usize,
    eps: f32,
    dtype: symm_dtype_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_all_reduce_add_rms_norm", || {
        let dtype = guard::dtype(dtype)?;
        let rms = crate::comm::call::Rms {
            residual: residual as u64,
            weight: weight as u64,
            out: out as u64,
            tokens: tokens as u64,
            hidden: hidden as u64,
            eps,
            quant: None,
        };
        with_comm(comm, |c| {
            c.all_reduce_add_rms_norm(x as u64, rms, dtype, stream_of(stream))
        })
    })
}

/// Every rank waits for every other; stream-ordered.
#[no_mangle]
pub extern "C" fn symm_barrier(comm: *mut symm_comm_t, stream: *mut CUstream_st) -> symm_status_t {
    guard_status!("symm_barrier", || {
        with_comm(comm, |c| c.barrier(stream_of(stream)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_version_is_the_crates() {
        let v = |s: &str| s.parse::<i32>().unwrap();
        assert_eq!(
            (
                SYMMALLOC_VERSION_MAJOR,
                SYMMALLOC_VERSION_MINOR,
                SYMMALLOC_VERSION_PATCH
            ),
            (
                v(env!("CARGO_PKG_VERSION_MAJOR")),
                v(env!("CARGO_PKG_VERSION_MINOR")),
                v(env!("CARGO_PKG_VERSION_PATCH"))
            ),
            "update the SYMMALLOC_VERSION_* constants with Cargo.toml's version"
        );
        assert_eq!(symm_version(), SYMMALLOC_VERSION_CODE);
    }

    #[test]
    fn the_v1_stats_are_the_first_ten_fields() {
        assert_eq!(
            SYMM_MEMORY_STATS_V1_SIZE,
            std::mem::offset_of!(Stats, requested_bytes)
        );
    }
}
