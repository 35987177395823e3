//! Communicator creation: the bootstrap mesh, the agreement on devices, heap sizes, backend and
//! collective settings, the peer windows and the internal block, and the first segment
//! exchange (the internal block's). Also the process-wide claim of one communicator per device.

use super::algo;
use super::algo::{DType, Kernel, ReduceOp};
use super::error_word::ErrorWords;
use super::exchange::{CallDesc, DescKind};
use super::kernel_args::*;
use super::retire::PeerReleases;
use super::streams::StreamOrder;
use super::windows::PeerWindows;
use super::Communicator;
use crate::config;
use crate::cuda;
use crate::error::{Error, Result};
use crate::heap::release_log::ReleaseView;
use crate::heap::{self, pools::INTERNAL_POOL, Allocator};
use crate::ipc::{Mesh, UniqueId};
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::Mutex;

/// Devices with a live communicator in this process.
static DEVICES_IN_USE: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// The init message's collective settings, as the variables that set them.
fn describe_settings(w: &[u64]) -> String {
    format!(
        "SYMMALLOC_LL_BYTES={} SYMMALLOC_LL_GRID={}x{} SYMMALLOC_LL_MAX_BYTES={} \
         SYMMALLOC_ONE_SHOT_MAX_BYTES={} SYMMALLOC_CHECK_SYMMETRY={} SYMMALLOC_SHARED_GPU={}",
        w[0],
        w[1] >> 32,
        w[1] & 0xffff_ffff,
        w[2],
        w[3],
        w[4],
        w[5]
    )
}

pub(super) fn release_device(device: i32) {
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
        let timeout = config::timeout()?;
        let ll_slot = config::ll_bytes(world)?;
        let ll_grid = config::ll_grid()?;
        let auto = algo::AutoThresholds::from_env(world, ll_slot)?;
        let check_symmetry = config::check_symmetry()?;
        let shared_gpu = config::shared_gpu()?;
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
            shared_gpu as u64,
        ];
        let mut hello = Vec::new();
        for w in [device as u64, heap_size, host as u64]
            .iter()
            .chain(&settings)
        {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        // Each rank's heap release log travels with its hello (retire.rs reads the peers').
        let log_fd = alloc.heap(device)?.release_log_fd()?;
        let all = mesh.all_gather(&hello, &[log_fd.as_fd()], "init")?;
        drop(log_fd);
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
                if !shared_gpu {
                    return Err(Error::invalid(format!(
                        "ranks {prev} and {r} both use device {d}; expected one device per rank \
                         (SYMMALLOC_SHARED_GPU=1 lets ranks share a GPU, for testing only)"
                    )));
                }
            }
            devices.push(d);
        }
        let mut clusters = !host;
        let mut fewest_sms = sms;
        if !host {
            let drv = cuda::driver()?;
            for (r, &d) in devices.iter().enumerate() {
                let info = drv.device(d)?;
                clusters &= info.cc_major >= 9;
                fewest_sms = fewest_sms.min(info.sm_count as u32);
                if !drv.can_access_peer(device, d)? {
                    return Err(Error::unsupported(format!(
                        "device {device} (rank {rank}) cannot access device {d} (rank {r}) \
                         directly; symmalloc needs NVLink or PCIe peer access between all ranks"
                    )));
                }
            }
        }

        let mut releases = PeerReleases::default();
        for (r, (_, fds)) in all.iter().enumerate() {
            let view = if r == rank {
                None
            } else {
                let fd = fds
                    .first()
                    .ok_or_else(|| Error::peer(format!("rank {r} sent no release log at init")))?;
                Some(ReleaseView::open(fd.as_fd())?)
            };
            // Earlier records name segments this communicator never mapped.
            releases.seen.push(view.as_ref().map_or(0, |v| v.count()));
            releases.views.push(view);
        }
        let windows = PeerWindows::new(alloc, device, rank, world)?;
        let errors = ErrorWords::new(host, device)?;
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
            internal_seg: 0,
            ll_slot,
            ll_grid,
            auto,
            check_symmetry,
            errors,
            streams: StreamOrder::default(),
            host_epoch: 0,
            scratch: None,
            timeout,
            sticky: None,
            sms,
            clusters,
            releases,
            pads: Vec::new(),
            kernels: HashMap::new(),
            quant_kernels: HashMap::new(),
            fewest_sms,
            resident: HashMap::new(),
            auto_seen: Default::default(),
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
            kind: DescKind::Init,
            kernel: Kernel::OneShot,
            send_off: 0,
            recv_off: 0,
            count: 0,
            dtype: DType::Fp32,
            op: ReduceOp::Sum,
            width: 0,
        };
        let seg = comm
            .locate(internal, internal_len)?
            .expect("internal block is in the heap");
        comm.internal_seg = seg.offset;
        comm.exchange(&[seg], desc, true)?;
        comm.mesh.barrier("init")?;
        crate::info!(
            "rank {rank}/{world}: communicator on device {device} (ranks' devices {devices:?}, \
             {} backend); {}; timeout {:.1} s",
            if host { "host" } else { "cuda" },
            describe_settings(&settings),
            timeout.as_secs_f64()
        );
        Ok(comm)
    }
}
