//! Peer heaps, shared by every communicator of this process that includes the peer: for one
//! peer process's heap (on its device), as seen from one device of this process, the window
//! (a reservation as large as the heap, where the peer's segments are mapped at their own
//! offsets), the mappings in it, and the peer's release log. A communicator holds an `Arc` per
//! peer; a child made by `symm_comm_split` clones its parent's, so memory the parent mapped is
//! not imported again, and a child keeps the mappings alive after its parent is destroyed.
//! A fresh `symm_comm_init` over peers this process already maps finds them here too (by the
//! peer's identity: process id, a random per-process nonce and its device).
//!
//! Invariants: at most one `PeerHeap` per (local device, peer identity) is alive (the registry
//! holds weak references); a mapping is keyed by its segment offset and carries the peer's
//! generation of that segment; mappings never overlap (a newer generation replaces every older
//! mapping it overlaps); each mapping counts once in the local device's `peer_mappings` stat
//! while it exists; the last `Arc` to go unmaps everything and gives the window back.
//! Mappings change under the heap's own mutex, so communicators on several threads may share
//! it; the window base never changes.

use crate::error::Result;
use crate::heap::backend::Phys;
use crate::heap::comm_view::CommView;
use crate::heap::device_heap::SegmentInfo;
use crate::heap::release_log::ReleaseView;
use crate::heap::Allocator;
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// Who a peer heap belongs to: a process (its pid and a random nonce drawn once per process,
/// so a reused pid is another identity) and the peer's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerIdent {
    pub pid: u32,
    pub nonce: u64,
    pub device: i32,
}

impl PeerIdent {
    /// This process on `device`.
    pub fn me(device: i32) -> Result<PeerIdent> {
        Ok(PeerIdent {
            pid: std::process::id(),
            nonce: process_nonce()?,
            device,
        })
    }

    pub fn words(&self) -> [u64; 3] {
        [self.pid as u64, self.nonce, self.device as u64]
    }

    pub fn from_words(w: &[u64]) -> PeerIdent {
        PeerIdent {
            pid: w[0] as u32,
            nonce: w[1],
            device: w[2] as i32,
        }
    }

    /// The same process (whatever the device).
    pub fn same_process(&self, other: &PeerIdent) -> bool {
        self.pid == other.pid && self.nonce == other.nonce
    }
}

fn process_nonce() -> Result<u64> {
    static NONCE: OnceLock<u64> = OnceLock::new();
    if let Some(n) = NONCE.get() {
        return Ok(*n);
    }
    let id = crate::ipc::UniqueId::generate()?;
    let b = id.secret;
    let n = u64::from_le_bytes(b[..8].try_into().expect("secret has 32 bytes"));
    Ok(*NONCE.get_or_init(|| n))
}

struct Mapping {
    size: u64,
    generation: u64,
    phys: Phys,
}

/// One peer's heap as mapped into one local device's address space.
pub struct PeerHeap {
    alloc: &'static Allocator,
    /// The local device (whose address space holds the window).
    device: i32,
    pub ident: PeerIdent,
    heap_size: u64,
    /// Where the peer's heap appears here.
    pub base: u64,
    /// The peer's release log (comm/peer/retire.rs reads it).
    pub log: ReleaseView,
    mapped: Mutex<BTreeMap<u64, Mapping>>,
}

type Key = (i32, PeerIdent);

fn registry() -> MutexGuard<'static, HashMap<Key, Weak<PeerHeap>>> {
    static R: OnceLock<Mutex<HashMap<Key, Weak<PeerHeap>>>> = OnceLock::new();
    R.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The live peer heap of `ident` on local `device`, if a communicator of this process holds one.
pub fn find(device: i32, ident: PeerIdent) -> Option<Arc<PeerHeap>> {
    registry().get(&(device, ident)).and_then(Weak::upgrade)
}

/// The peer heap of `ident` on local `device`: the live one, or a new window over the peer's
/// release log `log` (the peer's heap is `heap_size` bytes, as this device's).
pub fn open(
    alloc: &'static Allocator,
    device: i32,
    ident: PeerIdent,
    heap_size: u64,
    log: BorrowedFd<'_>,
) -> Result<Arc<PeerHeap>> {
    let mut reg = registry();
    if let Some(p) = reg.get(&(device, ident)).and_then(Weak::upgrade) {
        return Ok(p);
    }
    let log = ReleaseView::open(log)?;
    let base = alloc.backend().reserve(device, heap_size)?;
    let p = Arc::new(PeerHeap {
        alloc,
        device,
        ident,
        heap_size,
        base,
        log,
        mapped: Mutex::new(BTreeMap::new()),
    });
    reg.retain(|_, w| w.strong_count() > 0);
    reg.insert((device, ident), Arc::downgrade(&p));
    Ok(p)
}

impl PeerHeap {
    fn mapped(&self) -> MutexGuard<'_, BTreeMap<u64, Mapping>> {
        self.mapped.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unmap_one(&self, mapped: &mut BTreeMap<u64, Mapping>, off: u64) {
        if let Some(m) = mapped.remove(&off) {
            let be = self.alloc.backend();
            let _ = be.unmap(self.device, self.base + off, m.size);
            let _ = be.release(m.phys);
            let _ = CommView::new(self.alloc, self.device).count_peer_mapping(-1);
        }
    }

    /// The generation of the peer's segment mapped at `offset`, if one is.
    pub fn generation_at(&self, offset: u64) -> Option<u64> {
        self.mapped().get(&offset).map(|m| m.generation)
    }

    /// Unmaps the peer's segment at `offset` if exactly that `generation` of it is mapped (the
    /// peer released it); true when it did.
    pub fn unmap_released(&self, offset: u64, generation: u64) -> bool {
        let mut mapped = self.mapped();
        let here = mapped
            .get(&offset)
            .is_some_and(|m| m.generation == generation);
        if here {
            self.unmap_one(&mut mapped, offset);
        }
        here
    }

    /// Maps the peer's segment `seg` (its memory passed as `fd`), unless that generation is
    /// mapped already (another communicator imported it: the fd is simply dropped).
    pub fn import(&self, seg: SegmentInfo, fd: OwnedFd) -> Result<()> {
        let mut mapped = self.mapped();
        if let Some(m) = mapped.get(&seg.offset) {
            if m.generation == seg.generation && m.size == seg.size {
                return Ok(());
            }
        }
        let stale: Vec<u64> = mapped
            .iter()
            .filter(|(&o, m)| o < seg.offset + seg.size && seg.offset < o + m.size)
            .map(|(&o, _)| o)
            .collect();
        for o in stale {
            self.unmap_one(&mut mapped, o);
        }
        let be = self.alloc.backend();
        let phys = be.import(self.device, fd)?;
        if let Err(e) = be.map(self.device, self.base + seg.offset, seg.size, &phys) {
            let _ = be.release(phys);
            return Err(e.context(format!(
                "mapping pid {}'s segment at offset {:#x}",
                self.ident.pid, seg.offset
            )));
        }
        mapped.insert(
            seg.offset,
            Mapping {
                size: seg.size,
                generation: seg.generation,
                phys,
            },
        );
        CommView::new(self.alloc, self.device).count_peer_mapping(1)?;
        Ok(())
    }
}

impl Drop for PeerHeap {
    fn drop(&mut self) {
        let mut mapped = std::mem::take(&mut *self.mapped());
        let offs: Vec<u64> = mapped.keys().copied().collect();
        for o in offs {
            self.unmap_one(&mut mapped, o);
        }
        let _ = self
            .alloc
            .backend()
            .unreserve(self.device, self.base, self.heap_size);
    }
}
