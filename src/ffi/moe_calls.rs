//! The C ABI's calls on a moe object (docs/moe.md): `symm_moe_dispatch`, `symm_moe_combine`,
//! `symm_moe_check`, the split halves (`symm_moe_dispatch_send` / `_recv`,
//! `symm_moe_combine_send` / `_recv`) and the clock probe (`symm_moe_probe`). The object's
//! life and structs: moe.rs. Every entry point is guarded (panic, status, `symm_last_error()`)
//! and reaches the object only through `with_moe`'s live check; the one-call and send-half
//! forms build their arguments in one place each (`dispatch_args`, `combine_args`).

use super::guard::guard_status;
use super::moe::{symm_moe_t, with_moe, SYMM_MOE_PROBE_WORDS};
use super::types::*;
use super::{stream_of, with_comm};
use crate::comm::moe::{Combine, Dispatch};
use crate::error::Error;
use std::ffi::c_void;

/// A dispatch's arguments as the C caller gave them (checked by comm/moe).
#[allow(clippy::too_many_arguments)]
fn dispatch_args(
    x: *const c_void,
    x_scales: *const f32,
    topk_idx: *const c_void,
    idx_dtype: u32,
    topk_weights: *const f32,
    num_tokens: usize,
    k: u32,
    stream: *mut CUstream_st,
) -> Dispatch {
    Dispatch {
        x: x as u64,
        x_scales: x_scales as u64,
        idx: topk_idx as u64,
        idx_dtype,
        weights: topk_weights as u64,
        tokens: num_tokens as u64,
        k,
        stream: stream_of(stream),
    }
}

/// A combine's arguments as the C caller gave them (checked by comm/moe).
fn combine_args(expert_out: *const c_void, y: *mut c_void, stream: *mut CUstream_st) -> Combine {
    Combine {
        expert_out: expert_out as u64,
        y: y as u64,
        stream: stream_of(stream),
    }
}

/// Stream-ordered, capturable, no host synchronization: sends row `x[t]` (and its scales) to
/// the rank of every expert in `topk_idx[t]` (`-1`: slot unused); every rank's `recv_x` then
/// holds its local experts' rows, ordered by source rank then token, with `recv_counts` and
/// `recv_src` (docs/moe.md). `x`: `[num_tokens][hidden]` payload dtype, 16-byte aligned;
/// `x_scales`: `[num_tokens][hidden/128]` fp32 (FP8 only; NULL for bf16, and NULL when the
/// object quantizes: input SYMM_MOE_INPUT_BF16 takes bf16 `x`); `topk_idx`:
/// `[num_tokens][k]` of `idx_dtype` (SYMM_INDEX_INT32 or SYMM_INDEX_INT64); `topk_weights`:
/// `[num_tokens][k]` fp32. `num_tokens` (0 to max_tokens_per_rank) may differ between ranks;
/// `1 <= k <= topk`. Collective. A rank's bad arguments: SYMM_ERR_INVALID_ARGUMENT at once
/// naming the value, and every other rank's call fails naming that rank; a bad routing (an
/// expert out of range, twice in a token, a full expert) fails on every rank (at this call on
/// the host backend, at the next call or `symm_moe_check` on CUDA). Both leave the object and
/// the communicator usable. Throughput mode (`mode` SYMM_MOE_THROUGHPUT): each token goes
/// once to each rank holding one of its experts, and lands in `symm_moe_tp_layout`'s buffers.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_moe_dispatch(
    moe: *mut symm_moe_t,
    x: *const c_void,
    x_scales: *const f32,
    topk_idx: *const c_void,
    idx_dtype: u32,
    topk_weights: *const f32,
    num_tokens: usize,
    k: u32,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_dispatch", || {
        let a = dispatch_args(
            x,
            x_scales,
            topk_idx,
            idx_dtype,
            topk_weights,
            num_tokens,
            k,
            stream,
        );
        with_moe("symm_moe_dispatch", moe, |m, comm| {
            with_comm(comm, |c| c.moe_dispatch(m, &a))
        })
    })
}

/// Stream-ordered, capturable: sends `expert_out` (`[L][R][hidden]` bf16, the dispatch layout,
/// 16-byte aligned) back to the tokens' ranks, and writes `y` (`[num_tokens][hidden]` bf16 of
/// the last dispatch) = sum over k of `topk_weights[t][k] * expert_out(token t, slot k)`, in
/// fp32 with fma in increasing k, rounded once: bitwise the same on every run and rank count.
/// Collective. Refused before any dispatch (and, on the host backend, after a failed one).
/// Any number of combines may follow one dispatch, back to back on the stream (e.g. with other
/// expert outputs): each writes its own `y`, none disturbs another's. A combine one rank
/// refused (its own arguments) fails on every other rank naming it, with `y` zeros there, and
/// may simply be retried. Throughput mode: `expert_out` is `[world * max_tokens_per_rank][hidden]`
/// bf16, row i the caller's weighted sum over this rank's experts for received row i (rows past
/// `*num_recv` are not read), and `y[t]` = the sum of token t's rows over the ranks it went to,
/// in increasing rank order, in fp32, rounded to bf16 once.
#[no_mangle]
pub extern "C" fn symm_moe_combine(
    moe: *mut symm_moe_t,
    expert_out: *const c_void,
    y: *mut c_void,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_combine", || {
        let a = combine_args(expert_out, y, stream);
        with_moe("symm_moe_combine", moe, |m, comm| {
            with_comm(comm, |c| c.moe_combine(m, &a))
        })
    })
}

/// Reports (and clears) an error a dispatch or combine kernel recorded; call it after the
/// stream was synchronized. Every moe call also reports one first (on CUDA the call itself
/// still runs, as every rank's does). SYMM_SUCCESS when there is none.
#[no_mangle]
pub extern "C" fn symm_moe_check(moe: *mut symm_moe_t) -> symm_status_t {
    guard_status!("symm_moe_check", || {
        with_moe("symm_moe_check", moe, |m, comm| {
            with_comm(comm, |c| c.moe_check(m))
        })
    })
}

/// The send half of `symm_moe_dispatch` (same arguments): routes this rank's tokens, stages
/// their rows and publishes its counts to every rank; waits for no peer, so the caller may run
/// other work (another micro-batch, attention) before `symm_moe_dispatch_recv`. Stream-ordered,
/// capturable. `x` and `x_scales` must stay valid and unchanged until the receive half has run
/// (it reads this rank's own rows from them). Its receive half must come next on this object
/// (any other moe call on it is refused until then); calls of the communicator on other
/// streams are ordered after it by the library, as every collective is. A failure (this rank's
/// bad arguments, an error recorded earlier) completes the call at once: the receive half is
/// submitted too, nothing stays pending, and the peers' receive halves fail naming this rank.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_moe_dispatch_send(
    moe: *mut symm_moe_t,
    x: *const c_void,
    x_scales: *const f32,
    topk_idx: *const c_void,
    idx_dtype: u32,
    topk_weights: *const f32,
    num_tokens: usize,
    k: u32,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_dispatch_send", || {
        let a = dispatch_args(
            x,
            x_scales,
            topk_idx,
            idx_dtype,
            topk_weights,
            num_tokens,
            k,
            stream,
        );
        with_moe("symm_moe_dispatch_send", moe, |m, comm| {
            with_comm(comm, |c| c.moe_dispatch_send(m, &a))
        })
    })
}

/// The receive half of the dispatch `symm_moe_dispatch_send` sent: waits for every rank's counts
/// and pulls this rank's experts' rows; then the layout's buffers hold what `symm_moe_dispatch`
/// would have left, bit for bit. `stream` may differ from the send half's (the library orders
/// it after the send half: an event between the streams, or the capture's edge when both are
/// captured into one graph). SYMM_ERR_INVALID_ARGUMENT without a pending dispatch send.
#[no_mangle]
pub extern "C" fn symm_moe_dispatch_recv(
    moe: *mut symm_moe_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_dispatch_recv", || {
        let s = stream_of(stream);
        with_moe("symm_moe_dispatch_recv", moe, |m, comm| {
            with_comm(comm, |c| c.moe_dispatch_recv(m, s))
        })
    })
}

/// The send half of `symm_moe_combine` (same arguments): this rank's experts' rows back to their
/// tokens' ranks and its flag raised; waits for no peer. `expert_out` must stay valid and
/// unchanged and `y` untouched until `symm_moe_combine_recv` has run (it reads this rank's own
/// experts' rows from `expert_out` and writes `y`). Refused while a dispatch's send half is
/// pending (its receive half first) and before any dispatch. Otherwise as
/// `symm_moe_dispatch_send`.
#[no_mangle]
pub extern "C" fn symm_moe_combine_send(
    moe: *mut symm_moe_t,
    expert_out: *const c_void,
    y: *mut c_void,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_combine_send", || {
        let a = combine_args(expert_out, y, stream);
        with_moe("symm_moe_combine_send", moe, |m, comm| {
            with_comm(comm, |c| c.moe_combine_send(m, &a))
        })
    })
}

/// The receive half of the combine `symm_moe_combine_send` sent: waits for every peer's rows and
/// writes `y` (the send half's), bit for bit what `symm_moe_combine` writes. `stream` as for
/// `symm_moe_dispatch_recv`. SYMM_ERR_INVALID_ARGUMENT without a pending combine send.
#[no_mangle]
pub extern "C" fn symm_moe_combine_recv(
    moe: *mut symm_moe_t,
    stream: *mut CUstream_st,
) -> symm_status_t {
    guard_status!("symm_moe_combine_recv", || {
        let s = stream_of(stream);
        with_moe("symm_moe_combine_recv", moe, |m, comm| {
            with_comm(comm, |c| c.moe_combine_recv(m, s))
        })
    })
}

/// Writes the clock probe of an object created with SYMM_MOE_FLAG_PROBE into `out[0..words]`
/// (`words` must be SYMM_MOE_PROBE_WORDS): the last dispatch's phase times (start, routed,
/// staged, published, receive start, wait done, pulled) and its epoch, then the last combine's
/// (start, pushed, receive start, wait done, summed) and its epoch, then two zeros
/// (docs/moe.md, "Clock probe"). On CUDA the times are %globaltimer (ns) and the call
/// synchronizes the device first (not capturable; for benchmarks); on the host backend they
/// are the wall clock in ns since the Unix epoch. Local. SYMM_ERR_INVALID_ARGUMENT when the
/// probe is off.
#[no_mangle]
pub extern "C" fn symm_moe_probe(
    moe: *mut symm_moe_t,
    out: *mut u64,
    words: usize,
) -> symm_status_t {
    guard_status!("symm_moe_probe", || {
        if out.is_null() {
            return Err(Error::invalid("symm_moe_probe: out is NULL"));
        }
        if words != SYMM_MOE_PROBE_WORDS as usize {
            return Err(Error::invalid(format!(
                "symm_moe_probe: words {words}; expected {SYMM_MOE_PROBE_WORDS} \
                 (SYMM_MOE_PROBE_WORDS)"
            )));
        }
        let v = with_moe("symm_moe_probe", moe, |m, _| m.probe())?;
        // SAFETY: out is non-NULL and the caller declared `words` (= the array's length) u64s.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, v.len()) };
        Ok(())
    })
}
