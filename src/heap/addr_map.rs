//! Maps keyed by a block's address or offset, hashed with one multiply: the thread caches'
//! fast path (tcache.rs) and the heap's blocks and tracked blocks (device_heap/) do a lookup
//! per call, and std's SipHash cost as much as the rest of the fast path.
//!
//! Keys are 512-byte aligned (ROUND), so the hash drops the low 9 bits and folds the high ones
//! down, spreading segment starts (multiples of the 2 MiB granularity) over the table's low
//! bits. Any key is correct; only the spread assumes the alignment.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes a block address (512-byte aligned) with one multiply.
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        // The high bits folded down: the table indexes by the low bits, and segment starts
        // (multiples of the 2 MiB granularity) would otherwise all share them.
        let h = (x >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;
