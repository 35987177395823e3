//! The C ABI of expert parallelism (docs/moe.md), the object's life: `symm_moe_create`,
//! `symm_moe_create_config`, `symm_moe_destroy`, `symm_moe_layout`, `symm_moe_tp_layout`, and
//! the versioned structs (the calls on an object: moe_calls.rs). Argument checks, panic guard,
//! status + `symm_last_error()` as everywhere; the work is comm/moe/.
//!
//! A `symm_moe_t` keeps the communicator it was made on; every call goes through that
//! communicator's live check, so a handle whose communicator was destroyed is refused (its
//! destroy still gives the buffers back). Handles are checked against a live set, so a stale
//! or foreign pointer is an error, not a use after free.

use super::guard::{self, guard_status, Handle, Kind};
use super::types::*;
use super::{symm_comm_t, with_comm};
use crate::comm::moe::config::Request;
use crate::comm::moe::throughput::wrong_mode;
use crate::comm::moe::Moe;
use crate::error::{Error, Result};
use std::ffi::c_void;

/// Payload dtypes of `symm_moe_create` (`dtype`).
pub const SYMM_MOE_BF16: u32 = 0;
/// FP8 e4m3 with one fp32 scale per 128 elements (`hidden % 128 == 0`).
pub const SYMM_MOE_FP8_E4M3: u32 = 1;
/// Index dtypes of `symm_moe_dispatch` (`idx_dtype`).
pub const SYMM_INDEX_INT32: u32 = 0;
pub const SYMM_INDEX_INT64: u32 = 1;
/// Inputs of a dispatch (`symm_moe_config_t::input`, version 3): `x` is the payload dtype
/// (FP8 with the caller's `x_scales`), or bf16 quantized to the FP8 payload inside the
/// dispatch kernel (one fp32 scale per 128 elements, computed there; `x_scales` NULL).
pub const SYMM_MOE_INPUT_PAYLOAD: u32 = 0;
pub const SYMM_MOE_INPUT_BF16: u32 = 1;
/// Layouts of `recv_scales` (`symm_moe_config_t::scale_layout`, version 3): row-major
/// `[L][R][H/128]`, or per local expert a column-major `[H/128][R4]` (`R4` = R rounded up to a
/// multiple of 4: DeepGEMM's MN-major TMA-aligned scales).
pub const SYMM_MOE_SCALES_ROW_MAJOR: u32 = 0;
pub const SYMM_MOE_SCALES_COL_TMA: u32 = 1;
/// The `symm_moe_config_t` layout this library writes in its header (`version`): 2 added
/// `num_sms`, 3 `input`, `scale_layout`, `scale_ue8m0` and the mode group (`mode`). Versions 1
/// (`size` 48, without `num_sms`) and 2 (`size` 56) are still read, the missing fields as 0
/// (payload input, row-major scales, low-latency mode).
pub const SYMM_MOE_CONFIG_VERSION: u32 = 3;
/// The `symm_moe_layout_t` layout this library writes (`version`): 2 added the scale layout
/// and strides. Version 1 (`size` 112, ending at `buffer_bytes`) is still written.
pub const SYMM_MOE_LAYOUT_VERSION: u32 = 2;
/// Modes of `symm_moe_config_t.mode` (docs/moe.md): expert-major rows with device-side counts
/// (`symm_moe_layout`), or one row per (token, destination rank) (`symm_moe_tp_layout`).
pub const SYMM_MOE_LOW_LATENCY: u32 = 0;
pub const SYMM_MOE_THROUGHPUT: u32 = 1;
/// The `symm_moe_tp_layout_t` layout this library writes (`version`).
pub const SYMM_MOE_TP_LAYOUT_VERSION: u32 = 2;
/// `flags` of `symm_moe_create` / `symm_moe_config_t`: record the clock probe (the kernels'
/// %globaltimer at each phase boundary of the last dispatch and combine; `symm_moe_probe`).
pub const SYMM_MOE_FLAG_PROBE: u32 = 1;
/// Words `symm_moe_probe` writes.
pub const SYMM_MOE_PROBE_WORDS: u32 = 16;
/// The largest configured top-k, and the most experts.
pub const SYMM_MOE_MAX_TOPK: u32 = 16;
pub const SYMM_MOE_MAX_EXPERTS: u32 = 1024;
const _: () = assert!(
    SYMM_MOE_MAX_TOPK == crate::comm::moe::config::MAX_TOPK
        && SYMM_MOE_MAX_EXPERTS == crate::comm::moe::config::MAX_EXPERTS
        && SYMM_MOE_BF16 == crate::comm::moe::config::PAYLOAD_BF16
        && SYMM_MOE_FP8_E4M3 == crate::comm::moe::config::PAYLOAD_FP8_E4M3
        && SYMM_INDEX_INT32 == crate::comm::moe::config::INDEX_INT32
        && SYMM_INDEX_INT64 == crate::comm::moe::config::INDEX_INT64
        && SYMM_MOE_INPUT_PAYLOAD == crate::comm::moe::config::INPUT_PAYLOAD
        && SYMM_MOE_INPUT_BF16 == crate::comm::moe::config::INPUT_BF16
        && SYMM_MOE_SCALES_ROW_MAJOR == crate::comm::moe::config::SCALES_ROW_MAJOR
        && SYMM_MOE_SCALES_COL_TMA == crate::comm::moe::config::SCALES_COL_TMA
        && SYMM_MOE_FLAG_PROBE == crate::comm::moe::config::FLAG_PROBE
        && SYMM_MOE_PROBE_WORDS as u64 == crate::comm::moe::layout::PROBE_WORDS
        && SYMM_MOE_LOW_LATENCY == crate::comm::moe::config::MODE_LOW_LATENCY
        && SYMM_MOE_THROUGHPUT == crate::comm::moe::config::MODE_THROUGHPUT
);

/// A moe object's configuration (versioned: `version` and `size` first; set `version` to
/// SYMM_MOE_CONFIG_VERSION and `size` to `sizeof(symm_moe_config_t)`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct symm_moe_config_t {
    pub version: u32,
    pub size: u32,
    /// T: the most tokens a rank dispatches per call (the CUDA-graph shape).
    pub max_tokens_per_rank: u64,
    /// H: elements per token row.
    pub hidden: u64,
    /// K: the largest top-k a dispatch passes (1 to SYMM_MOE_MAX_TOPK).
    pub topk: u32,
    /// E: a multiple of the communicator's ranks, at most SYMM_MOE_MAX_EXPERTS.
    pub num_experts: u32,
    /// SYMM_MOE_BF16 or SYMM_MOE_FP8_E4M3.
    pub dtype: u32,
    /// 0, or SYMM_MOE_FLAG_PROBE (anything else is refused).
    pub flags: u32,
    /// R: rows per local expert; 0 = world * max_tokens_per_rank (no routing overflows it).
    pub max_recv_per_expert: u64,
    /// Version 2: the most SMs (blocks) a dispatch or combine kernel uses; 0 = as many as the
    /// work can keep busy, at most the communicator's GPUs' SMs (and 132). Every rank passes the
    /// same value.
    pub num_sms: u32,
    /// Version 2: 0 (reserved; anything else is refused).
    pub reserved: u32,
    /// Version 3: SYMM_MOE_INPUT_PAYLOAD (0: `x` is the payload dtype) or SYMM_MOE_INPUT_BF16
    /// (1: `x` is bf16, quantized to e4m3 inside the dispatch; needs dtype SYMM_MOE_FP8_E4M3).
    pub input: u32,
    /// Version 3: SYMM_MOE_SCALES_ROW_MAJOR (0) or SYMM_MOE_SCALES_COL_TMA (1, FP8 only).
    pub scale_layout: u32,
    /// Version 3: 1 rounds each scale the dispatch computes up to a power of two (UE8M0;
    /// needs SYMM_MOE_INPUT_BF16), 0 keeps amax / 448.
    pub scale_ue8m0: u32,
    /// Version 3: 0 (reserved; anything else is refused).
    pub reserved3: u32,
    // ---- version 3, the mode group ----
    /// Version 3: SYMM_MOE_LOW_LATENCY (0) or SYMM_MOE_THROUGHPUT (1). Every rank passes the
    /// same value.
    pub mode: u32,
    /// Version 3, mode group: 0 (reserved; anything else is refused).
    pub mode_reserved: u32,
}

/// The size of a version 1 `symm_moe_config_t` (the fields before `num_sms`).
const CONFIG_V1_SIZE: usize = std::mem::offset_of!(symm_moe_config_t, num_sms);
/// The size of a version 2 `symm_moe_config_t` (the fields before `input`).
const CONFIG_V2_SIZE: usize = std::mem::offset_of!(symm_moe_config_t, input);

/// Where a dispatch leaves its rows (written by `symm_moe_layout`; versioned like
/// `symm_device_comm_t`: set `version` and `size`, the library writes at most `size` bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_moe_layout_t {
    pub version: u32,
    pub size: u32,
    /// `[L][R][H]` payload dtype: local expert, row, element.
    pub recv_x: *mut c_void,
    /// `[L][R][H/128]` fp32 (FP8 only; NULL for bf16).
    pub recv_scales: *mut f32,
    /// `[L]`: rows of each local expert filled by the last dispatch (device memory).
    pub recv_counts: *mut i32,
    /// `[L][R]`: `(src_rank * T + token) * K + k` of each row.
    pub recv_src: *mut i32,
    pub local_experts: u64,
    pub first_expert: u64,
    pub max_recv: u64,
    pub hidden: u64,
    pub max_tokens_per_rank: u64,
    pub topk: u32,
    pub num_experts: u32,
    pub world: u32,
    pub rank: u32,
    pub dtype: u32,
    pub reserved: u32,
    /// Bytes of the communicator's arena this object holds.
    pub buffer_bytes: u64,
    /// Version 2: the config's `input` (SYMM_MOE_INPUT_*).
    pub input: u32,
    /// Version 2: SYMM_MOE_SCALES_ROW_MAJOR or SYMM_MOE_SCALES_COL_TMA (0 for bf16).
    pub scale_layout: u32,
    /// Version 2: 1 when the dispatch's scales are powers of two (UE8M0).
    pub scale_ue8m0: u32,
    pub reserved2: u32,
    /// Version 2: `recv_scales` strides in fp32 elements: the scale of (local expert `le`, row,
    /// group `g`) is `recv_scales[le * scale_stride_expert + row * scale_stride_row + g *
    /// scale_stride_group]` (row-major: `R*S, S, 1`; column-major TMA: `S*R4, 1, R4`; all 0
    /// for bf16).
    pub scale_stride_expert: u64,
    pub scale_stride_row: u64,
    pub scale_stride_group: u64,
}

/// The size of a version 1 `symm_moe_layout_t` (the fields before `input`).
const LAYOUT_V1_SIZE: usize = std::mem::offset_of!(symm_moe_layout_t, input);
/// Where a throughput-mode dispatch leaves its rows (written by `symm_moe_tp_layout`; versioned:
/// set `version` to SYMM_MOE_TP_LAYOUT_VERSION and `size` to `sizeof(symm_moe_tp_layout_t)`).
/// Rows are ordered by source rank, then token: one per (token, this rank); `max_rows` =
/// world * max_tokens_per_rank bounds them whatever the routing.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct symm_moe_tp_layout_t {
    pub version: u32,
    pub size: u32,
    /// `[max_rows][H]` payload dtype: the received rows, the first `*num_recv` filled.
    pub recv_x: *mut c_void,
    /// FP8 only (NULL for bf16): the scale of (row, group `g`) is `recv_scales[row *
    /// scale_stride_row + g * scale_stride_group]` (row-major `[max_rows][H/128]`, or with
    /// SYMM_MOE_SCALES_COL_TMA column-major `[H/128][R4]`, `R4` = max_rows rounded up to 4).
    pub recv_scales: *mut f32,
    /// `[max_rows][K]` int32: each row's top-k slots as local expert ids (0..L), -1 where the
    /// slot's expert is on another rank or the slot was unused.
    pub recv_topk_idx: *mut i32,
    /// `[max_rows][K]` fp32: the weights of those slots (0 where `recv_topk_idx` is -1).
    pub recv_topk_weights: *mut f32,
    /// `[max_rows]` int32: `src_rank * max_tokens_per_rank + token` of each row.
    pub recv_src: *mut i32,
    /// `[1]` int32 (device memory): rows received by the last dispatch.
    pub num_recv: *mut i32,
    /// `[L]` int32 (device memory): rows whose top-k has each local expert.
    pub num_recv_tokens_per_expert: *mut i32,
    /// `[L + 1]` int32: the CSR offsets of `expert_rows` (prefix sums of the counts above).
    pub expert_offsets: *mut i32,
    /// `[max_rows * K]` int32: `row * K + k` of each (row, slot) of each local expert, grouped
    /// by local expert, rows increasing.
    pub expert_rows: *mut i32,
    pub max_rows: u64,
    pub local_experts: u64,
    pub first_expert: u64,
    pub hidden: u64,
    pub max_tokens_per_rank: u64,
    pub topk: u32,
    pub num_experts: u32,
    pub world: u32,
    pub rank: u32,
    pub dtype: u32,
    pub reserved: u32,
    /// Bytes of the communicator's arena this object holds.
    pub buffer_bytes: u64,
    /// Version 2: the config's `input` (SYMM_MOE_INPUT_*).
    pub input: u32,
    /// Version 2: SYMM_MOE_SCALES_ROW_MAJOR or SYMM_MOE_SCALES_COL_TMA (0 for bf16).
    pub scale_layout: u32,
    /// Version 2: 1 when the dispatch's scales are powers of two (UE8M0).
    pub scale_ue8m0: u32,
    pub reserved2: u32,
    /// Version 2: `recv_scales` strides in fp32 elements (row-major: `H/128, 1`; column-major
    /// TMA: `1, R4`; both 0 for bf16).
    pub scale_stride_row: u64,
    pub scale_stride_group: u64,
}

/// The size of a version 1 `symm_moe_tp_layout_t` (the fields before `input`).
const TP_LAYOUT_V1_SIZE: usize = std::mem::offset_of!(symm_moe_tp_layout_t, input);

/// A moe object (opaque): dispatch and combine over one communicator.
#[allow(non_camel_case_types)]
pub struct symm_moe_t {
    comm: *mut symm_comm_t,
    inner: Option<Moe>,
}

impl Handle for symm_moe_t {
    const KIND: Kind = Kind::Moe;
}

/// The object behind a handle that is live.
pub(super) fn with_moe<T>(
    what: &str,
    moe: *mut symm_moe_t,
    f: impl FnOnce(&mut Moe, *mut symm_comm_t) -> Result<T>,
) -> Result<T> {
    if moe.is_null() {
        return Err(Error::invalid(format!("{what}: moe is NULL")));
    }
    if !guard::is_live(moe) {
        return Err(Error::invalid(format!(
            "{what}: moe {moe:p} is not a live moe object (destroyed already, or never created)"
        )));
    }
    // SAFETY: moe is a live handle (ffi/guard.rs), so it points at a symm_moe_t we allocated and have not
    // freed; one object is not used from two threads at once (as a communicator).
    let m = unsafe { &mut *moe };
    let comm = m.comm;
    f(
        m.inner
            .as_mut()
            .ok_or_else(|| Error::internal("moe object without state"))?,
        comm,
    )
}

/// `req`: the request, or why this rank could not read it; either way the rank takes part in
/// the agreement (comm/moe), so a refusal on one rank fails every rank at once.
fn create(comm: *mut symm_comm_t, req: Result<Request>, out: *mut *mut symm_moe_t) -> Result<()> {
    let req = if out.is_null() {
        Err(Error::invalid("symm_moe_create: out is NULL"))
    } else {
        // SAFETY: out is non-NULL; cleared first so a failure leaves NULL.
        unsafe { out.write(std::ptr::null_mut()) };
        req
    };
    let m = with_comm(comm, |c| c.moe_create(req.as_ref().map_err(Clone::clone)))?;
    let p = guard::give(symm_moe_t {
        comm,
        inner: Some(m),
    });
    // SAFETY: as above.
    unsafe { out.write(p) };
    Ok(())
}

/// Creates a moe object over `comm` (any communicator, a split child included): dispatch of
/// up to `max_tokens_per_rank` tokens of `hidden` elements (`dtype`: SYMM_MOE_BF16 or
/// SYMM_MOE_FP8_E4M3) to `num_experts` experts (a multiple of the ranks; rank r holds experts
/// [r*L, (r+1)*L)), each token to at most `topk` of them, and the combine back. Its buffers
/// come from the communicator's arena (`buffer_bytes` in `symm_moe_layout`); a too small arena
/// fails naming SYMMALLOC_COMM_ARENA_SIZE and the bytes needed. Collective: every rank passes
/// the same values, SYMM_ERR_NOT_SYMMETRIC on every rank otherwise. `flags`: 0, or
/// SYMM_MOE_FLAG_PROBE (the clock probe, `symm_moe_probe`).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn symm_moe_create(
    comm: *mut symm_comm_t,
    max_tokens_per_rank: usize,
    hidden: usize,
    topk: u32,
    num_experts: u32,
    dtype: u32,
    flags: u32,
    out: *mut *mut symm_moe_t,
) -> symm_status_t {
    guard_status!("symm_moe_create", || {
        let req = Request {
            tokens: max_tokens_per_rank as u64,
            hidden: hidden as u64,
            topk,
            experts: num_experts,
            dtype,
            flags,
            max_recv: 0,
            num_sms: 0,
            input: 0,
            scale_layout: 0,
            ue8m0: 0,
            mode: SYMM_MOE_LOW_LATENCY,
        };
        create(comm, Ok(req), out)
    })
}

/// As `symm_moe_create`, from a versioned config (`max_recv_per_expert` sizes the receive
/// buffers by the load: a dispatch that would overflow it fails on every rank, nothing dropped).
#[no_mangle]
pub extern "C" fn symm_moe_create_config(
    comm: *mut symm_comm_t,
    config: *const symm_moe_config_t,
    out: *mut *mut symm_moe_t,
) -> symm_status_t {
    guard_status!("symm_moe_create_config", || {
        create(comm, read_config(config), out)
    })
}

/// The request in `config`, or why it cannot be read (NULL, another version or size).
fn read_config(config: *const symm_moe_config_t) -> Result<Request> {
    if config.is_null() {
        return Err(Error::invalid(
            "symm_moe_create_config: config is NULL; expected a symm_moe_config_t (the Python \
             package passes NULL for a rank whose arguments it refused: that rank's error names \
             them)",
        ));
    }
    // SAFETY: config is non-NULL; the version and size words come first in every version.
    let (version, size) = unsafe { ((*config).version, (*config).size) };
    let have = std::mem::size_of::<symm_moe_config_t>();
    let old = (version == 1 && size as usize == CONFIG_V1_SIZE)
        || (version == 2 && size as usize == CONFIG_V2_SIZE);
    if !old && (version != SYMM_MOE_CONFIG_VERSION || size as usize != have) {
        return Err(Error::invalid(format!(
            "symm_moe_create_config: config version {version}, size {size}; expected \
             version {SYMM_MOE_CONFIG_VERSION} (SYMM_MOE_CONFIG_VERSION) and size {have} \
             (sizeof(symm_moe_config_t)), or version 2 and size {CONFIG_V2_SIZE}, or version 1 \
             and size {CONFIG_V1_SIZE}"
        )));
    }
    let mut c = symm_moe_config_t::default();
    // SAFETY: the caller declared `size` readable bytes (checked above to be a known layout);
    // a version 1 struct ends before `num_sms`, a version 2 one before `input`: those stay 0
    // (payload input, row-major scales, low-latency mode).
    unsafe {
        std::ptr::copy_nonoverlapping(
            config as *const u8,
            &mut c as *mut symm_moe_config_t as *mut u8,
            size as usize,
        )
    };
    for (name, v) in [("reserved", c.reserved), ("reserved3", c.reserved3)] {
        if v != 0 {
            return Err(Error::invalid(format!(
                "symm_moe_create_config: {name} {v:#x}; expected 0"
            )));
        }
    }
    if c.mode_reserved != 0 {
        return Err(Error::invalid(format!(
            "symm_moe_create_config: mode_reserved {:#x}; expected 0",
            c.mode_reserved
        )));
    }
    Ok(Request {
        tokens: c.max_tokens_per_rank,
        hidden: c.hidden,
        topk: c.topk,
        experts: c.num_experts,
        dtype: c.dtype,
        flags: c.flags,
        max_recv: c.max_recv_per_expert,
        num_sms: c.num_sms,
        input: c.input,
        scale_layout: c.scale_layout,
        ue8m0: c.scale_ue8m0,
        mode: c.mode,
    })
}

/// Destroys a moe object: waits for the device's work, then gives its buffers back to the
/// communicator's arena. Every rank destroys its object (no rank waits for another). NULL does
/// nothing; a destroyed handle is refused.
#[no_mangle]
pub extern "C" fn symm_moe_destroy(moe: *mut symm_moe_t) -> symm_status_t {
    guard_status!("symm_moe_destroy", || {
        if moe.is_null() {
            return Ok(());
        }
        let Some(b) = guard::take(moe) else {
            return Err(Error::invalid(format!(
                "symm_moe_destroy: moe {moe:p} is not a live moe object (destroyed already, or \
                 never created)"
            )));
        };
        match b.inner {
            Some(m) => m.destroy(),
            None => Ok(()),
        }
    })
}

/// Fills the first `out->size` bytes of `*out` (set `version` to SYMM_MOE_LAYOUT_VERSION and
/// `size` to `sizeof(symm_moe_layout_t)`) with where dispatch leaves its rows. Local.
#[no_mangle]
pub extern "C" fn symm_moe_layout(
    moe: *const symm_moe_t,
    out: *mut symm_moe_layout_t,
) -> symm_status_t {
    guard_status!("symm_moe_layout", || {
        if out.is_null() {
            return Err(Error::invalid("symm_moe_layout: out is NULL"));
        }
        // SAFETY: out is non-NULL; version and size come first in every version.
        let (version, size) = unsafe { ((*out).version, (*out).size as usize) };
        let have = std::mem::size_of::<symm_moe_layout_t>();
        let v1 = version == 1 && size == LAYOUT_V1_SIZE;
        if !v1 && (version != SYMM_MOE_LAYOUT_VERSION || size != have) {
            return Err(Error::invalid(format!(
                "symm_moe_layout: out->version {version}, out->size {size}; expected version \
                 {SYMM_MOE_LAYOUT_VERSION} (SYMM_MOE_LAYOUT_VERSION) and size {have} \
                 (sizeof(symm_moe_layout_t)), or version 1 and size {LAYOUT_V1_SIZE}"
            )));
        }
        let l = with_moe("symm_moe_layout", moe as *mut _, |m, _| {
            if m.tp.is_some() {
                return Err(wrong_mode("symm_moe_layout", m));
            }
            let (w, c, lay) = (m.world as u64, m.cfg, m.layout);
            let local = c.local_experts(w);
            let at = |off: u64| (m.block + off) as *mut c_void;
            Ok(symm_moe_layout_t {
                version,
                size: size as u32,
                recv_x: at(lay.recv_x),
                recv_scales: if c.dtype.has_scales() {
                    at(lay.recv_scales) as *mut f32
                } else {
                    std::ptr::null_mut()
                },
                recv_counts: at(lay.recv_counts) as *mut i32,
                recv_src: at(lay.recv_src) as *mut i32,
                local_experts: local,
                first_expert: m.rank as u64 * local,
                max_recv: c.max_recv,
                hidden: c.hidden,
                max_tokens_per_rank: c.tokens,
                topk: c.topk,
                num_experts: c.experts,
                world: m.world as u32,
                rank: m.rank as u32,
                dtype: c.dtype.code(),
                reserved: 0,
                buffer_bytes: lay.bytes,
                input: c.quantize as u32,
                scale_layout: c.scales.code(),
                scale_ue8m0: c.ue8m0 as u32,
                reserved2: 0,
                scale_stride_expert: c.scale_strides()[0],
                scale_stride_row: c.scale_strides()[1],
                scale_stride_group: c.scale_strides()[2],
            })
        })?;
        // SAFETY: out is non-NULL and the caller declared `size` bytes (checked: a known
        // version's size); a version 1 struct gets the fields before `input` only.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &l as *const symm_moe_layout_t as *const u8,
                out as *mut u8,
                size,
            )
        };
        Ok(())
    })
}

/// Fills the first `out->size` bytes of `*out` (set `version` to SYMM_MOE_TP_LAYOUT_VERSION
/// and `size` to `sizeof(symm_moe_tp_layout_t)`) with where a throughput-mode dispatch leaves
/// its rows. Local. A low-latency object is refused (use `symm_moe_layout`).
#[no_mangle]
pub extern "C" fn symm_moe_tp_layout(
    moe: *const symm_moe_t,
    out: *mut symm_moe_tp_layout_t,
) -> symm_status_t {
    guard_status!("symm_moe_tp_layout", || {
        if out.is_null() {
            return Err(Error::invalid("symm_moe_tp_layout: out is NULL"));
        }
        // SAFETY: out is non-NULL; version and size come first in every version.
        let (version, size) = unsafe { ((*out).version, (*out).size as usize) };
        let have = std::mem::size_of::<symm_moe_tp_layout_t>();
        let v1 = version == 1 && size == TP_LAYOUT_V1_SIZE;
        if !v1 && (version != SYMM_MOE_TP_LAYOUT_VERSION || size != have) {
            return Err(Error::invalid(format!(
                "symm_moe_tp_layout: out->version {version}, out->size {size}; expected version \
                 {SYMM_MOE_TP_LAYOUT_VERSION} (SYMM_MOE_TP_LAYOUT_VERSION) and size {have} \
                 (sizeof(symm_moe_tp_layout_t)), or version 1 and size {TP_LAYOUT_V1_SIZE}"
            )));
        }
        let l = with_moe("symm_moe_tp_layout", moe as *mut _, |m, _| {
            let Some(t) = m.tp else {
                return Err(wrong_mode("symm_moe_tp_layout", m));
            };
            let (w, c) = (m.world as u64, m.cfg);
            let local = c.local_experts(w);
            let at = |off: u64| (m.block + off) as *mut c_void;
            Ok(symm_moe_tp_layout_t {
                version,
                size: size as u32,
                recv_x: at(t.recv_x),
                recv_scales: if c.dtype.has_scales() {
                    at(t.recv_scales) as *mut f32
                } else {
                    std::ptr::null_mut()
                },
                recv_topk_idx: at(t.recv_idx) as *mut i32,
                recv_topk_weights: at(t.recv_weights) as *mut f32,
                recv_src: at(t.recv_src) as *mut i32,
                num_recv: at(t.meta) as *mut i32,
                num_recv_tokens_per_expert: at(t.meta + 4) as *mut i32,
                expert_offsets: at(t.meta + 4 * (1 + local)) as *mut i32,
                expert_rows: at(t.expert_rows) as *mut i32,
                max_rows: w * c.tokens,
                local_experts: local,
                first_expert: m.rank as u64 * local,
                hidden: c.hidden,
                max_tokens_per_rank: c.tokens,
                topk: c.topk,
                num_experts: c.experts,
                world: m.world as u32,
                rank: m.rank as u32,
                dtype: c.dtype.code(),
                reserved: 0,
                buffer_bytes: t.bytes,
                input: c.quantize as u32,
                scale_layout: c.scales.code(),
                scale_ue8m0: c.ue8m0 as u32,
                reserved2: 0,
                scale_stride_row: c.scale_strides()[1],
                scale_stride_group: c.scale_strides()[2],
            })
        })?;
        // SAFETY: out is non-NULL and the caller declared `size` bytes (checked: a known
        // version's size); a version 1 struct gets the fields before `input` only.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &l as *const symm_moe_tp_layout_t as *const u8,
                out as *mut u8,
                size,
            )
        };
        Ok(())
    })
}
