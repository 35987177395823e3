//! `symm_comm_split`: children of a communicator, as in `ncclCommSplit`. Collective over the
//! parent; one round over the parent's mesh, then rounds within each child:
//!
//! 1. every parent rank sends its color, key, why it refuses (a color below -1, a broken
//!    parent, the device's limit of communicators: registry.rs), which of the parent's split
//!    slots it has free (slots.rs), the text of its communicator settings and its heap's free
//!    address ranges. Any refusal, or settings that differ, fails the split on every rank,
//!    naming the ranks; the parent's mesh is then still in step (each rank sent and received
//!    one message per peer), so the parent stays usable. NOCOLOR ranks are done.
//! 2. ranks of one color form a child, ordered by key, then parent rank. Each makes a socket
//!    pair for every later rank of its child and sends it one end over the parent's connection
//!    (no listening socket, no new authentication: the parent's are).
//! 3. the child takes its parent's peer heaps for its ranks (peers.rs: no memory the parent
//!    mapped is imported again) and its record of shared segments, and `build` (init.rs)
//!    claims its arena at the highest offset free on all its ranks (from the ranges of round
//!    1); then its internal block (internal.rs) is carved out of the lowest split slot free on
//!    every parent rank (the same slot for every child of the split: no new memory, nothing to
//!    import), or, where none is, allocated and exchanged over the child's mesh.
//!
//! A failure in step 3 (a rank that died, memory) fails that child's ranks, naming the rank; a
//! failure in step 2 may leave messages on the parent's connections, so it breaks the parent
//! (a sticky error: destroy it). A child is independent of its parent from then on: its own
//! mesh, arena, internal block and error words; the peer heaps and a parent's block of split
//! slots are reference-counted, so destroying the parent first leaves the child working.

use super::arena::Terms;
use super::init::{Settings, Setup};
use super::registry;
use super::slots::{Internal, Plan};
use super::Communicator;
use crate::config;
use crate::error::{Error, Result, Status};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

/// `SYMM_SPLIT_NOCOLOR`: takes part in the split, gets no child.
pub const NOCOLOR: i32 = -1;

const TAG: &[u8; 8] = b"SYMMSPL1";

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

fn word(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
    ))
}

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
        } else if let Some(e) = &self.sticky {
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
        let gran = self.alloc.heap(self.device)?.granularity();
        let settings = config::comm_settings_text();
        let free_slots = match &self.block {
            Internal::WithSlots(b) => b.free_mask(),
            _ => 0,
        };
        let mut msg = Vec::new();
        put(&mut msg, color as i64 as u64);
        put(&mut msg, key as i64 as u64);
        put(&mut msg, gran);
        put(&mut msg, free_slots);
        put_text(&mut msg, &settings);
        put_text(&mut msg, &refusal);
        for (o, l) in self.alloc.heap(self.device)?.free_ranges() {
            put(&mut msg, o);
            put(&mut msg, l);
        }
        let all = self
            .mesh
            .all_gather(&msg, &[], "split")
            .map_err(|e| self.name_ranks(e))?;
        let mut refusals = Vec::new();
        let mut colors = Vec::with_capacity(self.world);
        let mut lists = Vec::with_capacity(self.world);
        // The slots free on every parent rank.
        let mut common_slots = u64::MAX;
        for (r, (m, _)) in all.iter().enumerate() {
            let mut at = 0;
            let parsed = (|| {
                let (c, k, g) = (next(m, &mut at)?, next(m, &mut at)?, next(m, &mut at)?);
                let f = next(m, &mut at)?;
                let (s, t) = (next_text(m, &mut at)?, next_text(m, &mut at)?);
                let w: Vec<u64> = m[at..]
                    .chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                Some((c, k, g, f, s, t, w))
            })();
            let Some((c, k, g, f, s, t, w)) = parsed else {
                return Err(Error::peer(format!(
                    "rank {r} sent a malformed split message"
                )));
            };
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
        let terms = Terms {
            gran,
            lists: members.iter().map(|&m| lists[m].clone()).collect(),
        };
        // Every child of this split takes the same slot (slots.rs), or none is free.
        let plan = match &self.block {
            Internal::WithSlots(b) if common_slots & free_slots != 0 => {
                Plan::Carve(b.take(common_slots.trailing_zeros() as usize))
            }
            _ => Plan::Own,
        };
        self.make_child(&members, claim, terms, plan)
            .map(Some)
            .map_err(|e| self.name_ranks(e.context(what)))
    }

    /// Round 2 for this rank's child over parent ranks `members` (in child order).
    fn make_child(
        &mut self,
        members: &[usize],
        claim: registry::Claim,
        terms: Terms,
        plan: Plan,
    ) -> Result<Box<Communicator>> {
        let world = members.len();
        let rank = members
            .iter()
            .position(|&m| m == self.rank)
            .expect("a rank is in its own color's child");
        let conns = match self.child_connections(members, rank) {
            Ok(c) => c,
            Err(e) => {
                // Messages of this split may be left on the parent's connections: it is out of
                // step from now on.
                self.sticky.get_or_insert_with(|| {
                    Error::peer(format!(
                        "a split failed while its ranks connected ({}): this communicator \
                         cannot be used any more; destroy it",
                        e.message
                    ))
                });
                return Err(e);
            }
        };
        let mesh = crate::ipc::Mesh::from_connections(rank, world, conns, self.timeout);
        let settings = Settings::read(world, self.alloc, self.device)
            .map_err(|e| format!("{}: {}", e.status.name(), e.message));
        let pids: Vec<u32> = members.iter().map(|&m| self.members[m].pid).collect();
        Communicator::build(Setup {
            rank,
            world,
            device: self.device,
            alloc: self.alloc,
            host: self.host,
            mesh,
            settings,
            claim: Ok(claim),
            members: members.iter().map(|&m| self.members[m]).collect(),
            windows: self.windows.subset(members),
            seen: members.iter().map(|&m| self.releases.seen[m]).collect(),
            sms: self.sms,
            clusters: self.clusters,
            fewest_sms: self.fewest_sms,
            lineage: Some(format!(
                "its ranks 0..{world} are ranks {members:?} of the communicator it was split \
                 from, pids {pids:?}"
            )),
            terms: Some(terms),
            plan: Some(plan),
        })
    }

    /// A connection to every other rank of the child (`members`, parent ranks in child order;
    /// this rank is `rank` there): a socket pair per pair of ranks, made by the lower one,
    /// which sends one end over the parent's connection.
    fn child_connections(&self, members: &[usize], rank: usize) -> Result<Vec<Option<UnixStream>>> {
        let world = members.len();
        let mut conns: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
        for (j, &peer) in members.iter().enumerate().skip(rank + 1) {
            let (mine, theirs) = UnixStream::pair()
                .map_err(|e| Error::internal(format!("socketpair for the split: {e}")))?;
            let fd = OwnedFd::from(theirs);
            let mut hello = TAG.to_vec();
            put(&mut hello, rank as u64);
            put(&mut hello, j as u64);
            self.mesh
                .send_to(peer, &hello, &[std::os::fd::AsFd::as_fd(&fd)], "split")?;
            conns[j] = Some(mine);
        }
        for (j, &peer) in members.iter().enumerate().take(rank) {
            let (m, mut fds) = self.mesh.recv_from(peer, "split")?;
            let ok = m.len() == 24
                && &m[..8] == TAG
                && word(&m[8..], 0) == Some(j as u64)
                && word(&m[8..], 1) == Some(rank as u64)
                && fds.len() == 1;
            if !ok {
                return Err(Error::peer(format!(
                    "rank {peer} sent a malformed split connection"
                )));
            }
            conns[j] = Some(UnixStream::from(fds.remove(0)));
        }
        Ok(conns)
    }

    /// Names the processes behind rank numbers in a child's peer and timeout errors.
    pub(super) fn name_ranks(&self, mut e: Error) -> Error {
        if matches!(e.status, Status::ErrPeer | Status::ErrTimeout) {
            match &self.lineage {
                Some(l) => {
                    e.message = format!(
                        "{} (in a communicator of {} ranks split from another: {l})",
                        e.message, self.world
                    )
                }
                None => {
                    let pids: Vec<u32> = self.members.iter().map(|m| m.pid).collect();
                    e.message =
                        format!("{} (ranks 0..{} are pids {pids:?})", e.message, self.world);
                }
            }
        }
        e
    }
}
