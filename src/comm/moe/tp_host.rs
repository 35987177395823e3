//! The host backend's throughput-mode dispatch and combine (docs/moe.md, "Throughput mode"),
//! the protocol the throughput kernels are to follow, run by the CPU over the peers' blocks.
//!
//! Dispatch, one cross-rank wait: a rank copies its routing into its block (`idx`, `weights`
//! of the epoch's parity), lists its tokens by destination rank (a token whose top-k has
//! several experts on one rank is listed once for it), stages its `x` (quantized when the
//! object quantizes, then at every world), then stores its counts row (tokens per destination
//! rank, then its status), every word tagged with the epoch, into every rank. Once every source's row carries the tag, each rank pulls its rows source by
//! source in rank order, each source's in token order, and derives each row's local top-k from
//! the source's routing. Parity: a source rewrites its parity-`p` parts at dispatch `n + 2`,
//! after dispatch `n + 1` saw every rank's row, which a rank publishes after its pulls of `n`.
//!
//! Combine, one cross-rank wait (two for the second and later combines of one dispatch): a rank
//! stages the rows of peers' tokens in its `cstage` and raises its "staged" flag
//! (`2 * c + refused`) on every rank; once every rank's flag is up, each rank sums, for each of
//! its tokens, the rows of the ranks it went to in increasing rank order (`f32` adds from 0,
//! rounded to bf16 once), its own rank's straight from `expert_out`, then raises its "read" flag
//! (`c`). A combine that is not the first of its dispatch first waits for every rank's "read"
//! flag of the previous combine (its `cstage` may still be read); the first needs no such wait:
//! every rank published the dispatch's counts after its previous combine finished.
//!
//! With the clock probe on, each phase boundary stores the wall clock into the probe words
//! (host.rs `probe`; routed and staged are one step here).
//!
//! Invariant: every rank runs every step of every call whatever it found (a refusal publishes a
//! status, stages nothing and reads nothing), so the epochs stay equal on every rank.

use super::config::IndexType;
use super::host::{quantize_rows, read_entry, stage_x};
use super::host_mem::{copy, probe, rd_bf16, rd_i32, word, wr_bf16_row, wr_i32, Wait};
use super::layout::{
    tagged, tp_row_words, TpLayout, PROBE_C_EPOCH, PROBE_C_PUSHED, PROBE_C_START, PROBE_C_SUMMED,
    PROBE_C_WAITED, PROBE_D_EPOCH, PROBE_D_PUBLISHED, PROBE_D_PULLED, PROBE_D_ROUTED,
    PROBE_D_SCANNED, PROBE_D_SORTED, PROBE_D_STAGED, PROBE_D_START, PROBE_D_WAITED, ROW_EXTRA,
    TP_FLAG_READ, TP_FLAG_STAGED,
};
use super::status::{self, Found, Refusal};
use super::{Combine, Dispatch, Last, Moe};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn lay(m: &Moe) -> TpLayout {
    m.tp.expect("a throughput-mode object has its layout")
}

/// Waits until every rank's flag `which` here is >= `want`; returns the values seen.
fn wait_flags(m: &Moe, which: u64, want: u64, timeout: Duration, what: &str) -> Result<Vec<u64>> {
    let l = lay(m);
    let at = |s: usize| m.at(m.rank, l.flag(m.world as u64, which, s as u64));
    super::host_mem::wait_flags(m, at, want, timeout, what)
}

/// Stores `v` into this rank's flag `which` on every rank (release).
fn raise(m: &Moe, which: u64, v: u64) {
    let l = lay(m);
    for d in 0..m.world {
        word(m.at(d, l.flag(m.world as u64, which, m.rank as u64))).store(v, Ordering::Release);
    }
}

/// Step 1: the routing into `idx`/`weights` (`-1`/0 past k), the first offending entry, the
/// tokens per destination rank, each token's position among them (`pos`, token order) and,
/// when the routing is good, the token lists by destination and the staged x.
fn route(m: &Moe, a: &Dispatch, it: IndexType, n: u64, epoch: u64) -> (Vec<i32>, Option<Found>) {
    let (c, l, w) = (m.cfg, lay(m), m.world as u64);
    let (kk, e_max) = (c.topk as u64, c.experts as i64);
    let local = c.local_experts(w) as i64;
    let (idx, weights, list, xs, ss) = l.parity(&c, w, epoch);
    let me = m.rank;
    let mut counts = vec![0i32; m.world];
    let mut bad: Option<Found> = None;
    for t in 0..n {
        let mut row = [-1i64; 16];
        let mut to = vec![false; m.world];
        for j in 0..kk {
            let at = t * kk + j;
            let (e, wt, code) = read_entry(a, it, (me, t, j), e_max, &mut row, &mut bad);
            if code == 0 && e >= 0 {
                to[(e / local) as usize] = true;
            }
            wr_i32(m.at(me, idx) + 4 * at, e as i32);
            wr_i32(m.at(me, weights) + 4 * at, wt.to_bits() as i32);
        }
        for (d, &sent) in to.iter().enumerate() {
            let p = if sent {
                counts[d] += 1;
                counts[d] - 1
            } else {
                -1
            };
            wr_i32(m.at(me, l.pos) + 4 * (t * w + d as u64), p);
        }
    }
    if bad.is_some() {
        return (counts, bad);
    }
    let mut off = 0u64;
    for (d, &cnt) in counts.iter().enumerate() {
        for t in 0..n {
            let p = rd_i32(m.at(me, l.pos) + 4 * (t * w + d as u64));
            if p >= 0 {
                wr_i32(m.at(me, list) + 4 * (off + p as u64), t as i32);
            }
        }
        off += cnt as u64;
    }
    if c.quantize && n > 0 {
        // Quantized once per token, at every world (the pull reads this rank's own rows here too).
        quantize_rows(m.at(me, xs), m.at(me, ss), a.x, n, c.hidden, c.ue8m0);
    } else if m.world > 1 && n > 0 {
        stage_x(m, a, n, xs, ss);
    }
    (counts, bad)
}

/// The one wait of a dispatch: every source's counts row of `epoch`, `[W][W + ROW_EXTRA]`.
fn wait_rows(m: &Moe, epoch: u64, timeout: Duration) -> Result<Vec<Vec<i32>>> {
    let (l, w) = (lay(m), m.world as u64);
    let wait = Wait {
        m,
        what: "symm_moe_dispatch (throughput mode)",
        start: Instant::now(),
        timeout,
    };
    wait.rows(epoch, tp_row_words(w), |s| m.at(m.rank, l.row(w, epoch, s)))
}

/// The host backend's throughput-mode `symm_moe_dispatch` (module header): its send half, then
/// its receive half. A refusal takes part with its status; the caller returns the refusal's own
/// error.
pub fn dispatch(
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
    timeout: Duration,
) -> Result<()> {
    dispatch_send(m, a, it, refusal);
    dispatch_recv(m, a, refusal.is_some(), timeout)
}

/// Steps 1 and 2 of a dispatch (`symm_moe_dispatch_send`): the routing, the lists, the staged
/// x and this rank's counts row in every rank; no wait on a peer.
pub fn dispatch_send(m: &mut Moe, a: &Dispatch, it: IndexType, refusal: Option<&Refusal>) {
    m.d_epoch += 1;
    m.tp_first_combine = m.c_epoch + 1;
    let epoch = m.d_epoch;
    let stamp = |m: &Moe, i| probe(m, i, PROBE_D_EPOCH, epoch);
    stamp(m, PROBE_D_START);
    let (l, w, me) = (lay(m), m.world as u64, m.rank);
    let n = if refusal.is_some() { 0 } else { a.tokens };
    let (counts, mut found) = route(m, a, it, n, epoch);
    stamp(m, PROBE_D_ROUTED);
    stamp(m, PROBE_D_STAGED);
    if let Some(r) = refusal {
        found = Some(Found {
            code: r.code,
            rank: me as u32,
            value: r.value,
            ..Found::default()
        });
    }
    // Step 2: this rank's row, tagged, into every rank (after its lists and staged x).
    let extra = status::row_extra(&found.unwrap_or_default());
    for d in 0..m.world {
        let row = m.at(d, l.row(w, epoch, me as u64));
        for (i, &v) in counts.iter().enumerate() {
            let v = if found.is_some() { 0 } else { v };
            word(row + 8 * i as u64).store(tagged(epoch, v), Ordering::Release);
        }
        for i in 0..ROW_EXTRA {
            let v = extra.get(i as usize).copied().unwrap_or(0);
            word(row + 8 * (w + i)).store(tagged(epoch, v), Ordering::Release);
        }
    }
    stamp(m, PROBE_D_PUBLISHED);
}

/// Steps 3 and 4 of the dispatch `dispatch_send` sent (`symm_moe_dispatch_recv`, the same
/// arguments): the one wait, the pull, the counts and the CSR.
pub fn dispatch_recv(m: &mut Moe, a: &Dispatch, refused: bool, timeout: Duration) -> Result<()> {
    let epoch = m.d_epoch;
    let stamp = |m: &Moe, i| probe(m, i, PROBE_D_EPOCH, epoch);
    let (c, l, w, me) = (m.cfg, lay(m), m.world as u64, m.rank);
    let kk = c.topk as u64;
    let local = c.local_experts(w);
    let n = if refused { 0 } else { a.tokens };
    // Step 3: the one wait; the first status (lowest rank). No capacity: W*T rows suffice.
    let rows = wait_rows(m, epoch, timeout)?;
    stamp(m, PROBE_D_WAITED);
    let first = rows.iter().enumerate().find_map(|(s, row)| {
        let ex = &row[m.world..m.world + 5];
        (ex[0] != 0).then(|| status::from_row(s as u32, ex))
    });
    let meta = m.at(me, l.meta);
    let per_expert = |le: u64| meta + 4 * (1 + le);
    let offsets = |le: u64| meta + 4 * (1 + local + le);
    if first.is_some() {
        for i in 0..2 * local + 2 {
            wr_i32(meta + 4 * i, 0);
        }
    } else {
        // Step 4: pull, source by source in rank order, each source's tokens in token order.
        let (row_bytes, sc) = (c.row_bytes(), c.scales_per_row());
        let mut got = vec![0u64; local as usize];
        let mut r = 0u64;
        for (s, srow) in rows.iter().enumerate() {
            let below: u64 = srow[..me].iter().map(|&v| v as u64).sum();
            let (idx, weights, list, xs, ss) = l.parity(&c, w, epoch);
            for i in 0..srow[me] as u64 {
                let t = rd_i32(m.at(s, list) + 4 * (below + i)) as u64;
                let (x, xsc) = if s == me && !c.quantize {
                    (a.x, a.x_scales)
                } else {
                    (m.at(s, xs), m.at(s, ss))
                };
                let dst = m.at(me, l.recv_x) + r * row_bytes;
                copy(dst, x + t * row_bytes, row_bytes);
                // Scale (row, g) at row * s1 + g * s2 (config.rs `scale_strides`, R = W*T).
                let [_, s1, s2] = c.scale_strides();
                for g in 0..sc {
                    let dst = m.at(me, l.recv_scales) + 4 * (r * s1 + g * s2);
                    copy(dst, xsc + 4 * (t * sc + g), 4);
                }
                wr_i32(
                    m.at(me, l.recv_src) + 4 * r,
                    (s as u64 * c.tokens + t) as i32,
                );
                for j in 0..kk {
                    let e = rd_i32(m.at(s, idx) + 4 * (t * kk + j)) as i64;
                    let mine = e >= 0 && e as u64 / local == me as u64;
                    let (le, wt) = if mine {
                        got[(e as u64 % local) as usize] += 1;
                        (
                            e % local as i64,
                            rd_i32(m.at(s, weights) + 4 * (t * kk + j)),
                        )
                    } else {
                        (-1, 0)
                    };
                    wr_i32(m.at(me, l.recv_idx) + 4 * (r * kk + j), le as i32);
                    wr_i32(m.at(me, l.recv_weights) + 4 * (r * kk + j), wt);
                }
                r += 1;
            }
        }
        stamp(m, PROBE_D_PULLED);
        // The counts, the CSR offsets and the rows by local expert (rows increasing).
        wr_i32(meta, r as i32);
        let mut sum = 0u64;
        let mut fill = vec![0u64; local as usize];
        for le in 0..local {
            wr_i32(per_expert(le), got[le as usize] as i32);
            wr_i32(offsets(le), sum as i32);
            fill[le as usize] = sum;
            sum += got[le as usize];
        }
        wr_i32(offsets(local), sum as i32);
        stamp(m, PROBE_D_SCANNED);
        for row in 0..r {
            for j in 0..kk {
                let le = rd_i32(m.at(me, l.recv_idx) + 4 * (row * kk + j));
                if le >= 0 {
                    let f = &mut fill[le as usize];
                    wr_i32(m.at(me, l.expert_rows) + 4 * *f, (row * kk + j) as i32);
                    *f += 1;
                }
            }
        }
        // Each of this rank's tokens' row at each rank it went to (after the lower sources').
        let base: Vec<i64> = (0..m.world)
            .map(|d| rows[..me].iter().map(|r| r[d] as i64).sum())
            .collect();
        for t in 0..n {
            for (d, b) in base.iter().enumerate() {
                let at = m.at(me, l.pos) + 4 * (t * w + d as u64);
                let p = rd_i32(at);
                if p >= 0 {
                    wr_i32(at, (b + p as i64) as i32);
                }
            }
        }
    }
    stamp(m, PROBE_D_SORTED);
    match first {
        None => Ok(()),
        Some(f) if f.rank as usize == me && status::is_refusal(f.code) => {
            Err(Error::invalid("refused")) // the caller returns this rank's own message
        }
        Some(f) => Err(f.error(&m.bounds())),
    }
}

/// The host backend's throughput-mode `symm_moe_combine` after a dispatch that succeeded
/// (module header): `expert_out` is `[W*T][H]` bf16, one row per received row. Its send half,
/// then its receive half.
pub fn combine(
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    timeout: Duration,
) -> Result<()> {
    combine_send(m, a, refused, timeout)?;
    combine_recv(m, a, last, refused, timeout)
}

/// The combine's send half (`symm_moe_combine_send`): the rows of peers' tokens staged and this
/// rank's "staged" flag raised. Its only wait is for the previous combine of the same dispatch
/// (normally long over).
pub fn combine_send(m: &mut Moe, a: &Combine, refused: bool, timeout: Duration) -> Result<()> {
    m.c_epoch += 1;
    let epoch = m.c_epoch;
    let stamp = |m: &Moe, i| probe(m, i, PROBE_C_EPOCH, epoch);
    stamp(m, PROBE_C_START);
    let (c, l, w, me) = (m.cfg, lay(m), m.world as u64, m.rank);
    let h = c.hidden;
    let row_bytes = h * 2;
    const F: &str = "symm_moe_combine (throughput mode)";
    if epoch > m.tp_first_combine {
        // A peer may still read this rank's cstage of the previous combine of this dispatch.
        wait_flags(m, TP_FLAG_READ, epoch - 1, timeout, F)?;
    }
    if !refused && w > 1 {
        let rows = rd_i32(m.at(me, l.meta)) as u64;
        for r in 0..rows {
            let src = rd_i32(m.at(me, l.recv_src) + 4 * r) as u64 / c.tokens;
            if src as usize != me {
                let dst = m.at(me, l.cstage) + r * row_bytes;
                copy(dst, a.expert_out + r * row_bytes, row_bytes);
            }
        }
    }
    raise(m, TP_FLAG_STAGED, 2 * epoch + refused as u64);
    stamp(m, PROBE_C_PUSHED);
    Ok(())
}

/// The combine's receive half (`symm_moe_combine_recv`): the one wait, the sums into `y`, and
/// this rank's "read" flag.
pub fn combine_recv(
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    timeout: Duration,
) -> Result<()> {
    let epoch = m.c_epoch;
    let stamp = |m: &Moe, i| probe(m, i, PROBE_C_EPOCH, epoch);
    let (l, w, me, h) = (lay(m), m.world as u64, m.rank, m.cfg.hidden);
    let row_bytes = h * 2;
    const F: &str = "symm_moe_combine (throughput mode)";
    let seen = wait_flags(m, TP_FLAG_STAGED, 2 * epoch, timeout, F)?;
    stamp(m, PROBE_C_WAITED);
    let other = seen.iter().position(|&v| v == 2 * epoch + 1);
    if !refused {
        let mut acc = vec![0f32; h as usize];
        for t in 0..last.tokens {
            acc.iter_mut().for_each(|v| *v = 0.0);
            for d in 0..m.world {
                let p = rd_i32(m.at(me, l.pos) + 4 * (t * w + d as u64));
                if p < 0 || other.is_some() {
                    continue;
                }
                let src = if d == me {
                    a.expert_out + p as u64 * row_bytes
                } else {
                    m.at(d, l.cstage) + p as u64 * row_bytes
                };
                // src: row p of rank d's cstage (mapped, W*T rows) or of the caller's expert_out.
                for (i, v) in acc.iter_mut().enumerate() {
                    *v += rd_bf16(src, i);
                }
            }
            wr_bf16_row(a.y + t * h * 2, &acc);
        }
    }
    raise(m, TP_FLAG_READ, epoch);
    stamp(m, PROBE_C_SUMMED);
    if refused {
        return Ok(()); // the caller returns this rank's own message
    }
    status::combine_refused_by(other, &m.bounds())
}
