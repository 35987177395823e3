//! A pool's free blocks, for best fit: one ordered set of (size, offset) per (size class,
//! first stream), the sets in a short vector (a pool's free memory waits on few streams).
//!
//! Best fit for a stream is one search of that stream's set; a search over every stream visits
//! each set once. A (size, offset) pair is packed into one `u128` (size high), so the sets
//! compare one integer rather than a tuple: the allocation path's searches were its largest
//! cost (bench/NOTES.md, "Global mode's host cost").
//!
//! Invariants (checked by `validate`): no set is empty; no two sets share a (class, stream);
//! `len` is the number of entries over all sets.

use super::{Class, Stream};
use std::collections::BTreeSet;

#[derive(Default, Debug)]
pub(super) struct FreeLists {
    lists: Vec<((Class, Stream), BTreeSet<u128>)>,
    len: usize,
}

fn pack(size: u64, off: u64) -> u128 {
    (size as u128) << 64 | off as u128
}

fn unpack(k: u128) -> (u64, u64) {
    ((k >> 64) as u64, k as u64)
}

impl FreeLists {
    fn set(&self, class: Class, stream: Stream) -> Option<&BTreeSet<u128>> {
        self.lists
            .iter()
            .find(|(k, _)| *k == (class, stream))
            .map(|(_, s)| s)
    }

    pub fn insert(&mut self, class: Class, stream: Stream, size: u64, off: u64) {
        let at = match self.lists.iter().position(|(k, _)| *k == (class, stream)) {
            Some(i) => i,
            None => {
                self.lists.push(((class, stream), BTreeSet::new()));
                self.lists.len() - 1
            }
        };
        if self.lists[at].1.insert(pack(size, off)) {
            self.len += 1;
        }
    }

    pub fn remove(&mut self, class: Class, stream: Stream, size: u64, off: u64) -> bool {
        let Some(at) = self.lists.iter().position(|(k, _)| *k == (class, stream)) else {
            return false;
        };
        let removed = self.lists[at].1.remove(&pack(size, off));
        if removed {
            self.len -= 1;
            if self.lists[at].1.is_empty() {
                self.lists.swap_remove(at);
            }
        }
        removed
    }

    pub fn contains(&self, class: Class, stream: Stream, size: u64, off: u64) -> bool {
        self.set(class, stream)
            .is_some_and(|s| s.contains(&pack(size, off)))
    }

    /// The free blocks of `class` waiting first on `stream` of at least `min` bytes, as
    /// (size, offset), best fit first.
    pub fn fits(
        &self,
        class: Class,
        stream: Stream,
        min: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.set(class, stream)
            .into_iter()
            .flat_map(move |s| s.range(pack(min, 0)..).map(|&k| unpack(k)))
    }

    /// The streams that free blocks of `class` wait on first (in no particular order).
    pub fn streams(&self, class: Class) -> impl Iterator<Item = Stream> + '_ {
        self.lists
            .iter()
            .filter(move |((c, _), _)| *c == class)
            .map(|((_, s), _)| *s)
    }

    /// The largest free block's size (0 when none).
    pub fn largest(&self) -> u64 {
        self.lists
            .iter()
            .filter_map(|(_, s)| s.last().map(|&k| unpack(k).0))
            .max()
            .unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut n = 0;
        for (i, (k, s)) in self.lists.iter().enumerate() {
            if s.is_empty() {
                return Err(format!("free list {k:?} is empty but kept"));
            }
            if self.lists[..i].iter().any(|(k2, _)| k2 == k) {
                return Err(format!("free list {k:?} is kept twice"));
            }
            n += s.len();
        }
        if n != self.len {
            return Err(format!("free lists hold {n} blocks, count {}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_per_stream_and_removal() {
        let mut f = FreeLists::default();
        f.insert(Class::Large, 7, 8 << 20, 0);
        f.insert(Class::Large, 7, 4 << 20, 64 << 20);
        f.insert(Class::Large, 7, 4 << 20, 32 << 20);
        f.insert(Class::Large, 9, 2 << 20, 96 << 20);
        f.insert(Class::Small, 7, 4096, 128 << 20);
        assert_eq!(f.len(), 5);
        assert_eq!(
            f.fits(Class::Large, 7, 3 << 20).collect::<Vec<_>>(),
            vec![(4 << 20, 32 << 20), (4 << 20, 64 << 20), (8 << 20, 0)],
            "by size, then offset"
        );
        assert_eq!(f.fits(Class::Large, 9, 3 << 20).count(), 0);
        assert_eq!(f.fits(Class::Small, 9, 0).count(), 0, "classes do not mix");
        let mut s: Vec<_> = f.streams(Class::Large).collect();
        s.sort();
        assert_eq!(s, vec![7, 9]);
        assert_eq!(f.largest(), 8 << 20);
        assert!(f.remove(Class::Large, 9, 2 << 20, 96 << 20));
        assert!(
            !f.remove(Class::Large, 9, 2 << 20, 96 << 20),
            "already gone"
        );
        assert_eq!(f.streams(Class::Large).collect::<Vec<_>>(), vec![7]);
        assert!(f.contains(Class::Small, 7, 4096, 128 << 20));
        assert_eq!(f.len(), 4);
        f.validate().unwrap();
    }

    #[test]
    fn validate_names_a_broken_list() {
        let mut f = FreeLists::default();
        f.insert(Class::Large, 7, 8 << 20, 0);
        f.len = 2;
        assert!(f.validate().unwrap_err().contains("count 2"));
        f.len = 1;
        f.lists.push(((Class::Small, 7), BTreeSet::new()));
        assert!(f.validate().unwrap_err().contains("empty"));
        f.lists.pop();
        f.lists.push(f.lists[0].clone());
        f.len = 2;
        assert!(f.validate().unwrap_err().contains("twice"));
    }
}
