//! A pool's free blocks, for best fit: one ordered set of (size, offset) per (size class,
//! first stream), the sets in a short vector (a pool's free memory waits on few streams).
//!
//! Best fit for a stream is one search of that stream's set; a search over every stream visits
//! each set once. A (size, offset) pair is packed into one `u128` (size high), so the sets
//! compare one integer rather than a tuple: the allocation path's searches were its largest
//! cost (bench/NOTES.md, "Global mode's host cost").
//!
//! A set is a sorted vector while it is short and a B-tree past `SPILL` entries (back to a
//! vector under `UNSPILL`: the gap keeps a set near the bound from converting at every call).
//! A training step's sets hold 15-80 blocks, where a binary search and a move of at most a few
//! hundred bytes cost less than a B-tree's node walks and node allocations; a pool fragmented
//! into thousands of free blocks keeps the B-tree's logarithmic insert and remove. Both forms
//! hold the same entries in the same order, so placement never depends on the form.
//!
//! Invariants (checked by `validate`): no set is empty; no two sets share a (class, stream);
//! a vector set is sorted without duplicates and holds at most `SPILL` entries; a tree set
//! holds at least `UNSPILL`; `len` is the number of entries over all sets.

use super::{Class, Stream};
use std::collections::BTreeSet;

/// A set past this many entries becomes a B-tree.
const SPILL: usize = 256;
/// A B-tree set under this many entries becomes a vector again.
const UNSPILL: usize = 64;

/// One (class, first stream)'s free blocks, packed (size, offset), ascending.
#[derive(Debug, Clone)]
enum Set {
    Sorted(Vec<u128>),
    Tree(BTreeSet<u128>),
}

impl Set {
    fn insert(&mut self, k: u128) -> bool {
        match self {
            Set::Sorted(v) => {
                let Err(i) = v.binary_search(&k) else {
                    return false;
                };
                v.insert(i, k);
                if v.len() > SPILL {
                    *self = Set::Tree(std::mem::take(v).into_iter().collect());
                }
                true
            }
            Set::Tree(t) => t.insert(k),
        }
    }

    fn remove(&mut self, k: u128) -> bool {
        match self {
            Set::Sorted(v) => match v.binary_search(&k) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
            Set::Tree(t) => {
                let removed = t.remove(&k);
                if t.len() < UNSPILL {
                    *self = Set::Sorted(std::mem::take(t).into_iter().collect());
                }
                removed
            }
        }
    }

    fn contains(&self, k: u128) -> bool {
        match self {
            Set::Sorted(v) => v.binary_search(&k).is_ok(),
            Set::Tree(t) => t.contains(&k),
        }
    }

    /// The entries from `k` on, ascending.
    fn ascending_from(&self, k: u128) -> Ascending<'_> {
        match self {
            Set::Sorted(v) => Ascending::Sorted(v[v.partition_point(|&e| e < k)..].iter()),
            Set::Tree(t) => Ascending::Tree(t.range(k..)),
        }
    }

    fn last(&self) -> Option<u128> {
        match self {
            Set::Sorted(v) => v.last().copied(),
            Set::Tree(t) => t.last().copied(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Set::Sorted(v) => v.len(),
            Set::Tree(t) => t.len(),
        }
    }

    fn validate(&self) -> Result<(), String> {
        match self {
            Set::Sorted(v) if v.len() > SPILL => Err(format!(
                "a vector set holds {} entries, more than {SPILL}",
                v.len()
            )),
            Set::Sorted(v) if v.windows(2).any(|w| w[0] >= w[1]) => {
                Err("a vector set is out of order or holds an entry twice".into())
            }
            Set::Tree(t) if t.len() < UNSPILL => Err(format!(
                "a tree set holds {} entries, fewer than {UNSPILL}",
                t.len()
            )),
            _ => Ok(()),
        }
    }
}

/// `Set::ascending_from`'s iterator, over either form.
enum Ascending<'a> {
    Sorted(std::slice::Iter<'a, u128>),
    Tree(std::collections::btree_set::Range<'a, u128>),
}

impl Iterator for Ascending<'_> {
    type Item = u128;

    fn next(&mut self) -> Option<u128> {
        match self {
            Ascending::Sorted(i) => i.next().copied(),
            Ascending::Tree(r) => r.next().copied(),
        }
    }
}

#[derive(Default, Debug)]
pub(super) struct FreeLists {
    lists: Vec<((Class, Stream), Set)>,
    len: usize,
}

fn pack(size: u64, off: u64) -> u128 {
    (size as u128) << 64 | off as u128
}

fn unpack(k: u128) -> (u64, u64) {
    ((k >> 64) as u64, k as u64)
}

impl FreeLists {
    fn set(&self, class: Class, stream: Stream) -> Option<&Set> {
        self.lists
            .iter()
            .find(|(k, _)| *k == (class, stream))
            .map(|(_, s)| s)
    }

    pub fn insert(&mut self, class: Class, stream: Stream, size: u64, off: u64) {
        let at = match self.lists.iter().position(|(k, _)| *k == (class, stream)) {
            Some(i) => i,
            None => {
                self.lists.push(((class, stream), Set::Sorted(Vec::new())));
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
        let removed = self.lists[at].1.remove(pack(size, off));
        if removed {
            self.len -= 1;
            if self.lists[at].1.len() == 0 {
                self.lists.swap_remove(at);
            }
        }
        removed
    }

    pub fn contains(&self, class: Class, stream: Stream, size: u64, off: u64) -> bool {
        self.set(class, stream)
            .is_some_and(|s| s.contains(pack(size, off)))
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
            .flat_map(move |s| s.ascending_from(pack(min, 0)).map(unpack))
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
            .filter_map(|(_, s)| s.last().map(|k| unpack(k).0))
            .max()
            .unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut n = 0;
        for (i, (k, s)) in self.lists.iter().enumerate() {
            if s.len() == 0 {
                return Err(format!("free list {k:?} is empty but kept"));
            }
            s.validate().map_err(|e| format!("free list {k:?}: {e}"))?;
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

    /// Both forms give the same answers: random inserts and removes over a model set, through
    /// growth past `SPILL` and shrinking under `UNSPILL` and back, each step checked.
    #[test]
    fn vector_and_tree_forms_agree_with_a_model() {
        let mut f = FreeLists::default();
        let mut model = BTreeSet::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut spills, mut unspills, mut was_tree) = (0, 0, false);
        // Grow to about 3x SPILL, shrink to empty, twice: insertions win while `grow`.
        for phase in 0..4 {
            let grow = phase % 2 == 0;
            for _ in 0..SPILL * 6 {
                let r = next();
                let (size, off) = ((r % 97 + 1) << 12, ((r >> 8) % 4096) << 21);
                let insert = if grow { r % 3 != 0 } else { r % 3 == 0 };
                if insert {
                    f.insert(Class::Large, 5, size, off);
                    model.insert((size, off));
                } else if let Some(&(s2, o2)) =
                    model.iter().nth((r >> 40) as usize % model.len().max(1))
                {
                    assert!(f.remove(Class::Large, 5, s2, o2));
                    model.remove(&(s2, o2));
                }
                assert!(
                    !f.remove(Class::Large, 5, 3, 1),
                    "an absent entry is not removed"
                );
                f.validate().unwrap();
                assert_eq!(f.len(), model.len());
                let tree = matches!(f.set(Class::Large, 5), Some(Set::Tree(_)));
                spills += usize::from(tree && !was_tree);
                unspills += usize::from(!tree && was_tree);
                was_tree = tree;
                let min = (r % 97) << 12;
                let got: Vec<_> = f.fits(Class::Large, 5, min).take(5).collect();
                let want: Vec<_> = model
                    .iter()
                    .filter(|e| e.0 >= min)
                    .take(5)
                    .copied()
                    .collect();
                assert_eq!(got, want, "best fit first, the same in either form");
                assert_eq!(f.largest(), model.iter().map(|e| e.0).max().unwrap_or(0));
                if let Some(&(s2, o2)) = model.first() {
                    assert!(f.contains(Class::Large, 5, s2, o2));
                }
            }
            if !grow {
                for (s2, o2) in std::mem::take(&mut model) {
                    assert!(f.remove(Class::Large, 5, s2, o2));
                }
                assert_eq!(f.len(), 0);
                assert!(f.set(Class::Large, 5).is_none(), "an empty set is dropped");
            }
        }
        assert!(
            spills >= 2 && unspills >= 2,
            "each form turned into the other: {spills} spills, {unspills} unspills"
        );
    }

    #[test]
    fn validate_names_a_broken_set() {
        let mut f = FreeLists::default();
        f.lists
            .push(((Class::Large, 1), Set::Sorted(vec![pack(8, 0), pack(4, 0)])));
        f.len = 2;
        assert!(f.validate().unwrap_err().contains("out of order"));
        f.lists[0].1 = Set::Tree((0..3).map(|i| pack(8, i)).collect());
        f.len = 3;
        assert!(f.validate().unwrap_err().contains("fewer than"));
        f.lists[0].1 = Set::Sorted((0..SPILL as u64 + 1).map(|i| pack(8, i)).collect());
        f.len = SPILL + 1;
        assert!(f.validate().unwrap_err().contains("more than"));
    }

    #[test]
    fn validate_names_a_broken_list() {
        let mut f = FreeLists::default();
        f.insert(Class::Large, 7, 8 << 20, 0);
        f.len = 2;
        assert!(f.validate().unwrap_err().contains("count 2"));
        f.len = 1;
        f.lists.push(((Class::Small, 7), Set::Sorted(Vec::new())));
        assert!(f.validate().unwrap_err().contains("empty"));
        f.lists.pop();
        f.lists.push(f.lists[0].clone());
        f.len = 2;
        assert!(f.validate().unwrap_err().contains("twice"));
    }
}
