//! Where a collective's kernel reads and writes: the caller's buffers when what peers touch is
//! in the symmetric heap, else the communicator's scratch (a heap block of its own, made or
//! grown here) with a copy in and out around the kernel (`Copy`, enqueued by launch.rs). Also
//! `locate` (which segments of the heap a buffer lies in) and, on the host backend, the meeting
//! a rank holds with its peers before it makes a scratch segment or shares a segment
//! (`meet_before_sharing`).
//!
//! Owns: the scratch (`Communicator::scratch`: address and size; freed at destroy), and the
//! placement cache (`Located`, `Collectives::located`): the segments under the last call's
//! buffers and which of them the peers have mapped, kept while nobody has held the heap's lock
//! since they were found (`Allocator::heap_releases`). A steady call (the same buffers, no
//! allocation or free in between) so takes no lock, looks nothing up and exchanges nothing.
//!
//! Invariants: whether a rank stages is decided before it makes any scratch (`place` makes
//! nothing); the scratch's size is a power of two of at least 1 MiB that depends only on the
//! call, so equal calls make equal scratches on every rank; a rank that is about to make a
//! scratch segment or share one first meets its peers on the host backend, so ranks that
//! disagree fail at once (NOT_SYMMETRIC) and make no scratch (CUDA has no meeting: see
//! docs/DESIGN.md). The cache answers only what the heap would: its key is the call's buffers
//! and extents, and any hold of the heap's lock since (a malloc, a free, a segment grown or
//! given back, a statistics read) makes it look again; a segment it says is shared was
//! exchanged by this communicator after the cache found it, and a communicator's record of
//! shared segments only grows (peer/windows.rs).

use super::call::{Call, Coll, Extents};
use super::host_reduce::{self, meeting_word};
use super::{CollSettings, Collectives, Ctx};
use crate::comm::peer::PeerView;
use crate::error::Result;
use crate::heap::comm_view::CommView;
use crate::heap::device_heap::SegmentInfo;
use crate::heap::Allocator;
use std::sync::atomic::Ordering;

/// The chunks of the segment of `device`'s heap holding `ptr..ptr+bytes` (one, unless the
/// segment grew in place under the block), `None` when `ptr` is outside the heap, an error
/// when it is inside the heap but not inside one live block.
pub(in crate::comm) fn locate(
    alloc: &Allocator,
    device: i32,
    ptr: u64,
    bytes: u64,
) -> Result<Option<Vec<SegmentInfo>>> {
    CommView::new(alloc, device).locate(ptr, bytes)
}

/// A copy between a caller's buffer and the scratch, stream-ordered around the kernel.
use crate::comm::exec::Copy;

/// Appends to `segs` each chunk of `more` it does not hold yet (the chunks under one buffer,
/// then another's: a collective's or a rendezvoused range's segments, each once).
pub(in crate::comm) fn add_chunks(
    segs: &mut Vec<SegmentInfo>,
    more: impl IntoIterator<Item = SegmentInfo>,
) {
    for s in more {
        if !segs.contains(&s) {
            segs.push(s);
        }
    }
}

/// The segments under the last collective's buffers, as the heap gave them (`locate_pair`),
/// valid while the heap lock's count of ended holds still reads `stamp` (module header).
pub(in crate::comm) struct Located {
    /// send, its bytes, recv, its bytes (0, 0 for the fused call: its outputs are its own).
    key: [u64; 4],
    stamp: u64,
    send: Option<Vec<SegmentInfo>>,
    recv: Option<Vec<SegmentInfo>>,
    /// The send's and the recv's segments were exchanged after they were found.
    shared: [bool; 2],
}

/// Where a call runs, decided before any scratch is made (`place`).
enum Place {
    /// The caller's buffers (what peers touch is in the heap), with the segments the kernel
    /// touches, output last (multimem binds it), which buffers' segments those are (send,
    /// recv), and whether every one of them is known to be mapped by the peers already.
    Heap {
        send: u64,
        recv: u64,
        segs: Vec<SegmentInfo>,
        uses: [bool; 2],
        shared: bool,
    },
    /// This rank's scratch, `len` bytes: the input at its start, the output `recv_at` bytes in
    /// (None: the fused call, whose outputs are this rank's own).
    Scratch { len: u64, recv_at: Option<u64> },
}

/// Where a call's kernel reads and writes: the caller's buffers when the shared ones are in
/// the heap, else the scratch (and the copies around the kernel), with the segments to share.
pub(super) struct Placement {
    pub send: u64,
    pub recv: u64,
    pub stage_in: Option<Copy>,
    pub stage_out: Option<Copy>,
    pub segs: Vec<SegmentInfo>,
    /// The kernel runs on this rank's scratch (`CallDesc::staged`).
    pub staged: bool,
    /// Every segment in `segs` is mapped by the peers already (the placement cache): a call
    /// that does not force the comparison has nothing to exchange.
    pub shared: bool,
    /// Which of the caller's buffers (send, recv) `segs` came from (none when staged).
    uses: [bool; 2],
}

impl Ctx<'_> {
    /// Where a checked call's kernel reads and writes (`place`), meeting the peers first where
    /// this rank is about to make or share a segment (host backend), then making the scratch
    /// when the call is staged (`stage`). Collective.
    pub(super) fn placement(&mut self, call: &Call, ext: Extents) -> Result<Placement> {
        let place = self.place(call, ext)?;
        let staged = matches!(place, Place::Scratch { .. });
        // Where the CPU runs the collectives (the executor decides), a rank that is about to make a scratch segment or share a
        // segment meets its peers before it does: a peer with nothing new (its buffers in the
        // heap where this rank stages, or other buffers) is then at this call's first barrier,
        // and both fail at once instead of waiting for each other. Every rank meets when the
        // comparison is forced (SYMMALLOC_CHECK_SYMMETRY, equal on every rank). On CUDA there
        // is no meeting, so nothing of this is worked out on the call's path.
        if self.settings.meets {
            let make = match &place {
                Place::Scratch { len, .. } => scratch_to_make(self.coll.scratch, *len),
                Place::Heap { .. } => None,
            };
            if self.settings.check_symmetry
                || make.is_some()
                || shares_new(
                    self.alloc,
                    self.device,
                    self.coll.scratch,
                    self.peer,
                    &place,
                )?
            {
                meet_before_sharing(self.rank, self.peer, self.settings, self.coll, staged, make)?;
            }
        }
        self.stage(call, ext, place)
    }

    /// Where the kernel runs; makes nothing. Only what peers touch must be in the heap: every
    /// rank's input for all-reduce, reduce-scatter and the fused call, every rank's output for
    /// all-reduce and all-gather. When one is not, the call runs on the scratch: all-reduce in
    /// place there, reduce-scatter and all-gather with both halves apart, the fused call with x
    /// alone (its other buffers are this rank's own), and copies in and out around the kernel.
    fn place(&mut self, call: &Call, ext: Extents) -> Result<Place> {
        match call.coll {
            // The barrier kernel is the one-shot kernel on nothing, "in place" (one barrier).
            Coll::Barrier => {
                let base = self.peer.windows.bases[self.rank];
                Ok(Place::Heap {
                    send: base,
                    recv: base,
                    segs: Vec::new(),
                    uses: [false; 2],
                    shared: true,
                })
            }
            Coll::AddRmsNorm(_) => Ok(match self.locate_call([call.send, ext.send, 0, 0])? {
                (Some(segs), _, known) => Place::Heap {
                    send: call.send,
                    recv: 0,
                    segs,
                    uses: [true, false],
                    shared: known[0],
                },
                _ => Place::Scratch {
                    len: ext.send,
                    recv_at: None,
                },
            }),
            _ => {
                let (a, b, known) = self.locate_call([call.send, ext.send, call.recv, ext.recv])?;
                if let (Some(a), Some(b)) = (a, b) {
                    let (segs, uses) = match call.coll {
                        Coll::ReduceScatter => (a, [true, false]),
                        Coll::AllGather => (b, [false, true]),
                        _ => {
                            let mut both = a;
                            add_chunks(&mut both, b);
                            (both, [true, true])
                        }
                    };
                    return Ok(Place::Heap {
                        send: call.send,
                        recv: call.recv,
                        segs,
                        uses,
                        shared: (0..2).all(|i| !uses[i] || known[i]),
                    });
                }
                // All-reduce in place in the scratch; reduce-scatter and all-gather with both
                // halves apart (the kernel then runs out of place).
                let recv_at = match call.coll {
                    Coll::AllReduce(_) => 0,
                    _ => ext.send.next_multiple_of(256),
                };
                Ok(Place::Scratch {
                    len: (recv_at + ext.recv).max(ext.send),
                    recv_at: Some(recv_at),
                })
            }
        }
    }

    /// The buffers the kernel uses at `place`: for the scratch, made (or grown) here, with the
    /// copies in and out.
    fn stage(&mut self, call: &Call, ext: Extents, place: Place) -> Result<Placement> {
        let (len, recv_at) = match place {
            Place::Heap {
                send,
                recv,
                segs,
                uses,
                shared,
            } => {
                return Ok(Placement {
                    send,
                    recv,
                    stage_in: None,
                    stage_out: None,
                    segs,
                    staged: false,
                    shared,
                    uses,
                })
            }
            Place::Scratch { len, recv_at } => (len, recv_at),
        };
        let s = self.ensure_scratch(len)?;
        // Located, and counted in `staged_collectives`, under one hold of the heap's lock.
        let segs = CommView::new(self.alloc, self.device).locate_staged(s, len)?;
        Ok(Placement {
            send: s,
            recv: recv_at.map_or(0, |at| s + at),
            stage_in: Some(Copy {
                dst: s,
                src: call.send,
                bytes: ext.send,
            }),
            stage_out: recv_at.map(|at| Copy {
                dst: call.recv,
                src: s + at,
                bytes: ext.recv,
            }),
            segs,
            staged: true,
            shared: false,
            uses: [false; 2],
        })
    }

    /// Makes (or grows) the scratch to hold `bytes`, at the same offset on every rank for the
    /// same call; returns its address.
    fn ensure_scratch(&mut self, bytes: u64) -> Result<u64> {
        let Some(size) = scratch_to_make(self.coll.scratch, bytes) else {
            return Ok(self.coll.scratch.expect("it holds them").0);
        };
        if let Some((p, old)) = self.coll.scratch {
            self.alloc.free(p, old, self.device, 0)?;
            self.coll.scratch = None;
        }
        // One of the communicator's own blocks of its arena (as group/arena.rs, `own_malloc`).
        let p = self.alloc.malloc_in(
            size,
            self.device,
            0,
            crate::heap::pools::arena_pool(self.arena, true),
        )?;
        self.coll.scratch = Some((p, size));
        Ok(p)
    }

    /// The segments under a call's two buffers (`key`: send, its bytes, recv, its bytes) as
    /// `locate` gives them, with whether each buffer's were exchanged since: from the placement
    /// cache while nobody has held the heap's lock since it was filled, else from the heap
    /// (both buffers under one hold of its lock), refilling the cache.
    fn locate_call(&mut self, key: [u64; 4]) -> Result<(Segs, Segs, [bool; 2])> {
        let now = self.coll.heap_releases.load(Ordering::Acquire);
        if let Some(l) = &self.coll.located {
            if l.key == key && l.stamp == now {
                return Ok((l.send.clone(), l.recv.clone(), l.shared));
            }
        }
        let (send, recv, stamp) = CommView::new(self.alloc, self.device)
            .locate_pair((key[0], key[1]), (key[2], key[3]))?;
        self.coll.located = Some(Located {
            key,
            stamp,
            send: send.clone(),
            recv: recv.clone(),
            shared: [false; 2],
        });
        Ok((send, recv, [false; 2]))
    }

    /// After `p`'s segments were exchanged: the placement cache records that the buffers they
    /// came from are mapped by the peers (their entry is this call's: `place` just filled or
    /// matched it).
    pub(super) fn note_exchanged(&mut self, p: &Placement) {
        if let Some(l) = &mut self.coll.located {
            for i in 0..2 {
                l.shared[i] |= p.uses[i];
            }
        }
    }
}

/// The segments under a buffer, or None outside the heap (`locate`).
type Segs = Option<Vec<SegmentInfo>>;

/// Whether running at `place` makes this rank share a segment its peers have not mapped: one of
/// the caller's, or a scratch it has yet to make (or grow) or to share (`scratch`: the
/// communicator's).
fn shares_new(
    alloc: &Allocator,
    device: i32,
    scratch: Option<(u64, u64)>,
    peer: &PeerView,
    place: &Place,
) -> Result<bool> {
    match place {
        Place::Heap { segs, .. } => Ok(segs.iter().any(|s| peer.windows.needs_sharing(s))),
        Place::Scratch { len, .. } => match scratch {
            Some((p, size)) if size >= *len => Ok(locate(alloc, device, p, size)?
                .is_none_or(|c| c.iter().any(|s| peer.windows.needs_sharing(s)))),
            _ => Ok(true),
        },
    }
}

/// The scratch a call staging `bytes` makes: None when the current one (`scratch`) holds them,
/// else its size (a power of two, at least 1 MiB; the same on every rank for the same call).
fn scratch_to_make(scratch: Option<(u64, u64)>, bytes: u64) -> Option<u64> {
    match scratch {
        Some((_, size)) if size >= bytes => None,
        _ => Some(bytes.next_power_of_two().max(1 << 20)),
    }
}

/// Before this rank makes a scratch segment or shares a segment (`staged`: it stages the call;
/// `make`: the bytes of scratch it makes, a power of two), it meets its peers: every peer that
/// does the same meets it here, and one that has nothing new is at the call's own first
/// barrier, whose digest never equals this word, so both fail at once with NOT_SYMMETRIC
/// instead of one waiting in the exchange and the other at the barrier. Two barriers, so no
/// peer can write its next barrier's word over this one before this rank has compared it. A
/// timeout breaks the communicator (as in a host collective). Only where the collectives run
/// on the CPU (`CollSettings::meets`, from `Executor::meets`); CUDA has no meeting (see
/// docs/DESIGN.md).
fn meet_before_sharing(
    rank: usize,
    peer: &PeerView,
    settings: &CollSettings,
    coll: &mut Collectives,
    staged: bool,
    make: Option<u64>,
) -> Result<()> {
    let word = meeting_word(staged, make);
    let r = host_reduce::meet(
        rank,
        &peer.pads,
        word,
        settings.timeout,
        &mut coll.host_epoch,
    );
    if let Err(e) = &r {
        if e.status == crate::error::Status::ErrTimeout {
            coll.sticky = Some(e.clone());
        }
    }
    r
}
