//! The process's live communicators: how many each device has (at most
//! `MAX_COMMS_PER_DEVICE`), which peer processes each includes (two communicators may not
//! place the same peer processes on two devices of this process), and the MemPool slots that
//! route a torch `MemPool`'s allocations to a communicator's arena (ffi/groups.rs exports one
//! allocation function per slot, since torch's pluggable allocator passes no pool id).
//!
//! Invariants: a `Claim` exists for every communicator between the start of its creation and
//! its destroy (a failed creation drops it); a slot is `Bound` to a live claim, `Orphaned` once
//! that communicator is destroyed while its MemPool may still call the slot's function (every
//! allocation there fails, naming why), and `Free` only after the caller released it: so a
//! slot is never rebound while an old MemPool could still use it.

use crate::comm::peer::peers::PeerIdent;
use crate::error::{Error, Result};
use crate::heap::pools::PoolId;
use std::sync::{Mutex, MutexGuard};

/// The most live communicators per process and device (`SYMM_MAX_COMMS_PER_DEVICE`).
pub const MAX_COMMS_PER_DEVICE: usize = 16;
/// MemPool slots per process (`SYMM_COMM_POOL_SLOTS`).
pub const POOL_SLOTS: usize = 64;

struct Live {
    serial: u64,
    device: i32,
    members: Vec<PeerIdent>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    Bound {
        serial: u64,
        device: i32,
        pool: PoolId,
    },
    Orphaned {
        device: i32,
    },
}

struct State {
    live: Vec<Live>,
    slots: [Slot; POOL_SLOTS],
    next_serial: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    live: Vec::new(),
    slots: [Slot::Free; POOL_SLOTS],
    next_serial: 1,
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A communicator's place in the registry, held from the start of its creation to its destroy.
pub struct Claim {
    pub serial: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut s = state();
        s.live.retain(|l| l.serial != self.serial);
        for slot in s.slots.iter_mut() {
            if let Slot::Bound { serial, device, .. } = *slot {
                if serial == self.serial {
                    *slot = Slot::Orphaned { device };
                }
            }
        }
    }
}

/// Takes a place for a new communicator on `device`; at the limit, the refusal's text (the
/// caller sends it to its peers, so that every rank fails alike).
pub fn claim(device: i32) -> std::result::Result<Claim, String> {
    let mut s = state();
    let n = s.live.iter().filter(|l| l.device == device).count();
    if n >= MAX_COMMS_PER_DEVICE {
        return Err(format!(
            "device {device} already has {n} live communicators in process {} (the most per \
             process and device: SYMM_MAX_COMMS_PER_DEVICE = {MAX_COMMS_PER_DEVICE}); destroy \
             one first",
            std::process::id()
        ));
    }
    let serial = s.next_serial;
    s.next_serial += 1;
    s.live.push(Live {
        serial,
        device,
        members: Vec::new(),
    });
    Ok(Claim { serial })
}

/// Live communicators on `device`.
pub fn count(device: i32) -> usize {
    state().live.iter().filter(|l| l.device == device).count()
}

/// Why a communicator on `device` over `members` (this process among them) cannot exist beside
/// the live ones: another live communicator of this process places one of the same peer
/// processes on another device of this process. Records `members` for `claim` when it can.
pub fn check_members(claim: &Claim, device: i32, members: &[PeerIdent]) -> Option<String> {
    let me = PeerIdent::me(device).ok()?;
    let mut s = state();
    for l in s.live.iter().filter(|l| l.device != device) {
        for (r, m) in members.iter().enumerate() {
            if m.same_process(&me) {
                continue;
            }
            if l.members.iter().any(|x| x.same_process(m)) {
                return Some(format!(
                    "its rank {r} (pid {}) is already in a live communicator of process {} on \
                     device {}, and this one is on device {device}: one process takes part in \
                     communicators with the same ranks on one device only",
                    m.pid, me.pid, l.device
                ));
            }
        }
    }
    if let Some(l) = s.live.iter_mut().find(|l| l.serial == claim.serial) {
        l.members = members.to_vec();
    }
    None
}

/// Binds a free MemPool slot to the communicator `serial`'s arena `pool` on `device` (its
/// existing slot when it has one); the slot's number.
pub fn bind_pool_slot(serial: u64, device: i32, pool: PoolId) -> Result<usize> {
    let mut s = state();
    if let Some(i) = s
        .slots
        .iter()
        .position(|x| matches!(x, Slot::Bound { serial: v, .. } if *v == serial))
    {
        return Ok(i);
    }
    let i = s
        .slots
        .iter()
        .position(|x| *x == Slot::Free)
        .ok_or_else(|| {
            Error::invalid(format!(
                "all {POOL_SLOTS} MemPool slots of this process are taken (by live MemPools, or \
             by pools of destroyed communicators not released yet); release one first"
            ))
        })?;
    s.slots[i] = Slot::Bound {
        serial,
        device,
        pool,
    };
    Ok(i)
}

/// The arena pool behind MemPool slot `slot`, allocating on `device`.
pub fn slot_pool(slot: usize, device: i32) -> Result<PoolId> {
    let s = state();
    match s.slots.get(slot) {
        Some(Slot::Bound {
            device: d, pool, ..
        }) if *d == device => Ok(*pool),
        Some(Slot::Bound { device: d, .. }) => Err(Error::invalid(format!(
            "MemPool slot {slot} belongs to a communicator on device {d}, not device {device}"
        ))),
        Some(Slot::Orphaned { device: d }) => Err(Error::invalid(format!(
            "MemPool slot {slot}: its communicator (device {d}) was destroyed; the pool can \
             only give memory back"
        ))),
        Some(Slot::Free) => Err(Error::invalid(format!(
            "MemPool slot {slot} is not bound to a communicator"
        ))),
        None => Err(Error::invalid(format!(
            "MemPool slot {slot} does not exist; expected 0..{POOL_SLOTS}"
        ))),
    }
}

/// Frees MemPool slot `slot` (its MemPool is gone): it may be bound again.
pub fn release_pool_slot(slot: usize) -> Result<()> {
    let mut s = state();
    match s.slots.get_mut(slot) {
        Some(x) => {
            *x = Slot::Free;
            Ok(())
        }
        None => Err(Error::invalid(format!(
            "MemPool slot {slot} does not exist; expected 0..{POOL_SLOTS}"
        ))),
    }
}
