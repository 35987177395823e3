//! Address-range allocator for one heap: which offsets of the reserved range hold segments.
//! First fit at the lowest offset (or, for a segment that may grow in place, the start of the
//! largest free range), so placement depends only on the sequence of calls.
//!
//! Invariants (checked by `validate`): free ranges are disjoint, non-adjacent (merged), inside
//! the heap and aligned to the granularity.

use std::collections::BTreeMap;

pub struct Ranges {
    size: u64,
    align: u64,
    /// offset -> length of each free range.
    free: BTreeMap<u64, u64>,
}

impl Ranges {
    pub fn new(size: u64, align: u64) -> Self {
        let size = size - size % align;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Ranges { size, align, free }
    }

    /// Takes `len` bytes (a multiple of the alignment) at the lowest free offset that fits.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        debug_assert!(len > 0 && len % self.align == 0);
        let (&off, &flen) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&off);
        if flen > len {
            self.free.insert(off + len, flen - len);
        }
        Some(off)
    }

    /// Takes `len` bytes at the start of the largest free range (the lowest of equal ones), so
    /// that the most room is left after it: for a segment that may grow in place.
    pub fn alloc_roomy(&mut self, len: u64) -> Option<u64> {
        debug_assert!(len > 0 && len % self.align == 0);
        let (&off, &flen) = self
            .free
            .iter()
            .filter(|(_, &l)| l >= len)
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
        self.free.remove(&off);
        if flen > len {
            self.free.insert(off + len, flen - len);
        }
        Some(off)
    }

    /// Returns a range taken by `alloc`, merging it with free neighbours.
    pub fn free(&mut self, mut off: u64, mut len: u64) {
        if let Some((&p, &plen)) = self.free.range(..off).next_back() {
            if p + plen == off {
                self.free.remove(&p);
                off = p;
                len += plen;
            }
        }
        if let Some(nlen) = self.free.remove(&(off + len)) {
            len += nlen;
        }
        self.free.insert(off, len);
    }

    /// Takes exactly `[off, off + len)` (aligned) if it is free; false otherwise.
    pub fn take_at(&mut self, off: u64, len: u64) -> bool {
        if len == 0 || off % self.align != 0 || len % self.align != 0 || !self.is_free(off, len) {
            return false;
        }
        let (&p, &plen) = self
            .free
            .range(..=off)
            .next_back()
            .expect("is_free found it");
        self.free.remove(&p);
        if p < off {
            self.free.insert(p, off - p);
        }
        if off + len < p + plen {
            self.free.insert(off + len, p + plen - off - len);
        }
        true
    }

    /// The free ranges, (offset, length) in address order.
    pub fn free_list(&self) -> Vec<(u64, u64)> {
        self.free.iter().map(|(&o, &l)| (o, l)).collect()
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn is_free(&self, off: u64, len: u64) -> bool {
        self.free
            .range(..=off)
            .next_back()
            .is_some_and(|(&p, &l)| p + l >= off + len)
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut end = None;
        for (&off, &len) in &self.free {
            if len == 0 || off % self.align != 0 || len % self.align != 0 {
                return Err(format!(
                    "free range {off:#x}+{len:#x} is empty or misaligned"
                ));
            }
            if off + len > self.size {
                return Err(format!("free range {off:#x}+{len:#x} runs past the heap"));
            }
            if let Some(e) = end {
                if off <= e {
                    return Err(format!(
                        "free range at {off:#x} overlaps or touches one before"
                    ));
                }
            }
            end = Some(off + len);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_and_merge() {
        let mut r = Ranges::new(10 << 20, 2 << 20);
        let a = r.alloc(2 << 20).unwrap();
        let b = r.alloc(4 << 20).unwrap();
        let c = r.alloc(2 << 20).unwrap();
        assert_eq!((a, b, c), (0, 2 << 20, 6 << 20));
        assert_eq!(r.alloc(4 << 20), None);
        r.free(b, 4 << 20);
        r.validate().unwrap();
        assert_eq!(r.alloc(2 << 20), Some(2 << 20));
        r.free(a, 2 << 20);
        r.free(2 << 20, 2 << 20);
        r.free(c, 2 << 20);
        r.validate().unwrap();
        assert_eq!(r.free_bytes(), 10 << 20);
        assert_eq!(r.alloc(10 << 20), Some(0));
    }

    #[test]
    fn roomy_takes_the_start_of_the_largest_range() {
        let mut r = Ranges::new(20 << 20, 2 << 20);
        assert!(r.take_at(2 << 20, 2 << 20));
        assert!(r.take_at(8 << 20, 2 << 20));
        // Free: [0, 2), [4, 8), [10, 20) MiB.
        assert_eq!(r.alloc_roomy(2 << 20), Some(10 << 20));
        assert_eq!(r.alloc(2 << 20), Some(0), "first fit stays lowest");
        // Free: [4, 8), [12, 20): the larger wins; among equals the lowest.
        assert_eq!(r.alloc_roomy(4 << 20), Some(12 << 20));
        assert_eq!(r.alloc_roomy(2 << 20), Some(4 << 20));
        assert_eq!(r.alloc_roomy(8 << 20), None);
        r.validate().unwrap();
    }

    #[test]
    fn take_at_an_exact_range() {
        let mut r = Ranges::new(10 << 20, 2 << 20);
        assert!(r.take_at(4 << 20, 4 << 20));
        assert_eq!(r.free_list(), vec![(0, 4 << 20), (8 << 20, 2 << 20)]);
        assert!(!r.take_at(6 << 20, 2 << 20), "taken already");
        assert!(!r.take_at(1 << 20, 2 << 20), "misaligned");
        assert!(!r.take_at(8 << 20, 4 << 20), "runs past the end");
        assert!(r.take_at(0, 2 << 20));
        r.validate().unwrap();
        r.free(4 << 20, 4 << 20);
        r.free(0, 2 << 20);
        assert_eq!(r.free_list(), vec![(0, 10 << 20)]);
    }
}
