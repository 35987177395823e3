//! A moe object's configuration (docs/moe.md, "Terms"): the checks every value must pass, with
//! messages naming the value and what was expected, and the words every rank compares at
//! create (a mismatch is SYMM_ERR_NOT_SYMMETRIC on every rank, naming the ranks and values).
//!
//! Invariants: a `Config` that `check` returned has a known mode (throughput: `R = W * T`), `E % W == 0`, `1 <= K <= MAX_TOPK`,
//! `E <= MAX_EXPERTS`, `H * elem_bytes % 16 == 0` (FP8: `H % 128 == 0`), `1 <= R <= W * T`, and
//! `W * T * K` below 2^31 (a `recv_src` code fits an int32), and every part of the layout
//! fits in a u64 with room to spare.

use crate::error::{Error, Result};

/// The most experts (the kernels keep per-expert histograms in shared memory).
pub const MAX_EXPERTS: u32 = 1024;
/// The largest configured top-k.
pub const MAX_TOPK: u32 = 16;
/// Payload dtype codes (`SYMM_MOE_BF16`, `SYMM_MOE_FP8_E4M3`).
pub const PAYLOAD_BF16: u32 = 0;
pub const PAYLOAD_FP8_E4M3: u32 = 1;
/// Index dtype codes (`SYMM_INDEX_INT32`, `SYMM_INDEX_INT64`).
pub const INDEX_INT32: u32 = 0;
pub const INDEX_INT64: u32 = 1;
/// Elements per FP8 scale.
pub const SCALE_GROUP: u64 = 128;
/// Modes (`SYMM_MOE_LOW_LATENCY`, `SYMM_MOE_THROUGHPUT`; docs/moe.md, "Throughput mode").
pub const MODE_LOW_LATENCY: u32 = 0;
pub const MODE_THROUGHPUT: u32 = 1;

/// How a moe object lays out what it receives: expert-major with device-side counts (low
/// latency), or one row per (token, destination rank) in one contiguous buffer (throughput).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    LowLatency,
    Throughput,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::LowLatency => "low latency",
            Mode::Throughput => "throughput",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    Bf16,
    Fp8,
}

impl Payload {
    pub fn from_code(code: u32) -> Result<Payload> {
        match code {
            PAYLOAD_BF16 => Ok(Payload::Bf16),
            PAYLOAD_FP8_E4M3 => Ok(Payload::Fp8),
            _ => Err(Error::invalid(format!(
                "dtype {code} is not a payload type; expected SYMM_MOE_BF16 (0) or \
                 SYMM_MOE_FP8_E4M3 (1)"
            ))),
        }
    }
    pub fn code(self) -> u32 {
        match self {
            Payload::Bf16 => PAYLOAD_BF16,
            Payload::Fp8 => PAYLOAD_FP8_E4M3,
        }
    }
    pub fn bytes(self) -> u64 {
        match self {
            Payload::Bf16 => 2,
            Payload::Fp8 => 1,
        }
    }
    pub fn has_scales(self) -> bool {
        self == Payload::Fp8
    }
    pub fn name(self) -> &'static str {
        match self {
            Payload::Bf16 => "bf16",
            Payload::Fp8 => "fp8",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexType {
    I32,
    I64,
}

impl IndexType {
    pub fn from_code(what: &str, code: u32) -> Result<IndexType> {
        match code {
            INDEX_INT32 => Ok(IndexType::I32),
            INDEX_INT64 => Ok(IndexType::I64),
            _ => Err(Error::invalid(format!(
                "{what}: idx_dtype {code} is not an index type; expected SYMM_INDEX_INT32 (0) or \
                 SYMM_INDEX_INT64 (1)"
            ))),
        }
    }
    pub fn bytes(self) -> u64 {
        match self {
            IndexType::I32 => 4,
            IndexType::I64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            IndexType::I32 => "i32",
            IndexType::I64 => "i64",
        }
    }
}

/// What a caller asked for, before the checks (the C struct's fields).
#[derive(Clone, Copy, Debug, Default)]
pub struct Request {
    pub tokens: u64,
    pub hidden: u64,
    pub topk: u32,
    pub experts: u32,
    pub dtype: u32,
    pub flags: u32,
    /// 0: W * tokens.
    pub max_recv: u64,
    /// The most SMs (blocks) of the kernels' grid; 0: no cap but the GPUs' (moe/mod.rs).
    pub num_sms: u32,
    /// MODE_LOW_LATENCY or MODE_THROUGHPUT.
    pub mode: u32,
}

/// A checked configuration (the module's invariants hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// T = max_tokens_per_rank.
    pub tokens: u64,
    pub hidden: u64,
    pub topk: u32,
    pub experts: u32,
    pub dtype: Payload,
    /// R rows per local expert.
    pub max_recv: u64,
    /// The grid's cap in SMs (0: none but the GPUs').
    pub num_sms: u32,
    pub mode: Mode,
}

fn bad(msg: String) -> Error {
    Error::invalid(format!("symm_moe_create: {msg}"))
}

impl Request {
    /// What a rank that could not read its request sends at create (every word all ones; the
    /// other ranks then report its refusal, not a mismatch).
    pub const UNREADABLE: Request = Request {
        tokens: u64::MAX,
        hidden: u64::MAX,
        topk: u32::MAX,
        experts: u32::MAX,
        dtype: u32::MAX,
        flags: u32::MAX,
        max_recv: u64::MAX,
        num_sms: u32::MAX,
        mode: u32::MAX,
    };

    /// The words every rank compares at create (as the caller passed them).
    pub fn words(&self) -> [u64; 9] {
        [
            self.tokens,
            self.hidden,
            self.topk as u64,
            self.experts as u64,
            self.dtype as u64,
            self.flags as u64,
            self.max_recv,
            self.num_sms as u64,
            self.mode as u64,
        ]
    }

    /// The words of `words()`, named for a mismatch message.
    pub fn describe(w: &[u64]) -> String {
        format!(
            "max_tokens_per_rank {}, hidden {}, topk {}, num_experts {}, dtype {}, flags {}, \
             max_recv_per_expert {}, num_sms {}, mode {}",
            w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
        )
    }

    /// Checks every value for a communicator of `world` ranks.
    pub fn check(&self, world: u64) -> Result<Config> {
        let dtype = Payload::from_code(self.dtype).map_err(|e| bad(e.message))?;
        let mode = match self.mode {
            MODE_LOW_LATENCY => Mode::LowLatency,
            MODE_THROUGHPUT => Mode::Throughput,
            m => {
                return Err(bad(format!(
                    "mode {m} is not a mode; expected SYMM_MOE_LOW_LATENCY (0) or \
                     SYMM_MOE_THROUGHPUT (1)"
                )))
            }
        };
        if self.flags != 0 {
            return Err(bad(format!(
                "flags {:#x} are not supported; expected 0 (reserved)",
                self.flags
            )));
        }
        if self.tokens == 0 || self.tokens > 1 << 20 {
            return Err(bad(format!(
                "max_tokens_per_rank {} is out of range; expected 1..={}",
                self.tokens,
                1u64 << 20
            )));
        }
        if !(1..=MAX_TOPK).contains(&self.topk) {
            return Err(bad(format!(
                "topk {} is out of range; expected 1..={MAX_TOPK}",
                self.topk
            )));
        }
        let e = self.experts as u64;
        if e == 0 || e % world != 0 || self.experts > MAX_EXPERTS {
            return Err(bad(format!(
                "num_experts {} must be a positive multiple of the communicator's {world} ranks, \
                 at most {MAX_EXPERTS}",
                self.experts
            )));
        }
        if self.hidden == 0 || self.hidden > 1 << 20 || (self.hidden * dtype.bytes()) % 16 != 0 {
            return Err(bad(format!(
                "hidden {} does not fit {} rows of 16-byte vectors; expected a multiple of {} up \
                 to {}",
                self.hidden,
                dtype.name(),
                16 / dtype.bytes(),
                1u64 << 20
            )));
        }
        if dtype.has_scales() && self.hidden % SCALE_GROUP != 0 {
            return Err(bad(format!(
                "hidden {} is not a multiple of {SCALE_GROUP}; FP8 payloads carry one scale per \
                 {SCALE_GROUP} elements",
                self.hidden
            )));
        }
        let most = world * self.tokens;
        if most * self.topk as u64 >= 1 << 31 {
            return Err(bad(format!(
                "world {world} x max_tokens_per_rank {} x topk {} is {}; expected below 2^31 (a \
                 recv_src code is an int32)",
                self.tokens,
                self.topk,
                most * self.topk as u64
            )));
        }
        let max_recv = match self.max_recv {
            0 => most,
            // Throughput mode receives at most W*T rows in all (one per token and rank).
            r if mode == Mode::Throughput => {
                return Err(bad(format!(
                    "max_recv_per_expert {r} is for the low-latency mode; expected 0 in \
                     throughput mode (its buffer holds world x max_tokens_per_rank = {most} rows, \
                     which no routing overflows)"
                )))
            }
            r if r <= most => r,
            r => {
                return Err(bad(format!(
                    "max_recv_per_expert {r} is above world x max_tokens_per_rank = {most}; \
                     expected 0 (that default) or 1..={most}"
                )))
            }
        };
        let c = Config {
            tokens: self.tokens,
            hidden: self.hidden,
            topk: self.topk,
            experts: self.experts,
            dtype,
            max_recv,
            num_sms: self.num_sms,
            mode,
        };
        // The two big parts, checked (the rest are smaller).
        let l = e / world;
        let recv = l
            .checked_mul(max_recv)
            .and_then(|x| x.checked_mul(self.hidden))
            .and_then(|x| x.checked_mul(dtype.bytes()))
            .filter(|&x| x < 1 << 56);
        let cbuf = self
            .tokens
            .checked_mul(2 * self.topk as u64 * self.hidden * 2)
            .filter(|&x| x < 1 << 56);
        if recv.is_none() || cbuf.is_none() {
            return Err(bad(format!(
                "the buffers of {l} local experts x {max_recv} rows x hidden {} overflow; \
                 expected a smaller max_recv_per_expert or hidden",
                self.hidden
            )));
        }
        Ok(c)
    }
}

impl Config {
    pub fn local_experts(&self, world: u64) -> u64 {
        self.experts as u64 / world
    }
    pub fn scales_per_row(&self) -> u64 {
        if self.dtype.has_scales() {
            self.hidden / SCALE_GROUP
        } else {
            0
        }
    }
    pub fn row_bytes(&self) -> u64 {
        self.hidden * self.dtype.bytes()
    }
}
