//! The communicator: one per (process, device) of a single-node job. Owns the bootstrap mesh,
//! the peer windows, the signal pad (a symmetric internal block), the kernels' error word and
//! the staging scratch; runs all-reduce and barrier.
//!
//! Invariants: every rank has the same collective settings (LL slot and grid, AUTO thresholds,
//! symmetry checking: read once at init and compared there); every rank calls collectives in
//! the same order with symmetric buffers; segments a collective touches are shared with the
//! peers (exchanged once per segment generation) before any kernel reads them; an error word
//! set by a kernel is reported by the next call (timeouts stay reported: the communicator is
//! then broken and must be destroyed).

pub mod algo;
pub mod convert;
pub mod host_reduce;
pub mod kernel_args;
pub mod kernels;
pub mod mc_window;
pub mod multicast;
pub mod windows;

use crate::config;
use crate::cuda;
use crate::error::{Error, Result, Status};
use crate::heap::{self, device_heap::SegmentInfo, pools::INTERNAL_POOL, Allocator};
use crate::ipc::{Mesh, UniqueId};
use algo::{Algo, DType, ReduceOp};
use kernel_args::*;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::time::Duration;
use windows::PeerWindows;

/// Devices with a live communicator in this process.
static DEVICES_IN_USE: Mutex<Vec<i32>> = Mutex::new(Vec::new());

enum ErrorWord {
    Device(cuda::mem::MappedWord),
    Host(Box<std::sync::atomic::AtomicU32>),
}

impl ErrorWord {
    fn read(&self) -> u32 {
        match self {
            // SAFETY: host is a live pinned word; volatile because the GPU writes it.
            ErrorWord::Device(w) => unsafe { std::ptr::read_volatile(w.host) },
            ErrorWord::Host(a) => a.load(std::sync::atomic::Ordering::Acquire),
        }
    }
    fn clear(&self) {
        match self {
            // SAFETY: as read().
            ErrorWord::Device(w) => unsafe { std::ptr::write_volatile(w.host, 0) },
            ErrorWord::Host(a) => a.store(0, std::sync::atomic::Ordering::Release),
        }
    }
    fn device_ptr(&self) -> u64 {
        match self {
            ErrorWord::Device(w) => w.device_ptr,
            ErrorWord::Host(a) => a.as_ref() as *const _ as u64,
        }
    }
}

/// Everything ranks must agree on for one collective call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CallDesc {
    send_off: u64,
    recv_off: u64,
    count: u64,
    dtype: u64,
    op: u64,
    algo: u64,
}

impl CallDesc {
    fn words(&self) -> [u64; 6] {
        [
            self.send_off,
            self.recv_off,
            self.count,
            self.dtype,
            self.op,
            self.algo,
        ]
    }
    /// A 64-bit digest the kernels compare at their first barrier.
    fn digest(&self) -> u64 {
        let mut x: u64 = 0xcbf29ce484222325;
        for w in self.words() {
            for b in w.to_le_bytes() {
                x ^= b as u64;
                x = x.wrapping_mul(0x100000001b3);
            }
        }
        x | 1
    }
}

/// The init message's collective settings, as the variables that set them.
fn describe_settings(w: &[u64]) -> String {
    format!(
        "SYMMALLOC_LL_BYTES={} SYMMALLOC_LL_GRID={}x{} SYMMALLOC_LL_MAX_BYTES={} \
         SYMMALLOC_ONE_SHOT_MAX_BYTES={} SYMMALLOC_CHECK_SYMMETRY={}",
        w[0],
        w[1] >> 32,
        w[1] & 0xffff_ffff,
        w[2],
        w[3],
        w[4]
    )
}

pub struct Communicator {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    alloc: &'static Allocator,
    host: bool,
    mesh: Mesh,
    windows: PeerWindows,
    /// Signal pad, epochs and LL buffers: `internal_bytes(world, ll_slot)` bytes (kernel_args.rs
    /// has the layout).
    internal: u64,
    /// Bytes per sender slot of the LL buffers (`SYMMALLOC_LL_BYTES`, equal on all ranks).
    ll_slot: u64,
    /// The LL kernel's (blocks, threads), fixed for the communicator's life.
    ll_grid: (u32, u32),
    /// AUTO's thresholds and `SYMMALLOC_CHECK_SYMMETRY`: read at init, equal on all ranks.
    auto: algo::AutoThresholds,
    check_symmetry: bool,
    error: ErrorWord,
    host_epoch: u32,
    scratch: Option<(u64, u64)>,
    timeout: Duration,
    sticky: Option<Error>,
    sms: u32,
    /// Each rank's signal pad in this process's address space (fixed after init).
    pads: Vec<u64>,
    /// Multicast windows by segment offset (MULTIMEM only; empty unless the gate allowed it).
    mc: HashMap<u64, mc_window::McWindow>,
    /// Kernels already looked up in the device's module, so a call does no name formatting,
    /// module lock or hash of a string.
    kernels: HashMap<(Algo, DType, ReduceOp, bool), cuda::module::Function>,
}

/// Threads per block for an LL call of `items` 16-byte items: enough to give every block a
/// share (a power of two, at least 64), at most the grid's limit. A pure function of the
/// message, so every rank maps items to the same threads.
pub fn ll_threads(items: u64, (blocks, max_threads): (u32, u32)) -> u32 {
    items
        .div_ceil(blocks as u64)
        .next_power_of_two()
        .clamp(64, max_threads as u64) as u32
}

fn release_device(device: i32) {
    let mut d = DEVICES_IN_USE.lock().unwrap_or_else(|p| p.into_inner());
    d.retain(|&x| x != device);
}

impl Communicator {
    pub fn init(world: i32, rank: i32, device: i32, id: &UniqueId) -> Result<Box<Communicator>> {
        if !(1..=MAX_RANKS as i32).contains(&world) {
            return Err(Error::invalid(format!(
                "world_size {world} is out of range; expected 1..={MAX_RANKS} ranks on one node"
            )));
        }
        if rank < 0 || rank >= world {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range; expected 0..{world} (world_size {world})"
            )));
        }
        let alloc = heap::global()?;
        alloc.check_device(device)?;
        let host = alloc.backend().name() == "host";
        {
            let mut d = DEVICES_IN_USE.lock().unwrap_or_else(|p| p.into_inner());
            if d.contains(&device) {
                return Err(Error::invalid(format!(
                    "device {device} already has a communicator in this process; destroy it \
                     first (one communicator per process and device)"
                )));
            }
            d.push(device);
        }
        let r = Self::init_claimed(world as usize, rank as usize, device, id, alloc, host);
        if r.is_err() {
            release_device(device);
        }
        r
    }

    fn init_claimed(
        world: usize,
        rank: usize,
        device: i32,
        id: &UniqueId,
        alloc: &'static Allocator,
        host: bool,
    ) -> Result<Box<Communicator>> {
        let timeout = config::timeout();
        let ll_slot = config::ll_bytes(world)?;
        let ll_grid = config::ll_grid()?;
        let auto = algo::AutoThresholds::from_env(world, ll_slot)?;
        let check_symmetry = config::check_symmetry();
        let sms = if host {
            1
        } else {
            cuda::driver()?.device(device)?.sm_count as u32
        };
        // Make sure the heap exists before any peer exchange.
        let heap_size = alloc.heap(device)?.size();
        let mesh = Mesh::connect(id, rank, world, timeout)?;

        // Agree on devices, heap sizes, backend and every setting that shapes a collective.
        let settings = [
            ll_slot,
            (ll_grid.0 as u64) << 32 | ll_grid.1 as u64,
            auto.ll_max,
            auto.one_shot_max,
            check_symmetry as u64,
        ];
        let mut hello = Vec::new();
        for w in [device as u64, heap_size, host as u64]
            .iter()
            .chain(&settings)
        {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        let all = mesh.all_gather(&hello, &[], "init")?;
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        let mut devices = Vec::new();
        for (r, (msg, _)) in all.iter().enumerate() {
            if msg.len() != hello.len() {
                return Err(Error::peer(format!(
                    "rank {r} sent a malformed init message"
                )));
            }
            let (d, hs, h) = (word(msg, 0) as i32, word(msg, 1), word(msg, 2) != 0);
            let theirs: Vec<u64> = (0..settings.len()).map(|i| word(msg, 3 + i)).collect();
            if theirs != settings {
                return Err(Error::invalid(format!(
                    "rank {r} has {}, rank {rank} has {}; set them alike on every rank",
                    describe_settings(&theirs),
                    describe_settings(&settings)
                )));
            }
            if h != host {
                return Err(Error::invalid(format!(
                    "rank {r} uses the {} backend, rank {rank} the {}; set SYMMALLOC_BACKEND alike",
                    if h { "host" } else { "cuda" },
                    if host { "host" } else { "cuda" }
                )));
            }
            if hs != heap_size {
                return Err(Error::invalid(format!(
                    "rank {r} has a heap of {hs} bytes, rank {rank} of {heap_size}; set \
                     SYMMALLOC_HEAP_SIZE alike on every rank"
                )));
            }
            if let Some(prev) = devices.iter().position(|&x| x == d) {
                return Err(Error::invalid(format!(
                    "ranks {prev} and {r} both use device {d}; expected one device per rank"
                )));
            }
            devices.push(d);
        }
        if !host {
            let drv = cuda::driver()?;
            for (r, &d) in devices.iter().enumerate() {
                if !drv.can_access_peer(device, d)? {
                    return Err(Error::unsupported(format!(
                        "device {device} (rank {rank}) cannot access device {d} (rank {r}) \
                         directly; symmalloc needs NVLink or PCIe peer access between all ranks"
                    )));
                }
            }
        }

        let windows = PeerWindows::new(alloc, device, rank, world)?;
        let error = if host {
            ErrorWord::Host(Box::default())
        } else {
            ErrorWord::Device(cuda::mem::MappedWord::new(device)?)
        };
        let internal_len = internal_bytes(world, ll_slot);
        let internal = alloc.malloc_in(internal_len, device, 0, INTERNAL_POOL)?;
        // Pad, epochs, LL counters and descriptor words start at 0; LL data words empty.
        let data_len = internal_len - LL_DATA_OFFSET;
        if host {
            // SAFETY: internal is a live block of internal_len bytes of mapped host memory.
            unsafe {
                std::ptr::write_bytes(internal as *mut u8, 0, LL_DATA_OFFSET as usize);
                std::ptr::write_bytes(
                    (internal + LL_DATA_OFFSET) as *mut u8,
                    LL_EMPTY_BYTE,
                    data_len as usize,
                );
            }
        } else {
            cuda::mem::memset_sync(device, internal, 0, LL_DATA_OFFSET)?;
            cuda::mem::memset_sync(device, internal + LL_DATA_OFFSET, LL_EMPTY_BYTE, data_len)?;
        }
        let mut comm = Box::new(Communicator {
            rank,
            world,
            device,
            alloc,
            host,
            mesh,
            windows,
            internal,
            ll_slot,
            ll_grid,
            auto,
            check_symmetry,
            error,
            host_epoch: 0,
            scratch: None,
            timeout,
            sticky: None,
            sms,
            pads: Vec::new(),
            kernels: HashMap::new(),
            mc: HashMap::new(),
        });
        let own_base = comm.windows.bases[rank];
        comm.pads = comm
            .windows
            .bases
            .iter()
            .map(|b| b + (internal - own_base))
            .collect();
        let desc = CallDesc {
            send_off: u64::MAX,
            recv_off: 0,
            count: 0,
            dtype: 0,
            op: 0,
            algo: 0,
        };
        let seg = comm
            .locate(internal, internal_len)?
            .expect("internal block is in the heap");
        comm.exchange(&[seg], desc, true)?;
        comm.mesh.barrier("init")?;
        Ok(comm)
    }

    /// The segment holding `ptr..ptr+bytes`, `None` when `ptr` is outside the heap, an error
    /// when it is inside the heap but not inside one live block.
    fn locate(&self, ptr: u64, bytes: u64) -> Result<Option<SegmentInfo>> {
        let heap = self.alloc.heap(self.device)?;
        if !heap.contains(ptr) {
            return Ok(None);
        }
        let (seg, bstart, bsize) = heap.segment_of(ptr)?;
        if ptr + bytes > bstart + bsize {
            return Err(Error::invalid(format!(
                "buffer {ptr:#x} of {bytes} bytes runs past the end of its symm_malloc block \
                 ({bsize} bytes at {bstart:#x}); expected count * element size to fit"
            )));
        }
        Ok(Some(seg))
    }

    /// Shares `segs` (own segments) with every peer and maps theirs; checks every rank passed
    /// the same call descriptor and segments. Collective: all ranks must call it together.
    fn exchange(&mut self, segs: &[SegmentInfo], desc: CallDesc, force: bool) -> Result<()> {
        let mut need: Vec<SegmentInfo> = Vec::new();
        for s in segs {
            if self.windows.needs_sharing(s) && !need.contains(s) {
                need.push(*s);
            }
        }
        if need.is_empty() && !force {
            return Ok(());
        }
        let mut msg = Vec::new();
        for w in desc.words() {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        msg.extend_from_slice(&(need.len() as u64).to_le_bytes());
        for s in &need {
            for w in [s.offset, s.size, s.generation] {
                msg.extend_from_slice(&w.to_le_bytes());
            }
        }
        let fds = {
            let heap = self.alloc.heap(self.device)?;
            need.iter()
                .map(|s| heap.export_segment(self.alloc.backend(), s.offset))
                .collect::<Result<Vec<_>>>()?
        };
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let all = self.mesh.all_gather(&msg, &borrowed, "segment exchange")?;
        drop(fds);
        let describe = |m: &[u8]| -> String {
            let w = |i: usize| u64::from_le_bytes(m[i * 8..i * 8 + 8].try_into().unwrap());
            let n = w(6) as usize;
            let segs: Vec<String> = (0..n)
                .map(|k| format!("{:#x}+{:#x}", w(7 + 3 * k), w(8 + 3 * k)))
                .collect();
            format!(
                "send offset {:#x}, recv offset {:#x}, count {}, new segments [{}]",
                w(0),
                w(1),
                w(2),
                segs.join(", ")
            )
        };
        // Compare everything except generations (they may differ after OOM retries).
        let shape = |m: &[u8]| -> Vec<u64> {
            m.chunks(8)
                .enumerate()
                .filter(|(i, _)| *i < 7 || (*i - 7) % 3 != 2)
                .map(|(_, c)| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        };
        let mismatched: Vec<usize> = (0..self.world)
            .filter(|&r| shape(&all[r].0) != shape(&msg))
            .collect();
        if !mismatched.is_empty() {
            let lines: Vec<String> = (0..self.world)
                .map(|r| format!("rank {r}: {}", describe(&all[r].0)))
                .collect();
            return Err(Error::not_symmetric(format!(
                "ranks disagree on the collective's buffers (allocation sequences differ between \
                 ranks?): {}",
                lines.join("; ")
            )));
        }
        for (r, (_, fds)) in all.into_iter().enumerate() {
            if r == self.rank {
                continue;
            }
            if fds.len() != need.len() {
                return Err(Error::peer(format!(
                    "rank {r} sent {} fds for {} segments",
                    fds.len(),
                    need.len()
                )));
            }
            for (s, fd) in need.iter().zip(fds) {
                self.windows.import(self.alloc, r, *s, fd)?;
            }
        }
        for s in &need {
            self.windows.mark_shared(s);
        }
        Ok(())
    }

    fn check_error_word(&mut self) -> Result<()> {
        if let Some(e) = &self.sticky {
            return Err(e.clone());
        }
        let w = self.error.read();
        if w == 0 {
            return Ok(());
        }
        let (code, peer) = (w >> 16, (w & 0xffff).saturating_sub(1));
        let e = match code {
            ERR_TIMEOUT => {
                let e = Error::timeout(format!(
                    "a collective kernel on rank {} waited more than {:.1} s for rank {peer} at a \
                     barrier (it may have died or called a different collective); this \
                     communicator is unusable, destroy it",
                    self.rank,
                    self.timeout.as_secs_f64()
                ));
                self.sticky = Some(e.clone());
                e
            }
            ERR_ASYMMETRIC => {
                self.error.clear();
                Error::not_symmetric(format!(
                    "the previous collective on rank {} did not run: rank {peer} called it with \
                     other buffer offsets, count, type or algorithm",
                    self.rank
                ))
            }
            ERR_LL_ASYMMETRIC => {
                let e = Error::not_symmetric(format!(
                    "the previous collective on rank {} (one-shot LL) did not run: rank {peer} \
                     called another collective (other buffer offsets, count, type or \
                     algorithm); words it sent may be left in the LL buffers, so this \
                     communicator is unusable, destroy it",
                    self.rank
                ));
                self.sticky = Some(e.clone());
                e
            }
            ERR_NO_MULTIMEM => {
                self.error.clear();
                Error::unsupported(
                    "the multimem kernel ran on a GPU without multimem (needs sm_90)",
                )
            }
            _ => Error::internal(format!("unknown kernel error word {w:#x}")),
        };
        Err(e)
    }

    fn ensure_scratch(&mut self, bytes: u64) -> Result<u64> {
        if let Some((p, size)) = self.scratch {
            if size >= bytes {
                return Ok(p);
            }
            self.alloc.free(p, size, self.device, 0)?;
            self.scratch = None;
        }
        let size = bytes.next_power_of_two().max(1 << 20);
        let p = self.alloc.malloc_in(size, self.device, 0, INTERNAL_POOL)?;
        self.scratch = Some((p, size));
        Ok(p)
    }

    fn copy(&self, dst: u64, src: u64, bytes: u64, stream: u64) -> Result<()> {
        if self.host {
            // SAFETY: both are buffers of at least `bytes` bytes (the caller's arguments and
            // our scratch); they never overlap (the scratch is ours alone).
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize)
            };
            Ok(())
        } else {
            cuda::mem::copy_async(self.device, dst, src, bytes, stream)
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        algo: Algo,
        send: u64,
        recv: u64,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        self.check_error_word()?;
        if count == 0 {
            return Ok(());
        }
        if send == 0 || recv == 0 {
            return Err(Error::invalid(format!(
                "send ({send:#x}) and recv ({recv:#x}) must not be NULL when count > 0"
            )));
        }
        let esize = dtype.size() as u64;
        if send % esize != 0 || recv % esize != 0 {
            return Err(Error::invalid(format!(
                "send {send:#x} / recv {recv:#x} are not aligned to the {}-byte {} element",
                esize,
                dtype.name()
            )));
        }
        let bytes = count
            .checked_mul(esize)
            .ok_or_else(|| Error::invalid(format!("count {count} overflows the byte size")))?;
        let algo = algo::choose(algo, bytes, self.world, self.ll_slot, &self.auto)?;
        if algo == Algo::Multimem {
            let supports = !self.host && cuda::driver()?.device(self.device)?.multicast;
            multicast::multicast_gate_from_env(supports)
                .map_err(|why| Error::unsupported(format!("SYMM_ALGO_MULTIMEM refused: {why}")))?;
            mc_window::check_call(send, recv, count, dtype, op)?;
        }
        let in_send = self.locate(send, bytes)?;
        let in_recv = self.locate(recv, bytes)?;
        // The segments the kernel touches, output last (no allocation per call).
        let (work_send, work_recv, staged, seg_pair, nsegs) = match (in_send, in_recv) {
            (Some(a), Some(b)) => (send, recv, false, [a, b], 2),
            _ => {
                let s = self.ensure_scratch(bytes)?;
                let seg = self.locate(s, bytes)?.expect("scratch is in the heap");
                (s, s, true, [seg, seg], 1)
            }
        };
        let segs = &seg_pair[..nsegs];
        let base = self.windows.bases[self.rank];
        let desc = CallDesc {
            send_off: work_send - base,
            recv_off: work_recv - base,
            count,
            dtype: dtype as u64,
            op: op as u64,
            algo: algo as u64,
        };
        self.exchange(segs, desc, self.check_symmetry)?;
        if staged {
            self.copy(work_send, send, bytes, stream)?;
            self.alloc.heap(self.device)?.stats.staged_collectives += 1;
        }
        let mc_out = if algo == Algo::Multimem {
            // Past the gate: the output segment's multicast window (built collectively once).
            let seg = *segs.last().expect("the output's segment");
            self.multicast_window(seg)? + (work_recv - base - seg.offset)
        } else {
            0
        };
        self.run(algo, desc, dtype, op, stream, mc_out)?;
        if staged {
            self.copy(recv, work_recv, bytes, stream)?;
        }
        Ok(())
    }

    fn run(
        &mut self,
        algo: Algo,
        desc: CallDesc,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
        mc_out: u64,
    ) -> Result<()> {
        // Every rank's buffers in this address space, straight into the kernel's argument
        // layout (no allocation per call); entries past the world stay 0.
        let (mut inputs, mut outputs) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for (r, b) in self.windows.bases.iter().enumerate() {
            inputs[r] = b + desc.send_off;
            outputs[r] = b + desc.recv_off;
        }
        let world = self.world;
        let in_place = desc.send_off == desc.recv_off;
        if self.host {
            let call = host_reduce::HostCall {
                rank: self.rank,
                world: self.world,
                pads: &self.pads,
                inputs: &inputs[..world],
                outputs: &outputs[..world],
                count: desc.count as usize,
                dtype,
                op,
                algo,
                in_place,
                desc: desc.digest(),
                timeout: self.timeout,
            };
            let r = host_reduce::all_reduce(&call, &mut self.host_epoch);
            if let Err(e) = &r {
                if e.status == Status::ErrTimeout {
                    self.sticky = Some(e.clone());
                }
            }
            return r;
        }
        let esize = dtype.size() as u64;
        let vec = inputs[..world]
            .iter()
            .chain(&outputs[..world])
            .all(|p| p % 16 == 0);
        let items = if vec {
            desc.count * esize / 16
        } else {
            desc.count
        };

        let sliced = matches!(algo, Algo::TwoShot | Algo::Multimem);
        let per_rank = if sliced {
            items.div_ceil(self.world as u64)
        } else {
            items
        };
        let cap = if sliced {
            MAX_BLOCKS as u64
        } else {
            (self.sms as u64 / 4).clamp(1, 32)
        };
        // Items one block covers per round.
        let per_block = match algo {
            Algo::TwoShot if vec => THREADS as u64 * TWO_SHOT_UNROLL,
            _ => THREADS as u64,
        };
        let (grid, threads) = match algo {
            Algo::OneShotLL => {
                let ll_items = (desc.count * esize).div_ceil(16);
                (self.ll_grid.0, ll_threads(ll_items, self.ll_grid))
            }
            _ => (per_rank.div_ceil(per_block).clamp(1, cap) as u32, THREADS),
        };
        let mut args = SymmArgs {
            inputs,
            outputs,
            count: desc.count,
            desc: desc.digest(),
            timeout_ns: self.timeout.as_nanos() as u64,
            rank: self.rank as i32,
            world: self.world as i32,
            in_place: in_place as i32,
            counters: self.internal + COUNTERS_OFFSET,
            error_word: self.error.device_ptr(),
            ll_slot_kib: (self.ll_slot >> 10) as i32,
            mc_out,
            ..SymmArgs::default()
        };
        args.pads[..world].copy_from_slice(&self.pads);
        let f = match self.kernels.get(&(algo, dtype, op, vec)) {
            Some(&f) => f,
            None => {
                let name = kernels::kernel_name(algo, dtype, op, vec).ok_or_else(|| {
                    Error::unsupported(format!(
                        "no {} kernel for {} {}",
                        algo.name(),
                        dtype.name(),
                        op.name()
                    ))
                })?;
                let f = cuda::module::function(self.device, &name)?;
                self.kernels.insert((algo, dtype, op, vec), f);
                f
            }
        };
        cuda::module::launch(self.device, f, grid, threads, stream, &args)
    }

    /// All ranks meet; stream-ordered on CUDA (a kernel), immediate on the host backend.
    pub fn barrier(&mut self, stream: u64) -> Result<()> {
        self.check_error_word()?;
        let desc = CallDesc {
            send_off: 0,
            recv_off: 0,
            count: 0,
            dtype: 0,
            op: 0,
            algo: u64::MAX,
        };
        if self.check_symmetry {
            self.exchange(&[], desc, true)?;
        }
        self.run(Algo::OneShot, desc, DType::Fp32, ReduceOp::Sum, stream, 0)
    }

    /// Gives back the peer mappings, windows, internal buffers and the device claim.
    pub fn destroy(mut self: Box<Self>) -> Result<()> {
        if !self.host {
            // Kernels in flight still use the pad and the peers' mappings.
            let _ = cuda::mem::sync_device(self.device);
            self.destroy_multicast_windows();
        }
        self.windows.destroy(self.alloc);
        if let Some((p, size)) = self.scratch.take() {
            let _ = self.alloc.free(p, size, self.device, 0);
        }
        let _ = self.alloc.free(
            self.internal,
            internal_bytes(self.world, self.ll_slot),
            self.device,
            0,
        );
        let _ = self.alloc.release_pool(self.device, INTERNAL_POOL);
        release_device(self.device);
        Ok(())
    }

    /// Open connections (for tests counting descriptors).
    pub fn connection_count(&self) -> usize {
        self.mesh.fds().len()
    }
}

#[cfg(test)]
mod tests {
    use super::ll_threads;

    #[test]
    fn ll_threads_spread_a_message_over_every_block() {
        assert_eq!(ll_threads(1, (128, 512)), 64, "at least two warps");
        assert_eq!(ll_threads(512, (128, 512)), 64);
        assert_eq!(ll_threads(16384, (128, 512)), 128);
        assert_eq!(ll_threads(65536, (128, 512)), 512);
        assert_eq!(ll_threads(1 << 20, (128, 512)), 512, "capped");
        assert_eq!(ll_threads(65536, (128, 256)), 256);
    }
}
