//! Environment variables, read in one place: every read of the process environment by the
//! library goes through [`var`] (vars.rs), and every `SYMMALLOC_*` setting but
//! `SYMMALLOC_UNIQUE_ID` is parsed in this folder, by one of five typed parsers ([`Vars::size`],
//! [`Vars::duration_s`], [`Vars::boolean`], [`Vars::enumeration`], [`Vars::count`]) or, for
//! `SYMMALLOC_LL_GRID`, by [`parse_grid`] and, for `SYMMALLOC_HOST_ID`, by [`Vars::host_id`].
//! The README's "Environment" table lists every variable with its default and accepted values
//! (`tests/config_env.rs` checks both ways).
//!
//! - vars.rs: [`var`], [`Lookup`], [`Vars`] and its five parsers, [`parse_size`]: how a
//!   variable's text becomes a value or a refusal (knows no setting);
//! - settings.rs: each setting's variable, type, default and limits (the `Vars` methods named
//!   after the settings, [`Level`], [`BackendKind`], the `DEFAULT_*` and `MAX_*` values);
//! - this file: the settings of the process (`timeout()`, `ll_bytes(world)`, ...: each one
//!   setting's `Vars` method over the process environment), which the rest of the library calls.
//!   Imports point one way: this file -> settings.rs -> vars.rs.
//!
//! Rules: unset or empty (blank) means the default; any other value that is not accepted is an
//! `SYMM_ERR_INVALID_ARGUMENT` naming the variable, the value and what is accepted, returned by
//! the call that reads it (`symm_comm_init` for the communicator settings, the first allocator
//! call for the allocator's). Never a panic, never a silent default.
//!
//! Readers outside this folder, and why:
//! - `ipc/env.rs` parses the launcher's variables (`LOCAL_RANK`, `OMPI_COMM_WORLD_*`, ...,
//!   and `SYMMALLOC_UNIQUE_ID`) for `symm_comm_init_from_env`, as a pure function of a lookup;
//!   the FFI passes it [`var`].
//! - `debug.rs` reads `SYMMALLOC_DEBUG` through [`debug_level`]. An unknown level fails the
//!   allocator's creation like any other setting (`heap::global`); were diagnostics asked for
//!   before that, `debug.rs` prints one warning naming the value and leaves them off.
//! - The multicast gate (`cuda/multicast_gate.rs`, over a lookup; [`var`] in the process)
//!   reads the foreign disabling variables (`NCCL_NVLS_ENABLE`,
//!   `TORCH_SYMM_MEM_DISABLE_MULTICAST`, `NVSHMEM_DISABLE_NVLS`) with their own conventions:
//!   disabling always wins. It checks its opt-in with [`Vars::enable_multicast`] (garbage is
//!   refused by name) and turns multicast on only for exactly `1`.
//! - `build.rs` reads the build-time variables (`NVCC`, `CUDA_HOME`, `SYMMALLOC_CUDA_ARCHS`).
//! - The demo binary (`src/bin/symmalloc-demo.rs`, not the library) passes its children
//!   `SYMMALLOC_DEMO_COUNT` and reads it back itself.

mod settings;
mod vars;

pub use settings::{
    default_comm_arena_bytes, default_ll_bytes, parse_grid, BackendKind, Level, DEFAULT_LL_GRID,
    DEFAULT_SPLIT_SLOTS, DEFAULT_TIMEOUT_S, MAX_HOST_ID, MAX_LL_BYTES, MAX_SPLIT_SLOTS,
    MAX_TIMEOUT_S, MIN_TIMEOUT_S,
};
pub use vars::{parse_size, var, Lookup, Vars};

use crate::error::Result;
use std::time::Duration;

/// Which memory backend the process uses (`SYMMALLOC_BACKEND`).
pub fn backend_kind() -> Result<BackendKind> {
    Vars::process().backend_kind()
}

/// `SYMMALLOC_HEAP_SIZE`: virtual size of each device's symmetric heap. `None` = backend default.
pub fn heap_size() -> Result<Option<u64>> {
    Vars::process().heap_size()
}

/// `SYMMALLOC_COMM_ARENA_SIZE`: address space of each communicator's arena (its own buffers
/// and `symm_comm_malloc` memory), rounded up to the granularity; must match on all ranks.
/// Default `default_comm_arena_bytes` of the heap.
pub fn comm_arena_size() -> Result<Option<u64>> {
    Vars::process().comm_arena_size()
}

/// `SYMMALLOC_SPLIT_SLOTS`: how many children's internal blocks a communicator made by
/// `symm_comm_init` reserves in its own (comm/group/slots.rs), so that a split makes no device
/// memory; at most a quarter of its arena. `0..=MAX_SPLIT_SLOTS`, default `DEFAULT_SPLIT_SLOTS`;
/// must match on all ranks.
pub fn split_slots() -> Result<u64> {
    Vars::process().split_slots()
}

/// The raw values of the variables a communicator's settings come from (those `symm_comm_init`
/// compares between ranks), for `symm_comm_split` to compare: equal text gives equal settings
/// for any world size.
pub fn comm_settings_text() -> String {
    [
        "SYMMALLOC_LL_BYTES",
        "SYMMALLOC_LL_GRID",
        "SYMMALLOC_LL_MAX_BYTES",
        "SYMMALLOC_ONE_SHOT_MAX_BYTES",
        "SYMMALLOC_CHECK_SYMMETRY",
        "SYMMALLOC_SHARED_GPU",
        "SYMMALLOC_COMM_ARENA_SIZE",
        "SYMMALLOC_SPLIT_SLOTS",
    ]
    .iter()
    .map(|n| format!("{n}={:?}", var(n).unwrap_or_default().trim()))
    .collect::<Vec<_>>()
    .join(" ")
}

/// `SYMMALLOC_TIMEOUT_S`: every wait on a peer (bootstrap, exchange, kernel barrier) gives up
/// after this many seconds. Default 60; from `MIN_TIMEOUT_S` to `MAX_TIMEOUT_S`.
pub fn timeout() -> Result<Duration> {
    Vars::process().timeout()
}

/// `SYMMALLOC_CHECK_SYMMETRY=1`: every collective compares buffer offsets and count across ranks.
pub fn check_symmetry() -> Result<bool> {
    Vars::process().check_symmetry()
}

/// `SYMMALLOC_THREAD_CACHE=0` turns off the per-thread caches in front of the heap
/// (heap/tcache.rs); on by default.
pub fn thread_cache() -> Result<bool> {
    Vars::process().thread_cache()
}

/// `SYMMALLOC_SHARED_GPU=1`: several ranks (processes) may use one GPU. For testing the
/// collectives' protocol at N ranks on a machine with fewer GPUs: without MPS the ranks' kernels
/// time-slice, so each wait on a peer can last a scheduler time slice (milliseconds). Correct,
/// never fast; multicast stays off. Must match on all ranks.
pub fn shared_gpu() -> Result<bool> {
    Vars::process().shared_gpu()
}

/// `SYMMALLOC_ENABLE_MULTICAST=1`: the opt-in for the multimem path (the multicast gate decides;
/// see `Vars::enable_multicast`).
pub fn enable_multicast() -> Result<bool> {
    Vars::process().enable_multicast()
}

/// `SYMMALLOC_DEBUG`: the diagnostics level (debug.rs).
pub fn debug_level() -> Result<Level> {
    Vars::process().debug_level()
}

/// `SYMMALLOC_HOST_ID`: a host identity that replaces the one read from the kernel (see
/// `Vars::host_id`); `None` when unset.
pub fn host_id() -> Result<Option<String>> {
    Vars::process().host_id()
}

/// `SYMMALLOC_LL_BYTES`: the largest message the one-shot LL kernel takes; each communicator
/// holds 2 x world x this much device memory for it (default `default_ll_bytes`). A multiple
/// of 1 KiB, at most 256M; must match on all ranks.
pub fn ll_bytes(world: usize) -> Result<u64> {
    Vars::process().ll_bytes(world)
}

/// `SYMMALLOC_LL_GRID=BLOCKSxTHREADS`: the most blocks of an LL call (each call runs on just
/// the blocks that have items: launch.rs) and the most threads per block (each call uses just
/// enough, at least 64, to spread its message over the blocks); at most 128 blocks of at most
/// 512 threads, threads a multiple of 32; must match on all ranks.
pub fn ll_grid() -> Result<(u32, u32)> {
    Vars::process().ll_grid()
}

/// An AUTO threshold override (`SYMMALLOC_LL_MAX_BYTES`, `SYMMALLOC_ONE_SHOT_MAX_BYTES`), a
/// size like the others.
pub fn auto_threshold(name: &str) -> Result<Option<u64>> {
    Vars::process().size(name)
}
