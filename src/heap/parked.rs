//! The allocator's fast path for small blocks: blocks freed whole and kept for the next request
//! of the same rounded size, on the same stream, in the same pool (a LIFO per key).
//!
//! A freed small block whose only pending stream is the freeing stream is *parked* here instead
//! of being merged with its neighbours and listed in the pool's best-fit sets: freeing is one
//! map push, and the next `malloc` of that size on that stream is one map pop, with no
//! ordering to add (the block waits on nothing but the requesting stream). Parked blocks go
//! back to the best-fit sets (`drain`) when a request finds nothing there, on `empty_cache`,
//! and when their pool is released. Large blocks are never parked (`device_heap::parks` says
//! why); the thread caches keep those.
//!
//! Invariants (checked by `DeviceHeap::validate`): each parked block is small and in exactly one
//! LIFO, under its pool, its single stream and the rounded size it was last allocated with;
//! `len()` counts them all. No LIFO is empty (`pop` removes the key of the last block).
//!
//! Determinism: what is parked and popped depends only on the call sequence; drains return
//! offsets in ascending order, never in hash order.

use super::backend::Stream;
use super::pools::PoolId;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// (pool, stream, rounded size).
pub type Key = (PoolId, Stream, u64);

/// A multiply-rotate hash for keys made of a few integers (the std default, SipHash, costs
/// more than the rest of a cached malloc+free pair). Not DoS-resistant, which is fine: keys
/// come from this process's own allocation calls.
#[derive(Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Default)]
pub struct Parked {
    lifo: HashMap<Key, Vec<u64>, BuildHasherDefault<IntHasher>>,
    count: usize,
}

impl Parked {
    pub fn push(&mut self, key: Key, off: u64) {
        self.lifo.entry(key).or_default().push(off);
        self.count += 1;
    }

    /// The block parked last under `key`, if any. A key whose last block goes is removed, so
    /// `drain` visits parked blocks only (keys left empty made each drain walk every size the
    /// step had parked since: bench/NOTES.md, "Global mode's host cost").
    pub fn pop(&mut self, key: &Key) -> Option<u64> {
        let v = self.lifo.get_mut(key)?;
        let off = v.pop()?;
        if v.is_empty() {
            self.lifo.remove(key);
        }
        self.count -= 1;
        Some(off)
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Removes and returns the parked blocks of `pool` (every pool with `None`), ascending.
    pub fn drain(&mut self, pool: Option<PoolId>) -> Vec<u64> {
        let mut out = Vec::new();
        self.lifo.retain(|&(p, _, _), v| {
            if pool.is_none_or(|want| want == p) {
                out.append(v);
                false
            } else {
                true
            }
        });
        self.count -= out.len();
        out.sort_unstable();
        out
    }

    /// Every (key, offset) parked, for validation.
    pub fn entries(&self) -> impl Iterator<Item = (&Key, u64)> {
        self.lifo
            .iter()
            .flat_map(|(k, v)| v.iter().map(move |&o| (k, o)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifo_per_key_and_sorted_drains() {
        let (a, b) = (PoolId(0, 0), PoolId(1, 0));
        let mut p = Parked::default();
        p.push((a, 7, 512), 4096);
        p.push((a, 7, 512), 1024);
        p.push((b, 7, 512), 2048);
        p.push((a, 9, 512), 512);
        assert_eq!(p.len(), 4);
        assert_eq!(p.pop(&(a, 7, 512)), Some(1024), "last parked comes first");
        assert_eq!(p.pop(&(a, 7, 1024)), None, "sizes do not mix");
        p.push((a, 9, 8192), 8192);
        assert_eq!(p.drain(Some(a)), vec![512, 4096, 8192]);
        assert_eq!(p.len(), 1);
        assert_eq!(p.pop(&(a, 7, 512)), None);
        assert_eq!(p.drain(Some(a)), vec![], "a has none left");
        assert_eq!(p.drain(None), vec![2048]);
        assert!(p.is_empty());
        assert_eq!(p.entries().count(), 0);
    }
}
