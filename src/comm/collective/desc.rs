//! The call descriptor: what every rank must agree on for one collective call (`CallDesc`,
//! typed), its words on the wire (the segment exchange sends them, exchange.rs) and its 64-bit
//! digest (what the kernels and the host barriers compare, host_reduce.rs), with the bits that
//! say what differs when two ranks' words do (`mismatch`), and the word a rank holds up when it
//! meets its peers before it shares segments on the host backend (`meeting_word`).
//!
//! Invariants: a digest is never 0 and never a meeting's word (`DIGEST_SHARING` is set only in
//! the latter); offsets that only their own rank uses are `RANK_LOCAL` in the words, so ranks
//! never compare them.

use super::algo::{DType, Kernel, ReduceOp};

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
pub(super) fn meeting_word(staged: bool, make: Option<u64>) -> u64 {
    let log = make.map_or(0, |b| b.trailing_zeros() as u64);
    DIGEST_SET | DIGEST_SHARING | if staged { DIGEST_STAGED } else { 0 } | log << SCRATCH_SHIFT
}

/// Why rank `peer`'s word (a digest, or a meeting's word) differs from this rank's, for a
/// NOT_SYMMETRIC message: one rank staged and the other did not, or one shares a segment for the
/// first time and the other does not, or else the descriptors differ.
pub(super) fn mismatch(rank: usize, mine: u64, peer: usize, theirs: u64) -> String {
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
            m.contains("rank 0 makes a scratch of 8388608 bytes") && m.contains("rank 1 16777216"),
            "{m}"
        );
        let m = mismatch(0, plain, 1, desc(false, 9).digest());
        assert!(m.contains("other buffer offsets, count"), "{m}");
        // A call's digest is never a meeting's word.
        assert_eq!(staged & DIGEST_SHARING, 0);
    }
}
