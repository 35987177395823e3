//! Pool identities and the per-thread pool stack.
//!
//! `symm_begin_pool(device, id)` pushes `(device, id)` on the calling thread's stack and routes
//! that thread's allocations on `device` to the pool until the matching `symm_end_pool`. The
//! stack nests; `end` must name the innermost pool open for that device.

use crate::error::{Error, Result};
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Pools open on any thread (PyTorch opens one around every graph capture): while any is, the
/// heap never waits for the device on its own initiative (a wait could break a capture).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Whether any thread has a pool open.
pub fn any_open() -> bool {
    OPEN.load(Ordering::Relaxed) > 0
}

/// PyTorch's `MempoolId_t`: a pair of integers. (0, 0) is the default pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PoolId(pub u64, pub u64);

pub const DEFAULT_POOL: PoolId = PoolId(0, 0);
/// The communicator's own buffers (signal pads, staging scratch): never mixed with user blocks.
/// (Communicators now keep theirs in their arena; the id stays reserved.)
pub const INTERNAL_POOL: PoolId = PoolId(u64::MAX, u64::MAX);

/// First word of the pools of communicator arenas (device_heap/arena.rs): `(ARENA_TAG, 2 * id)`
/// holds what `symm_comm_malloc` hands out, `(ARENA_TAG, 2 * id + 1)` the communicator's own
/// buffers. Reserved: no caller may open or release such a pool by id.
pub const ARENA_TAG: u64 = u64::MAX - 1;

/// The pool of arena `id`: its users' (`internal` false) or the communicator's own.
pub fn arena_pool(id: u64, internal: bool) -> PoolId {
    PoolId(ARENA_TAG, id << 1 | internal as u64)
}

/// The arena a pool belongs to, if it is an arena's pool.
pub fn arena_of(pool: PoolId) -> Option<u64> {
    (pool.0 == ARENA_TAG).then_some(pool.1 >> 1)
}

/// Whether `pool` is an id symmalloc reserves for itself (the internal pool, arenas' pools).
pub fn is_reserved(pool: PoolId) -> bool {
    pool == INTERNAL_POOL || arena_of(pool).is_some()
}

thread_local! {
    static STACK: RefCell<Vec<(i32, PoolId)>> = const { RefCell::new(Vec::new()) };
}

pub fn begin(device: i32, pool: PoolId) -> Result<()> {
    if is_reserved(pool) {
        return Err(Error::invalid(format!(
            "pool id ({}, {}) is reserved for symmalloc's own buffers (pools whose first word is \
             2^64-1 or 2^64-2)",
            pool.0, pool.1
        )));
    }
    STACK
        .try_with(|s| s.borrow_mut().push((device, pool)))
        .map_err(|_| Error::invalid("symm_begin_pool called while the thread is exiting"))?;
    OPEN.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

pub fn end(device: i32, pool: PoolId) -> Result<()> {
    let r = STACK.try_with(|s| {
        let mut s = s.borrow_mut();
        let top = s.iter().rposition(|&(d, _)| d == device);
        match top {
            Some(i) if s[i].1 == pool => {
                s.remove(i);
                OPEN.fetch_sub(1, Ordering::Relaxed);
                Ok(())
            }
            Some(i) => Err(Error::invalid(format!(
                "symm_end_pool(device {device}, pool ({}, {})): the innermost pool open on this \
                 thread for device {device} is ({}, {}); pools must end in reverse order",
                pool.0, pool.1, s[i].1 .0, s[i].1 .1
            ))),
            None => Err(Error::invalid(format!(
                "symm_end_pool(device {device}, pool ({}, {})): no pool is open on this thread \
                 for device {device}",
                pool.0, pool.1
            ))),
        }
    });
    r.unwrap_or(Ok(())) // the thread is exiting: its pool stack is gone with it
}

/// The pool the calling thread's allocations on `device` go to (the default pool once the
/// thread's storage is torn down, e.g. for frees and allocations at process exit).
pub fn current(device: i32) -> PoolId {
    STACK
        .try_with(|s| {
            s.borrow()
                .iter()
                .rev()
                .find(|&&(d, _)| d == device)
                .map_or(DEFAULT_POOL, |&(_, p)| p)
        })
        .unwrap_or(DEFAULT_POOL)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn pools_nest_per_device() {
        let (a, b) = (PoolId(1, 2), PoolId(3, 4));
        assert_eq!(current(0), DEFAULT_POOL);
        begin(0, a).unwrap();
        begin(1, b).unwrap();
        begin(0, b).unwrap();
        assert_eq!(current(0), b);
        assert_eq!(current(1), b);
        assert!(end(0, a).is_err(), "ending the outer pool first must fail");
        end(0, b).unwrap();
        assert_eq!(current(0), a);
        end(0, a).unwrap();
        end(1, b).unwrap();
        assert!(end(1, b).is_err());
        assert_eq!(current(0), DEFAULT_POOL);
        assert!(begin(0, INTERNAL_POOL).is_err());
        assert!(begin(0, arena_pool(3, false)).is_err());
        assert_eq!(arena_of(arena_pool(3, true)), Some(3));
        assert_eq!(arena_of(a), None);
    }
}
