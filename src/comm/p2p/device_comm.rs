//! What device code sees of a communicator (`symm_comm_device`, include/symmalloc_device.cuh):
//! the `symm_device_comm_t` struct and the constants of the signal pads. This file is part of
//! the public header: cbindgen reads it (tests/header.rs), so every `pub` item here is C ABI.
//!
//! Signal pad of one rank (device memory, symmetric, owned by the communicator, allocated and
//! zeroed at init; comm/p2p/signal_pad.rs): `SYMM_SIGNAL_SLOTS` `uint64_t` values, then
//! `SYMM_SIGNAL_SLOTS` `uint32_t` writer words. A signal to slot s of rank p stores the sender's
//! `rank + 1` into p's writer word s, then the value into p's value s (release, system scope);
//! a wait reads its own value s (acquire, system scope). The writer word only names, in a
//! timeout's report, the rank that last raised the slot.
//!
//! Invariants: the struct only grows at its end (`struct_size` says how much of it the library
//! wrote; `version` counts layouts); `heap_bases[rank]` is this process's own heap, so a peer's
//! address of a local pointer is `heap_bases[r] + (ptr - heap_bases[rank])`.

/// Ranks of a communicator, at most (the length of the per-rank arrays below).
pub const SYMM_MAX_RANKS: usize = 8;
/// Signal slots per rank and communicator, numbered 0..SYMM_SIGNAL_SLOTS-1.
pub const SYMM_SIGNAL_SLOTS: u32 = 4096;
/// Byte offset, in a signal pad, of the writer words (after the `uint64_t` values).
pub const SYMM_SIGNAL_WRITERS_OFFSET: u64 = SYMM_SIGNAL_SLOTS as u64 * 8;
/// Bytes of one rank's signal pad.
pub const SYMM_SIGNAL_PAD_BYTES: u64 = SYMM_SIGNAL_WRITERS_OFFSET + SYMM_SIGNAL_SLOTS as u64 * 4;
/// The layout `symm_comm_device` writes (`symm_device_comm_t.version`).
pub const SYMM_DEVICE_COMM_VERSION: u32 = 1;
/// Bytes of the first `symm_device_comm_t`: the least `symm_comm_device` serves.
pub const SYMM_DEVICE_COMM_V1_SIZE: usize = 176;
/// The code of a signal wait's timeout in the abort word and the fatal error word:
/// `(SYMM_DEVICE_ERR_SIGNAL_TIMEOUT << 16) | writer`, writer the slot's writer word (the rank
/// that last raised it, plus one; 0 when none did).
pub const SYMM_DEVICE_ERR_SIGNAL_TIMEOUT: u32 = 5;
/// `error_word` is `uint32_t[16]` of host-mapped memory, only ever written by device code:
/// index of the fatal error word.
pub const SYMM_DEVICE_ERR_FATAL: u32 = 1;
/// Index of the timed-out wait's slot, written before the fatal word.
pub const SYMM_DEVICE_ERR_SLOT: u32 = 2;
/// Index of the awaited value (two words, low first), written before the fatal word.
pub const SYMM_DEVICE_ERR_AWAITED: u32 = 4;
/// Index of the last value seen in the slot (two words, low first), written before the fatal word.
pub const SYMM_DEVICE_ERR_SEEN: u32 = 6;

/// A communicator as device code sees it (`symm_comm_device` fills it; the helpers of
/// include/symmalloc_device.cuh take it). Every address is in this process's address space and
/// stays valid until the communicator is destroyed; a peer's address is valid only for memory
/// every rank passed to `symm_rendezvous` and has not released since.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceComm {
    /// Bytes of this struct the library wrote (the `size` the caller passed).
    pub struct_size: u64,
    /// `SYMM_DEVICE_COMM_VERSION` of the library that wrote it.
    pub version: u32,
    /// Ranks of the communicator.
    pub world: i32,
    /// This process's rank.
    pub rank: i32,
    /// `SYMM_SIGNAL_SLOTS`.
    pub signal_slots: u32,
    /// `SYMMALLOC_TIMEOUT_S` in nanoseconds (of `%globaltimer`): how long a signal wait spins.
    pub timeout_ns: u64,
    /// Where rank r's heap appears in this process (r = rank: the heap itself); entries past
    /// `world` are 0.
    pub heap_bases: [u64; SYMM_MAX_RANKS],
    /// Rank r's signal pad in this process (`uint64_t[SYMM_SIGNAL_SLOTS]` values, then the
    /// writer words); entries past `world` are 0.
    pub signal_pads: [u64; SYMM_MAX_RANKS],
    /// This rank's abort word (`uint32_t`, device memory): 0, or the communicator's first fatal
    /// error. Device waits poll it; once set, every wait of the communicator returns at once.
    pub abort_word: u64,
    /// The communicator's error words (`uint32_t[16]`, host-mapped; 0 on the host backend):
    /// device code only writes them, once per error (SYMM_DEVICE_ERR_* name the words).
    pub error_word: u64,
}

const _: () = assert!(std::mem::size_of::<DeviceComm>() == SYMM_DEVICE_COMM_V1_SIZE);
// The collective kernels report a wait's timeout with the same code (collective/kernel_args.rs).
const _: () = assert!(
    SYMM_DEVICE_ERR_SIGNAL_TIMEOUT == crate::comm::collective::kernel_args::ERR_SIGNAL_TIMEOUT
);
