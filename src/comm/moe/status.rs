//! What a dispatch or combine can find wrong once the ranks have met: the codes a rank
//! publishes in its counts row (and the kernels store into the object's host-mapped status
//! words), and the errors they become, naming the rank and the value (docs/moe.md, "Errors").
//! The host backend and the kernels use the same codes and the same order (the lowest rank
//! with a status wins; then capacity, lowest expert first), so every rank reports the same
//! error.
//!
//! Status words (host-mapped, `u32[16]`, written only by the kernels, read and cleared by the
//! host): `[1]` bad rank, `[2]` token (or expert), `[3]` k, `[4..6]` value (low, high), `[6]`
//! the call (0 dispatch, 1 combine), then `[0]` the code, written last.

use crate::error::{Error, Result};

/// Codes (0: none). Device-detectable: out of range, duplicate, capacity; host-detectable
/// refusals: too many tokens, bad k, other arguments; a refused combine.
pub const ST_OUT_OF_RANGE: u32 = 1;
pub const ST_DUPLICATE: u32 = 2;
pub const ST_CAPACITY: u32 = 3;
pub const ST_TOO_MANY_TOKENS: u32 = 4;
pub const ST_BAD_K: u32 = 5;
pub const ST_REFUSED: u32 = 6;
pub const ST_COMBINE_REFUSED: u32 = 7;

/// Status word indices.
pub const SW_CODE: usize = 0;
pub const SW_RANK: usize = 1;
pub const SW_TOKEN: usize = 2;
pub const SW_K: usize = 3;
pub const SW_VALUE: usize = 4;
pub const SW_CALL: usize = 6;

/// A refusal a rank found in its own arguments: the code and value it publishes, and its own
/// error (what the rank itself returns).
#[derive(Clone, Debug)]
pub struct Refusal {
    pub code: u32,
    pub value: i64,
    pub error: Error,
}

/// Whether `code` is a refusal (the refusing rank returned its own error already).
pub fn is_refusal(code: u32) -> bool {
    matches!(
        code,
        ST_TOO_MANY_TOKENS | ST_BAD_K | ST_REFUSED | ST_COMBINE_REFUSED
    )
}

/// The values a status names, decoded into an error.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Found {
    pub code: u32,
    pub rank: u32,
    pub token: u32,
    pub k: u32,
    pub value: i64,
}

/// A combine's end on a rank that did its part: the error naming `other`, the lowest rank that
/// refused its own combine, if one did (both host combines, host_combine.rs and tp_host.rs).
pub fn combine_refused_by(other: Option<usize>, b: &Bounds) -> Result<()> {
    match other {
        None => Ok(()),
        Some(s) => Err(Found {
            code: ST_COMBINE_REFUSED,
            rank: s as u32,
            ..Found::default()
        }
        .error(b)),
    }
}

/// What the configuration contributes to the messages.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub experts: u32,
    pub local: u64,
    pub tokens: u64,
    pub topk: u32,
    pub max_recv: u64,
}

impl Found {
    pub fn error(&self, b: &Bounds) -> Error {
        let (r, t, k, v) = (self.rank, self.token, self.k, self.value);
        Error::invalid(match self.code {
            ST_OUT_OF_RANGE => format!(
                "symm_moe_dispatch: rank {r}: topk_idx[{t}][{k}] = {v} is out of range; expected \
                 -1 or 0..{} (num_experts); nothing was dispatched",
                b.experts
            ),
            ST_DUPLICATE => format!(
                "symm_moe_dispatch: rank {r}: topk_idx[{t}][{k}] = {v} repeats an expert of an \
                 earlier slot of token {t}; expected distinct experts in a token's top-k; nothing \
                 was dispatched"
            ),
            ST_CAPACITY => format!(
                "symm_moe_dispatch: expert {t} (local expert {} of rank {r}) would receive {v} \
                 rows; expected at most max_recv_per_expert = {}: create the object with a larger \
                 max_recv_per_expert (0 = world x max_tokens_per_rank never overflows); nothing \
                 was dispatched",
                t as u64 % b.local.max(1),
                b.max_recv
            ),
            ST_TOO_MANY_TOKENS => format!(
                "symm_moe_dispatch: rank {r} passed num_tokens {v}; expected at most \
                 max_tokens_per_rank = {}; nothing was dispatched",
                b.tokens
            ),
            ST_BAD_K => format!(
                "symm_moe_dispatch: rank {r} passed k = {v}; expected 1..={} (the configured \
                 topk); nothing was dispatched",
                b.topk
            ),
            ST_REFUSED => format!(
                "symm_moe_dispatch: rank {r} refused the dispatch (its arguments were invalid; \
                 its own error names them); nothing was dispatched"
            ),
            ST_COMBINE_REFUSED => format!(
                "symm_moe_combine: rank {r} refused the combine (its arguments were invalid; its \
                 own error names them); y is zeros on this rank"
            ),
            c => format!("moe status code {c} is unknown (rank {r}); please report this bug"),
        })
    }
}

/// The row a rank publishes: `[status, token, k, value low, value high]` after its counts.
pub fn row_extra(f: &Found) -> [i32; 5] {
    [
        f.code as i32,
        f.token as i32,
        f.k as i32,
        f.value as i32,
        (f.value >> 32) as i32,
    ]
}

/// A row's status back from its extra words and its rank.
pub fn from_row(rank: u32, extra: &[i32]) -> Found {
    Found {
        code: extra[0] as u32,
        rank,
        token: extra[1] as u32,
        k: extra[2] as u32,
        value: (extra[3] as u32 as i64) | ((extra[4] as i64) << 32),
    }
}
