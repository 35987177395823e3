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
/// `flags` bit: record the clock probe (launch.rs picks the kernels' probe instances; the host
/// backend records wall-clock times), read by `symm_moe_probe`.
pub const FLAG_PROBE: u32 = 1;
/// Elements per FP8 scale.
pub const SCALE_GROUP: u64 = 128;
/// Input codes (`SYMM_MOE_INPUT_PAYLOAD`, `SYMM_MOE_INPUT_BF16`): what a dispatch's `x` holds.
pub const INPUT_PAYLOAD: u32 = 0;
pub const INPUT_BF16: u32 = 1;
/// Scale layout codes (`SYMM_MOE_SCALES_ROW_MAJOR`, `SYMM_MOE_SCALES_COL_TMA`).
pub const SCALES_ROW_MAJOR: u32 = 0;
pub const SCALES_COL_TMA: u32 = 1;
/// fp32 scales per 16 bytes: a column-major scale column's rows are padded to a multiple of
/// this (DeepGEMM's `get_tma_aligned_size(R, 4)`: TMA wants 16-byte aligned strides).
pub const TMA_ALIGN_ELEMS: u64 = 4;

/// Where `recv_scales` puts the scale of (local expert, row, group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// `[L][R][H/128]`: `(le * R + row) * S + g`.
    RowMajor,
    /// Per local expert a column-major `[H/128][R4]`, `R4 = R` rounded up to a multiple of 4
    /// (DeepGEMM's MN-major TMA-aligned scales): `le * S * R4 + g * R4 + row`.
    ColTma,
}

impl ScaleLayout {
    pub fn code(self) -> u32 {
        match self {
            ScaleLayout::RowMajor => SCALES_ROW_MAJOR,
            ScaleLayout::ColTma => SCALES_COL_TMA,
        }
    }
}

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
    /// `INPUT_*`: x is the payload (0), or bf16 quantized to the FP8 payload in the dispatch.
    pub input: u32,
    /// `SCALES_*`: the layout of `recv_scales`.
    pub scale_layout: u32,
    /// Nonzero: quantization rounds each scale up to a power of two (UE8M0).
    pub ue8m0: u32,
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
    /// x is bf16, quantized to the FP8 payload inside the dispatch (per 128 elements).
    pub quantize: bool,
    /// The layout of `recv_scales` (FP8; `RowMajor` for bf16).
    pub scales: ScaleLayout,
    /// Quantization rounds each scale up to a power of two (only with `quantize`).
    pub ue8m0: bool,
    /// `FLAG_PROBE` was set: the calls record their phase times.
    pub probe: bool,
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
        input: u32::MAX,
        scale_layout: u32::MAX,
        ue8m0: u32::MAX,
        mode: u32::MAX,
    };

    /// How many words `words()` gives.
    pub const WORDS: usize = 12;

    /// The words every rank compares at create (as the caller passed them).
    pub fn words(&self) -> [u64; Request::WORDS] {
        [
            self.tokens,
            self.hidden,
            self.topk as u64,
            self.experts as u64,
            self.dtype as u64,
            self.flags as u64,
            self.max_recv,
            self.num_sms as u64,
            self.input as u64,
            self.scale_layout as u64,
            self.ue8m0 as u64,
            self.mode as u64,
        ]
    }

    /// The words of `words()`, named for a mismatch message.
    pub fn describe(w: &[u64]) -> String {
        format!(
            "max_tokens_per_rank {}, hidden {}, topk {}, num_experts {}, dtype {}, flags {}, \
             max_recv_per_expert {}, num_sms {}, input {}, scale_layout {}, scale_ue8m0 {}, mode {}",
            w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11]
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
        if self.flags & !FLAG_PROBE != 0 {
            return Err(bad(format!(
                "flags {:#x} are not supported; expected 0 or SYMM_MOE_FLAG_PROBE ({FLAG_PROBE:#x})",
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
        let (quantize, scales, ue8m0) = self.quantization(dtype)?;
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
            quantize,
            scales,
            ue8m0,
            probe: self.flags & FLAG_PROBE != 0,
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

impl Request {
    /// The input, scale layout and UE8M0 fields (version 3 of the config struct; 0 before).
    fn quantization(&self, dtype: Payload) -> Result<(bool, ScaleLayout, bool)> {
        let quantize = match self.input {
            INPUT_PAYLOAD => false,
            INPUT_BF16 if dtype == Payload::Fp8 => true,
            INPUT_BF16 => {
                return Err(bad(format!(
                    "input {INPUT_BF16} (SYMM_MOE_INPUT_BF16: quantize bf16 x in the dispatch) \
                     with dtype {} (bf16); expected dtype SYMM_MOE_FP8_E4M3 (1), or input \
                     SYMM_MOE_INPUT_PAYLOAD (0)",
                    dtype.code()
                )))
            }
            v => {
                return Err(bad(format!(
                    "input {v} is not an input kind; expected SYMM_MOE_INPUT_PAYLOAD (0: x is \
                     the payload dtype) or SYMM_MOE_INPUT_BF16 (1: bf16 x quantized to FP8 in \
                     the dispatch)"
                )))
            }
        };
        let scales = match self.scale_layout {
            SCALES_ROW_MAJOR => ScaleLayout::RowMajor,
            SCALES_COL_TMA if dtype.has_scales() => ScaleLayout::ColTma,
            SCALES_COL_TMA => {
                return Err(bad(format!(
                    "scale_layout {SCALES_COL_TMA} (SYMM_MOE_SCALES_COL_TMA) with dtype {} \
                     (bf16, no scales); expected SYMM_MOE_SCALES_ROW_MAJOR (0) for bf16",
                    dtype.code()
                )))
            }
            v => {
                return Err(bad(format!(
                    "scale_layout {v} is not a scale layout; expected \
                     SYMM_MOE_SCALES_ROW_MAJOR (0) or SYMM_MOE_SCALES_COL_TMA (1)"
                )))
            }
        };
        let ue8m0 = match self.ue8m0 {
            0 => false,
            1 if quantize => true,
            1 => {
                return Err(bad(
                    "scale_ue8m0 1 without quantization; expected 0, or input \
                     SYMM_MOE_INPUT_BF16 (1) with dtype SYMM_MOE_FP8_E4M3 (the dispatch then \
                     computes the scales)"
                        .to_string(),
                ))
            }
            v => return Err(bad(format!("scale_ue8m0 {v}; expected 0 or 1"))),
        };
        Ok((quantize, scales, ue8m0))
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
    /// Bytes of a row of the caller's `x` (bf16 when the dispatch quantizes).
    pub fn input_row_bytes(&self) -> u64 {
        if self.quantize {
            self.hidden * 2
        } else {
            self.row_bytes()
        }
    }
    /// `R4`: R rounded up to a multiple of 4 (a column-major scale column, 16-byte aligned).
    pub fn tma_rows(&self) -> u64 {
        self.max_recv.next_multiple_of(TMA_ALIGN_ELEMS)
    }
    /// The strides of `recv_scales` in elements (fp32), per local expert, row and group: the
    /// scale of (le, row, g) is at `le * s0 + row * s1 + g * s2`. Zeros for bf16.
    pub fn scale_strides(&self) -> [u64; 3] {
        let s = self.scales_per_row();
        match (s, self.scales) {
            (0, _) => [0; 3],
            (_, ScaleLayout::RowMajor) => [self.max_recv * s, s, 1],
            (_, ScaleLayout::ColTma) => [s * self.tma_rows(), 1, self.tma_rows()],
        }
    }
    /// fp32 elements of `recv_scales` per rank (all local experts).
    pub fn scale_elems(&self, world: u64) -> u64 {
        self.scale_strides()[0] * self.local_experts(world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(dtype: u32, input: u32, scale_layout: u32, ue8m0: u32) -> Request {
        Request {
            tokens: 13,
            hidden: 384,
            topk: 2,
            experts: 4,
            dtype,
            max_recv: 0,
            input,
            scale_layout,
            ue8m0,
            ..Request::default()
        }
    }

    /// recv_scales' strides: row-major `[L][R][S]`, or per expert `[S][R4]` with R4 = R
    /// rounded up to 4 (DeepGEMM's `get_tma_aligned_size(R, 4)`).
    #[test]
    fn scale_strides_of_both_layouts() {
        let row = req(PAYLOAD_FP8_E4M3, INPUT_BF16, SCALES_ROW_MAJOR, 1)
            .check(1)
            .unwrap();
        assert!(row.quantize && row.ue8m0 && row.max_recv == 13);
        assert_eq!(row.scale_strides(), [13 * 3, 3, 1]);
        assert_eq!(row.scale_elems(2), 2 * 13 * 3);
        let col = req(PAYLOAD_FP8_E4M3, INPUT_PAYLOAD, SCALES_COL_TMA, 0)
            .check(1)
            .unwrap();
        assert_eq!((col.tma_rows(), col.scale_strides()), (16, [3 * 16, 1, 16]));
        assert_eq!(col.scale_elems(1), 4 * 3 * 16);
        let bf = req(PAYLOAD_BF16, INPUT_PAYLOAD, SCALES_ROW_MAJOR, 0)
            .check(1)
            .unwrap();
        assert_eq!((bf.scale_strides(), bf.input_row_bytes()), ([0; 3], 768));
        assert_eq!(row.input_row_bytes(), 768);
    }

    #[test]
    fn bad_quantization_fields_name_the_value() {
        for (r, needle) in [
            (req(1, 2, 0, 0), "input 2 is not an input kind"),
            (req(0, 1, 0, 0), "with dtype 0 (bf16)"),
            (req(1, 0, 5, 0), "scale_layout 5 is not a scale layout"),
            (req(0, 0, 1, 0), "SYMM_MOE_SCALES_COL_TMA) with dtype 0"),
            (req(1, 0, 0, 1), "scale_ue8m0 1 without quantization"),
            (req(1, 1, 0, 3), "scale_ue8m0 3; expected 0 or 1"),
        ] {
            let e = r.check(1).unwrap_err();
            assert!(e.message.contains(needle), "{}", e.message);
        }
    }
}
