//! What a caller asks of a communicator, as one value (`Call`, with the validated values it is
//! made of: `DType`, `ReduceOp`, `Algo`, `Quant`), and every check of it that needs no peer:
//! pointers, alignment, sizes that overflow, overlaps, the fused call's shape.
//! The public front ends (mod.rs) build a `Call`; `plan.rs` turns it into a `Plan`.
//!
//! Units: `count` is in elements, as the C ABI takes it (all-reduce: the message; reduce-scatter:
//! each rank's output; all-gather: each rank's input; the fused call: tokens x hidden). Buffer
//! extents are in bytes (`Extents`), computed once here with overflow checks; nothing after this
//! converts again.

use super::kernel_args::RMS_MAX_HIDDEN;
use crate::error::{Error, Result};

// The validated values of a call: element type, operation, the C-visible algorithm, the FP8
// output (ffi/guard.rs converts the C values).

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    Fp16,
    Fp32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// The all-reduce algorithm a caller asks for (`symm_algo_t`; ffi/guard.rs converts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    Auto,
    OneShot,
    TwoShot,
    Multimem,
    /// One-shot without barriers: values carry their own arrival flags (kernels/ll.cuh).
    OneShotLL,
}

/// The FP8 (e4m3) output of the fused call (`symm_quant_t`; ffi/guard.rs converts), as
/// kernels/quant.cuh defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quant {
    /// One fp32 scale, read from device memory by the kernel.
    Static,
    /// A scale per row, written: max(amax / 448, FLT_MIN).
    PerToken,
    /// A scale per 128 elements of a row, written row-major `[tokens, hidden / 128]`.
    PerGroup128,
}

impl Quant {
    /// The C ABI value (`SYMM_QUANT_FP8_*`).
    pub fn code(self) -> u32 {
        self as u32
    }
    /// The suffix of its kernel instances (kernels.rs).
    pub fn suffix(self) -> &'static str {
        match self {
            Quant::Static => "static",
            Quant::PerToken => "token",
            Quant::PerGroup128 => "group",
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Quant::Static => "SYMM_QUANT_FP8_STATIC",
            Quant::PerToken => "SYMM_QUANT_FP8_PER_TOKEN",
            Quant::PerGroup128 => "SYMM_QUANT_FP8_PER_GROUP_128",
        }
    }
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::Fp16 => 2,
            DType::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp16 => "fp16",
            DType::Fp32 => "fp32",
        }
    }
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::OneShot => "one_shot",
            Algo::TwoShot => "two_shot",
            Algo::Multimem => "multimem",
            Algo::OneShotLL => "one_shot_ll",
        }
    }
}

/// Which collective, with what only it takes.
#[derive(Clone, Copy, Debug)]
pub enum Coll {
    AllReduce(Algo),
    ReduceScatter,
    AllGather,
    /// All-reduce + residual + RMSNorm: `residual`, `weight` and `out` are this rank's own.
    AddRmsNorm(Rms),
    Barrier,
}

/// The fused call's own buffers and shape (`count` = tokens x hidden).
#[derive(Clone, Copy, Debug)]
pub struct Rms {
    pub residual: u64,
    pub weight: u64,
    /// The output: the input's type, or e4m3 bytes when `quant` is set.
    pub out: u64,
    pub tokens: u64,
    pub hidden: u64,
    pub eps: f32,
    /// The FP8 output's mode and scale buffer (kernels/quant.cuh); None for a bf16/fp16 output.
    pub quant: Option<QuantOut>,
}

/// An FP8 output: its mode, and the fp32 scale buffer (read for STATIC; written, `scales()`
/// floats, otherwise).
#[derive(Clone, Copy, Debug)]
pub struct QuantOut {
    pub mode: Quant,
    pub scale: u64,
}

/// Elements of an FP8 scale group (`Quant::PerGroup128`).
pub const QUANT_GROUP: u64 = 128;

impl Rms {
    /// The name of the call, for messages.
    pub fn name(&self) -> &'static str {
        if self.quant.is_some() {
            "all_reduce_add_rms_norm_quant"
        } else {
            "all_reduce_add_rms_norm"
        }
    }

    /// Scales of an FP8 output: 1 (static), one per row, or one per group of 128 of a row.
    pub fn scales(&self) -> u64 {
        match self.quant.map(|q| q.mode) {
            None => 0,
            Some(Quant::Static) => 1,
            Some(Quant::PerToken) => self.tokens,
            Some(Quant::PerGroup128) => self.tokens.saturating_mul(self.hidden / QUANT_GROUP),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub coll: Coll,
    pub send: u64,
    /// 0 for the fused call (its outputs are in `Rms`) and the barrier.
    pub recv: u64,
    pub count: u64,
    pub dtype: DType,
    pub op: ReduceOp,
    pub stream: u64,
}

/// A call's buffers in bytes: what `send` and `recv` span, and the slice of one rank
/// (reduce-scatter's output, all-gather's input; the whole message otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extents {
    pub send: u64,
    pub recv: u64,
    pub slice: u64,
}

impl Call {
    pub fn name(&self) -> &'static str {
        match self.coll {
            Coll::AllReduce(_) => "all_reduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
            Coll::AddRmsNorm(r) => r.name(),
            Coll::Barrier => "barrier",
        }
    }

    /// Nothing to do: no element (the call still reports earlier errors, in begin_call).
    pub fn is_empty(&self) -> bool {
        match self.coll {
            Coll::Barrier => false,
            Coll::AddRmsNorm(r) => r.tokens == 0,
            _ => self.count == 0,
        }
    }

    /// Checks everything that needs no peer and returns the buffers' extents.
    pub fn check(&self, rank: usize, world: usize) -> Result<Extents> {
        let es = self.dtype.size() as u64;
        match self.coll {
            Coll::Barrier => Ok(Extents {
                send: 0,
                recv: 0,
                slice: 0,
            }),
            Coll::AllReduce(_) => {
                check_pointers(self.send, self.recv, self.dtype)?;
                let b = byte_size(self.count, es, 1)?;
                Ok(Extents {
                    send: b,
                    recv: b,
                    slice: b,
                })
            }
            Coll::ReduceScatter | Coll::AllGather => {
                check_pointers(self.send, self.recv, self.dtype)?;
                let slice = byte_size(self.count, es, 1)?;
                let whole = byte_size(self.count, es, world as u64)?;
                let e = match self.coll {
                    Coll::ReduceScatter => Extents {
                        send: whole,
                        recv: slice,
                        slice,
                    },
                    _ => Extents {
                        send: slice,
                        recv: whole,
                        slice,
                    },
                };
                check_overlap(self, e, rank as u64 * slice)?;
                Ok(e)
            }
            Coll::AddRmsNorm(r) => {
                check_rms(self.send, &r, self.dtype)?;
                let elems = byte_size(r.tokens, r.hidden, 1)?;
                let b = byte_size(elems, es, 1)?;
                // An FP8 output is a byte per element, plus its scales.
                let (out_name, out_bytes) = match r.quant {
                    Some(_) => ("out_q", elems),
                    None => ("out", b),
                };
                let mut own = vec![
                    (r.residual, b, "residual"),
                    (r.out, out_bytes, out_name),
                    (r.weight, r.hidden * es, "weight"),
                ];
                if let Some(q) = r.quant {
                    own.push((q.scale, byte_size(r.scales(), 4, 1)?, "scale"));
                }
                let what = r.name();
                for (i, &(p, n, name)) in own.iter().enumerate() {
                    for &(q, m, other) in own[..i].iter().chain([(self.send, b, "x")].iter()) {
                        if p < q + m && q < p + n {
                            return Err(Error::invalid(format!(
                                "{what}: {name} ({p:#x}, {n} bytes) overlaps {other} ({q:#x}, \
                                 {m} bytes); expected separate buffers"
                            )));
                        }
                    }
                }
                Ok(Extents {
                    send: b,
                    recv: 0,
                    slice: b,
                })
            }
        }
    }
}

/// Collective buffers must be non-NULL and aligned to their element.
fn check_pointers(send: u64, recv: u64, dtype: DType) -> Result<()> {
    if send == 0 || recv == 0 {
        return Err(Error::invalid(format!(
            "send ({send:#x}) and recv ({recv:#x}) must not be NULL when count > 0"
        )));
    }
    let esize = dtype.size() as u64;
    if send % esize != 0 || recv % esize != 0 {
        return Err(Error::invalid(format!(
            "send {send:#x} / recv {recv:#x} are not aligned to the {}-byte {} element",
            esize,
            dtype.name()
        )));
    }
    Ok(())
}

/// `count * esize * times` bytes, or an error naming the count that overflows.
pub fn byte_size(count: u64, esize: u64, times: u64) -> Result<u64> {
    count
        .checked_mul(esize)
        .and_then(|b| b.checked_mul(times))
        .ok_or_else(|| Error::invalid(format!("count {count} overflows the byte size")))
}

/// Reduce-scatter and all-gather refuse overlapping buffers unless they are in place by NCCL's
/// rule: the smaller buffer is this rank's slot (at `slot_at` bytes) of the larger one.
fn check_overlap(c: &Call, e: Extents, slot_at: u64) -> Result<()> {
    let (send, recv) = (c.send, c.recv);
    if send + e.send <= recv || recv + e.recv <= send {
        return Ok(());
    }
    let rs = matches!(c.coll, Coll::ReduceScatter);
    let (ok, rule, at) = if rs {
        (
            recv == send + slot_at,
            "recv = send + rank * recv_count",
            send + slot_at,
        )
    } else {
        (
            send == recv + slot_at,
            "send = recv + rank * send_count",
            recv + slot_at,
        )
    };
    if ok {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{}: send {send:#x} ({} bytes) and recv {recv:#x} ({} bytes) overlap; in place means \
         {rule} (here {at:#x}), otherwise the buffers must be apart",
        c.name(),
        e.send,
        e.recv
    )))
}

/// What the fused kernels need of the shape, types and pointers, each named when it is wrong.
fn check_rms(x: u64, r: &Rms, dtype: DType) -> Result<()> {
    let what = r.name();
    if dtype == DType::Fp32 {
        return Err(Error::unsupported(format!(
            "{what} takes bf16 or fp16 (fp32 accumulation inside); fp32 is not supported"
        )));
    }
    if r.hidden == 0 || r.hidden % 8 != 0 || r.hidden > RMS_MAX_HIDDEN {
        return Err(Error::invalid(format!(
            "{what}: hidden {} is not supported; expected a multiple of 8 from 8 to \
             {RMS_MAX_HIDDEN}",
            r.hidden
        )));
    }
    if !(r.eps.is_finite() && r.eps >= 0.0) {
        return Err(Error::invalid(format!(
            "{what}: eps {} is not a finite non-negative number",
            r.eps
        )));
    }
    let mut ptrs = vec![
        (x, "x", 16),
        (r.residual, "residual", 16),
        (r.weight, "weight", 16),
    ];
    match r.quant {
        None => ptrs.push((r.out, "out", 16)),
        Some(q) => {
            // The kernels store 8 e4m3 bytes per vector, and read or write fp32 scales.
            ptrs.push((r.out, "out_q", 8));
            ptrs.push((q.scale, "scale", 4));
            if q.mode == Quant::PerGroup128 && r.hidden % QUANT_GROUP != 0 {
                return Err(Error::invalid(format!(
                    "{what}: hidden {} is not a multiple of {QUANT_GROUP}; \
                     SYMM_QUANT_FP8_PER_GROUP_128 takes a scale per {QUANT_GROUP} elements of a row",
                    r.hidden
                )));
            }
        }
    }
    for (p, name, align) in ptrs {
        if p == 0 || p % align != 0 {
            return Err(Error::invalid(format!(
                "{what}: {name} {p:#x} must be a non-NULL, {align}-byte aligned pointer"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sg(coll: Coll, send: u64, recv: u64, count: u64) -> Call {
        Call {
            coll,
            send,
            recv,
            count,
            dtype: DType::Bf16,
            op: ReduceOp::Sum,
            stream: 0,
        }
    }

    #[test]
    fn overlap_is_refused_unless_in_place_by_the_rule() {
        // Rank 1 of 2, 100-byte slots (50 bf16): send 200 bytes at 0x1000.
        let rs = |send, recv| sg(Coll::ReduceScatter, send, recv, 50).check(1, 2);
        assert!(rs(0x1000, 0x2000).is_ok(), "apart");
        assert!(rs(0x1000, 0x1000 + 100).is_ok(), "in place");
        let e = rs(0x1000, 0x1000).unwrap_err();
        assert!(
            e.message
                .contains("recv = send + rank * recv_count (here 0x1064)"),
            "{}",
            e.message
        );
        let ag = |send, recv| sg(Coll::AllGather, send, recv, 50).check(1, 2);
        assert!(ag(0x2000 + 100, 0x2000).is_ok());
        let e = ag(0x2000, 0x2000).unwrap_err();
        assert!(e.message.contains("send = recv + rank * send_count"));
    }

    #[test]
    fn extents_are_bytes_and_overflow_is_named() {
        let e = sg(Coll::ReduceScatter, 0x1000, 0x9000, 8)
            .check(0, 4)
            .unwrap();
        assert_eq!(
            e,
            Extents {
                send: 64,
                recv: 16,
                slice: 16
            }
        );
        let e = sg(
            Coll::AllReduce(Algo::Auto),
            0x1000,
            0x1000,
            u64::MAX / 2 + 1,
        )
        .check(0, 2)
        .unwrap_err();
        assert!(e.message.contains("overflows"), "{}", e.message);
    }
}
