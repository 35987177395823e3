//! Pool identities and the routes that send allocations to pools.
//!
//! A route sends allocations on one device to a pool until it ends. Two kinds:
//! - a thread route (`begin`, from `symm_begin_pool`): the allocations of the thread that
//!   opened it;
//! - a filtered route (`begin_filtered`, from `symm_begin_pool_filtered`, which the pluggable
//!   shim calls with PyTorch's filter): every allocation, from any thread, whose stream the
//!   filter accepts. PyTorch's graph capture passes a filter that accepts the capturing stream
//!   (the autograd engine allocates the backward's memory on that stream from its own device
//!   thread, so a thread route would send the backward's temporaries to the default pool, where
//!   eager work reuses them while the graph still writes them); `torch.cuda.use_mem_pool`
//!   passes one that accepts the calling thread.
//!
//! `current(device, stream)` asks the device's routes, newest first; the first that accepts the
//! allocation names the pool, and with none the default pool serves. `end(device, pool)` ends
//! the newest route the calling thread opened for the device, which must be for `pool` (routes
//! nest per thread); if the thread opened none there, the newest route for (device, pool)
//! opened by any thread. A thread's routes end when it exits.
//!
//! Invariants: `OPEN` counts the routes of every thread; with none, `current` reads that one
//! atomic and nothing else (the allocation fast path). Filters are called with the route
//! table's lock held and no heap locked (the table's lock is a leaf: nothing else is taken
//! under it); a route's filter is dropped after the table's lock is released.

use super::backend::Stream;
use crate::error::{Error, Result};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Routes open on any thread (PyTorch opens one around every graph capture): while any is, the
/// heap never waits for the device on its own initiative (a wait could break a capture).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Whether any route is open.
pub fn any_open() -> bool {
    OPEN.load(Ordering::Acquire) > 0
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

/// How diagnostics name a pool: `default`, `internal`, `arena N` / `arena N internal`, or
/// PyTorch's pair.
impl std::fmt::Display for PoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (*self, arena_of(*self)) {
            (DEFAULT_POOL, _) => write!(f, "default"),
            (INTERNAL_POOL, _) => write!(f, "internal"),
            (p, Some(id)) if p.1 & 1 == 1 => write!(f, "arena {id} internal"),
            (_, Some(id)) => write!(f, "arena {id}"),
            (PoolId(a, b), None) => write!(f, "({a}, {b})"),
        }
    }
}

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

/// Whether an allocation on a stream belongs to a filtered route's pool. Called from any thread.
pub type Filter = Box<dyn Fn(Stream) -> bool + Send + Sync>;

enum Accept {
    /// The allocations of the opening thread.
    Thread,
    /// The allocations whose stream the filter accepts, from any thread.
    Filter(Filter),
}

struct Route {
    device: i32,
    pool: PoolId,
    opener: u64,
    accept: Accept,
}

static ROUTES: Mutex<Vec<Route>> = Mutex::new(Vec::new());

fn routes() -> MutexGuard<'static, Vec<Route>> {
    ROUTES.lock().unwrap_or_else(|p| p.into_inner())
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// Ends the thread's routes when it exits (registered when it opens its first route).
struct ThreadRoutes(u64);

impl Drop for ThreadRoutes {
    fn drop(&mut self) {
        let gone: Vec<Route> = {
            let mut r = routes();
            let (gone, kept) = std::mem::take(&mut *r)
                .into_iter()
                .partition(|x| x.opener == self.0);
            *r = kept;
            gone
        };
        OPEN.fetch_sub(gone.len(), Ordering::AcqRel);
    }
}

thread_local! {
    /// This thread's id for routes (0: not yet assigned).
    static THREAD: Cell<u64> = const { Cell::new(0) };
    static EXIT: Cell<Option<ThreadRoutes>> = const { Cell::new(None) };
}

/// The calling thread's id for routes; None while the thread is exiting.
fn thread_id() -> Option<u64> {
    THREAD
        .try_with(|t| {
            if t.get() == 0 {
                t.set(NEXT_THREAD.fetch_add(1, Ordering::Relaxed));
            }
            t.get()
        })
        .ok()
}

fn open(device: i32, pool: PoolId, accept: Accept) -> Result<()> {
    if is_reserved(pool) {
        return Err(Error::invalid(format!(
            "pool id ({}, {}) is reserved for symmalloc's own buffers (pools whose first word is \
             2^64-1 or 2^64-2)",
            pool.0, pool.1
        )));
    }
    let opener = thread_id()
        .ok_or_else(|| Error::invalid("a pool was begun while the thread is exiting"))?;
    // Its routes end with the thread (the guard's drop runs at thread exit).
    let _ = EXIT.try_with(|e| {
        let g = e.take().unwrap_or_else(|| ThreadRoutes(opener));
        e.set(Some(g));
    });
    routes().push(Route {
        device,
        pool,
        opener,
        accept,
    });
    OPEN.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Routes the calling thread's allocations on `device` to `pool` until the matching `end`.
pub fn begin(device: i32, pool: PoolId) -> Result<()> {
    open(device, pool, Accept::Thread)
}

/// Routes every allocation on `device` whose stream `filter` accepts, from any thread, to
/// `pool` until the matching `end`.
pub fn begin_filtered(device: i32, pool: PoolId, filter: Filter) -> Result<()> {
    open(device, pool, Accept::Filter(filter))
}

pub fn end(device: i32, pool: PoolId) -> Result<()> {
    let Some(me) = thread_id() else {
        return Ok(()); // the thread is exiting: its routes end with it
    };
    let mut r = routes();
    let at = match r.iter().rposition(|x| x.device == device && x.opener == me) {
        Some(i) if r[i].pool == pool => Some(i),
        Some(i) => {
            return Err(Error::invalid(format!(
                "symm_end_pool(device {device}, pool ({}, {})): the innermost pool this thread \
                 opened for device {device} is ({}, {}); pools must end in reverse order",
                pool.0, pool.1, r[i].pool.0, r[i].pool.1
            )))
        }
        None => r.iter().rposition(|x| x.device == device && x.pool == pool),
    };
    let Some(i) = at else {
        return Err(Error::invalid(format!(
            "symm_end_pool(device {device}, pool ({}, {})): no pool is open for device {device} \
             with this id",
            pool.0, pool.1
        )));
    };
    let gone = r.remove(i);
    OPEN.fetch_sub(1, Ordering::AcqRel);
    drop(r);
    drop(gone); // a filter's drop runs outside the table's lock
    Ok(())
}

/// The pool an allocation on `device` and `stream` by the calling thread goes to (the default
/// pool when no route accepts it, and once the thread's storage is torn down).
pub fn current(device: i32, stream: Stream) -> PoolId {
    if OPEN.load(Ordering::Acquire) == 0 {
        return DEFAULT_POOL;
    }
    let me = thread_id();
    let r = routes();
    r.iter()
        .rev()
        .filter(|x| x.device == device)
        .find(|x| match &x.accept {
            Accept::Thread => Some(x.opener) == me,
            Accept::Filter(f) => f(stream),
        })
        .map_or(DEFAULT_POOL, |x| x.pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the route table is process-wide, and tests run on parallel threads.
    #[test]
    fn routes_nest_per_thread_and_filters_route_any_thread() {
        let (a, b, c) = (PoolId(1, 2), PoolId(3, 4), PoolId(5, 6));
        assert_eq!(current(0, 0), DEFAULT_POOL);
        begin(0, a).unwrap();
        begin(1, b).unwrap();
        begin(0, b).unwrap();
        assert_eq!(current(0, 0), b);
        assert_eq!(current(1, 0), b);
        assert!(end(0, a).is_err(), "ending the outer pool first must fail");
        end(0, b).unwrap();
        assert_eq!(current(0, 0), a);
        // Another thread's allocations do not follow this thread's routes.
        assert_eq!(
            std::thread::spawn(|| current(0, 0)).join().unwrap(),
            DEFAULT_POOL
        );
        end(0, a).unwrap();
        end(1, b).unwrap();
        assert!(end(1, b).is_err());
        assert_eq!(current(0, 0), DEFAULT_POOL);
        assert!(begin(0, INTERNAL_POOL).is_err());
        assert!(begin(0, arena_pool(3, false)).is_err());
        assert_eq!(arena_of(arena_pool(3, true)), Some(3));
        assert_eq!(arena_of(a), None);

        // A filtered route takes the streams it accepts, from every thread; ended from another
        // thread than the one that opened it, as PyTorch may.
        begin_filtered(0, c, Box::new(|s| s == 0x77)).unwrap();
        assert_eq!(current(0, 0x77), c);
        assert_eq!(current(0, 0x78), DEFAULT_POOL);
        assert_eq!(current(1, 0x77), DEFAULT_POOL);
        assert_eq!(std::thread::spawn(|| current(0, 0x77)).join().unwrap(), c);
        std::thread::spawn(move || end(0, c).unwrap())
            .join()
            .unwrap();
        assert_eq!(current(0, 0x77), DEFAULT_POOL);

        // A thread's routes end when it exits.
        std::thread::spawn(move || begin(0, a).unwrap())
            .join()
            .unwrap();
        assert!(!any_open());
    }
}
