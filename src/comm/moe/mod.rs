//! Expert parallelism: MoE dispatch and combine over a communicator (docs/moe.md is the
//! contract: C ABI, buffer layout, protocol, errors). This folder owns the moe object (`Moe`):
//! its configuration (config.rs), its buffer in the communicator's arena and the layout of it
//! (layout.rs), the codes and messages of what a call can find wrong (status.rs), the CPU
//! protocol of the host backend (host.rs, host_combine.rs; their loads, stores and waits:
//! host_mem.rs) and the kernels' launch and argument struct
//! (launch.rs, kernels/moe.cu); the throughput mode's plans (throughput.rs; its layout is
//! layout.rs's too) and its CPU protocol (tp_host.rs).
//!
//! The object does not live in the communicator: the C handle keeps both, and every call
//! passes the communicator in (its mesh, arena, peer windows, settings and error words are
//! what this folder reads). Creating one is collective: the ranks compare configurations
//! (NOT_SYMMETRIC on every rank otherwise), agree on the grid (`num_sms` caps it), allocate the block (the same
//! offset on every rank), zero its control parts and share it (a rendezvous), so dispatch and
//! combine map nothing and are capturable.
//!
//! The split API (`*_send` / `*_recv`, docs/moe.md "Split halves") runs each call as two
//! launches, paired by the object's state machine (split.rs, which also reads the clock probe).
//!
//! Invariants: every rank runs every step of every call (a rank whose own arguments are bad
//! publishes a refusal instead of counts), so nothing waits for a rank that gave up; errors
//! found after the ranks met are the same on every rank (status.rs) and leave the object and
//! the communicator usable; the layout and the grid are equal on every rank.

pub mod config;
pub mod host;
pub mod host_combine;
pub mod host_mem;
pub mod launch;
pub mod layout;
pub mod split;
pub mod status;
pub mod throughput;
pub mod tp_host;

use crate::comm::collective::kernel_args::MAX_RANKS;
use crate::comm::collective::Ctx;
use crate::comm::Communicator;
use crate::cuda;
use crate::error::{Error, Result, Status};
use config::{Config, IndexType, Payload, Request};
use launch::Phase;
use layout::Layout;
use split::Pending;
use status::{Bounds, Refusal};

/// The most blocks of a dispatch or combine grid. The grid is the communicator's fewest SMs,
/// capped by this and by the config's `num_sms` (its SM budget; without one, by the blocks the
/// work can use: `Request::work_grid`), agreed at create (the least over the ranks): one block per SM, all resident at once (the blocks wait for each other's
/// counting-in, kernels/moe.cu).
pub const MAX_GRID: u32 = 132;
/// Threads per block of the kernels (kernels/moe.cu `MOE_THREADS`).
pub const THREADS: u32 = 512;
/// The fewest blocks a grid sized by the work gets (`num_sms` 0; at most the GPUs' SMs).
pub const MIN_WORK_GRID: u32 = 4;

impl Request {
    /// The blocks the work of one call can keep busy (`Config`'s fields, equal on every rank, so
    /// the grid is too): a dispatch copies a row per warp and receives at most W*T*K rows; a
    /// combine pushes a row per warp and sums T*H/8 16-byte vectors, one per thread. More blocks
    /// than that only add block-counting and flag traffic (a 1-token call on 132 blocks).
    /// Unreadable requests (all ones) give `MAX_GRID`.
    fn work_grid(&self, world: u64) -> u32 {
        let warps = (THREADS / 32) as u64;
        let rows = world
            .saturating_mul(self.tokens)
            .saturating_mul(self.topk as u64);
        let vecs = self.tokens.saturating_mul(self.hidden) / 8;
        let blocks = rows
            .div_ceil(warps)
            .max(vecs.div_ceil(THREADS as u64))
            .max(MIN_WORK_GRID as u64);
        blocks.min(MAX_GRID as u64) as u32
    }
}

/// The last dispatch, as the next combine needs it.
#[derive(Clone, Copy, Debug)]
pub struct Last {
    pub tokens: u64,
    pub k: u32,
    /// It completed without error (host backend only; the kernels keep their own word).
    pub ok: bool,
}

/// A moe object: its configuration, its block of the communicator's arena and every rank's
/// copy of it in this address space, the grid, the status words and the host backend's epochs.
pub struct Moe {
    pub cfg: Config,
    pub layout: Layout,
    pub world: usize,
    pub rank: usize,
    pub device: i32,
    /// This rank's block.
    pub block: u64,
    /// Every rank's block in this address space (entries past the world are 0).
    pub blocks: [u64; MAX_RANKS],
    /// The kernels' grid, equal on every rank.
    pub grid: u32,
    /// Host-mapped status words the kernels store into (where kernels run: CUDA).
    status: Option<cuda::mem::MappedWord>,
    /// Its communicator's kind of executor (destroy waits on it; the object outlives it).
    exec: Box<dyn crate::comm::exec::Executor>,
    /// The host backend's call counters (the kernels count in the block's ctrl part).
    d_epoch: u64,
    c_epoch: u64,
    last: Option<Last>,
    /// The send half whose receive half has not been called yet (split API).
    pending: Option<Pending>,
    /// Throughput mode (config `mode`): its layout (`layout` then holds only the block's size
    /// and zeroed part), and the first combine epoch of the last dispatch (tp_host.rs).
    pub tp: Option<layout::TpLayout>,
    tp_first_combine: u64,
}

/// A dispatch's arguments as the caller passed them.
#[derive(Clone, Copy, Debug)]
pub struct Dispatch {
    pub x: u64,
    pub x_scales: u64,
    pub idx: u64,
    pub idx_dtype: u32,
    pub weights: u64,
    pub tokens: u64,
    pub k: u32,
    pub stream: u64,
}

/// A combine's arguments.
#[derive(Clone, Copy, Debug)]
pub struct Combine {
    pub expert_out: u64,
    pub y: u64,
    pub stream: u64,
}

/// A dispatch's plan in the object's mode (`phase`: the whole call or one half).
fn plan_dispatch(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Dispatch,
    it: IndexType,
    refusal: Option<&Refusal>,
    phase: Phase,
) -> Result<()> {
    match m.tp {
        Some(_) => throughput::dispatch(c, m, a, it, refusal, phase),
        None => launch::dispatch(c, m, a, it, refusal, phase),
    }
}

/// A combine's plan in the object's mode (`phase`: the whole call or one half).
fn plan_combine(
    c: &mut Ctx,
    m: &mut Moe,
    a: &Combine,
    last: Last,
    refused: bool,
    phase: Phase,
) -> Result<()> {
    match m.tp {
        Some(_) => throughput::combine(c, m, a, last, refused, phase),
        None => launch::combine(c, m, a, last, refused, phase),
    }
}

fn aligned(what: &str, p: u64, to: u64, f: &str) -> Result<()> {
    if p % to != 0 {
        return Err(Error::invalid(format!(
            "{f}: {what} {p:#x} is not {to}-byte aligned; expected a {to}-byte aligned pointer"
        )));
    }
    Ok(())
}

fn non_null(what: &str, p: u64, f: &str) -> Result<()> {
    if p == 0 {
        return Err(Error::invalid(format!("{f}: {what} is NULL")));
    }
    Ok(())
}

impl Moe {
    pub fn bounds(&self) -> Bounds {
        Bounds {
            experts: self.cfg.experts,
            local: self.cfg.local_experts(self.world as u64),
            tokens: self.cfg.tokens,
            topk: self.cfg.topk,
            max_recv: self.cfg.max_recv,
        }
    }

    /// The address of a part (`layout` offset) of rank `r`'s block, here.
    pub fn at(&self, r: usize, off: u64) -> u64 {
        self.blocks[r] + off
    }

    /// The host-detectable checks of a dispatch (docs/moe.md, "Errors").
    fn check_dispatch(&self, a: &Dispatch) -> std::result::Result<IndexType, Refusal> {
        const F: &str = "symm_moe_dispatch";
        let refuse = |code, value, error: Error| Refusal { code, value, error };
        let it =
            IndexType::from_code(F, a.idx_dtype).map_err(|e| refuse(status::ST_REFUSED, 0, e))?;
        if a.tokens > self.cfg.tokens {
            return Err(refuse(
                status::ST_TOO_MANY_TOKENS,
                a.tokens.min(i64::MAX as u64) as i64,
                Error::invalid(format!(
                    "{F}: num_tokens {} is above max_tokens_per_rank {} (rank {}); expected at \
                     most {}",
                    a.tokens, self.cfg.tokens, self.rank, self.cfg.tokens
                )),
            ));
        }
        if a.k == 0 || a.k > self.cfg.topk {
            return Err(refuse(
                status::ST_BAD_K,
                a.k as i64,
                Error::invalid(format!(
                    "{F}: k = {} (rank {}); expected 1..={} (the configured topk)",
                    a.k, self.rank, self.cfg.topk
                )),
            ));
        }
        let other = |e: Error| refuse(status::ST_REFUSED, 0, e);
        match (self.cfg.dtype, a.x_scales) {
            (_, s) if s != 0 && self.cfg.quantize => {
                return Err(other(Error::invalid(format!(
                    "{F}: x_scales {s:#x} given, but this object quantizes bf16 x itself \
                     (input SYMM_MOE_INPUT_BF16); expected NULL"
                ))))
            }
            (Payload::Fp8, 0) if self.cfg.quantize => {}
            (Payload::Bf16, s) if s != 0 => {
                return Err(other(Error::invalid(format!(
                    "{F}: x_scales {s:#x} given for a bf16 payload; expected NULL (scales are \
                     for SYMM_MOE_FP8_E4M3)"
                ))))
            }
            (Payload::Fp8, 0) if a.tokens > 0 => {
                return Err(other(Error::invalid(format!(
                    "{F}: x_scales is NULL for an FP8 payload; expected [num_tokens][{}] fp32 \
                     scales",
                    self.cfg.scales_per_row()
                ))))
            }
            _ => {}
        }
        if a.tokens > 0 {
            let checks = || -> Result<()> {
                non_null("x", a.x, F)?;
                non_null("topk_idx", a.idx, F)?;
                non_null("topk_weights", a.weights, F)?;
                aligned("x", a.x, 16, F)?;
                aligned("topk_idx", a.idx, it.bytes(), F)?;
                aligned("topk_weights", a.weights, 4, F)?;
                if self.cfg.dtype.has_scales() && !self.cfg.quantize {
                    aligned("x_scales", a.x_scales, 4, F)?;
                }
                Ok(())
            };
            checks().map_err(other)?;
        }
        Ok(it)
    }

    /// The host-detectable checks of a combine whose last dispatch had `tokens` tokens.
    fn check_combine(&self, a: &Combine, tokens: u64) -> Result<()> {
        const F: &str = "symm_moe_combine";
        non_null("expert_out", a.expert_out, F)?;
        aligned("expert_out", a.expert_out, 16, F)?;
        if tokens > 0 {
            non_null("y", a.y, F)?;
            aligned("y", a.y, 16, F)?;
        }
        Ok(())
    }

    /// Gives the block back (after the device's work that may use it). Local: every rank's
    /// kernels that write into this block have finished once this rank's last call did.
    pub fn destroy(self) -> Result<()> {
        // Its kernels may still run (the CPU's twins have run already).
        self.exec.sync()?;
        crate::heap::global()?.free(self.block, self.layout.bytes, self.device, 0)
    }
}

impl Communicator {
    /// `symm_moe_create`: collective over this communicator (module header). `Err(why)`: this
    /// rank could not even read its request (a bad config struct, `out` NULL); it still takes
    /// part in the agreement, so every rank fails at once naming it instead of waiting for the
    /// bootstrap timeout, and this rank returns `why`.
    pub fn moe_create(&mut self, req: std::result::Result<&Request, Error>) -> Result<Moe> {
        self.begin(0)?;
        let world = self.world as u64;
        let unread = req.is_err();
        let asked = req.as_ref().map_or(Request::UNREADABLE, |r| **r);
        let checked = req.and_then(|r| r.check(world));
        let req = &asked;
        // One block on the host backend, whose device has one SM; `num_sms` caps it.
        // Without a budget (0) the grid is what the work keeps busy.
        let cap = match asked.num_sms {
            0 => asked.work_grid(world),
            n => n.min(MAX_GRID),
        };
        let grid = self.settings.fewest_sms.min(cap).clamp(1, MAX_GRID);
        // The agreement: refusal text, the requested words, the grid.
        let mut msg = Vec::new();
        let text = checked
            .as_ref()
            .err()
            .map(|e| e.message.clone())
            .unwrap_or_default();
        msg.extend_from_slice(&(text.len() as u64).to_le_bytes());
        msg.extend_from_slice(text.as_bytes());
        msg.resize(msg.len().next_multiple_of(8), 0);
        for w in req.words() {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        msg.extend_from_slice(&(grid as u64).to_le_bytes());
        let all = self
            .mesh
            .all_gather(&msg, &[], "symm_moe_create agreement")?;
        let mut refusals = Vec::new();
        let mut unreadable = Vec::new();
        let mut words = Vec::new();
        let mut g = grid;
        for (r, (m, _)) in all.iter().enumerate() {
            let bad = || {
                Error::peer(format!(
                    "symm_moe_create: rank {r} sent a malformed agreement"
                ))
            };
            let n = u64::from_le_bytes(m.get(..8).ok_or_else(bad)?.try_into().unwrap()) as usize;
            let t = m.get(8..8 + n).ok_or_else(bad)?;
            let rest = m.get((8 + n).next_multiple_of(8)..).ok_or_else(bad)?;
            const N: usize = Request::WORDS;
            if rest.len() != (N + 1) * 8 {
                return Err(bad());
            }
            let w: Vec<u64> = rest
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            if n > 0 {
                refusals.push(format!("rank {r}: {}", String::from_utf8_lossy(t)));
                if w[..N] == Request::UNREADABLE.words() {
                    unreadable.push(format!("rank {r}: {}", String::from_utf8_lossy(t)));
                }
            }
            g = g.min(w[N] as u32);
            words.push(w[..N].to_vec());
        }
        if let (true, Err(e)) = (unread, &checked) {
            return Err(e.clone()); // this rank's own reason
        }
        if !unreadable.is_empty() {
            return Err(Error::invalid(format!(
                "symm_moe_create: {} (no rank made the object)",
                unreadable.join("; ")
            )));
        }
        let mine = req.words();
        if words.iter().any(|w| w[..] != mine[..]) {
            let lines: Vec<String> = words
                .iter()
                .enumerate()
                .map(|(r, w)| format!("rank {r}: {}", Request::describe(w)))
                .collect();
            return Err(Error::not_symmetric(format!(
                "symm_moe_create: the ranks passed different configurations; every rank must \
                 pass the same values: {}",
                lines.join("; ")
            )));
        }
        let cfg = checked?;
        if !refusals.is_empty() {
            return Err(Error::invalid(format!(
                "symm_moe_create: {}",
                refusals.join("; ")
            )));
        }
        let (layout, tp) = match cfg.mode {
            config::Mode::LowLatency => (Layout::new(&cfg, world), None),
            config::Mode::Throughput => {
                let t = layout::TpLayout::new(&cfg, world);
                (t.block(), Some(t))
            }
        };
        let block = self.moe_alloc(layout.bytes)?;
        match self
            .moe_share(&cfg, layout, block, g.max(1))
            .map(|m| Moe { tp, ..m })
        {
            Ok(m) => Ok(m),
            Err(e) => {
                let _ = self.alloc.free(block, layout.bytes, self.device, 0);
                Err(e)
            }
        }
    }

    /// The block from the arena, on every rank or on none (each rank says whether it got it).
    fn moe_alloc(&mut self, bytes: u64) -> Result<u64> {
        let got = self.comm_malloc(bytes, 0);
        let all = self
            .mesh
            .all_gather(&[got.is_ok() as u8], &[], "symm_moe_create allocation")?;
        let failed: Vec<usize> = (0..self.world).filter(|&r| all[r].0 != [1]).collect();
        if failed.is_empty() {
            return got;
        }
        if let Ok(p) = got {
            let _ = self.alloc.free(p, bytes, self.device, 0);
        }
        let arena = self.arena_bounds().map(|b| b.1).unwrap_or(0);
        let why = match &got {
            Err(e) => format!("here: {}", e.message),
            Ok(_) => "this rank had room".to_string(),
        };
        Err(Error::oom(format!(
            "symm_moe_create: the moe buffers need {bytes} bytes of the communicator's arena \
             ({arena} bytes in all, SYMMALLOC_COMM_ARENA_SIZE) and rank(s) {failed:?} could not \
             allocate them ({why}); set SYMMALLOC_COMM_ARENA_SIZE to at least {bytes} bytes \
             more than the communicator's other symm_comm_malloc memory, or lower \
             max_tokens_per_rank, hidden or max_recv_per_expert"
        )))
    }

    /// Zeroes the block's control parts, shares the block with every rank (maps theirs) and
    /// builds the object.
    fn moe_share(&mut self, cfg: &Config, layout: Layout, block: u64, grid: u32) -> Result<Moe> {
        let zero = layout.zeroed_bytes();
        // block..block+zero lies in the block just allocated.
        self.exec.zero(block, zero)?;
        // Zeroed before this meeting: no peer writes into the block before it returns here.
        self.rendezvous(block, layout.bytes)
            .map_err(|e| e.context("symm_moe_create (sharing the buffers)"))?;
        let own = self.peer.windows.bases[self.rank];
        let mut blocks = [0u64; MAX_RANKS];
        for (r, b) in self.peer.windows.bases.iter().enumerate() {
            blocks[r] = b + (block - own);
        }
        let status = self.exec.mapped_word()?;
        crate::info!(
            "rank {}/{}: moe object of {} bytes (T {}, H {}, K {}, E {}, R {}, {}), grid {grid} \
             (num_sms {})",
            self.rank,
            self.world,
            layout.bytes,
            cfg.tokens,
            cfg.hidden,
            cfg.topk,
            cfg.experts,
            cfg.max_recv,
            cfg.dtype.name(),
            cfg.num_sms
        );
        Ok(Moe {
            cfg: *cfg,
            layout,
            world: self.world,
            rank: self.rank,
            device: self.device,
            block,
            blocks,
            grid,
            status,
            exec: self.exec.fresh(),
            d_epoch: 0,
            c_epoch: 0,
            last: None,
            pending: None,
            tp: None,
            tp_first_combine: 0,
        })
    }

    fn moe_fatal(&mut self, e: Error) -> Error {
        if e.status == Status::ErrTimeout {
            self.coll.sticky = Some(e.clone());
        }
        self.name_ranks(e)
    }

    /// `symm_moe_dispatch` (docs/moe.md, "Protocol").
    pub fn moe_dispatch(&mut self, m: &mut Moe, a: &Dispatch) -> Result<()> {
        let mut c = self.begin(a.stream)?;
        m.idle("symm_moe_dispatch")?;
        let pending = m.take_status();
        let checked = m.check_dispatch(a);
        let (it, refusal) = match checked {
            Ok(it) => (it, None),
            Err(r) => (IndexType::I32, Some(r)),
        };
        let tokens = if refusal.is_some() { 0 } else { a.tokens };
        // The kernel, or on the host backend its CPU twin (host.rs); an error the kernels
        // recorded since the last call after a launch that went well.
        let r = plan_dispatch(&mut c, m, a, it, refusal.as_ref(), Phase::Both)
            .map_err(|e| self.moe_fatal(e))
            .and_then(|()| pending.map_or(Ok(()), Err));
        m.last = Some(Last {
            tokens,
            k: a.k,
            ok: r.is_ok() && refusal.is_none(),
        });
        match refusal {
            Some(f) => Err(f.error),
            None => r,
        }
    }

    /// `symm_moe_combine`.
    pub fn moe_combine(&mut self, m: &mut Moe, a: &Combine) -> Result<()> {
        let mut c = self.begin(a.stream)?;
        m.idle("symm_moe_combine")?;
        let Some(last) = m.last else {
            return Err(Error::invalid(
                "symm_moe_combine: no dispatch on this object yet; expected symm_moe_dispatch \
                 first",
            ));
        };
        let pending = m.take_status();
        let refusal = m.check_combine(a, last.tokens).err();
        let r = plan_combine(&mut c, m, a, last, refusal.is_some(), Phase::Both)
            .map_err(|e| self.moe_fatal(e))
            .and_then(|()| pending.map_or(Ok(()), Err));
        match (r, refusal) {
            // The host backend's combine after a failed dispatch does nothing, and says so
            // before anything else (launch.rs).
            (Err(e), _) if e.message == launch::NOTHING_TO_COMBINE => Err(e),
            (_, Some(e)) => Err(e),
            (r, None) => r,
        }
    }

    /// `symm_moe_check`: the error a kernel of this object (or of the communicator) recorded.
    pub fn moe_check(&mut self, m: &mut Moe) -> Result<()> {
        self.begin(0)?;
        m.take_status().map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tokens: u64, hidden: u64, topk: u32) -> Request {
        Request {
            tokens,
            hidden,
            topk,
            ..Request::default()
        }
    }

    #[test]
    fn the_grid_follows_the_work_between_its_bounds() {
        // 1 token, top-8, H 7168: 8 (W=1) or 64 (W=8) rows, 896 vectors: the floor, then 4.
        assert_eq!(req(1, 7168, 8).work_grid(1), MIN_WORK_GRID);
        assert_eq!(req(1, 7168, 8).work_grid(8), 4);
        // 8 tokens at W=8: 512 rows over 16 warps = 32 blocks.
        assert_eq!(req(8, 7168, 8).work_grid(8), 32);
        // 16 tokens, H 7168: 14,336 vectors over 512 threads = 28 blocks (rows: 8).
        assert_eq!(req(16, 7168, 1).work_grid(1), 28);
        // DeepEP's decode at 128 tokens and anything unreadable: every block there is.
        assert_eq!(req(128, 7168, 8).work_grid(8), MAX_GRID);
        assert_eq!(Request::UNREADABLE.work_grid(8), MAX_GRID);
    }
}
