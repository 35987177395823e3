//! The live handles of the C ABI: one registry for every kind of object src/ffi hands to C as a
//! pointer (`symm_comm_t`, `symm_moe_t`), so a stale, foreign or wrongly typed pointer is an
//! error naming it, never a use after free.
//!
//! Invariants:
//! - An address is registered exactly while it is a `Box` of its kind made by `give` and not yet
//!   returned by `take`; nothing else frees a handle.
//! - Each address has one kind: a handle passed where another kind is expected is not live.
//! - `take` returns the box once per `give`: a second destroy is refused, nothing is freed twice.
//! - The lock is held only to look up, insert or remove an address, never while a handle's object
//!   is used; using one handle from two threads at once (a call racing its destroy) is the
//!   caller's error, as in NCCL.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};

/// What a registered address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Comm,
    Moe,
    #[cfg(test)]
    Test,
}

/// A type the C ABI hands out as a pointer.
pub trait Handle {
    const KIND: Kind;
}

static LIVE: LazyLock<Mutex<HashMap<usize, Kind>>> = LazyLock::new(Default::default);

fn live() -> MutexGuard<'static, HashMap<usize, Kind>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Boxes `value` and registers its address: the pointer to give to C.
pub fn give<T: Handle>(value: T) -> *mut T {
    let p = Box::into_raw(Box::new(value));
    let old = live().insert(p as usize, T::KIND);
    debug_assert!(old.is_none(), "a fresh Box at a registered address");
    p
}

/// Whether `p` is a live handle of `T`'s kind (false for NULL).
pub fn is_live<T: Handle>(p: *const T) -> bool {
    live().get(&(p as usize)) == Some(&T::KIND)
}

/// Unregisters `p` and returns its box; None (nothing changed) when `p` is not a live handle of
/// `T`'s kind.
pub fn take<T: Handle>(p: *mut T) -> Option<Box<T>> {
    let mut set = live();
    if set.get(&(p as usize)) != Some(&T::KIND) {
        return None;
    }
    set.remove(&(p as usize));
    drop(set);
    // SAFETY: p was registered with T's kind, so it is a Box<T> from `give` not yet taken back;
    // it is now unregistered, so this is its only owner.
    Some(unsafe { Box::from_raw(p) })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Probe(u64);
    impl Handle for Probe {
        const KIND: Kind = Kind::Test;
    }
    struct Other;
    impl Handle for Other {
        const KIND: Kind = Kind::Moe;
    }

    #[test]
    fn a_handle_is_live_from_give_to_take_once() {
        let p = give(Probe(7));
        assert!(is_live(p));
        let b = take(p).expect("live");
        assert_eq!(b.0, 7);
        assert!(!is_live(p), "taken back: no longer live");
        assert!(take(p).is_none(), "a second take is refused");
    }

    #[test]
    fn null_foreign_and_wrongly_typed_pointers_are_not_live() {
        assert!(!is_live(std::ptr::null::<Probe>()));
        let local = Probe(1);
        assert!(!is_live(&local as *const Probe));
        let p = give(Probe(2));
        // The same address seen as another kind.
        assert!(!is_live(p as *const Other));
        assert!(take(p as *mut Other).is_none());
        assert!(is_live(p), "a refused take changes nothing");
        drop(take(p));
    }

    #[test]
    fn concurrent_gives_and_takes_keep_every_handle_once() {
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let p = give(Probe(t * 1000 + i));
                        assert!(is_live(p));
                        let b = take(p);
                        assert_eq!(b.as_ref().map(|b| b.0), Some(t * 1000 + i));
                        // While `b` lives no other give can reuse the address.
                        assert!(take(p).is_none());
                        drop(b);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
