//! `symm_comm_split`: children of a communicator, as in `ncclCommSplit`. Collective over the
//! parent; one round over the parent's mesh, and usually nothing more:
//!
//! 1. every parent rank sends its color, key, why it refuses (a color below -1, a broken
//!    parent, the device's limit of communicators: registry.rs), which of the parent's split
//!    slots it has free (slots.rs), the text of its communicator settings, its heap's free
//!    address ranges, its bet (below), which parent ranks' blocks it maps, and to every later
//!    parent rank one end of a socket pair of their own (no listening socket, no new
//!    authentication: the parent's connections carry them). Any refusal, or settings that
//!    differ, fails the split on every rank, naming the ranks; the parent's mesh is then still
//!    in step (each rank sent and received one message per peer), so the parent stays usable.
//!    NOCOLOR ranks are done.
//! 2. ranks of one color form a child, ordered by key, then parent rank, over the socket pairs
//!    between them. The child takes its parent's peer heaps for its ranks (peer/peers.rs: no memory
//!    the parent mapped is imported again) and its record of shared segments.
//! 3. its arena lies at the highest offset free on all its ranks, and its internal block is
//!    carved out of the lowest split slot free on every parent rank (the same slot for every
//!    child of the split: no new memory, nothing to import) or, where none is, allocated and
//!    exchanged over the child's mesh.
//!
//! The bet. Before round 1 a colored rank that does not refuse claims its arena at the highest
//! offset its own heap has free and takes its lowest free slot, resets it for any child
//! (internal.rs, `reset_slot`) and draws the release-log generation of the block it will carve
//! there; round 1 carries the three. Heaps and slots of ranks that made the same calls look
//! alike, so every rank of a child has usually bet the same offset and the slot step 3 picks:
//! then the arena is claimed and the block readied on every rank (each reset its slot before it
//! sent round 1), and the child needs no round of its own. Otherwise what was bet goes back
//! and the child runs the rounds that decide it: the arena claim round (arena.rs) and the carve
//! round (internal.rs). Either way the outcome is the one the rounds would give.
//!
//! A failure in step 3 (a rank that died, memory) fails that child's ranks, naming the rank. A
//! child is independent of its parent from then on: its own mesh, arena, internal block and
//! error words; the peer heaps and a parent's block of split slots are reference-counted, so
//! destroying the parent first leaves the child working.

use super::arena::Terms;
use super::init::{Settings, Setup};
use super::registry;
use super::slots::{Internal, Plan, SlotHold};
use crate::comm::Communicator;
use crate::config;
use crate::error::{Error, Result};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// `SYMM_SPLIT_NOCOLOR`: takes part in the split, gets no child.
pub const NOCOLOR: i32 = -1;

fn put(v: &mut Vec<u8>, w: u64) {
    v.extend_from_slice(&w.to_le_bytes());
}

/// A length, then the text, padded to 8 bytes.
fn put_text(v: &mut Vec<u8>, t: &str) {
    put(v, t.len() as u64);
    v.extend_from_slice(t.as_bytes());
    v.resize(v.len().next_multiple_of(8), 0);
}

fn next(m: &[u8], at: &mut usize) -> Option<u64> {
    let w = u64::from_le_bytes(m.get(*at..*at + 8)?.try_into().ok()?);
    *at += 8;
    Some(w)
}

fn next_text(m: &[u8], at: &mut usize) -> Option<String> {
    let n = usize::try_from(next(m, at)?).ok()?;
    let t = String::from_utf8_lossy(m.get(*at..at.checked_add(n)?)?).into_owned();
    *at = (*at + n).next_multiple_of(8);
    Some(t)
}

/// What a colored rank readied before the first round (the module header's bet): its arena
/// claimed at `arena` = (offset, id), and a slot taken and reset, with the generation of the
/// block it will carve there. Whatever is still here when it drops goes back.
struct Bet {
    alloc: &'static crate::heap::Allocator,
    device: i32,
    arena: Option<(u64, u64)>,
    slot: Option<(SlotHold, u64)>,
}

impl Bet {
    /// Offset, slot and generation as round 1 sends them (`NONE` for what was not bet).
    fn words(&self) -> [u64; 3] {
        let (slot, generation) = self
            .slot
            .as_ref()
            .map_or((NONE, NONE), |(h, g)| (h.slot() as u64, *g));
        [self.arena.map_or(NONE, |a| a.0), slot, generation]
    }
}

impl Drop for Bet {
    fn drop(&mut self) {
        if let Some((_, id)) = self.arena.take() {
            let _ = self.alloc.release_arena(self.device, id);
        }
    }
}

/// What round 1 says of a bet that was not made.
const NONE: u64 = u64::MAX;

impl Communicator {
    /// Splits this communicator (module header); `None` for `NOCOLOR`.
    pub fn split(&mut self, color: i32, key: i32) -> Result<Option<Box<Communicator>>> {
        let what = "symm_comm_split";
        // Round 1: colors, keys and refusals.
        let mut claim = None;
        let refusal = if color < NOCOLOR {
            format!(
                "color {color} is not accepted; expected a color >= 0 or SYMM_SPLIT_NOCOLOR (-1)"
            )
        } else if let Some(e) = &self.coll.sticky {
            format!(
                "its communicator is broken ({}: {})",
                e.status.name(),
                e.message
            )
        } else if color >= 0 {
            match registry::claim(self.device) {
                Ok(c) => {
                    claim = Some(c);
                    String::new()
                }
                Err(why) => why,
            }
        } else {
            String::new()
        };
        let (gran, ranges) = {
            let heap = self.alloc.heap(self.device)?;
            (heap.granularity(), heap.free_ranges())
        };
        let settings = config::comm_settings_text();
        let free_slots = match &self.group.block {
            Internal::WithSlots(b) => b.free_mask(),
            _ => 0,
        };
        let bet = (color >= 0 && refusal.is_empty()).then(|| self.bet(&ranges, gran, free_slots));
        let mut msg = Vec::new();
        put(&mut msg, color as i64 as u64);
        put(&mut msg, key as i64 as u64);
        put(&mut msg, gran);
        put(&mut msg, free_slots);
        put_text(&mut msg, &settings);
        put_text(&mut msg, &refusal);
        for w in bet.as_ref().map_or([NONE; 3], Bet::words) {
            put(&mut msg, w);
        }
        for m in self.maps_parent_blocks() {
            put(&mut msg, m as u64);
        }
        for (o, l) in &ranges {
            put(&mut msg, *o);
            put(&mut msg, *l);
        }
        // A socket pair with every later parent rank: this end kept, the other sent.
        let mut mine: Vec<Option<UnixStream>> = (0..self.world).map(|_| None).collect();
        let mut theirs: Vec<Option<OwnedFd>> = (0..self.world).map(|_| None).collect();
        for j in self.rank + 1..self.world {
            let (a, b) = UnixStream::pair()
                .map_err(|e| Error::internal(format!("socketpair for the split: {e}")))?;
            mine[j] = Some(a);
            theirs[j] = Some(OwnedFd::from(b));
        }
        let all = self
            .mesh
            .all_gather_each(
                &msg,
                |peer| theirs[peer].iter().map(|f| f.as_fd()).collect(),
                "split",
            )
            .map_err(|e| self.name_ranks(e))?;
        drop(theirs);
        let mut refusals = Vec::new();
        let mut colors = Vec::with_capacity(self.world);
        let mut lists = Vec::with_capacity(self.world);
        let mut bets = Vec::with_capacity(self.world);
        let mut maps = Vec::with_capacity(self.world);
        let mut conns: Vec<Option<UnixStream>> = Vec::with_capacity(self.world);
        // The slots free on every parent rank.
        let mut common_slots = u64::MAX;
        for (r, (m, mut fds)) in all.into_iter().enumerate() {
            let mut at = 0;
            let parsed = (|| {
                let (c, k, g) = (next(&m, &mut at)?, next(&m, &mut at)?, next(&m, &mut at)?);
                let f = next(&m, &mut at)?;
                let (s, t) = (next_text(&m, &mut at)?, next_text(&m, &mut at)?);
                let b = [next(&m, &mut at)?, next(&m, &mut at)?, next(&m, &mut at)?];
                let p: Vec<bool> = (0..self.world)
                    .map(|_| next(&m, &mut at).map(|w| w == 1))
                    .collect::<Option<_>>()?;
                let w: Vec<u64> = m[at..]
                    .chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                Some((c, k, g, f, s, t, b, p, w))
            })();
            // One end of a socket pair from each earlier rank, nothing from a later one.
            let conn = match (r < self.rank, fds.len()) {
                (true, 1) => Some(Some(UnixStream::from(fds.remove(0)))),
                (false, 0) => Some(mine[r].take()),
                _ => None,
            };
            let (Some((c, k, g, f, s, t, b, p, w)), Some(conn)) = (parsed, conn) else {
                return Err(Error::peer(format!(
                    "rank {r} sent a malformed split message"
                )));
            };
            conns.push(conn);
            common_slots &= f;
            colors.push((c as i64, k as i64 as i32));
            if !t.is_empty() {
                refusals.push(format!("rank {r}: {t}"));
            } else if s != settings {
                refusals.push(format!(
                    "rank {r}: its settings differ (rank {r}: {s}; rank {}: {settings}); set \
                     them alike on every rank",
                    self.rank
                ));
            } else if g != gran {
                refusals.push(format!(
                    "rank {r}: a heap granularity of {g} bytes, not {gran}"
                ));
            }
            bets.push(b);
            maps.push(p);
            lists.push(w.chunks_exact(2).map(|p| (p[0], p[1])).collect::<Vec<_>>());
        }
        if !refusals.is_empty() {
            return Err(Error::invalid(format!(
                "{what} refused on every rank of the parent (which stays usable): {}",
                refusals.join("; ")
            )));
        }
        if color == NOCOLOR {
            return Ok(None);
        }
        let mut members: Vec<usize> = (0..self.world)
            .filter(|&r| colors[r].0 == color as i64)
            .collect();
        members.sort_by_key(|&r| (colors[r].1, r));
        let claim = claim.take().expect("a colored rank holds a claim");
        let mut bet = bet.expect("a colored rank that does not refuse bets");
        let terms = Terms {
            gran,
            lists: members.iter().map(|&m| lists[m].clone()).collect(),
        };
        // The arena: as bet, where every rank of the child bet the same offset.
        let arena = match bets[self.rank][0] {
            NONE => None,
            off => members
                .iter()
                .all(|&m| bets[m][0] == off)
                .then(|| bet.arena.take().map(|a| a.1))
                .flatten(),
        };
        // Every child of this split takes the same slot (slots.rs), or none is free.
        let plan = match &self.group.block {
            Internal::WithSlots(b) if common_slots & free_slots != 0 => {
                let slot = common_slots.trailing_zeros() as u64;
                let alike = members
                    .iter()
                    .all(|&m| bets[m][1] == slot && members.iter().all(|&p| maps[m][p]));
                match bet.slot.take() {
                    Some((hold, generation)) if alike => Plan::Ready {
                        hold,
                        generation,
                        peer_gens: members.iter().map(|&m| bets[m][2]).collect(),
                    },
                    held => {
                        drop(held);
                        Plan::Carve(b.take(slot as usize))
                    }
                }
            }
            _ => Plan::Own,
        };
        // What was bet and not used goes back before the child's rounds decide it.
        drop(bet);
        let conns = members.iter().map(|&m| conns[m].take()).collect();
        self.make_child(&members, claim, terms, plan, arena, conns)
            .map(Some)
            .map_err(|e| self.name_ranks(e.context(what)))
    }

    /// The bet (module header). What cannot be bet (no arena range, no slot, an error) is
    /// simply not bet: round 1 says so, and the child's rounds decide it.
    fn bet(&self, ranges: &[(u64, u64)], gran: u64, free_slots: u64) -> Bet {
        let mut bet = Bet {
            alloc: self.alloc,
            device: self.device,
            arena: None,
            slot: None,
        };
        if let Ok(mut heap) = self.alloc.heap(self.device) {
            let len = super::init::arena_len(heap.size(), gran).ok();
            let off = len.and_then(|l| super::arena::common_offset(&[ranges.to_vec()], l, gran));
            if let (Some(off), Some(len)) = (off, len) {
                bet.arena = heap.claim_arena(off, len).map(|id| (off, id));
            }
        }
        if let Internal::WithSlots(b) = &self.group.block {
            if free_slots != 0 {
                let hold = b.take(free_slots.trailing_zeros() as usize);
                let generation = self
                    .alloc
                    .heap(self.device)
                    .map(|mut h| h.fresh_generation());
                if let (Ok(()), Ok(g)) = (self.reset_slot(&hold), generation) {
                    bet.slot = Some((hold, g));
                }
            }
        }
        bet
    }

    /// Whether this rank maps each parent rank's internal block (this rank's own: true), where
    /// a carved child's block lies; all true for a parent without split slots, all false where
    /// the block cannot be found (the child's carve round then reports it).
    fn maps_parent_blocks(&self) -> Vec<bool> {
        let Internal::WithSlots(b) = &self.group.block else {
            return vec![true; self.world];
        };
        let Ok(seg) = self.locate_own(b.start(), 1, "split slot block") else {
            return vec![false; self.world];
        };
        (0..self.world)
            .map(|r| r == self.rank || self.peer.windows.mapped_generation(r, seg.offset).is_some())
            .collect()
    }

    /// The child over parent ranks `members` (in child order), over `conns` (the socket pairs
    /// of round 1, in child order).
    fn make_child(
        &mut self,
        members: &[usize],
        claim: registry::Claim,
        terms: Terms,
        plan: Plan,
        arena: Option<u64>,
        conns: Vec<Option<UnixStream>>,
    ) -> Result<Box<Communicator>> {
        let world = members.len();
        let rank = members
            .iter()
            .position(|&m| m == self.rank)
            .expect("a rank is in its own color's child");
        let mesh = crate::ipc::Mesh::from_connections(rank, world, conns, self.settings.timeout);
        let settings = Settings::read(world, self.alloc, self.device)
            .map_err(|e| format!("{}: {}", e.status.name(), e.message));
        let pids: Vec<u32> = members.iter().map(|&m| self.group.members[m].pid).collect();
        Communicator::build(Setup {
            rank,
            world,
            device: self.device,
            alloc: self.alloc,
            exec: self.exec.fresh(),
            mesh,
            settings,
            claim: Ok(claim),
            members: members.iter().map(|&m| self.group.members[m]).collect(),
            windows: self.peer.windows.subset(members),
            seen: members
                .iter()
                .map(|&m| self.peer.releases.seen[m])
                .collect(),
            sms: self.settings.sms,
            clusters: self.settings.clusters,
            fewest_sms: self.settings.fewest_sms,
            lineage: Some(format!(
                "its ranks 0..{world} are ranks {members:?} of the communicator it was split \
                 from, pids {pids:?}"
            )),
            terms: Some(terms),
            plan: Some(plan),
            arena,
        })
    }
}
