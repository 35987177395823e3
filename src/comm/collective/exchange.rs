//! The lazy, collective segment exchange: before a kernel touches a segment, its owner shares
//! it (an fd per segment) and every peer maps it into its window; every rank also compares the
//! call's descriptor (launch.rs, `CallDesc`) and the segments' offsets and sizes, and fails
//! loudly on a mismatch. Collectives (plan.rs), the communicator's first exchange (group/internal.rs) and
//! rendezvous (p2p/) all share segments through here.
//!
//! Invariants: a segment is exchanged once per generation (PeerWindows keeps which), so a
//! steady-state call sends nothing. Whether a rank exchanges is its own decision (a segment new
//! to it), so ranks whose decisions differ must not wait for each other: on the host backend a
//! rank that is about to exchange first meets its peers at the signal pad (place.rs,
//! `meet_before_sharing`), where a peer that
//! went straight to the call's own first barrier (it has nothing new: other buffers, or not
//! staged) fails the comparison with it at once.

use super::launch::{CallDesc, DESC_WORDS, RANK_LOCAL, WORD_STAGED};
use super::Ctx;
use crate::error::{Error, Result};
use crate::heap::device_heap::SegmentInfo;
use std::os::fd::AsFd;

impl Ctx<'_> {
    /// Shares `segs` (own segments) with every peer and maps theirs; checks every rank passed
    /// the same call descriptor and segments. Collective: all ranks must call it together.
    pub(in crate::comm) fn exchange(
        &mut self,
        segs: &[SegmentInfo],
        desc: CallDesc,
        force: bool,
    ) -> Result<()> {
        let mut need: Vec<SegmentInfo> = Vec::new();
        for s in segs {
            if self.peer.windows.needs_sharing(s) && !need.contains(s) {
                need.push(*s);
            }
        }
        if need.is_empty() && !force {
            return Ok(());
        }
        let mut msg = Vec::new();
        for w in desc.words() {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        msg.extend_from_slice(&(need.len() as u64).to_le_bytes());
        for s in &need {
            for w in [s.offset, s.size, s.generation] {
                msg.extend_from_slice(&w.to_le_bytes());
            }
        }
        let fds = crate::heap::comm_view::CommView::new(self.alloc, self.device)
            .export_segments(need.iter().map(|s| s.offset))?;
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let all = self.mesh.all_gather(&msg, &borrowed, "segment exchange")?;
        drop(fds);
        let describe = |m: &[u8]| -> String {
            let w = |i: usize| u64::from_le_bytes(m[i * 8..i * 8 + 8].try_into().unwrap());
            let n = w(DESC_WORDS) as usize;
            let segs: Vec<String> = (0..n)
                .map(|k| {
                    let at = DESC_WORDS + 1 + 3 * k;
                    format!("{:#x}+{:#x}", w(at), w(at + 1))
                })
                .collect();
            let off = |v: u64| match v {
                RANK_LOCAL => "its own".to_string(),
                v => format!("{v:#x}"),
            };
            format!(
                "call {}{} kernel {}, send offset {}, recv offset {}, count {}, type/op {:#x}, \
                 width {}, new segments [{}]",
                w(0) & !WORD_STAGED,
                if w(0) & WORD_STAGED != 0 {
                    " (staged through the scratch)"
                } else {
                    ""
                },
                w(1),
                off(w(2)),
                off(w(3)),
                w(4),
                w(5),
                w(6),
                segs.join(", ")
            )
        };
        // Compare everything except generations (they may differ after OOM retries).
        let shape = |m: &[u8]| -> Vec<u64> {
            m.chunks(8)
                .enumerate()
                .filter(|(i, _)| *i <= DESC_WORDS || (*i - DESC_WORDS - 1) % 3 != 2)
                .map(|(_, c)| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        };
        let mismatched: Vec<usize> = (0..self.world)
            .filter(|&r| shape(&all[r].0) != shape(&msg))
            .collect();
        if !mismatched.is_empty() {
            let lines: Vec<String> = (0..self.world)
                .map(|r| format!("rank {r}: {}", describe(&all[r].0)))
                .collect();
            return Err(Error::not_symmetric(format!(
                "ranks disagree on the collective's buffers (allocation sequences differ between \
                 ranks?): {}",
                lines.join("; ")
            )));
        }
        let (all_msgs, all_fds): (Vec<Vec<u8>>, Vec<_>) = all.into_iter().unzip();
        for (r, fds) in all_fds.into_iter().enumerate() {
            if r == self.rank {
                continue;
            }
            if fds.len() != need.len() {
                return Err(Error::peer(format!(
                    "rank {r} sent {} fds for {} segments",
                    fds.len(),
                    need.len()
                )));
            }
            // The peer's own generation of each segment (generations may differ between
            // ranks): what its release log will name.
            for (k, (s, fd)) in need.iter().zip(fds).enumerate() {
                let at = (DESC_WORDS + 1 + 3 * k + 2) * 8;
                let theirs = SegmentInfo {
                    generation: u64::from_le_bytes(all_msgs[r][at..at + 8].try_into().unwrap()),
                    ..*s
                };
                self.peer.windows.import(self.alloc, r, theirs, fd)?;
            }
        }
        for s in &need {
            self.peer.windows.mark_shared(s);
        }
        crate::info!(
            "rank {}/{}: exchanged {} segment(s) [{}] with every peer; {} peer mapping(s) made",
            self.rank,
            self.world,
            need.len(),
            need.iter()
                .map(|s| format!("{:#x}+{:#x}", s.offset, s.size))
                .collect::<Vec<_>>()
                .join(", "),
            need.len() * (self.world - 1)
        );
        Ok(())
    }
}
