//! The communicator's p2p signal pads (layout: device_comm.rs) and the three ways a signal or a
//! wait is carried out: on the host backend by the CPU (atomics on the peers' memfd mappings),
//! on CUDA by a one-thread kernel (kernels/p2p.cu over include/symmalloc_device.cuh) or by
//! stream memory operations (cuda/stream_ops.rs). Also the argument struct of the p2p kernels
//! (the error a timed-out wait reports is collective/error_word.rs's `timeout_error`, as the
//! kernels report it through the error words).
//!
//! Invariants: a pad is written only through `signal` (the writer word, then the value with
//! release semantics at system scope) and read only by waits (acquire); values are stored, not
//! added, so a slot is raised by storing a larger value (monotonic counters: no reset). A CUDA
//! wait is always bounded: the kernel gives up after the communicator's timeout, records it in
//! the abort word and the error words, and releases the stream; the stream-memory-op wait is
//! unbounded and never used for `symm_wait` (bench/NOTES.md, "Signals and waits").

use super::device_comm::*;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Address of slot `slot`'s value in the pad at `pad`.
pub fn value_addr(pad: u64, slot: u32) -> u64 {
    pad + slot as u64 * 8
}

/// Address of slot `slot`'s writer word in the pad at `pad`.
pub fn writer_addr(pad: u64, slot: u32) -> u64 {
    pad + SYMM_SIGNAL_WRITERS_OFFSET + slot as u64 * 4
}

/// How a CUDA signal is carried out (`symm_signal` takes `DEFAULT_SIGNAL`; the benchmark
/// compares both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalVia {
    /// A one-thread kernel: `symm_signal_send` (writer word, `fence.sc.sys`, release store).
    Kernel,
    /// Two stream memory operations (`cuStreamWriteValue32` of the writer word, then
    /// `cuStreamWriteValue64` of the value behind a memory barrier): no kernel, no SM.
    StreamWrite,
}

/// How a CUDA wait is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitVia {
    /// A one-thread kernel: `symm_signal_wait` (bounded; reports through the error words).
    Kernel,
    /// `cuStreamWaitValue64(GEQ)`: unbounded (a dead peer holds the stream for good), so only
    /// the benchmark uses it.
    StreamWait,
}

/// What `symm_signal` uses on CUDA: a kernel. The driver refused the stream writes into the pads
/// on an H100 (CUDA_ERROR_INVALID_VALUE; bench/NOTES.md, "Signals and waits").
pub const DEFAULT_SIGNAL: SignalVia = SignalVia::Kernel;

/// The argument of the p2p kernels (kernels/p2p.cu `P2pArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct P2pArgs {
    pub d: DeviceComm,
    pub value: u64,
    pub slot: u32,
    pub peer: i32,
}

const _: () = assert!(std::mem::size_of::<P2pArgs>() == SYMM_DEVICE_COMM_V1_SIZE + 16);

fn value_word(addr: u64) -> &'static AtomicU64 {
    // SAFETY: addr is an 8-byte-aligned value word of a signal pad mapped for the communicator's
    // life (the caller checked the peer's pad is still mapped); atomics are the only access.
    unsafe { &*(addr as *const AtomicU64) }
}

fn writer_word(addr: u64) -> &'static AtomicU32 {
    // SAFETY: as value_word(), for a 4-byte writer word.
    unsafe { &*(addr as *const AtomicU32) }
}

/// The host backend's signal: `sender`'s mark into the writer word (unless `sender` signals
/// its own pad: a reset keeps naming the last other writer), then `value` (release).
pub fn host_signal(peer_pad: u64, slot: u32, sender: usize, own: bool, value: u64) {
    if !own {
        writer_word(writer_addr(peer_pad, slot)).store(sender as u32 + 1, Ordering::Relaxed);
    }
    value_word(value_addr(peer_pad, slot)).store(value, Ordering::Release);
}

/// The host backend's wait: until the slot's value is >= `value` (acquire), polling, yielding
/// every 256 polls; past `timeout`, `Err((value seen, writer word))`.
pub fn host_wait(
    own_pad: u64,
    slot: u32,
    value: u64,
    timeout: Duration,
) -> std::result::Result<(), (u64, u32)> {
    let word = value_word(value_addr(own_pad, slot));
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let seen = word.load(Ordering::Acquire);
        if seen >= value {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if spins % 256 == 0 {
            if start.elapsed() > timeout {
                let writer = writer_word(writer_addr(own_pad, slot)).load(Ordering::Relaxed);
                return Err((seen, writer));
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::collective::error_word::timeout_error;

    #[test]
    fn a_pad_is_values_then_writer_words() {
        assert_eq!(value_addr(0x1000, 3), 0x1000 + 24);
        assert_eq!(writer_addr(0x1000, 0), 0x1000 + 4096 * 8);
        assert_eq!(
            writer_addr(0, SYMM_SIGNAL_SLOTS - 1) + 4,
            SYMM_SIGNAL_PAD_BYTES
        );
    }

    #[test]
    fn a_host_signal_raises_and_a_wait_sees_it_or_times_out_naming_the_writer() {
        let mut pad = vec![0u64; (SYMM_SIGNAL_PAD_BYTES / 8) as usize];
        let p = pad.as_mut_ptr() as u64;
        let t = Duration::from_millis(30);
        assert_eq!(host_wait(p, 7, 0, t), Ok(()));
        assert_eq!(host_wait(p, 7, 1, t), Err((0, 0)));
        host_signal(p, 7, 2, false, 5);
        assert_eq!(host_wait(p, 7, 5, t), Ok(()));
        assert_eq!(host_wait(p, 7, 6, t), Err((5, 3)));
        // The owner's reset keeps the writer: a timeout still names rank 2.
        host_signal(p, 7, 0, true, 0);
        assert_eq!(host_wait(p, 7, 1, t), Err((0, 3)));
        host_signal(p, 7, 2, false, 5);
        let e = timeout_error(0, 7, 6, 5, 3, t);
        assert!(
            e.message
                .contains("slot 7 stayed at 5, below the awaited 6"),
            "{e}"
        );
        assert!(e.message.contains("rank 2 raised it last"), "{e}");
        assert!(timeout_error(0, 7, 1, 0, 0, t)
            .message
            .contains("no rank has raised it"));
    }
}
