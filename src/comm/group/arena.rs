//! A communicator's arena (heap/device_heap/arena.rs): the agreement that reserves it at the
//! same heap offset on every rank, and `symm_comm_malloc` / `symm_comm_free` over it.
//!
//! The agreement is collective over the new communicator's mesh, and is also where ranks agree
//! to exist at all: each rank sends the reason it refuses (the limit of communicators per
//! device, peers placed on another device: registry.rs), its collective settings, and its
//! heap's free address ranges. Any refusal or settings mismatch fails every rank alike, naming
//! the rank. Otherwise every rank computes the same offset (the highest one free on every rank,
//! so arenas stay away from device-level allocations, which start at the bottom) and claims
//! it; if another thread of some rank took part of that range meanwhile, every rank gives its
//! claim back and the round repeats with fresh ranges (a bounded number of times). `terms` is
//! that first round for `symm_comm_init`; a split gathers the same in its parent's round
//! (split.rs) and starts at `claim`, whose message then carries a refusal of the child's ranks.
//!
//! Invariant: a communicator keeps its arena only where every one of its ranks claimed it at
//! the same offset and length.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::heap::pools::arena_pool;
use crate::heap::Allocator;
use crate::ipc::Mesh;

/// Rounds of claims before the agreement gives up (each needs a race with another thread).
const ATTEMPTS: usize = 8;

fn words(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn put(v: &mut Vec<u8>, w: u64) {
    v.extend_from_slice(&w.to_le_bytes());
}

/// The intersection of sorted, disjoint range lists.
fn intersect(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = (a[i].0 + a[i].1).min(b[j].0 + b[j].1);
        if lo < hi {
            out.push((lo, hi - lo));
        }
        if a[i].0 + a[i].1 < b[j].0 + b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// The highest offset, aligned to `gran`, where `len` bytes are free in every list.
pub fn common_offset(lists: &[Vec<(u64, u64)>], len: u64, gran: u64) -> Option<u64> {
    let mut common = lists.first()?.clone();
    for l in &lists[1..] {
        common = intersect(&common, l);
    }
    common.iter().rev().find_map(|&(o, l)| {
        let top = (o + l).checked_sub(len)?;
        let at = top - top % gran;
        (at >= o).then_some(at)
    })
}

/// Every rank's free address ranges, as the agreement needs them.
pub(in crate::comm) struct Terms {
    pub gran: u64,
    pub lists: Vec<Vec<(u64, u64)>>,
}

fn encode_ranges(msg: &mut Vec<u8>, ranges: &[(u64, u64)]) {
    for &(o, l) in ranges {
        put(msg, o);
        put(msg, l);
    }
}

fn decode_ranges(w: &[u64]) -> Vec<(u64, u64)> {
    w.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

/// The first round of `symm_comm_init`'s agreement: every rank's refusal (the reason it does
/// not take part), settings (equal on every rank; `describe` names them) and free ranges. Any
/// refusal or mismatch fails every rank alike, naming the ranks.
pub(in crate::comm) fn terms(
    mesh: &Mesh,
    alloc: &Allocator,
    device: i32,
    refusal: Option<&str>,
    settings: &[u64],
    describe: impl Fn(&[u64]) -> String,
) -> Result<Terms> {
    let (rank, world) = (mesh.rank, mesh.world);
    let gran = crate::heap::comm_view::CommView::new(alloc, device).granularity()?;
    let mut msg = Vec::new();
    let text = refusal.unwrap_or("").as_bytes();
    put(&mut msg, text.len() as u64);
    msg.extend_from_slice(text);
    msg.resize(msg.len().next_multiple_of(8), 0);
    for &w in settings {
        put(&mut msg, w);
    }
    put(&mut msg, gran);
    encode_ranges(
        &mut msg,
        &crate::heap::comm_view::CommView::new(alloc, device).free_ranges()?,
    );
    let all = mesh.all_gather(&msg, &[], "communicator agreement")?;
    let mut refusals = Vec::new();
    let mut lists = Vec::with_capacity(world);
    for (r, (m, _)) in all.iter().enumerate() {
        let malformed = || Error::peer(format!("rank {r} sent a malformed agreement"));
        let n = m.get(..8).map_or(usize::MAX, |b| {
            u64::from_le_bytes(b.try_into().unwrap()) as usize
        });
        let end = 8usize.saturating_add(n);
        let (Some(t), Some(rest)) = (m.get(8..end), m.get(end.next_multiple_of(8)..)) else {
            return Err(malformed());
        };
        if n > 0 {
            refusals.push(format!("rank {r}: {}", String::from_utf8_lossy(t)));
        }
        let w = words(rest);
        if w.len() <= settings.len() || (w.len() - settings.len() - 1) % 2 != 0 {
            return Err(malformed());
        }
        if w[..settings.len()] != *settings && refusals.is_empty() && refusal.is_none() {
            return Err(Error::invalid(format!(
                "rank {r} has {}, rank {rank} has {}; set them alike on every rank",
                describe(&w[..settings.len()]),
                describe(settings)
            )));
        }
        if w[settings.len()] != gran {
            return Err(Error::invalid(format!(
                "rank {r}'s heap has a granularity of {} bytes, rank {rank}'s {gran}; expected \
                 GPUs of one kind",
                w[settings.len()]
            )));
        }
        lists.push(decode_ranges(&w[settings.len() + 1..]));
    }
    if !refusals.is_empty() {
        return Err(Error::invalid(format!(
            "the communicator of {world} ranks cannot be created: {}",
            refusals.join("; ")
        )));
    }
    Ok(Terms { gran, lists })
}

/// Claims, on every rank of `mesh`, an arena of `len` bytes at the highest offset free in every
/// rank's ranges (`terms`), and returns its id here. A `refusal` (this rank's reason not to
/// take part, sent with its claim) fails every rank alike. Where a rank could not claim the
/// offset (another thread took part of it meanwhile), every rank gives its claim back and the
/// round repeats over fresh ranges.
pub(in crate::comm) fn claim(
    mesh: &Mesh,
    alloc: &Allocator,
    device: i32,
    len: u64,
    mut terms: Terms,
    refusal: Option<&str>,
) -> Result<u64> {
    let (rank, world) = (mesh.rank, mesh.world);
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            let mut msg = Vec::new();
            encode_ranges(
                &mut msg,
                &crate::heap::comm_view::CommView::new(alloc, device).free_ranges()?,
            );
            let all = mesh.all_gather(&msg, &[], "arena agreement")?;
            terms.lists = all.iter().map(|(m, _)| decode_ranges(&words(m))).collect();
        }
        let off = common_offset(&terms.lists, len, terms.gran);
        let id = match (off, refusal) {
            (Some(off), None) => alloc.heap(device)?.claim_arena(off, len),
            _ => None,
        };
        let mut msg = vec![id.is_some() as u8];
        msg.extend_from_slice(refusal.unwrap_or("").as_bytes());
        let all = mesh.all_gather(&msg, &[], "arena claim")?;
        let refusals: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, (m, _))| m.len() > 1)
            .map(|(r, (m, _))| format!("rank {r}: {}", String::from_utf8_lossy(&m[1..])))
            .collect();
        if !refusals.is_empty() || off.is_none() {
            if let Some(id) = id {
                alloc.release_arena(device, id)?;
            }
        }
        if !refusals.is_empty() {
            return Err(Error::invalid(format!(
                "the communicator of {world} ranks cannot be created: {}",
                refusals.join("; ")
            )));
        }
        let Some(off) = off else {
            let free: Vec<String> = terms
                .lists
                .iter()
                .enumerate()
                .map(|(r, l)| {
                    let most = l.iter().map(|x| x.1).max().unwrap_or(0);
                    format!("rank {r}: largest free range {most} bytes")
                })
                .collect();
            return Err(Error::oom(format!(
                "no range of {len} bytes is free at the same offset of the heaps of all {world} \
                 ranks ({}); raise SYMMALLOC_HEAP_SIZE, lower SYMMALLOC_COMM_ARENA_SIZE or \
                 destroy communicators",
                free.join(", ")
            )));
        };
        if all.iter().all(|(m, _)| m.first() == Some(&1)) {
            crate::info!(
                "rank {rank}/{world}: communicator arena of {len} bytes at heap offset {off:#x} \
                 (attempt {})",
                attempt + 1
            );
            return Ok(id.expect("every rank claimed"));
        }
        if let Some(id) = id {
            alloc.release_arena(device, id)?;
        }
    }
    Err(Error::internal(format!(
        "the ranks could not claim a common arena of {len} bytes in {ATTEMPTS} attempts (other \
         threads kept allocating in the chosen ranges)"
    )))
}

impl Communicator {
    /// Memory from the communicator's arena: the same offset on every rank of the
    /// communicator, given the same sequence of these calls (module header).
    pub fn comm_malloc(&mut self, size: u64, stream: u64) -> Result<u64> {
        self.alloc.malloc_in(
            size,
            self.device,
            stream,
            arena_pool(self.group.arena, false),
        )
    }

    /// Frees a block of `comm_malloc`; `size` as allocated.
    pub fn comm_free(&mut self, ptr: u64, size: u64, stream: u64) -> Result<()> {
        let pool = self.alloc.heap(self.device)?.pool_of(ptr);
        if pool != Some(arena_pool(self.group.arena, false)) {
            return Err(Error::invalid(format!(
                "symm_comm_free({ptr:#x}): the pointer was not returned by symm_comm_malloc of \
                 this communicator (rank {} of {})",
                self.rank, self.world
            )));
        }
        self.alloc.free(ptr, size, self.device, stream)
    }

    /// (heap offset, length) of the communicator's arena.
    pub fn arena_bounds(&self) -> Result<(u64, u64)> {
        self.alloc
            .heap(self.device)?
            .arena_bounds(self.group.arena)
            .ok_or_else(|| Error::internal("a live communicator without its arena"))
    }

    /// A MemPool slot (registry.rs) that allocates from this communicator's arena.
    pub fn mem_pool_slot(&self) -> Result<usize> {
        super::registry::bind_pool_slot(
            self.group.claim.serial,
            self.device,
            arena_pool(self.group.arena, false),
        )
    }

    /// The communicator's own buffers (internal block, staging scratch), in its arena.
    pub(in crate::comm) fn own_malloc(&self, size: u64) -> Result<u64> {
        self.alloc
            .malloc_in(size, self.device, 0, arena_pool(self.group.arena, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_common_offset() {
        const M: u64 = 1 << 20;
        let a = vec![(0, 10 * M), (20 * M, 10 * M)];
        let b = vec![(4 * M, 20 * M), (26 * M, 4 * M)];
        assert_eq!(
            common_offset(&[a.clone(), b.clone()], 4 * M, 2 * M),
            Some(26 * M)
        );
        assert_eq!(
            common_offset(&[a.clone(), b.clone()], 6 * M, 2 * M),
            Some(4 * M)
        );
        assert_eq!(common_offset(&[a.clone(), b], 8 * M, 2 * M), None);
        assert_eq!(common_offset(&[a], 3 * M, 2 * M), Some(26 * M));
        assert_eq!(intersect(&[(0, 4)], &[(4, 4)]), vec![]);
    }
}
