//! The lazy, collective segment exchange: before a kernel touches a segment, its owner shares
//! it (an fd per segment) and every peer maps it into its window; every rank also compares the
//! call's descriptor (`desc`, below) and the segments' offsets and sizes, and fails loudly on a
//! mismatch. Collectives (plan.rs), the communicator's first exchange (group/internal.rs) and
//! rendezvous (p2p/) all share segments through here.
//!
//! Invariants: a segment is exchanged once per generation (PeerWindows keeps which), so a
//! steady-state call sends nothing. Whether a rank exchanges is its own decision (a segment new
//! to it), so ranks whose decisions differ must not wait for each other: on the host backend a
//! rank that is about to exchange first meets its peers at the signal pad (place.rs,
//! `meet_before_sharing`), where a peer that
//! went straight to the call's own first barrier (it has nothing new: other buffers, or not
//! staged) fails the comparison with it at once.

use super::Ctx;
use crate::error::{Error, Result};
use crate::heap::device_heap::SegmentInfo;
use desc::{CallDesc, DESC_WORDS, RANK_LOCAL, WORD_STAGED};
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

pub(in crate::comm) mod desc {
    //! The call descriptor: what every rank must agree on for one collective call (`CallDesc`,
    //! typed), its words on the wire (the segment exchange sends them, exchange.rs) and its 64-bit
    //! digest (what the kernels and the host barriers compare, host_reduce.rs), with the bits that
    //! say what differs when two ranks' words do (`mismatch`), and the word a rank holds up when it
    //! meets its peers before it shares segments on the host backend (`meeting_word`).
    //!
    //! Invariants: a digest is never 0 and never a meeting's word (`DIGEST_SHARING` is set only in
    //! the latter); offsets that only their own rank uses are `RANK_LOCAL` in the words, so ranks
    //! never compare them.

    use crate::comm::collective::algo::{DType, Kernel, ReduceOp};

    /// Which exchange a descriptor belongs to (its tag word).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(in crate::comm) enum DescKind {
        Init,
        Barrier,
        AllReduce,
        ReduceScatter,
        AllGather,
        AddRmsNorm,
        /// `symm_rendezvous` (comm/p2p/): send offset = the range's offset, count = its bytes.
        Rendezvous,
    }

    /// Everything ranks must agree on for one collective call, typed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(in crate::comm) struct CallDesc {
        pub kind: DescKind,
        /// The kernel the call runs (ranks that chose differently fail the comparison).
        pub kernel: Kernel,
        pub send_off: u64,
        pub recv_off: u64,
        /// Elements, as the call counts them (call.rs).
        pub count: u64,
        pub dtype: DType,
        pub op: ReduceOp,
        /// The fused call's row width (hidden) and, from bit 32, its output format (plan.rs); 0
        /// otherwise.
        pub width: u64,
        /// This rank runs the call on its scratch (a buffer peers touch is outside the heap:
        /// plan.rs, `place`). Ranks must agree: a peer reads the scratch at the offsets only where
        /// every rank staged.
        pub staged: bool,
    }

    /// Stands for an offset that only its own rank uses, so ranks need not agree on it.
    pub(in crate::comm) const RANK_LOCAL: u64 = u64::MAX - 1;

    /// Words of a descriptor on the wire (exchange messages start with them).
    pub(super) const DESC_WORDS: usize = 7;

    /// Bits of a digest (and of the word of `meet_before_sharing`) that say what differs when two
    /// ranks' words do (`mismatch`): always set (a digest is never 0), the rank staged, the rank is
    /// about to make a scratch segment or share a segment (never set in a call's digest). A
    /// meeting's word also carries, from `SCRATCH_SHIFT`, log2 of the scratch the rank makes (0:
    /// none).
    const DIGEST_SET: u64 = 1;
    const DIGEST_STAGED: u64 = 2;
    const DIGEST_SHARING: u64 = 4;
    const SCRATCH_SHIFT: u32 = 3;
    /// Bit of the descriptor's first word (above the kind) that says the rank staged.
    pub(super) const WORD_STAGED: u64 = 1 << 8;

    impl CallDesc {
        /// What every rank must agree on, as words. Reduce-scatter and the fused call write only
        /// the caller's own output, and all-gather reads only the caller's own `send` (in place,
        /// those offsets differ by rank by design), so those are left out (RANK_LOCAL).
        pub fn words(&self) -> [u64; DESC_WORDS] {
            let (send, recv) = match self.kind {
                DescKind::ReduceScatter | DescKind::AddRmsNorm => (self.send_off, RANK_LOCAL),
                DescKind::AllGather => (RANK_LOCAL, self.recv_off),
                _ => (self.send_off, self.recv_off),
            };
            [
                self.kind as u64 | if self.staged { WORD_STAGED } else { 0 },
                self.kernel as u64,
                send,
                recv,
                self.count,
                (self.dtype as u64) << 8 | self.op as u64,
                self.width,
            ]
        }
        /// A 64-bit digest the kernels compare (at their first barrier, or in the LL check): a hash
        /// of the words, with the low bits as `mismatch` reads them.
        pub fn digest(&self) -> u64 {
            let mut x: u64 = 0xcbf29ce484222325;
            for w in self.words() {
                for b in w.to_le_bytes() {
                    x ^= b as u64;
                    x = x.wrapping_mul(0x100000001b3);
                }
            }
            let staged = if self.staged { DIGEST_STAGED } else { 0 };
            x & !(DIGEST_STAGED | DIGEST_SHARING) | DIGEST_SET | staged
        }
    }

    /// The word of `meet_before_sharing`: never a call's digest (DIGEST_SHARING), with whether the
    /// rank staged and log2 of the scratch it makes.
    pub(in crate::comm) fn meeting_word(staged: bool, make: Option<u64>) -> u64 {
        let log = make.map_or(0, |b| b.trailing_zeros() as u64);
        DIGEST_SET | DIGEST_SHARING | if staged { DIGEST_STAGED } else { 0 } | log << SCRATCH_SHIFT
    }

    /// Why rank `peer`'s word (a digest, or a meeting's word) differs from this rank's, for a
    /// NOT_SYMMETRIC message: one rank staged and the other did not, or one shares a segment for the
    /// first time and the other does not, or else the descriptors differ.
    pub(in crate::comm) fn mismatch(rank: usize, mine: u64, peer: usize, theirs: u64) -> String {
        let one_side = |bit: u64| {
            let yes_no = if mine & bit != 0 {
                (rank, peer)
            } else {
                (peer, rank)
            };
            ((mine ^ theirs) & bit != 0).then_some(yes_no)
        };
        if let Some((yes, no)) = one_side(DIGEST_STAGED) {
            return format!(
                "rank {yes} staged this collective through the communicator's scratch (a buffer that \
                 peers touch is outside the symmetric heap there) and rank {no} did not; expected \
                 those buffers from symm_malloc on every rank, at the same offsets"
            );
        }
        if let Some((yes, no)) = one_side(DIGEST_SHARING) {
            return format!(
                "rank {yes} touches a segment for the first time in this collective and rank {no} \
                 does not (allocation sequences differ between ranks?); expected the same buffers \
                 on every rank"
            );
        }
        if mine & theirs & DIGEST_SHARING != 0 {
            let scratch = |w: u64| match (w >> SCRATCH_SHIFT) & 63 {
                0 => "none".to_string(),
                log => format!("{} bytes", 1u64 << log),
            };
            return format!(
                "rank {rank} makes a scratch of {} for this collective and rank {peer} {} (the calls' \
                 sizes differ?); expected the same call on every rank",
                scratch(mine),
                scratch(theirs)
            );
        }
        format!(
            "rank {peer} called this collective with other buffer offsets, count, type or algorithm \
             than rank {rank}"
        )
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn desc(staged: bool, count: u64) -> CallDesc {
            CallDesc {
                kind: DescKind::AllReduce,
                kernel: Kernel::OneShot,
                send_off: 0x1000,
                recv_off: 0x1000,
                count,
                dtype: DType::Fp32,
                op: ReduceOp::Sum,
                width: 0,
                staged,
            }
        }

        #[test]
        fn a_mismatch_says_what_differs() {
            let (plain, staged) = (desc(false, 8).digest(), desc(true, 8).digest());
            assert_ne!(plain, staged);
            let m = mismatch(0, plain, 1, staged);
            assert!(
                m.starts_with("rank 1 staged this collective") && m.contains("rank 0 did not"),
                "{m}"
            );
            // A meeting (rank 1 makes its scratch) against a call's first barrier.
            let meet = meeting_word(true, Some(8 << 20));
            assert!(mismatch(0, plain, 1, meet).starts_with("rank 1 staged"));
            let m = mismatch(1, meeting_word(false, None), 0, plain);
            assert!(
                m.starts_with("rank 1 touches a segment for the first time"),
                "{m}"
            );
            let m = mismatch(0, meet, 1, meeting_word(true, Some(16 << 20)));
            assert!(
                m.contains("rank 0 makes a scratch of 8388608 bytes")
                    && m.contains("rank 1 16777216"),
                "{m}"
            );
            let m = mismatch(0, plain, 1, desc(false, 9).digest());
            assert!(m.contains("other buffer offsets, count"), "{m}");
            // A call's digest is never a meeting's word.
            assert_eq!(staged & DIGEST_SHARING, 0);
        }
    }
}
