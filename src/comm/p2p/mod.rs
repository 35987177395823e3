//! Symmetric memory the user programs: `rendezvous` (collective: maps every peer's segments
//! under a range and checks that every rank passed the same one), `peer_ptr` (local), and the
//! stream-ordered `put` (copy engine), `signal` and `wait` over the communicator's signal pads
//! (signal_pad.rs), plus `device_view` for device code (device_comm.rs). docs/DESIGN.md,
//! "Programming symmetric memory", states the ordering semantics. Each is a method of `View`, a
//! per-call view of the communicator (comm/calls.rs checks the arguments that need no state,
//! begins the call and builds it); put, signal and wait build an executor plan (comm/exec/:
//! the copy, the kernel or stream operation, and the CPU twin of the host backend).
//!
//! Owned by the communicator (nothing here is per device or per process): the rendezvous table
//! and the signal pads (`P2p`).
//!
//! Invariants:
//! - a peer address is handed out (peer_ptr, put) only for a range inside one rendezvoused
//!   range whose segments are still, on this rank, the generation that was rendezvoused, and,
//!   for another rank, mapped here and not released by that rank (its release log is read
//!   first, so a released segment is refused even where peer/retire.rs cannot unmap it yet,
//!   during a capture): never a dangling mapping;
//! - a rank whose arguments are bad still takes part in the rendezvous exchange (as "invalid"),
//!   so every rank fails together (NOT_SYMMETRIC on the others) instead of waiting for it;
//! - p2p calls are not ordered against the communicator's collectives on other streams (they
//!   share no state with the collective kernels): only stream order holds. Their plans say so
//!   (`ordered: false`, comm/exec/): ordering them against the communicator's other streams
//!   would serialize the overlap they exist for (compute on one stream, puts and waits on
//!   another; docs/DESIGN.md, "Streams").

pub mod device_comm;
pub mod signal_pad;

use crate::comm::collective::algo::{DType, Kernel, ReduceOp};
use crate::comm::collective::kernel_args::ABORT_OFFSET;
use crate::comm::collective::launch::{CallDesc, DescKind};
use crate::comm::collective::Ctx;
use crate::comm::exec::{self, ArgBlock, Family, KernelId};
use crate::error::{Error, Result, Status};
use crate::heap::device_heap::SegmentInfo;
use device_comm::*;
use signal_pad::{P2pArgs, SignalVia, WaitVia};
use std::collections::BTreeMap;

/// The p2p kernels' names (kernels/p2p.cu).
pub const P2P_WAIT_KERNEL: &str = "symm_p2p_wait";
pub const P2P_SIGNAL_KERNEL: &str = "symm_p2p_signal";

const WAIT: KernelId = KernelId::new(Family::P2p, 0);
const SIGNAL: KernelId = KernelId::new(Family::P2p, 1);

fn kernel_name(id: KernelId) -> Result<String> {
    Ok(if id == WAIT {
        P2P_WAIT_KERNEL
    } else {
        P2P_SIGNAL_KERNEL
    }
    .to_string())
}

/// A p2p kernel on one warp, with `args`.
fn launch(id: KernelId, args: &P2pArgs) -> exec::Device {
    exec::Device::Kernel(exec::Launch {
        id,
        name: kernel_name,
        grid: 1,
        block: 32,
        cluster: 1,
        shared: 0,
        args: ArgBlock::of(args),
    })
}

/// A range every rank passed to `symm_rendezvous`: [start, end) in this rank's heap, and the
/// segments under it as they were then.
struct Range {
    end: u64,
    segs: Vec<SegmentInfo>,
}

/// The communicator's p2p state.
pub(in crate::comm) struct P2p {
    /// This rank's signal pad (`SYMM_SIGNAL_PAD_BYTES` of the internal pool, zeroed at init).
    pub pad: u64,
    /// The offset of the pad's segment: a peer that releases it destroyed its communicator.
    pub pad_seg: u64,
    /// Every rank's pad in this address space.
    pub pads: Vec<u64>,
    /// Rendezvoused ranges by start address.
    table: BTreeMap<u64, Range>,
}

impl P2p {
    pub fn new(pad: u64) -> P2p {
        P2p {
            pad,
            pad_seg: 0,
            pads: Vec::new(),
            table: BTreeMap::new(),
        }
    }
}

/// A range's bytes as an exclusive end, or an error naming the call and the values.
fn end_of(what: &str, ptr: u64, bytes: u64) -> Result<u64> {
    ptr.checked_add(bytes).ok_or_else(|| {
        Error::invalid(format!(
            "{what}: {ptr:#x} + {bytes} bytes overflows the address space"
        ))
    })
}

/// `peer` as a rank of a world of `world`, or an error naming the call.
pub(in crate::comm) fn check_peer(what: &str, peer: i64, world: usize) -> Result<usize> {
    usize::try_from(peer)
        .ok()
        .filter(|&p| p < world)
        .ok_or_else(|| {
            Error::invalid(format!(
                "{what}: peer {peer} is out of range; expected 0..{world} (world size {world})"
            ))
        })
}

/// A signal slot, or an error naming the call.
pub(in crate::comm) fn check_slot(what: &str, slot: u32) -> Result<()> {
    if slot >= SYMM_SIGNAL_SLOTS {
        return Err(Error::invalid(format!(
            "{what}: slot {slot} is past the signal pad; expected 0..{SYMM_SIGNAL_SLOTS} \
             (SYMM_SIGNAL_SLOTS slots per rank)"
        )));
    }
    Ok(())
}

/// `symm_put`'s checks of what it copies from, before the call begins.
pub(in crate::comm) fn check_src(src: u64, bytes: u64) -> Result<()> {
    if src == 0 {
        return Err(Error::invalid("symm_put: src is NULL"));
    }
    end_of("symm_put (src)", src, bytes)?;
    Ok(())
}

/// What p2p reads and writes of its communicator for one call: the collective pipeline's view
/// (`Ctx`: place, settings, executor, error words, the peers' memory; the rendezvous exchanges
/// through it), the p2p state, and the segment of the internal block (a peer's release of it
/// is its destroy). Built by comm/calls.rs after the call began (`begin_call`).
pub(in crate::comm) struct View<'a> {
    pub c: Ctx<'a>,
    pub p2p: &'a mut P2p,
    pub internal_seg: u64,
}

impl View<'_> {
    /// The segments under [ptr, ptr + bytes), every byte of which must lie in a live block of
    /// this rank's heap.
    fn live_segments(&self, ptr: u64, bytes: u64) -> Result<Vec<SegmentInfo>> {
        if bytes == 0 {
            return Err(Error::invalid(format!(
                "symm_rendezvous: bytes is 0 at {ptr:#x}; expected a range of at least one byte"
            )));
        }
        let end = end_of("symm_rendezvous", ptr, bytes)?;
        let heap = self.c.alloc.heap(self.c.device)?;
        if !heap.contains(ptr) || end > heap.base() + heap.size() {
            return Err(Error::invalid(format!(
                "symm_rendezvous: range {ptr:#x} + {bytes} bytes is not inside the symmetric heap \
                 of device {} ([{:#x}, {:#x})); expected memory from symm_malloc",
                self.c.device,
                heap.base(),
                heap.base() + heap.size()
            )));
        }
        let mut segs: Vec<SegmentInfo> = Vec::new();
        let mut p = ptr;
        while p < end {
            let (chunks, bstart, bsize) = heap.segment_of(p).map_err(|_| {
                Error::invalid(format!(
                    "symm_rendezvous: range {ptr:#x} + {bytes} bytes: address {p:#x} is not \
                     inside a live symm_malloc block; expected every byte allocated"
                ))
            })?;
            crate::comm::collective::place::add_chunks(&mut segs, chunks);
            p = bstart + bsize;
        }
        Ok(segs)
    }

    /// `symm_rendezvous`: collective. Every rank passes the same offset and size; maps every
    /// peer's segments under the range and records it. Idempotent.
    /// (The call began: comm/calls.rs.)
    pub fn rendezvous(&mut self, ptr: u64, bytes: u64) -> Result<()> {
        let heap_base = self.c.peer.windows.bases[self.c.rank];
        let local = self.live_segments(ptr, bytes);
        let (off, count) = match &local {
            Ok(_) => (ptr - heap_base, bytes),
            // Takes part as "invalid": the peers then fail the comparison with this rank.
            Err(_) => (u64::MAX, u64::MAX),
        };
        let desc = CallDesc {
            kind: DescKind::Rendezvous,
            kernel: Kernel::OneShot,
            send_off: off,
            recv_off: off,
            count,
            dtype: DType::Fp32,
            op: ReduceOp::Sum,
            width: 0,
            staged: false,
        };
        let segs = local.as_ref().map(|s| s.as_slice()).unwrap_or(&[]);
        let shared = self.c.exchange(segs, desc, true);
        let segs = local?;
        shared.map_err(|e| {
            if e.status == Status::ErrNotSymmetric {
                e.context(format!(
                    "symm_rendezvous: rank {} passed offset {off:#x} and {bytes} bytes; every rank \
                     must pass the same offset and size (a rank whose descriptor shows offset \
                     0xffffffffffffffff passed an invalid range)",
                    self.c.rank
                ))
            } else {
                e.context("symm_rendezvous")
            }
        })?;
        // Ranges whose segments went back since are dropped, so the table stays small.
        let heap = self.c.alloc.heap(self.c.device)?;
        self.p2p.table.retain(|_, r| {
            r.segs
                .iter()
                .all(|s| heap.segment_info(s.offset) == Some(*s))
        });
        drop(heap);
        let end = ptr + bytes;
        match self.p2p.table.get_mut(&ptr) {
            Some(r) if r.end >= end => r.segs = segs,
            _ => {
                self.p2p.table.insert(ptr, Range { end, segs });
            }
        }
        crate::info!(
            "rank {}/{}: rendezvous of {bytes} bytes at offset {off:#x}",
            self.c.rank,
            self.c.world
        );
        Ok(())
    }

    /// Whether `peer` has released (its release log says so) the generation of its segment at
    /// `offset` that this rank maps, including records peer/retire.rs has not handled yet.
    fn released_by(&self, peer: usize, offset: u64) -> bool {
        let Some(generation) = self.c.peer.windows.mapped_generation(peer, offset) else {
            return true;
        };
        let Some(heap) = &self.c.peer.windows.peers[peer] else {
            return false;
        };
        let mut records = Vec::new();
        heap.log
            .read_since(self.c.peer.releases.seen[peer], &mut records);
        records.contains(&(offset, generation))
    }

    /// `peer`'s address of [ptr, ptr + bytes), a range of this rank's heap inside one
    /// rendezvoused range (see the module's invariants).
    fn peer_range(&self, what: &str, ptr: u64, bytes: u64, peer: usize) -> Result<u64> {
        let end = end_of(what, ptr, bytes.max(1))?;
        let (heap_base, heap_end, valid) = {
            let heap = self.c.alloc.heap(self.c.device)?;
            let (base, size) = (heap.base(), heap.size());
            if !heap.contains(ptr) {
                return Err(Error::invalid(format!(
                    "{what}: pointer {ptr:#x} is outside the symmetric heap of device {} \
                     ([{base:#x}, {:#x})); expected memory from symm_malloc passed to \
                     symm_rendezvous",
                    self.c.device,
                    base + size
                )));
            }
            let covering = self
                .p2p
                .table
                .range(..=ptr)
                .rev()
                .find(|(_, r)| r.end >= end);
            let Some((&start, r)) = covering else {
                let within = self
                    .p2p
                    .table
                    .range(..=ptr)
                    .rev()
                    .find(|(_, r)| r.end > ptr);
                return Err(Error::invalid(match within {
                    Some((&s, r)) => format!(
                        "{what}: range {ptr:#x} + {bytes} bytes leaves the rendezvoused range \
                         [{s:#x}, {:#x}) (and the peers' mapped segments); expected it inside",
                        r.end
                    ),
                    None => format!(
                        "{what}: {ptr:#x} is in the heap but not in a range rendezvoused on this \
                         communicator; call symm_rendezvous on it (every rank) first"
                    ),
                }));
            };
            let stale = r
                .segs
                .iter()
                .find(|s| heap.segment_info(s.offset) != Some(**s));
            if let Some(s) = stale {
                return Err(Error::invalid(format!(
                    "{what}: the range rendezvoused at {start:#x} lost its segment at heap offset \
                     {:#x} (released by empty_cache or release_pool since); its peer pointers are \
                     refused: allocate and rendezvous again",
                    s.offset
                )));
            }
            (base, base + size, r.segs.clone())
        };
        debug_assert!(end <= heap_end);
        if peer != self.c.rank {
            for s in valid
                .iter()
                .filter(|s| heap_base + s.offset < end && ptr < heap_base + s.offset + s.size)
            {
                if self.released_by(peer, s.offset) {
                    return Err(Error::peer(format!(
                        "{what}: rank {peer} released its segment at heap offset {:#x} (under \
                         {ptr:#x}) after the rendezvous; its peer pointers are refused",
                        s.offset
                    )));
                }
            }
        }
        Ok(self.c.peer.windows.bases[peer] + (ptr - heap_base))
    }

    /// `symm_peer_ptr`: local; the address, in this process, of `ptr`'s offset in `peer`'s heap.
    pub fn peer_ptr(&self, ptr: u64, peer: i64) -> Result<u64> {
        let peer = check_peer("symm_peer_ptr", peer, self.c.world)?;
        if let Some(e) = &self.c.coll.sticky {
            return Err(e.clone());
        }
        self.peer_range("symm_peer_ptr", ptr, 1, peer)
    }

    /// `symm_put`: after the stream's earlier work, copies `bytes` from `src` into `peer`'s
    /// buffer at `dst`'s offset (copy engine; on the host backend, now).
    /// (The call checked `peer`, `src` and a non-zero `bytes`, and began: comm/calls.rs.)
    pub fn put(&mut self, peer: usize, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        // `to` spans `bytes` bytes of a mapped, rendezvoused range (checked here); src is the
        // caller's buffer of `bytes` bytes; they may overlap (a put to self).
        let to = self.peer_range("symm_put", dst, bytes, peer)?;
        self.c.exec.submit(exec::Plan {
            stream,
            ordered: false,
            copy_in: Some(exec::Copy {
                dst: to,
                src,
                bytes,
            }),
            device: exec::Device::Nothing,
            cpu: None,
            copy_out: None,
        })
    }

    fn p2p_args(&self, slot: u32, value: u64, peer: usize) -> P2pArgs {
        P2pArgs {
            d: self.device_view(),
            value,
            slot,
            peer: peer as i32,
        }
    }

    /// The peer's pad, unless the peer destroyed its communicator (released the pad).
    fn peer_pad(&self, what: &str, peer: usize) -> Result<u64> {
        if peer != self.c.rank
            && (self.released_by(peer, self.p2p.pad_seg)
                || self.c.peer.internal_released_by(peer, self.internal_seg))
        {
            return Err(Error::peer(format!(
                "{what}: rank {peer} destroyed its communicator (its signal pad was released)"
            )));
        }
        Ok(self.p2p.pads[peer])
    }

    /// `signal` by a chosen mechanism (the benchmark compares them).
    /// (The call checked `peer` and `slot`, and began: comm/calls.rs.)
    pub fn signal_via(
        &mut self,
        via: SignalVia,
        peer: usize,
        slot: u32,
        value: u64,
        stream: u64,
    ) -> Result<()> {
        let pad = self.peer_pad("symm_signal", peer)?;
        let device = match via {
            SignalVia::StreamWrite => exec::Device::StreamWrite {
                word_addr: signal_pad::writer_addr(pad, slot),
                word: self.c.rank as u32 + 1,
                value_addr: signal_pad::value_addr(pad, slot),
                value,
            },
            SignalVia::Kernel => launch(SIGNAL, &self.p2p_args(slot, value, peer)),
        };
        let rank = self.c.rank;
        let mut twin = || {
            signal_pad::host_signal(pad, slot, rank, peer == rank, value);
            Ok(())
        };
        self.c
            .exec
            .submit(exec::Plan::work(stream, false, device, &mut twin))
    }

    /// `wait` by a chosen mechanism; `StreamWait` is unbounded (benchmark only).
    /// (The call checked `slot` and began: comm/calls.rs.)
    pub fn wait_via(&mut self, via: WaitVia, slot: u32, value: u64, stream: u64) -> Result<()> {
        let device = match via {
            WaitVia::Kernel => launch(WAIT, &self.p2p_args(slot, value, self.c.rank)),
            WaitVia::StreamWait => exec::Device::StreamWait {
                addr: signal_pad::value_addr(self.p2p.pad, slot),
                value,
            },
        };
        let (rank, pad, timeout) = (self.c.rank, self.p2p.pad, self.c.settings.timeout);
        let sticky = &mut self.c.coll.sticky;
        let mut twin = || match signal_pad::host_wait(pad, slot, value, timeout) {
            Ok(()) => Ok(()),
            Err((seen, writer)) => {
                let e = crate::comm::collective::error_word::timeout_error(
                    rank, slot, value, seen, writer, timeout,
                );
                *sticky = Some(e.clone());
                Err(e)
            }
        };
        self.c
            .exec
            .submit(exec::Plan::work(stream, false, device, &mut twin))
    }

    /// `symm_comm_device`: the communicator as device code sees it (`struct_size` left for the
    /// caller's layer to set).
    pub fn device_view(&self) -> DeviceComm {
        let mut d = DeviceComm {
            struct_size: std::mem::size_of::<DeviceComm>() as u64,
            version: SYMM_DEVICE_COMM_VERSION,
            world: self.c.world as i32,
            rank: self.c.rank as i32,
            signal_slots: SYMM_SIGNAL_SLOTS,
            timeout_ns: self.c.settings.timeout.as_nanos().min(u64::MAX as u128) as u64,
            abort_word: self.c.internal + ABORT_OFFSET,
            error_word: self.c.coll.errors.device_ptr(),
            ..DeviceComm::default()
        };
        d.heap_bases[..self.c.world].copy_from_slice(&self.c.peer.windows.bases);
        d.signal_pads[..self.c.world].copy_from_slice(&self.p2p.pads);
        d
    }
}

impl P2p {
    /// Rendezvoused ranges held (for tests).
    pub fn ranges(&self) -> usize {
        self.table.len()
    }
}
