//! The shared part of the MoE dispatch/combine tests (tests/moe_host.rs on the host backend,
//! tests/gpu_moe.rs on CUDA; docs/moe.md is the contract). Here: where a test's buffers live
//! (`Dev`, `Buf`), an object with its layout (`Obj`), every rank's reproducible inputs
//! (`rank_inputs`: each rank regenerates every other rank's from the case's seed, the
//! all-gather reference) and the experts the tests apply. check.rs: one checked dispatch +
//! expert + combine (`run_case`) and what a rank learns of a failed call (`outcome`). cases.rs
//! and errors.rs: the scenarios both backends run; repeat.rs: repeated and retried combines of
//! one dispatch.

pub mod cases;
mod check;
pub mod edges;
pub mod errors;
pub mod quant;
pub mod repeat;
pub mod split;
pub mod tp;
pub mod tp_errors;
pub mod tp_quant;
pub mod tp_split;
pub use check::*;

use super::{err, init, Child, Comm, Rng, OK};
use std::ffi::c_void;
use std::ptr::null_mut;
use symmalloc::comm::convert::bf16_to_f32;
use symmalloc::cuda::util;
use symmalloc::ffi::moe::*;
use symmalloc::ffi::moe_calls::*;
use symmalloc::ffi::types::*;

pub const INVALID: symm_status_t = symm_status_t::SYMM_ERR_INVALID_ARGUMENT;
/// The byte every output is poisoned with before a call (bf16 0xFFFF is a NaN).
pub const POISON: u8 = 0xFF;

/// The clock probe's words of `moe` after `dev`'s work is done (`symm_moe_probe`, which must
/// succeed with the start word set); `what` names the call in the messages.
pub fn probe_read(
    moe: *mut symm_moe_t,
    dev: Dev,
    what: &str,
) -> [u64; SYMM_MOE_PROBE_WORDS as usize] {
    dev.sync();
    let mut out = [0u64; SYMM_MOE_PROBE_WORDS as usize];
    let st = symm_moe_probe(moe, out.as_mut_ptr(), out.len());
    assert_eq!(st, OK, "probe of {what}: {}", err());
    assert!(out[0] > 0, "{what}: {out:?}");
    out
}

/// Whether probe words `ws` of `out` are in order (each at most the next).
pub fn probe_in_order(out: &[u64], ws: &[usize]) -> bool {
    ws.windows(2).all(|p| out[p[0]] <= out[p[1]])
}

/// A child rank: its communicator, its buffers' home (`dev`: `Dev::host` or `Dev::cuda`) on its
/// device, world, rank and the parent's seed.
pub fn rank_setup(c: &Child, dev: fn(i32) -> Dev) -> (Comm, Dev, usize, usize, u64) {
    let comm = init(c);
    let seed = c.arg.parse().expect("the parent passes the seed");
    (comm, dev(c.device), c.world as usize, c.rank as usize, seed)
}

/// Every rank that lived (all but the last `dead`) printed its "rank R:" line: the child ran
/// the test, not nothing.
pub fn assert_ran(outs: &[std::process::Output], name: &str, dead: usize) {
    for (r, o) in outs.iter().enumerate().take(outs.len() - dead) {
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(&format!("rank {r}: ")),
            "{name}: rank {r} printed no result line"
        );
    }
}

/// Where a test's buffers live: host memory (host backend) or device memory and a stream (CUDA).
#[derive(Clone, Copy, Debug)]
pub struct Dev {
    pub gpu: bool,
    pub device: i32,
    pub stream: u64,
}

impl Dev {
    pub fn host(device: i32) -> Dev {
        Dev {
            gpu: false,
            device,
            stream: 0,
        }
    }
    pub fn cuda(device: i32) -> Dev {
        let stream = util::stream_create(device).unwrap();
        Dev {
            gpu: true,
            device,
            stream,
        }
    }
    pub fn s(&self) -> *mut CUstream_st {
        self.stream as _
    }
    pub fn sync(&self) {
        if self.gpu {
            util::stream_sync(self.device, self.stream).unwrap();
        }
    }
    /// Copies `b` to `p` (in stream order on CUDA, waited for).
    pub fn put(&self, p: u64, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        if self.gpu {
            util::htod_async(self.device, p, b, self.stream).unwrap();
            self.sync();
        } else {
            // SAFETY: p holds b.len() bytes of host memory (a Buf or a moe buffer).
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p as *mut u8, b.len()) };
        }
    }
    /// The `n` bytes at `p`, after the stream's work.
    pub fn get(&self, p: u64, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        if n == 0 {
            return v;
        }
        if self.gpu {
            self.sync();
            util::dtoh(self.device, &mut v, p).unwrap();
        } else {
            // SAFETY: as put.
            unsafe { std::ptr::copy_nonoverlapping(p as *const u8, v.as_mut_ptr(), n) };
        }
        v
    }
    pub fn fill(&self, p: u64, n: usize, v: u8) {
        self.put(p, &vec![v; n]);
    }
}

/// A buffer of the caller's (not in the heap): 256-byte aligned, freed on drop.
pub struct Buf {
    pub p: u64,
    pub bytes: usize,
    dev: Dev,
}

impl Buf {
    fn layout(bytes: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(bytes.max(256), 256).unwrap()
    }
    pub fn new(dev: Dev, bytes: usize) -> Buf {
        let p = if dev.gpu {
            util::raw_alloc(dev.device, bytes.max(256)).unwrap()
        } else {
            // SAFETY: a non-zero size.
            unsafe { std::alloc::alloc(Buf::layout(bytes)) as u64 }
        };
        assert!(p != 0, "no memory for {bytes} bytes");
        Buf { p, bytes, dev }
    }
    pub fn with(dev: Dev, data: &[u8]) -> Buf {
        let b = Buf::new(dev, data.len());
        dev.put(b.p, data);
        b
    }
    pub fn ptr(&self) -> *mut c_void {
        self.p as _
    }
    pub fn get(&self) -> Vec<u8> {
        self.dev.get(self.p, self.bytes)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.dev.gpu {
            self.dev.sync();
            util::raw_free(self.dev.device, self.p).unwrap();
        } else {
            // SAFETY: allocated in new() with this layout, freed once.
            unsafe { std::alloc::dealloc(self.p as *mut u8, Buf::layout(self.bytes)) };
        }
    }
}

/// A configuration: T, H, topk, E, FP8 payload, R (0: the default W * T).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub t: usize,
    pub h: usize,
    pub topk: u32,
    pub e: u32,
    pub fp8: bool,
    pub max_recv: u64,
    /// The kernels' grid cap (`num_sms`; 0: none).
    pub num_sms: u32,
}

impl Shape {
    pub fn new(t: usize, h: usize, topk: u32, e: u32, fp8: bool) -> Shape {
        Shape {
            t,
            h,
            topk,
            e,
            fp8,
            max_recv: 0,
            num_sms: 0,
        }
    }
    pub fn dtype(&self) -> u32 {
        if self.fp8 {
            SYMM_MOE_FP8_E4M3
        } else {
            SYMM_MOE_BF16
        }
    }
    /// Bytes of a payload row, fp32 scales per row.
    pub fn row(&self) -> usize {
        self.h * if self.fp8 { 1 } else { 2 }
    }
    pub fn sc(&self) -> usize {
        if self.fp8 {
            self.h / 128
        } else {
            0
        }
    }
    pub fn config(&self) -> symm_moe_config_t {
        symm_moe_config_t {
            version: SYMM_MOE_CONFIG_VERSION,
            size: std::mem::size_of::<symm_moe_config_t>() as u32,
            max_tokens_per_rank: self.t as u64,
            hidden: self.h as u64,
            topk: self.topk,
            num_experts: self.e,
            dtype: self.dtype(),
            flags: 0,
            max_recv_per_expert: self.max_recv,
            num_sms: self.num_sms,
            ..Default::default()
        }
    }
}

/// The smallest multiple of `world` that is at least `at_least` (E must be a multiple of W).
pub fn experts(world: usize, at_least: usize) -> u32 {
    (at_least.div_ceil(world) * world) as u32
}

/// `symm_moe_layout` into a fresh struct: the status and what it wrote.
pub fn layout_of(
    moe: *const symm_moe_t,
    version: u32,
    size: u32,
) -> (symm_status_t, symm_moe_layout_t) {
    // SAFETY: an all-zero symm_moe_layout_t is valid (integers and NULL pointers).
    let mut l: symm_moe_layout_t = unsafe { std::mem::zeroed() };
    l.version = version;
    l.size = size;
    let st = symm_moe_layout(moe, &mut l);
    (st, l)
}

pub fn layout_size() -> u32 {
    std::mem::size_of::<symm_moe_layout_t>() as u32
}

/// A moe object, its layout and where its caller's buffers live; destroyed on drop.
pub struct Obj {
    pub moe: *mut symm_moe_t,
    pub s: Shape,
    pub w: usize,
    pub rank: usize,
    pub l: usize,
    pub r: usize,
    pub lay: symm_moe_layout_t,
    pub dev: Dev,
}

/// Creates an object (`symm_moe_create`, or `symm_moe_create_config` when R is given) and
/// checks its layout's fields.
pub fn create(comm: Comm, s: Shape, dev: Dev) -> Obj {
    let mut moe = null_mut();
    let st = if s.max_recv == 0 && s.num_sms == 0 {
        let (t, h) = (s.t, s.h);
        symm_moe_create(comm, t, h, s.topk, s.e, s.dtype(), 0, &mut moe)
    } else {
        symm_moe_create_config(comm, &s.config(), &mut moe)
    };
    assert_eq!(st, OK, "symm_moe_create {s:?}: {}", err());
    assert!(!moe.is_null());
    let (st, lay) = layout_of(moe, SYMM_MOE_LAYOUT_VERSION, layout_size());
    assert_eq!(st, OK, "symm_moe_layout: {}", err());
    let w = lay.world as usize;
    let l = s.e as usize / w;
    let r = if s.max_recv == 0 {
        w * s.t
    } else {
        s.max_recv as usize
    };
    let want = (
        l as u64,
        lay.rank as u64 * l as u64,
        r as u64,
        s.h as u64,
        s.t as u64,
    );
    let got = (
        lay.local_experts,
        lay.first_expert,
        lay.max_recv,
        lay.hidden,
        lay.max_tokens_per_rank,
    );
    assert_eq!(got, want, "layout of {s:?}");
    assert_eq!(
        (lay.topk, lay.num_experts, lay.dtype, lay.reserved),
        (s.topk, s.e, s.dtype(), 0)
    );
    assert_eq!(
        (lay.version, lay.size),
        (SYMM_MOE_LAYOUT_VERSION, layout_size())
    );
    let payload = (l * r * s.row()) as u64;
    assert!(lay.buffer_bytes >= payload + (l * r * 4) as u64, "{lay:?}");
    for p in [
        lay.recv_x as u64,
        lay.recv_counts as u64,
        lay.recv_src as u64,
    ] {
        assert!(p != 0 && p % 16 == 0, "{lay:?}");
    }
    assert_eq!(lay.recv_scales.is_null(), !s.fp8, "{lay:?}");
    Obj {
        moe,
        s,
        w,
        rank: lay.rank as usize,
        l,
        r,
        lay,
        dev,
    }
}

impl Drop for Obj {
    fn drop(&mut self) {
        self.dev.sync();
        let st = symm_moe_destroy(self.moe);
        if !std::thread::panicking() {
            assert_eq!(st, OK, "symm_moe_destroy: {}", err());
        }
    }
}

/// How a case routes its tokens.
#[derive(Clone, Copy, Debug)]
pub enum Route {
    /// k distinct experts out of all E.
    Random,
    /// As Random, with about a quarter of the slots -1 (some tokens go nowhere).
    Holes,
    /// Experts e % 4 == 1 and the last rank's experts get nothing (slots past the others -1).
    Sparse,
    /// Slot t % k of every token is this expert (with n = T it gets W * T rows: R is full).
    Hot(u32),
    /// Slot j of token t of rank r is f(world, r, t, j).
    Table(fn(usize, usize, usize, usize) -> i64),
}

/// One dispatch + combine's inputs on every rank.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub seed: u64,
    /// Tokens per rank (ragged: rank r passes n * r / (W - 1), so rank 0 passes none).
    pub n: usize,
    pub ragged: bool,
    pub k: u32,
    pub idx64: bool,
    pub route: Route,
    /// Every rank generates the same inputs (its y is then the same bit for bit).
    pub same: bool,
}

impl Case {
    pub fn new(seed: u64, n: usize, k: u32, route: Route) -> Case {
        Case {
            seed,
            n,
            ragged: false,
            k,
            idx64: false,
            route,
            same: false,
        }
    }
    pub fn i64(mut self) -> Case {
        self.idx64 = true;
        self
    }
    pub fn ragged(mut self) -> Case {
        self.ragged = true;
        self
    }
    pub fn tokens(&self, rank: usize, world: usize) -> usize {
        if self.ragged {
            self.n * rank / (world - 1).max(1)
        } else {
            self.n
        }
    }
}

/// A rank's inputs: payload rows (bf16 bits or opaque FP8 bytes), scales, routing, weights.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub n: usize,
    pub k: usize,
    pub x: Vec<u8>,
    pub scales: Vec<f32>,
    pub idx: Vec<i64>,
    pub w: Vec<f32>,
}

impl Inputs {
    pub fn idx_bytes(&self, idx64: bool) -> Vec<u8> {
        if idx64 {
            self.idx.iter().flat_map(|v| v.to_le_bytes()).collect()
        } else {
            self.idx
                .iter()
                .flat_map(|&v| (v as i32).to_le_bytes())
                .collect()
        }
    }
}

/// bf16 of `v`, rounded to nearest even (finite `v`): written here, not the crate's.
pub fn bf16(v: f32) -> u16 {
    let b = v.to_bits();
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// An FP8 e4m3 byte's value (0x7F and 0xFF, the NaNs, are never generated).
pub fn e4m3(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (ex, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    if ex == 0 {
        s * m / 8.0 * 2f32.powi(-6)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(ex - 7)
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// k distinct picks out of `cands` (-1 past them).
fn pick(g: &mut Rng, mut cands: Vec<i64>, k: usize) -> Vec<i64> {
    (0..k)
        .map(|j| {
            if j >= cands.len() {
                return -1;
            }
            let i = j + g.below((cands.len() - j) as u64) as usize;
            cands.swap(j, i);
            cands[j]
        })
        .collect()
}

/// Rank `rank`'s inputs for a case: the same on every rank that asks.
pub fn rank_inputs(s: &Shape, c: &Case, world: usize, rank: usize) -> Inputs {
    let (n, k, e) = (c.tokens(rank, world), c.k as usize, s.e as i64);
    let data_rank = if c.same { 0 } else { rank as u64 + 1 };
    let mut g = Rng::new(c.seed ^ (data_rank << 40) ^ 0x3c6e_f372);
    let mut x = Vec::with_capacity(n * s.row());
    for _ in 0..n * s.h {
        if s.fp8 {
            // Opaque bytes, neither 0 nor a NaN.
            let b = 1 + g.below(0x7E) as u8;
            x.push(b | if g.below(2) == 1 { 0x80 } else { 0 });
        } else {
            let mut v = g.unit() * 4.0;
            if v.abs() < 0.0625 {
                v += 0.5f32.copysign(v);
            }
            x.extend_from_slice(&bf16(v).to_le_bytes());
        }
    }
    let scales = (0..n * s.sc())
        .map(|_| 0.25 + g.unit().abs() * 2.0)
        .collect();
    let l = e / world as i64;
    let mut idx = Vec::with_capacity(n * k);
    for t in 0..n {
        let all: Vec<i64> = (0..e).collect();
        let row = match c.route {
            Route::Random => pick(&mut g, all, k),
            Route::Holes => pick(&mut g, all, k)
                .into_iter()
                .map(|v| if g.below(4) == 0 { -1 } else { v })
                .collect(),
            Route::Sparse => {
                let cands = all
                    .into_iter()
                    .filter(|&v| v % 4 != 1 && v / l != world as i64 - 1)
                    .collect();
                pick(&mut g, cands, k)
            }
            Route::Hot(hot) => {
                let others = all.into_iter().filter(|&v| v != hot as i64).collect();
                let mut r = pick(&mut g, others, k);
                r[t % k] = hot as i64;
                r
            }
            Route::Table(f) => (0..k).map(|j| f(world, rank, t, j)).collect(),
        };
        idx.extend(row);
    }
    let w = (0..n * k)
        .map(|_| {
            let v = g.unit();
            (0.125 + v.abs()).copysign(v)
        })
        .collect();
    Inputs {
        n,
        k,
        x,
        scales,
        idx,
        w,
    }
}

/// The functions tests apply as experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expert {
    /// bf16(x * (1 + e / 16)) (FP8: x is the e4m3 value times its scale), computed on the host.
    Scale,
    /// Even elements as they came, odd ones times 2^(1 + (e + shift) % 3) (bf16 payloads): what
    /// doubling each element pair read as one fp32 does (tests/gpu_moe.rs runs it on the
    /// device). Three shifts give three different experts.
    Pairs(u32),
}

/// Expert `e`'s output row (bf16 bits) for a payload row and its scales.
pub fn expert_row(kind: Expert, s: &Shape, e: usize, row: &[u8], scales: &[f32]) -> Vec<u16> {
    let x = |i: usize| {
        if s.fp8 {
            e4m3(row[i]) * scales[i / 128]
        } else {
            bf16_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]]))
        }
    };
    match kind {
        Expert::Scale => (0..s.h)
            .map(|i| bf16(x(i) * (1.0 + e as f32 / 16.0)))
            .collect(),
        Expert::Pairs(shift) => {
            assert!(!s.fp8, "the pair expert is for bf16 payloads");
            let f = (1u32 << (1 + (e + shift as usize) % 3)) as f32;
            (0..s.h)
                .map(|i| bf16(if i % 2 == 1 { x(i) * f } else { x(i) }))
                .collect()
        }
    }
}
