//! The host backend's combine (docs/moe.md, "Protocol"; host.rs runs the dispatch and holds
//! the helpers both use): the peers' rows pushed into their landing buffers (`cbuf`), this
//! rank's flag raised on every rank, then the wait and the sum in increasing k with
//! `f32::mul_add` from 0, rounded to bf16 once (what `fmaf` gives on the GPU). A rank reads its
//! own experts' rows in place in `expert_out`.
//!
//! Invariant: the flag row and `cbuf` alternate by the combine epoch's parity (layout.rs
//! `combine_flag`, `cbuf_at`), so any number of combines of one dispatch may follow each other;
//! a flag is `2 * epoch + refused`, so a refusal names its rank on every other rank.

use super::host_mem::{copy, probe, raise, rd_bf16, rd_f32, rd_i32, wait_all, wr_bf16_row};
use super::layout::*;
use super::status;
use super::{Combine, Last, Moe};
use crate::error::Result;
use std::time::Duration;

/// What both halves of combine `epoch` read off the object: this rank, k, the hidden size, the
/// local experts, a row's bytes, the epoch's flag row and landing buffer.
struct Geometry {
    me: usize,
    kk: u64,
    h: u64,
    l: u64,
    row_bytes: u64,
    flag: u64,
    cbuf: u64,
}

impl Geometry {
    fn of(m: &Moe, epoch: u64) -> Self {
        let c = m.cfg;
        Geometry {
            me: m.rank,
            kk: c.topk as u64,
            h: c.hidden,
            l: c.local_experts(m.world as u64),
            row_bytes: c.hidden * 2,
            flag: combine_flag(epoch),
            cbuf: m.layout.cbuf_at(epoch),
        }
    }
}

/// The host backend's `symm_moe_combine` after a dispatch that succeeded (`last`); any number
/// of combines may follow one dispatch (module header). Rows of this rank's own experts are
/// read from `expert_out` where they are; only the peers' go through the landing buffer.
pub fn combine(
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    timeout: Duration,
) -> Result<()> {
    combine_send(m, a, refused);
    combine_recv(m, a, last, refused, timeout)
}

/// The send half of a combine: a new epoch, the peers' rows into their landing buffers, this
/// rank's flag raised on every rank (waits for nothing).
pub fn combine_send(m: &mut Moe, a: &Combine, refused: bool) {
    m.c_epoch += 1;
    let epoch = m.c_epoch;
    probe(m, PROBE_C_START, PROBE_C_EPOCH, epoch);
    let Geometry {
        me,
        kk,
        l,
        row_bytes,
        flag,
        cbuf,
        ..
    } = Geometry::of(m, epoch);
    let c = m.cfg;
    if !refused {
        for le in 0..l {
            let rows = rd_i32(m.at(me, m.layout.recv_counts) + 4 * le) as u64;
            for row in 0..rows {
                let slot = le * c.max_recv + row;
                let code = rd_i32(m.at(me, m.layout.recv_src) + 4 * slot) as u64;
                let (s, t, j) = (code / (c.tokens * kk), (code / kk) % c.tokens, code % kk);
                if s as usize == me {
                    continue; // read in place by this rank's own sum
                }
                copy(
                    m.at(s as usize, cbuf) + (t * kk + j) * row_bytes,
                    a.expert_out + slot * row_bytes,
                    row_bytes,
                );
            }
        }
    }
    raise(m, flag, 2 * epoch + refused as u64);
    probe(m, PROBE_C_PUSHED, PROBE_C_EPOCH, epoch);
}

/// The receive half of the combine whose send half ran last (its epoch): the wait and the sum.
pub fn combine_recv(
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    timeout: Duration,
) -> Result<()> {
    let epoch = m.c_epoch;
    probe(m, PROBE_C_RECV, PROBE_C_EPOCH, epoch);
    let Geometry {
        me,
        kk,
        h,
        l,
        row_bytes,
        flag,
        cbuf,
    } = Geometry::of(m, epoch);
    let seen = wait_all(m, flag, 2 * epoch, timeout, "symm_moe_combine")?;
    probe(m, PROBE_C_WAITED, PROBE_C_EPOCH, epoch);
    if refused {
        return Ok(()); // the caller returns this rank's own message
    }
    // Exactly this combine's value (no peer can be two combines ahead: layout.rs).
    let other = seen.iter().position(|&v| v == 2 * epoch + 1);
    let mut acc = vec![0f32; h as usize];
    for t in 0..last.tokens {
        acc.iter_mut().for_each(|v| *v = 0.0);
        if other.is_none() {
            for j in 0..kk {
                let at = t * kk + j;
                let e = rd_i32(m.at(me, m.layout.idx) + 4 * at);
                if e < 0 {
                    continue;
                }
                let wgt = rd_f32(m.at(me, m.layout.weights) + 4 * at);
                let src = if e as u64 / l == me as u64 {
                    let slot = rd_i32(m.at(me, m.layout.pos) + 4 * at) as u64;
                    a.expert_out + slot * row_bytes
                } else {
                    m.at(me, cbuf) + at * row_bytes
                };
                // src: row (t, j) of this rank's cbuf or its row of the caller's expert_out.
                for (i, v) in acc.iter_mut().enumerate() {
                    *v = wgt.mul_add(rd_bf16(src, i), *v);
                }
            }
        }
        wr_bf16_row(a.y + t * h * 2, &acc);
    }
    probe(m, PROBE_C_SUMMED, PROBE_C_EPOCH, epoch);
    status::combine_refused_by(other, &m.bounds())
}
