//! The host backend's view of the MoE blocks (both modes): loads and stores of the words,
//! rows and flags in this rank's and the peers' mappings (volatile or atomic, because peers
//! write them), the probe words, and every bounded wait on them (`Wait`).
//!
//! Invariant: every wait ends within the communicator's timeout, and its error names the rank
//! it waited for and what it saw; no access outlives the object whose blocks it reads.

use super::layout::*;
use super::Moe;
use crate::comm::collective::convert::{bf16_to_f32, f32_to_bf16};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(super) fn word(addr: u64) -> &'static AtomicU64 {
    // SAFETY: addr is an 8-byte aligned flag word of a moe block (this rank's or a peer's,
    // mapped for the object's life); atomics are the only access to flags.
    unsafe { &*(addr as *const AtomicU64) }
}

pub(super) fn rd_i32(addr: u64) -> i32 {
    // SAFETY: addr is a 4-byte aligned int32 of a mapped moe block or of a checked caller
    // buffer; volatile because peers write the blocks.
    unsafe { std::ptr::read_volatile(addr as *const i32) }
}

pub(super) fn wr_i32(addr: u64, v: i32) {
    // SAFETY: as rd_i32.
    unsafe { std::ptr::write_volatile(addr as *mut i32, v) }
}

pub(super) fn rd_f32(addr: u64) -> f32 {
    f32::from_bits(rd_i32(addr) as u32)
}

/// Element `i` of the bf16 row at `row` (a mapped moe block's or a checked caller buffer's),
/// widened to f32; volatile because peers write the blocks.
pub(super) fn rd_bf16(row: u64, i: usize) -> f32 {
    // SAFETY: row holds at least i + 1 bf16 values (the caller's row bound), 2-byte aligned.
    bf16_to_f32(unsafe { std::ptr::read_volatile((row as *const u16).add(i)) })
}

/// Stores `vals` rounded to bf16 (nearest even) at `dst`, a checked caller row of `vals.len()`
/// bf16 values.
pub(super) fn wr_bf16_row(dst: u64, vals: &[f32]) {
    for (i, v) in vals.iter().enumerate() {
        // SAFETY: dst holds vals.len() bf16 values (the caller's checked buffer), 2-byte aligned.
        unsafe { std::ptr::write_volatile((dst as *mut u16).add(i), f32_to_bf16(*v)) };
    }
}

pub(super) fn copy(dst: u64, src: u64, bytes: u64) {
    // SAFETY: src is a checked caller row (or a part of this rank's block) and dst a row of a
    // mapped moe block, both `bytes` long; they never overlap (different parts).
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize) }
}

/// A bounded wait of a host call: its name (`what`), its rank's object, when it began and the
/// communicator's timeout. Every wait of the host backend's MoE calls goes through `word`.
pub(super) struct Wait<'a> {
    pub m: &'a Moe,
    pub what: &'a str,
    pub start: Instant,
    pub timeout: Duration,
}

impl Wait<'_> {
    /// Waits until `ready(v)` holds for the word at `addr` (acquire) and returns it; past the
    /// timeout, an error naming `src` (the rank that did not arrive) and what was seen
    /// (`saw(v)`).
    pub(super) fn word(
        &self,
        addr: u64,
        src: usize,
        ready: impl Fn(u64) -> bool,
        saw: impl Fn(u64) -> String,
    ) -> Result<u64> {
        let w = word(addr);
        let mut spins = 0u32;
        loop {
            let v = w.load(Ordering::Acquire);
            if ready(v) {
                return Ok(v);
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                if self.start.elapsed() > self.timeout {
                    return Err(Error::timeout(format!(
                        "{} on rank {}: rank {src} did not arrive within {:.1} s ({}; it may \
                         have died or not made the same call); this communicator is unusable, \
                         destroy it",
                        self.what,
                        self.m.rank,
                        self.timeout.as_secs_f64(),
                        saw(v)
                    )));
                }
                std::thread::yield_now();
            }
        }
    }

    /// Waits until each of the `words` words of every source's counts row of `epoch` (source
    /// `s`'s row at `row(s)` here) carries the epoch's tag (layout.rs `tagged`); returns the
    /// rows' values, `[W][words]`. Both modes' one cross-rank wait of a dispatch.
    pub(super) fn rows(
        &self,
        epoch: u64,
        words: u64,
        row: impl Fn(u64) -> u64,
    ) -> Result<Vec<Vec<i32>>> {
        let ready = |v| tag_of(v, epoch);
        let saw = |v: u64| {
            format!(
                "waited for its counts of call {epoch}, saw call {}",
                v >> 32
            )
        };
        (0..self.m.world as u64)
            .map(|s| {
                let r = row(s);
                (0..words)
                    .map(|i| self.word(r + 8 * i, s as usize, ready, saw).map(untag))
                    .collect()
            })
            .collect()
    }
}

/// Waits until every rank's flag `which` here is >= `want`; returns the values seen.
pub(super) fn wait_all(
    m: &Moe,
    which: u64,
    want: u64,
    timeout: Duration,
    what: &str,
) -> Result<Vec<u64>> {
    let at = |s: usize| m.at(m.rank, m.layout.flag(m.world as u64, which, s as u64));
    wait_flags(m, at, want, timeout, what)
}

/// Waits until the flag of every rank `s` here (at `at(s)`, either mode's layout) is >= `want`;
/// returns the values seen.
pub(super) fn wait_flags(
    m: &Moe,
    at: impl Fn(usize) -> u64,
    want: u64,
    timeout: Duration,
    what: &str,
) -> Result<Vec<u64>> {
    let wait = Wait {
        m,
        what,
        start: Instant::now(),
        timeout,
    };
    (0..m.world)
        .map(|s| {
            wait.word(
                at(s),
                s,
                |v| v >= want,
                |v| format!("waited for {want}, saw {v}"),
            )
        })
        .collect()
}

/// Stores `v` into flag `which` of this rank on every rank (release).
pub(super) fn raise(m: &Moe, which: u64, v: u64) {
    for d in 0..m.world {
        word(m.at(d, m.layout.flag(m.world as u64, which, m.rank as u64)))
            .store(v, Ordering::Release);
    }
}

/// Stores the wall clock into probe word `i` of this rank's control part (probe on only).
pub(super) fn probe(m: &Moe, i: u64, epoch_word: u64, epoch: u64) {
    if !m.cfg.probe {
        return;
    }
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let at = |w: u64| m.at(m.rank, 8 * (CTRL_PROBE + w));
    word(at(i)).store(ns, Ordering::Relaxed);
    word(at(epoch_word)).store(epoch, Ordering::Relaxed);
}
