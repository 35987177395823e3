//! The lock around each device heap: test-and-test-and-set that spins, then yields the CPU,
//! and never sleeps in the kernel.
//!
//! Why not `std::sync::Mutex`: a cached malloc or free holds the heap for about 50 ns. Under
//! contention a std mutex parks waiters on a futex, and each wake-up costs microseconds, far
//! more than the work it waits for (bench/NOTES.md, "The allocator").
//! Spinning keeps the hand-over at cache-line speed; after `SPINS` tries a waiter yields, so a
//! preempted holder still gets the CPU back.
//!
//! Invariants: `locked` is true exactly while a `SpinGuard` exists; the guard gives the only
//! access to the value. A panic while locked releases the lock when the guard drops (there is
//! no poisoning; the heap's `validate` is the check that its state is consistent). `releases`
//! counts the holds that ended, bumped by the holder just before it lets go: a reader outside
//! the lock that finds it unchanged since a hold of its own knows nobody held the value since,
//! so nothing it read then has changed (comm's placement cache, heap/comm_view.rs).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Busy-wait rounds before a waiter starts yielding.
const SPINS: u32 = 1 << 12;

pub struct SpinLock<T> {
    locked: AtomicBool,
    /// Holds that ended (see the module header); written only by the holder.
    releases: AtomicU64,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and one guard exists at a time (the
// atomic swap below), so sharing the lock between threads shares `T` like a mutex does.
unsafe impl<T: Send> Sync for SpinLock<T> {}

pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinLock<T> {
    pub fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            releases: AtomicU64::new(0),
            value: UnsafeCell::new(value),
        }
    }

    pub fn lock(&self) -> SpinGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            if !self.locked.swap(true, Ordering::Acquire) {
                return SpinGuard { lock: self };
            }
            // Wait on a plain load (no cache-line ping-pong), then try again.
            while self.locked.load(Ordering::Relaxed) {
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl<T> SpinLock<T> {
    /// The count of holds that ended: compare it (Acquire) with `SpinGuard::releases_after`
    /// of an earlier hold to learn whether anyone held the value since.
    pub fn releases(&self) -> &AtomicU64 {
        &self.releases
    }
}

impl<T> SpinGuard<'_, T> {
    /// What `SpinLock::releases` reads once this hold ends, while nobody holds the lock after
    /// it. (An associated function, so that it never shadows a method of `T`.)
    pub fn releases_after(guard: &Self) -> u64 {
        guard.lock.releases.load(Ordering::Relaxed) + 1
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only access to the value while it lives.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in deref; &mut self makes the access unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        // Only the holder writes the count, so a load and a store do (no read-modify-write).
        let n = self.lock.releases.load(Ordering::Relaxed);
        self.lock.releases.store(n + 1, Ordering::Release);
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excludes_and_releases_on_panic() {
        let l = SpinLock::new(0u64);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        let mut g = l.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1; // a lost update would show in the total
                    }
                });
            }
        });
        assert_eq!(*l.lock(), 80_000);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = l.lock();
            panic!("while locked");
        }));
        assert!(r.is_err());
        assert_eq!(
            *l.lock(),
            80_000,
            "the guard released the lock while unwinding"
        );
    }

    #[test]
    fn releases_count_every_hold_and_stamp_the_next_value() {
        let l = SpinLock::new(0u64);
        assert_eq!(l.releases().load(Ordering::Acquire), 0);
        let stamp = {
            let g = l.lock();
            SpinGuard::releases_after(&g)
        };
        assert_eq!(
            l.releases().load(Ordering::Acquire),
            stamp,
            "unchanged since that hold"
        );
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        *l.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(l.releases().load(Ordering::Acquire), stamp + 40_000);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = l.lock();
            panic!("while locked");
        }));
        assert_eq!(
            l.releases().load(Ordering::Acquire),
            stamp + 40_001,
            "a hold that ended in a panic counts"
        );
    }
}
