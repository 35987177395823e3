//! The host backend's collectives: the same semantics as the kernels (fixed rank order, fp32
//! accumulation, one-shot and two-shot data movement, reduce-scatter and all-gather, barriers
//! through the shared signal pad with acquire/release and a timeout), run by the CPU over the
//! peer windows; the fused call's row arithmetic is host_norm.rs's; and the meeting a rank
//! holds before it shares segments (`meet`, for place.rs). Slot 0 of the pad is used (the host
//! has one "block").

use super::algo::{DType, Kernel, Quant, ReduceOp};
use super::convert::*;
use super::host_norm;
use super::kernel_args::slot;
use crate::error::{Error, Result, Status};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct HostCall<'a> {
    pub rank: usize,
    pub world: usize,
    pub pads: &'a [u64],
    pub inputs: &'a [u64],
    pub outputs: &'a [u64],
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub kernel: Kernel,
    pub in_place: bool,
    pub desc: u64,
    pub timeout: Duration,
    /// The fused call's own buffers (the fused kernels only).
    pub rms: Option<HostRms>,
}

/// This rank's buffers of a fused all-reduce + residual + RMSNorm.
#[derive(Clone, Copy)]
pub struct HostRms {
    pub residual: u64,
    pub weight: u64,
    pub out: u64,
    pub hidden: usize,
    pub eps: f32,
    /// FP8 output (`out` holds e4m3 bytes): its mode and the fp32 scale buffer.
    pub quant: Option<(Quant, u64)>,
}

fn flag(addr: u64) -> &'static AtomicU32 {
    // SAFETY: addr is a 16-byte-aligned slot of a signal pad mapped shared for the
    // communicator's life; atomics are the only access to it.
    unsafe { &*(addr as *const AtomicU32) }
}

fn desc_word(addr: u64) -> &'static AtomicU64 {
    // SAFETY: as flag(); the descriptor is the slot's second 8 bytes.
    unsafe { &*((addr + 8) as *const AtomicU64) }
}

/// Meets every peer at `epoch`. With `check_desc` (only at a call's first barrier, through
/// `first_barrier`: a peer cannot leave the call before we reach its last barrier, or on a
/// mismatch the extra one, so the descriptor it left in our slot is still this call's) each
/// peer's call descriptor must equal ours.
pub fn barrier(c: &HostCall<'_>, epoch: u32, check_desc: bool) -> Result<()> {
    for p in (0..c.world).filter(|&p| p != c.rank) {
        let remote = slot(c.pads[p], 0, c.rank);
        desc_word(remote).store(c.desc, Ordering::Relaxed);
        flag(remote).store(epoch, Ordering::Release);
    }
    let start = Instant::now();
    for p in (0..c.world).filter(|&p| p != c.rank) {
        let mine = slot(c.pads[c.rank], 0, p);
        let mut spins = 0u32;
        while (flag(mine).load(Ordering::Acquire).wrapping_sub(epoch) as i32) < 0 {
            spins += 1;
            if spins % 256 == 0 {
                if start.elapsed() > c.timeout {
                    return Err(Error::timeout(format!(
                        "rank {p} did not reach the all-reduce barrier within {:.1} s \
                         (it may have exited, been killed, or called a different collective); \
                         waited for epoch {epoch}, saw {}",
                        c.timeout.as_secs_f64(),
                        flag(mine).load(Ordering::Acquire)
                    )));
                }
                std::thread::yield_now();
            }
        }
        let theirs = desc_word(mine).load(Ordering::Relaxed);
        if check_desc && theirs != c.desc {
            return Err(Error::not_symmetric(mismatch(c.rank, c.desc, p, theirs)));
        }
    }
    Ok(())
}

/// A call's first barrier (`epoch` advanced): meets every peer and compares descriptors. On a
/// mismatch every rank finds one (some peer's word differs from its own) and meets the peers
/// once more before it returns the error, so no peer leaves and writes its next call's word
/// over the one compared here (which could equal this rank's and pass).
pub fn first_barrier(c: &HostCall<'_>, epoch: &mut u32) -> Result<()> {
    *epoch = epoch.wrapping_add(1);
    match barrier(c, *epoch, true) {
        Err(e) if e.status == Status::ErrNotSymmetric => {
            *epoch = epoch.wrapping_add(1);
            barrier(c, *epoch, false)?;
            Err(e)
        }
        r => r,
    }
}

/// Meets every peer with `word` and no collective (place.rs, `meet_before_sharing`): a
/// first barrier, then a plain one, so a peer's next word cannot replace `word` in this rank's
/// slot before this rank compared it.
pub fn meet(
    rank: usize,
    pads: &[u64],
    word: u64,
    timeout: Duration,
    epoch: &mut u32,
) -> Result<()> {
    let c = HostCall {
        rank,
        world: pads.len(),
        pads,
        inputs: &[],
        outputs: &[],
        count: 0,
        dtype: DType::Fp32,
        op: ReduceOp::Sum,
        kernel: Kernel::OneShot,
        in_place: false,
        desc: word,
        timeout,
        rms: None,
    };
    first_barrier(&c, epoch)?;
    *epoch = epoch.wrapping_add(1);
    barrier(&c, *epoch, false)
}

fn load(dtype: DType, base: u64, i: usize) -> f32 {
    // SAFETY: base..base+count*size is a mapped buffer of the collective (checked by the
    // caller); volatile because peers write it concurrently in other phases.
    unsafe {
        match dtype {
            DType::Bf16 => bf16_to_f32(std::ptr::read_volatile((base as *const u16).add(i))),
            DType::Fp16 => f16_to_f32(std::ptr::read_volatile((base as *const u16).add(i))),
            DType::Fp32 => std::ptr::read_volatile((base as *const f32).add(i)),
        }
    }
}

fn store(dtype: DType, base: u64, i: usize, v: f32) {
    // SAFETY: as load().
    unsafe {
        match dtype {
            DType::Bf16 => std::ptr::write_volatile((base as *mut u16).add(i), f32_to_bf16(v)),
            DType::Fp16 => std::ptr::write_volatile((base as *mut u16).add(i), f32_to_f16(v)),
            DType::Fp32 => std::ptr::write_volatile((base as *mut f32).add(i), v),
        }
    }
}

fn reduce(c: &HostCall<'_>, i: usize) -> f32 {
    let mut acc = load(c.dtype, c.inputs[0], i);
    for r in 1..c.world {
        let v = load(c.dtype, c.inputs[r], i);
        acc = match c.op {
            ReduceOp::Sum => acc + v,
            ReduceOp::Max => acc.max(v),
            ReduceOp::Min => acc.min(v),
        };
    }
    acc
}

/// Runs one collective (`c.kernel`, as the CPU does it); `epoch` is the communicator's host
/// epoch counter.
pub fn run(c: &HostCall<'_>, epoch: &mut u32) -> Result<()> {
    first_barrier(c, epoch)?;
    match c.kernel {
        Kernel::ReduceScatter | Kernel::ReduceScatterLL => {
            // Slice `rank` (c.count elements) of every input, into this rank's output.
            let begin = c.rank * c.count;
            for i in 0..c.count {
                let v = reduce(c, begin + i);
                store(c.dtype, c.outputs[c.rank], i, v);
            }
        }
        Kernel::AddRmsNorm
        | Kernel::AddRmsNormLL
        | Kernel::AddRmsNormLL1
        | Kernel::AddRmsNormLLC => {
            let f = c.rms.expect("the fused call carries its buffers");
            let mut row = vec![0f32; f.hidden];
            for t in 0..c.count / f.hidden {
                for (j, v) in row.iter_mut().enumerate() {
                    let i = t * f.hidden + j;
                    *v = reduce(c, i) + load(c.dtype, f.residual, i);
                    store(c.dtype, f.residual, i, *v);
                }
                let ss = host_norm::row_squares(&row);
                let inv = 1.0 / (ss / f.hidden as f32 + f.eps).sqrt();
                let Some((mode, scale)) = f.quant else {
                    for (j, v) in row.iter().enumerate() {
                        let w = load(c.dtype, f.weight, j);
                        store(c.dtype, f.out, t * f.hidden + j, v * inv * w);
                    }
                    continue;
                };
                // Per-token: y = (r * w) * inv, the kernels' order for that mode (quant.cuh).
                for (j, v) in row.iter_mut().enumerate() {
                    let w = load(c.dtype, f.weight, j);
                    *v = if mode == Quant::PerToken {
                        *v * w * inv
                    } else {
                        *v * inv * w
                    };
                }
                // SAFETY: scale is a checked, 4-byte aligned host buffer of the call's scales
                // (call.rs); the static one is read, the others written at this row's place.
                unsafe {
                    let s = match mode {
                        Quant::Static => std::ptr::read_volatile(scale as *const f32),
                        _ => 0.0,
                    };
                    let (q, scales) = host_norm::quantize_row(mode, &row, s);
                    let out = (f.out as *mut u8).add(t * f.hidden);
                    for (j, b) in q.into_iter().enumerate() {
                        std::ptr::write_volatile(out.add(j), b);
                    }
                    let at = (scale as *mut f32).add(t * scales.len());
                    for (g, v) in scales.into_iter().enumerate() {
                        std::ptr::write_volatile(at.add(g), v);
                    }
                }
            }
        }
        Kernel::AllGather => {
            // This rank's input into slot `rank` of every output (bit-exact: a copy of elements).
            let es = c.dtype.size();
            for r in 0..c.world {
                for i in 0..c.count * es {
                    // SAFETY: both ranges are mapped buffers of the collective (checked by the
                    // caller): input bytes 0..count*es, output bytes of slot `rank`.
                    unsafe {
                        let b = std::ptr::read_volatile((c.inputs[c.rank] as *const u8).add(i));
                        std::ptr::write_volatile(
                            (c.outputs[r] as *mut u8).add(c.rank * c.count * es + i),
                            b,
                        );
                    }
                }
            }
        }
        Kernel::TwoShot => {
            let slice = c.count.div_ceil(c.world);
            let begin = (slice * c.rank).min(c.count);
            let end = (begin + slice).min(c.count);
            for i in begin..end {
                let v = reduce(c, i);
                for r in 0..c.world {
                    store(c.dtype, c.outputs[r], i, v);
                }
            }
        }
        _ => {
            let acc: Vec<f32> = (0..c.count).map(|i| reduce(c, i)).collect();
            if c.in_place {
                *epoch = epoch.wrapping_add(1);
                barrier(c, *epoch, false)?;
            }
            for (i, v) in acc.into_iter().enumerate() {
                store(c.dtype, c.outputs[c.rank], i, v);
            }
        }
    }
    *epoch = epoch.wrapping_add(1);
    barrier(c, *epoch, false)
}

// The bits of a descriptor's digest (launch.rs, `CallDesc::digest`) that the comparisons read:
// the word a rank holds up when it meets its peers before it shares segments (`meet`, above),
// and what a NOT_SYMMETRIC message says differs when two ranks' words do.

/// Bits of a digest (and of the word of `meet_before_sharing`) that say what differs when two
/// ranks' words do (`mismatch`): always set (a digest is never 0), the rank staged, the rank is
/// about to make a scratch segment or share a segment (never set in a call's digest). A
/// meeting's word also carries, from `SCRATCH_SHIFT`, log2 of the scratch the rank makes (0:
/// none).
pub(in crate::comm) const DIGEST_SET: u64 = 1;
pub(in crate::comm) const DIGEST_STAGED: u64 = 2;
pub(in crate::comm) const DIGEST_SHARING: u64 = 4;
pub(in crate::comm) const SCRATCH_SHIFT: u32 = 3;

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
    use crate::comm::collective::algo::{DType, Kernel, ReduceOp};
    use crate::comm::collective::launch::{CallDesc, DescKind};

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
