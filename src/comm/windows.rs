//! Peer windows: for every peer, a reservation as large as the heap in which the peer's
//! segments are mapped at their own offsets, so peer address = window[peer] + offset.
//!
//! Invariants: a mapping is keyed by (peer, segment offset) and carries the segment's
//! generation; mappings of one peer never overlap; a segment that comes back with a new
//! generation (released and re-created) replaces every older mapping it overlaps. Every mapping
//! counts once in the device's `peer_mappings` stat while it exists. A mapping goes when the
//! peer's segment is replaced (a new generation), released (retire.rs) or the communicator is
//! destroyed.

use crate::error::Result;
use crate::heap::backend::Phys;
use crate::heap::device_heap::SegmentInfo;
use crate::heap::Allocator;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;

struct Mapping {
    size: u64,
    generation: u64,
    phys: Phys,
}

pub struct PeerWindows {
    device: i32,
    rank: usize,
    heap_size: u64,
    /// bases[r]: where rank r's heap appears in this process (own rank: the heap itself).
    pub bases: Vec<u64>,
    mapped: Vec<BTreeMap<u64, Mapping>>,
    /// Own segments already shared with the peers: offset -> generation.
    shared: HashMap<u64, u64>,
}

impl PeerWindows {
    pub fn new(alloc: &Allocator, device: i32, rank: usize, world: usize) -> Result<Self> {
        let (heap_base, heap_size) = {
            let h = alloc.heap(device)?;
            (h.base(), h.size())
        };
        let mut w = PeerWindows {
            device,
            rank,
            heap_size,
            bases: vec![0; world],
            mapped: (0..world).map(|_| BTreeMap::new()).collect(),
            shared: HashMap::new(),
        };
        for r in 0..world {
            w.bases[r] = if r == rank {
                heap_base
            } else {
                match alloc.backend().reserve(device, heap_size) {
                    Ok(b) => b,
                    Err(e) => {
                        w.destroy(alloc);
                        return Err(e.context(format!("reserving the window of rank {r}")));
                    }
                }
            };
        }
        Ok(w)
    }

    pub fn needs_sharing(&self, seg: &SegmentInfo) -> bool {
        self.shared.get(&seg.offset) != Some(&seg.generation)
    }

    pub fn mark_shared(&mut self, seg: &SegmentInfo) {
        self.shared.insert(seg.offset, seg.generation);
    }

    fn unmap_one(&mut self, alloc: &Allocator, peer: usize, off: u64) {
        if let Some(m) = self.mapped[peer].remove(&off) {
            let be = alloc.backend();
            let _ = be.unmap(self.device, self.bases[peer] + off, m.size);
            let _ = be.release(m.phys);
            if let Ok(mut h) = alloc.heap(self.device) {
                h.stats.peer_mappings -= 1;
            }
        }
    }

    /// Unmaps `peer`'s segment at `offset` if this rank maps exactly that `generation` of it
    /// (the peer released it); true when it did.
    pub fn unmap_released(
        &mut self,
        alloc: &Allocator,
        peer: usize,
        offset: u64,
        generation: u64,
    ) -> bool {
        let here = self.mapped[peer]
            .get(&offset)
            .is_some_and(|m| m.generation == generation);
        if here {
            self.unmap_one(alloc, peer, offset);
        }
        here
    }

    /// The generation of `peer`'s segment at `offset` as mapped here, if it is mapped.
    pub fn mapped_generation(&self, peer: usize, offset: u64) -> Option<u64> {
        self.mapped[peer].get(&offset).map(|m| m.generation)
    }

    /// Maps `peer`'s segment `seg` (memory passed as `fd`) into the peer's window.
    pub fn import(
        &mut self,
        alloc: &Allocator,
        peer: usize,
        seg: SegmentInfo,
        fd: OwnedFd,
    ) -> Result<()> {
        if let Some(m) = self.mapped[peer].get(&seg.offset) {
            if m.generation == seg.generation && m.size == seg.size {
                return Ok(());
            }
        }
        let stale: Vec<u64> = self.mapped[peer]
            .iter()
            .filter(|(&o, m)| o < seg.offset + seg.size && seg.offset < o + m.size)
            .map(|(&o, _)| o)
            .collect();
        for o in stale {
            self.unmap_one(alloc, peer, o);
        }
        let be = alloc.backend();
        let phys = be.import(self.device, fd)?;
        if let Err(e) = be.map(self.device, self.bases[peer] + seg.offset, seg.size, &phys) {
            let _ = be.release(phys);
            return Err(e.context(format!(
                "mapping rank {peer}'s segment at offset {:#x}",
                seg.offset
            )));
        }
        self.mapped[peer].insert(
            seg.offset,
            Mapping {
                size: seg.size,
                generation: seg.generation,
                phys,
            },
        );
        alloc.heap(self.device)?.stats.peer_mappings += 1;
        Ok(())
    }

    /// Unmaps every peer segment and gives the windows back.
    pub fn destroy(&mut self, alloc: &Allocator) {
        for peer in 0..self.mapped.len() {
            let offs: Vec<u64> = self.mapped[peer].keys().copied().collect();
            for o in offs {
                self.unmap_one(alloc, peer, o);
            }
            if peer != self.rank && self.bases[peer] != 0 {
                let _ = alloc
                    .backend()
                    .unreserve(self.device, self.bases[peer], self.heap_size);
                self.bases[peer] = 0;
            }
        }
        self.shared.clear();
    }
}
