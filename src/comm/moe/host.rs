//! The host backend's dispatch (its combine: host_combine.rs; the loads, stores and bounded
//! waits both use: host_mem.rs): the kernels' protocol (docs/moe.md, "Protocol")
//! run by the CPU over the peers' blocks (memfd mappings), with the same arithmetic: rows in
//! (source rank, token) order, `recv_src` codes, and the combine's sum in increasing k with
//! `f32::mul_add` from 0, rounded to bf16 once (what `fmaf` gives on the GPU).
//!
//! Dispatch has one cross-rank wait: a rank first leaves its entry list and its staged `x` in
//! its own block, then stores its counts row, every word tagged with the epoch
//! (layout.rs `tagged`), into every rank, its grid's block words last (this backend is all of
//! its grid's blocks; on the GPU block 0 stores the counts and each block its own word). Once
//! every source's row carries the tag, each rank pulls its experts' rows from the sources'
//! blocks (and its own from the caller's `x`; from its own staged rows when the dispatch
//! quantizes bf16 `x`, once per token, as the kernel does with kernels/quant.cuh's
//! arithmetic: host_norm.rs `quantize_group`). Counts
//! rows, lists and staged rows alternate by the dispatch epoch's parity: a source reaches
//! dispatch `n + 2` only after every rank's dispatch `n + 1` published its row, i.e. after
//! every rank finished pulling call `n`'s.
//! The combine's flags are `u64` words stored with release and read with acquire (monotonic:
//! `2 * epoch + refused`); its flag row and landing buffer (`cbuf`) alternate by the combine
//! epoch's parity (layout.rs `combine_flag`), so any number of combines of one dispatch may
//! follow each other. Only the peers' rows go through `cbuf`: a rank sums its own experts'
//! rows straight from `expert_out` (its entries' rows are in `pos` after the dispatch).
//! Every wait is bounded by the communicator's timeout and names the rank it waited for.
//!
//! The split API runs the same steps in two halves: `dispatch_send` (the local steps and the
//! published row; no wait) and `dispatch_recv` (the wait and the pull), `combine_send` (the rows
//! out, the flag raised) and `combine_recv` (the wait and the sum); the one-call forms are the
//! two halves back to back, so the results are the same bit for bit. The epoch moves at the send
//! half; the receive half uses it (the object's state machine, mod.rs, pairs the halves).
//! With the clock probe on, each phase boundary stores the wall clock (ns since the Unix epoch)
//! into the probe words of the control part, as the kernels store %globaltimer.
//!
//! Invariant: every rank runs every step of every call whatever it found (a refusal publishes
//! a row with a status and sends nothing), so the epochs stay equal on every rank.

use super::config::{IndexType, SCALE_GROUP};
use super::host_mem::{copy, probe, rd_f32, rd_i32, word, wr_i32, Wait};
use super::layout::*;
use super::status::{self, Found, Refusal};
use super::{Dispatch, Moe};
use crate::comm::collective::convert::bf16_to_f32;
use crate::comm::collective::host_norm::quantize_group;
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Quantizes `n` bf16 rows of `h` elements at `src` into e4m3 rows at `dst` and their fp32
/// scales, one per 128 elements, row-major at `scales`: kernels/quant.cuh's per-group
/// arithmetic (host_norm.rs `quantize_group`), as the dispatch kernel stages them.
pub(super) fn quantize_rows(dst: u64, scales: u64, src: u64, n: u64, h: u64, ue8m0: bool) {
    let g = SCALE_GROUP as usize;
    let mut y = vec![0f32; g];
    for i in 0..n * h / SCALE_GROUP {
        for (j, v) in y.iter_mut().enumerate() {
            // SAFETY: src is the caller's checked [n][h] bf16 x; i * 128 + j < n * h.
            let b = unsafe { std::ptr::read_volatile((src as *const u16).add(i as usize * g + j)) };
            *v = bf16_to_f32(b);
        }
        let (q, sc) = quantize_group(&y, ue8m0);
        // SAFETY: dst is this rank's staged [T][h] e4m3 rows (n <= T), `scales` its [T][h/128]
        // fp32 scales; group i is at bytes i * 128 and scale i.
        unsafe {
            std::ptr::copy_nonoverlapping(q.as_ptr(), (dst as *mut u8).add(i as usize * g), g);
            std::ptr::write_volatile((scales as *mut f32).add(i as usize), sc);
        }
    }
}

/// Token t's slot j of the caller's topk_idx, widened.
pub(super) fn load_idx(a: &Dispatch, it: IndexType, i: u64) -> i64 {
    // SAFETY: i < num_tokens * k, a.idx is a checked, aligned [num_tokens][k] buffer.
    unsafe {
        match it {
            IndexType::I32 => std::ptr::read_volatile((a.idx as *const i32).add(i as usize)) as i64,
            IndexType::I64 => std::ptr::read_volatile((a.idx as *const i64).add(i as usize)),
        }
    }
}

/// Entry `(t, j)` of the caller's routing (`at` = (this rank, t, j)), both host dispatches' one
/// reading of it: its expert (-1 past the caller's k), its weight (0 there) and its code (0,
/// out of range, or a repeat of an earlier entry of the token: `row` holds the token's entries
/// so far and gets this one). The first offending entry of the call is kept in `bad`.
pub(super) fn read_entry(
    a: &Dispatch,
    it: IndexType,
    at: (usize, u64, u64),
    e_max: i64,
    row: &mut [i64; 16],
    bad: &mut Option<Found>,
) -> (i64, f32, u32) {
    let (me, t, j) = at;
    let (e, w) = if j < a.k as u64 {
        let i = t * a.k as u64 + j;
        (load_idx(a, it, i), rd_f32(a.weights + 4 * i))
    } else {
        (-1, 0.0)
    };
    row[j as usize] = e;
    let code = if e < -1 || e >= e_max {
        status::ST_OUT_OF_RANGE
    } else if e >= 0 && row[..j as usize].contains(&e) {
        status::ST_DUPLICATE
    } else {
        0
    };
    if code != 0 && bad.is_none() {
        *bad = Some(Found {
            code,
            rank: me as u32,
            token: t as u32,
            k: j as u32,
            value: e,
        });
    }
    (e, w, code)
}

/// Step 1: the local copy of the routing (`idx`, `weights`, `-1`/0 past k), the first
/// offending entry, the counts per expert, each entry's position within its expert (`pos`,
/// token order) and, when the routing is good, the entry list by expert (`list`, a slot per
/// expert and token) and the staged `x` the peers pull from.
fn local(m: &Moe, a: &Dispatch, it: IndexType, n: u64, epoch: u64) -> (Vec<i32>, Option<Found>) {
    let c = &m.cfg;
    let (kk, e_max) = (c.topk as u64, c.experts as i64);
    let mut counts = vec![0i32; c.experts as usize];
    let mut bad: Option<Found> = None;
    let me = m.rank;
    // (expert, position, entry) of each good entry, for the list once the routing is known good.
    let mut placed = Vec::with_capacity((n * kk) as usize);
    for t in 0..n {
        let mut row = [-1i64; 16];
        for j in 0..kk {
            let at = t * kk + j;
            let (e, w, code) = read_entry(a, it, (me, t, j), e_max, &mut row, &mut bad);
            wr_i32(m.at(me, m.layout.idx) + 4 * at, e as i32);
            wr_i32(m.at(me, m.layout.weights) + 4 * at, w.to_bits() as i32);
            let pos = if code == 0 && e >= 0 {
                let pos = counts[e as usize];
                counts[e as usize] += 1;
                placed.push((e as u64, pos as u64, at));
                pos
            } else {
                -1
            };
            wr_i32(m.at(me, m.layout.pos) + 4 * at, pos);
        }
    }
    if bad.is_some() {
        return (counts, bad);
    }
    // The entries by expert, in token order: element pos of expert e's list = t * K + k (a slot
    // per expert and token, layout.rs `list_at`).
    for (e, pos, at) in placed {
        wr_i32(m.at(me, m.layout.list_at(epoch, e)) + 4 * pos, at as i32);
    }
    if c.quantize && n > 0 {
        // Quantized once per token, at every world (the pull reads this rank's own rows here too).
        let (xs, ss) = m.layout.xstage_at(epoch);
        quantize_rows(m.at(me, xs), m.at(me, ss), a.x, n, c.hidden, c.ue8m0);
    } else if m.world > 1 && n > 0 {
        let (xs, ss) = m.layout.xstage_at(epoch);
        stage_x(m, a, n, xs, ss);
    }
    (counts, bad)
}

/// Copies the caller's first `n` rows of `x` (and their FP8 scales) to this rank's staging
/// buffers at offsets `xs` and `ss` of its block, where the peers pull them (both modes).
pub(super) fn stage_x(m: &Moe, a: &Dispatch, n: u64, xs: u64, ss: u64) {
    let c = &m.cfg;
    copy(m.at(m.rank, xs), a.x, n * c.row_bytes());
    if c.dtype.has_scales() {
        copy(m.at(m.rank, ss), a.x_scales, n * c.scales_per_row() * 4);
    }
}

/// Waits until every word of every source's counts row of `epoch` carries its tag (the one
/// cross-rank wait of a dispatch: counts, status words, the grid's block words); returns the
/// rows' values, `[W][E + ROW_EXTRA + grid]`.
fn wait_rows(m: &Moe, epoch: u64, timeout: Duration) -> Result<Vec<Vec<i32>>> {
    let (w, e_all) = (m.world as u64, m.cfg.experts as u64);
    let wait = Wait {
        m,
        what: "symm_moe_dispatch",
        start: Instant::now(),
        timeout,
    };
    wait.rows(epoch, row_used(e_all, m.grid as u64), |s| {
        m.at(m.rank, m.layout.row(e_all, w, epoch, s))
    })
}

/// The host backend's `symm_moe_dispatch`. A refusal (this rank's own bad arguments) takes
/// part with its status; the caller returns the refusal's own error.
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

/// The send half of a dispatch: steps 1 and 2 (a new epoch; waits for nothing).
pub fn dispatch_send(m: &mut Moe, a: &Dispatch, it: IndexType, refusal: Option<&Refusal>) {
    m.d_epoch += 1;
    let epoch = m.d_epoch;
    probe(m, PROBE_D_START, PROBE_D_EPOCH, epoch);
    let (w, me) = (m.world as u64, m.rank);
    let c = m.cfg;
    let e_all = c.experts as u64;
    let n = if refusal.is_some() { 0 } else { a.tokens };
    let (counts, mut found) = local(m, a, it, n, epoch);
    probe(m, PROBE_D_ROUTED, PROBE_D_EPOCH, epoch);
    probe(m, PROBE_D_STAGED, PROBE_D_EPOCH, epoch);
    if let Some(r) = refusal {
        found = Some(Found {
            code: r.code,
            rank: me as u32,
            value: r.value,
            ..Found::default()
        });
    }
    // Step 2: this rank's row, tagged with the epoch, into every rank's counts (after the list
    // and the staged x: the tags release them).
    let extra = status::row_extra(&found.unwrap_or_default());
    for d in 0..m.world {
        let row = m.at(d, m.layout.row(e_all, w, epoch, me as u64));
        for (e, &v) in counts.iter().enumerate() {
            let v = if found.is_some() { 0 } else { v };
            word(row + 8 * e as u64).store(tagged(epoch, v), Ordering::Release);
        }
        for (i, &v) in extra.iter().enumerate() {
            let at = row + 8 * (e_all + i as u64);
            word(at).store(tagged(epoch, v), Ordering::Release);
        }
        for i in extra.len() as u64..ROW_EXTRA {
            word(row + 8 * (e_all + i)).store(tagged(epoch, 0), Ordering::Release);
        }
        // The grid's block words (the kernels' step 2b; this backend is all of its blocks).
        for b in 0..m.grid as u64 {
            word(row + 8 * (e_all + ROW_EXTRA + b)).store(tagged(epoch, 1), Ordering::Release);
        }
    }
    probe(m, PROBE_D_PUBLISHED, PROBE_D_EPOCH, epoch);
}

/// The receive half of the dispatch whose send half ran last (its epoch): steps 3 and 4.
/// `refused`: that send half published this rank's refusal (no tokens).
pub fn dispatch_recv(m: &mut Moe, a: &Dispatch, refused: bool, timeout: Duration) -> Result<()> {
    let epoch = m.d_epoch;
    probe(m, PROBE_D_RECV, PROBE_D_EPOCH, epoch);
    let (w, me) = (m.world as u64, m.rank);
    let c = m.cfg;
    let (e_all, kk) = (c.experts as u64, c.topk as u64);
    let n = if refused { 0 } else { a.tokens };
    // Step 3: the one wait; the first status (lowest rank), else capacity.
    let rows = wait_rows(m, epoch, timeout)?;
    probe(m, PROBE_D_WAITED, PROBE_D_EPOCH, epoch);
    let mut first = rows.iter().enumerate().find_map(|(s, row)| {
        let ex = &row[e_all as usize..e_all as usize + 5];
        (ex[0] != 0).then(|| status::from_row(s as u32, ex))
    });
    let count = |s: usize, e: u64| rows[s][e as usize] as i64;
    let l = c.local_experts(w);
    if first.is_none() {
        first = (0..e_all).find_map(|e| {
            let total: i64 = (0..m.world).map(|s| count(s, e)).sum();
            (total > c.max_recv as i64).then_some(Found {
                code: status::ST_CAPACITY,
                rank: (e / l) as u32,
                token: e as u32,
                k: 0,
                value: total,
            })
        });
    }
    let ok = first.is_none();
    // Step 4: pull this rank's experts' rows, source by source in rank order, each source's in
    // token order (its list), from the source's staged x (or the caller's x for this rank's own).
    let row_bytes = c.row_bytes();
    let scales = c.scales_per_row();
    for le in 0..l {
        let e = me as u64 * l + le;
        let mut row = 0u64;
        if ok {
            for (s, src_row) in rows.iter().enumerate() {
                let list = m.at(s, m.layout.list_at(epoch, e));
                let (xs, ss) = m.layout.xstage_at(epoch);
                for i in 0..src_row[e as usize] as u64 {
                    let entry = rd_i32(list + 4 * i) as u64;
                    let t = entry / kk;
                    let slot = le * c.max_recv + row;
                    let (x, xsc) = if s == me && !c.quantize {
                        (a.x, a.x_scales)
                    } else {
                        (m.at(s, xs), m.at(s, ss))
                    };
                    copy(
                        m.at(me, m.layout.recv_x) + slot * row_bytes,
                        x + t * row_bytes,
                        row_bytes,
                    );
                    // Scale (le, row, g) at le * s0 + row * s1 + g * s2 (config.rs).
                    let [s0, s1, s2] = c.scale_strides();
                    for g in 0..scales {
                        copy(
                            m.at(me, m.layout.recv_scales) + 4 * (le * s0 + row * s1 + g * s2),
                            xsc + 4 * (t * scales + g),
                            4,
                        );
                    }
                    let code = (s as u64 * c.tokens * kk + entry) as i32;
                    wr_i32(m.at(me, m.layout.recv_src) + 4 * slot, code);
                    row += 1;
                }
            }
        }
        wr_i32(m.at(me, m.layout.recv_counts) + 4 * le, row as i32);
    }
    // Each of this rank's entries' row in its expert's rank (the combine reads this rank's own
    // experts' rows there).
    if ok {
        for at in 0..n * kk {
            let pos = rd_i32(m.at(me, m.layout.pos) + 4 * at);
            if pos >= 0 {
                let e = rd_i32(m.at(me, m.layout.idx) + 4 * at) as u64;
                let base: i64 = (0..me).map(|s| count(s, e)).sum();
                let slot = (e % l) * c.max_recv + (base + pos as i64) as u64;
                wr_i32(m.at(me, m.layout.pos) + 4 * at, slot as i32);
            }
        }
    }
    probe(m, PROBE_D_PULLED, PROBE_D_EPOCH, epoch);
    match first {
        None => Ok(()),
        Some(f) if f.rank as usize == me && status::is_refusal(f.code) => {
            // The caller returns this rank's own message.
            Err(Error::invalid("refused"))
        }
        Some(f) => Err(f.error(&m.bounds())),
    }
}
