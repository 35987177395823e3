//! The kernels' error words, as the host sees them: two `u32` in pinned host memory mapped into
//! the device (kernels/common.cuh, `report_to_host`). Word 0 holds a recoverable error of one
//! call (cleared once reported); word 1 the fatal error (never cleared: the communicator is then
//! unusable). A p2p signal wait that times out (include/symmalloc_device.cuh) first records its
//! slot and values in words 2..8, then its fatal word. Kernels only ever write these words, once
//! per error; the host reads them at the start of every call, so an error surfaces at the next
//! call without a synchronization.
//!
//! On the host backend collectives return their errors directly and nothing writes the words.

use super::kernel_args::{
    ERR_ASYMMETRIC, ERR_LL_ASYMMETRIC, ERR_NO_MULTIMEM, ERR_SIGNAL_TIMEOUT, ERR_TIMEOUT,
};
use super::Collectives;
use crate::cuda;
use crate::error::{Error, Result};
use std::time::Duration;

pub enum ErrorWords {
    Device(cuda::mem::MappedWord),
    /// The host backend: no kernel writes anything.
    Host,
}

impl ErrorWords {
    /// The words in `word` (the executor's host-mapped block), or none on the host backend.
    pub fn new(word: Option<cuda::mem::MappedWord>) -> Self {
        match word {
            Some(w) => ErrorWords::Device(w),
            None => ErrorWords::Host,
        }
    }

    /// (recoverable, fatal).
    fn read(&self) -> (u32, u32) {
        match self {
            // SAFETY: host is a live pinned allocation of 64 bytes; volatile because the GPU
            // writes it.
            ErrorWords::Device(w) => unsafe {
                (
                    std::ptr::read_volatile(w.host),
                    std::ptr::read_volatile(w.host.add(1)),
                )
            },
            ErrorWords::Host => (0, 0),
        }
    }

    fn clear_recoverable(&self) {
        if let ErrorWords::Device(w) = self {
            // SAFETY: as read().
            unsafe { std::ptr::write_volatile(w.host, 0) }
        }
    }

    /// What the kernels get in `SymmArgs::error_word` (0 on the host backend).
    pub fn device_ptr(&self) -> u64 {
        match self {
            ErrorWords::Device(w) => w.device_ptr,
            ErrorWords::Host => 0,
        }
    }

    /// Words 2..8: what a timed-out signal wait recorded before its fatal word (p2p/device_comm.rs,
    /// `SYMM_DEVICE_ERR_*`).
    fn record(&self) -> [u32; 6] {
        let mut r = [0u32; 6];
        if let ErrorWords::Device(w) = self {
            for (i, v) in r.iter_mut().enumerate() {
                // SAFETY: as read(): words 2..8 of the 16 words of the pinned allocation.
                *v = unsafe { std::ptr::read_volatile(w.host.add(2 + i)) };
            }
        }
        r
    }

    /// The error a kernel reported since the last call, if any. A recoverable one is cleared
    /// here (reported once); a fatal one is returned with `fatal` set so the caller keeps it.
    pub fn take(&self, rank: usize, timeout: Duration) -> Option<Reported> {
        let (recoverable, fatal) = self.read();
        if fatal >> 16 == ERR_SIGNAL_TIMEOUT {
            return Some(decode_signal_timeout(fatal, self.record(), rank, timeout));
        }
        if fatal != 0 {
            return Some(decode(fatal, rank, timeout));
        }
        if recoverable != 0 {
            self.clear_recoverable();
            return Some(decode(recoverable, rank, timeout));
        }
        None
    }
}

/// A decoded error word.
#[derive(Debug)]
pub struct Reported {
    pub error: Error,
    /// The communicator is unusable from now on (every later call reports this error).
    pub fatal: bool,
}

/// A signal wait's timeout (include/symmalloc_device.cuh, `symm_signal_wait`): the fatal word
/// `(code << 16) | writer` and the record written before it (slot, awaited and seen values).
pub fn decode_signal_timeout(word: u32, rec: [u32; 6], rank: usize, timeout: Duration) -> Reported {
    let (slot, awaited, seen) = (
        rec[0],
        rec[2] as u64 | (rec[3] as u64) << 32,
        rec[4] as u64 | (rec[5] as u64) << 32,
    );
    Reported {
        error: timeout_error(rank, slot, awaited, seen, word & 0xffff, timeout),
        fatal: true,
    }
}

/// Turns a word `(code << 16) | (peer + 1)` written by a kernel of `rank` into an error.
pub fn decode(word: u32, rank: usize, timeout: Duration) -> Reported {
    let (code, peer) = (word >> 16, (word & 0xffff).saturating_sub(1));
    match code {
        ERR_TIMEOUT => Reported {
            error: Error::timeout(format!(
                "a collective kernel on rank {rank} waited more than {:.1} s for rank {peer} (it \
                 may have died or called a different collective); this communicator is \
                 unusable, destroy it",
                timeout.as_secs_f64()
            )),
            fatal: true,
        },
        ERR_ASYMMETRIC => Reported {
            error: Error::not_symmetric(format!(
                "the previous collective on rank {rank} did not run: rank {peer} called it with \
                 other buffer offsets, count, type or algorithm"
            )),
            fatal: false,
        },
        ERR_LL_ASYMMETRIC => Reported {
            error: Error::not_symmetric(format!(
                "the previous collective on rank {rank} (one-shot LL) did not run: rank {peer} \
                 called another collective (other buffer offsets, count, type or algorithm); \
                 words it sent may be left in the LL buffers, so this communicator is unusable, \
                 destroy it"
            )),
            fatal: true,
        },
        ERR_NO_MULTIMEM => Reported {
            error: Error::unsupported(
                "the multimem kernel ran on a GPU without multimem (needs sm_90)",
            ),
            fatal: false,
        },
        _ => Reported {
            error: Error::internal(format!("unknown kernel error word {word:#x}")),
            fatal: true,
        },
    }
}

/// The error of a wait that timed out: names the slot, the values and the rank that raised the
/// slot last (`writer` = rank + 1, 0 when none did).
pub fn timeout_error(
    rank: usize,
    slot: u32,
    awaited: u64,
    seen: u64,
    writer: u32,
    timeout: Duration,
) -> Error {
    let who = match writer {
        0 => "no rank has raised it since the communicator was created (the peer expected to \
              signal it may have died or not reached its signal)"
            .to_string(),
        w => format!(
            "rank {} raised it last (it may have died, or not reached its next signal)",
            w - 1
        ),
    };
    Error::timeout(format!(
        "symm_wait on rank {rank}: signal slot {slot} stayed at {seen}, below the awaited {awaited}, \
         for more than {:.1} s; {who}; this communicator is unusable, destroy it",
        timeout.as_secs_f64()
    ))
}

impl Collectives {
    /// Reports what a kernel of this communicator wrote into the error words since the last
    /// call; a fatal error stays and is reported by every later call.
    pub(in crate::comm) fn check_error_word(
        &mut self,
        rank: usize,
        timeout: Duration,
    ) -> Result<()> {
        if let Some(e) = &self.sticky {
            return Err(e.clone());
        }
        match self.errors.take(rank, timeout) {
            None => Ok(()),
            Some(r) => {
                if r.fatal {
                    self.sticky = Some(r.error.clone());
                }
                Err(r.error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn a_timeout_names_both_ranks_and_is_fatal() {
        let r = decode(ERR_TIMEOUT << 16 | 2, 0, T);
        assert!(r.fatal);
        assert_eq!(r.error.status, Status::ErrTimeout);
        assert!(r
            .error
            .message
            .contains("rank 0 waited more than 5.0 s for rank 1"));
    }

    #[test]
    fn barrier_asymmetry_is_recoverable_ll_asymmetry_is_not() {
        let b = decode(ERR_ASYMMETRIC << 16 | 1, 1, T);
        assert!(!b.fatal);
        assert_eq!(b.error.status, Status::ErrNotSymmetric);
        assert!(b.error.message.contains("rank 0 called it"));
        let l = decode(ERR_LL_ASYMMETRIC << 16 | 1, 1, T);
        assert!(l.fatal);
        assert!(l.error.message.contains("unusable"));
    }

    #[test]
    fn a_signal_wait_timeout_names_slot_values_and_writer() {
        let r = decode_signal_timeout(ERR_SIGNAL_TIMEOUT << 16 | 2, [9, 0, 7, 1, 6, 0], 0, T);
        assert!(r.fatal);
        assert_eq!(r.error.status, Status::ErrTimeout);
        let m = &r.error.message;
        assert!(
            m.contains("signal slot 9 stayed at 6, below the awaited 4294967303"),
            "{m}"
        );
        assert!(m.contains("rank 1 raised it last"), "{m}");
    }

    #[test]
    fn unknown_codes_are_internal_and_fatal() {
        let r = decode(99 << 16 | 1, 0, T);
        assert!(r.fatal);
        assert_eq!(r.error.status, Status::ErrInternal);
        assert!(r.error.message.contains("0x630001"));
    }

    #[test]
    fn the_host_backend_never_reports_through_words() {
        let w = ErrorWords::new(None);
        assert_eq!(w.device_ptr(), 0);
        assert!(w.take(0, T).is_none());
    }
}
