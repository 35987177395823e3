//! The lazy, collective segment exchange: before a kernel touches a segment, its owner shares
//! it (an fd per segment) and every peer maps it into its window; every rank also compares the
//! call's descriptor and the segments' offsets and sizes, and fails loudly on a mismatch.
//!
//! Invariant: a segment is exchanged once per generation (PeerWindows keeps which), so a
//! steady-state call sends nothing.

use super::algo::{DType, Kernel, ReduceOp};
use super::Communicator;
use crate::error::{Error, Result};
use crate::heap::device_heap::SegmentInfo;
use std::os::fd::AsFd;

/// Which exchange a descriptor belongs to (its tag word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DescKind {
    Init,
    Barrier,
    AllReduce,
    ReduceScatter,
    AllGather,
    AddRmsNorm,
    /// `symm_rendezvous` (comm/p2p.rs): send offset = the range's offset, count = its bytes.
    Rendezvous,
}

/// Everything ranks must agree on for one collective call, typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CallDesc {
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
}

/// Stands for an offset that only its own rank uses, so ranks need not agree on it.
pub(super) const RANK_LOCAL: u64 = u64::MAX - 1;

/// Words of a descriptor on the wire (exchange messages start with them).
const DESC_WORDS: usize = 7;

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
            self.kind as u64,
            self.kernel as u64,
            send,
            recv,
            self.count,
            (self.dtype as u64) << 8 | self.op as u64,
            self.width,
        ]
    }
    /// A 64-bit digest the kernels compare (at their first barrier, or in the LL check).
    pub fn digest(&self) -> u64 {
        let mut x: u64 = 0xcbf29ce484222325;
        for w in self.words() {
            for b in w.to_le_bytes() {
                x ^= b as u64;
                x = x.wrapping_mul(0x100000001b3);
            }
        }
        x | 1
    }
}

impl Communicator {
    /// The segment holding `ptr..ptr+bytes`, `None` when `ptr` is outside the heap, an error
    /// when it is inside the heap but not inside one live block.
    pub(super) fn locate(&self, ptr: u64, bytes: u64) -> Result<Option<SegmentInfo>> {
        let heap = self.alloc.heap(self.device)?;
        if !heap.contains(ptr) {
            return Ok(None);
        }
        let (seg, bstart, bsize) = heap.segment_of(ptr)?;
        if ptr + bytes > bstart + bsize {
            return Err(Error::invalid(format!(
                "buffer {ptr:#x} of {bytes} bytes runs past the end of its symm_malloc block \
                 ({bsize} bytes at {bstart:#x}); expected count * element size to fit"
            )));
        }
        Ok(Some(seg))
    }

    /// Shares `segs` (own segments) with every peer and maps theirs; checks every rank passed
    /// the same call descriptor and segments. Collective: all ranks must call it together.
    pub(super) fn exchange(
        &mut self,
        segs: &[SegmentInfo],
        desc: CallDesc,
        force: bool,
    ) -> Result<()> {
        let mut need: Vec<SegmentInfo> = Vec::new();
        for s in segs {
            if self.windows.needs_sharing(s) && !need.contains(s) {
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
        let fds = {
            let heap = self.alloc.heap(self.device)?;
            need.iter()
                .map(|s| heap.export_segment(self.alloc.backend(), s.offset))
                .collect::<Result<Vec<_>>>()?
        };
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
                "call {} kernel {}, send offset {}, recv offset {}, count {}, type/op {:#x}, \
                 width {}, new segments [{}]",
                w(0),
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
                self.windows.import(self.alloc, r, theirs, fd)?;
            }
        }
        for s in &need {
            self.windows.mark_shared(s);
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
