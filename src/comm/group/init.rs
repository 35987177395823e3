//! Communicator creation, for `symm_comm_init` (here: the bootstrap mesh, the agreement on
//! devices, heap sizes, backend and collective settings, the peer heaps) and for
//! `symm_comm_split` (split.rs builds the same `Setup` from its parent); then, for both,
//! `build`: the registry claim's verdict and the arena (arena.rs), the peer windows, then the
//! internal block in the arena and the first segment exchange (internal.rs: a communicator made
//! here reserves split slots in it, slots.rs).
//!
//! Several communicators may live on one device (registry.rs has the limit): each owns its
//! arena, internal block (pads, epochs, LL buffers), error words, scratch and mesh; they share
//! only the peer heaps (peer/peers.rs).

use super::registry::{self, Claim};
use super::slots::{self, Internal, Plan};
use super::Group;
use crate::comm::collective::algo;
use crate::comm::collective::error_word::ErrorWords;
use crate::comm::collective::kernel_args::*;
use crate::comm::collective::{CollSettings, Collectives};
use crate::comm::exec::{self, Executor};
use crate::comm::p2p::P2p;
use crate::comm::peer::peers::{self, PeerHeap, PeerIdent};
use crate::comm::peer::retire::PeerReleases;
use crate::comm::peer::windows::PeerWindows;
use crate::comm::peer::PeerView;
use crate::comm::Communicator;
use crate::config;
use crate::error::{Error, Result};
use crate::heap::{self, Allocator};
use crate::ipc::{Mesh, UniqueId};
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

/// The init message's collective settings, as the variables that set them.
pub(in crate::comm) fn describe_settings(w: &[u64]) -> String {
    if w.len() < 8 {
        return format!("settings {w:?}");
    }
    format!(
        "SYMMALLOC_LL_BYTES={} SYMMALLOC_LL_GRID={}x{} SYMMALLOC_LL_MAX_BYTES={} \
         SYMMALLOC_ONE_SHOT_MAX_BYTES={} SYMMALLOC_CHECK_SYMMETRY={} SYMMALLOC_SHARED_GPU={} \
         SYMMALLOC_COMM_ARENA_SIZE={} SYMMALLOC_SPLIT_SLOTS={}",
        w[0],
        w[1] >> 32,
        w[1] & 0xffff_ffff,
        w[2],
        w[3],
        w[4],
        w[5],
        w[6],
        w[7]
    )
}

/// Everything that shapes a collective, read from the environment for a world size.
#[derive(Clone, Copy)]
pub(in crate::comm) struct Settings {
    pub ll_slot: u64,
    pub ll_grid: (u32, u32),
    pub auto: algo::AutoThresholds,
    pub check_symmetry: bool,
    pub shared_gpu: bool,
    pub arena_len: u64,
    pub timeout: Duration,
    /// `SYMMALLOC_SPLIT_SLOTS`, and how many of them a communicator made by init reserves
    /// (slots.rs), each of `slot_len` bytes.
    pub split_slots: u64,
    pub reserve: usize,
    pub slot_len: u64,
}

/// The bytes of a communicator's arena on a heap of `heap_size` bytes mapped in `gran` pieces
/// (`SYMMALLOC_COMM_ARENA_SIZE`): the same for every communicator of the heap.
pub(in crate::comm) fn arena_len(heap_size: u64, gran: u64) -> Result<u64> {
    let arena =
        config::comm_arena_size()?.unwrap_or_else(|| config::default_comm_arena_bytes(heap_size));
    Ok(arena.checked_next_multiple_of(gran).unwrap_or(u64::MAX))
}

impl Settings {
    pub fn read(world: usize, alloc: &Allocator, device: i32) -> Result<Settings> {
        let ll_slot = config::ll_bytes(world)?;
        let (heap_size, gran) = {
            let h = alloc.heap(device)?;
            (h.size(), h.granularity())
        };
        let arena_len = arena_len(heap_size, gran)?;
        let split_slots = config::split_slots()?;
        let slot_len = slots::slot_len(world)?;
        Ok(Settings {
            ll_slot,
            ll_grid: config::ll_grid()?,
            auto: algo::AutoThresholds::from_env(world, ll_slot)?,
            check_symmetry: config::check_symmetry()?,
            shared_gpu: config::shared_gpu()?,
            arena_len,
            timeout: config::timeout()?,
            split_slots,
            reserve: slots::slots_to_reserve(split_slots, slot_len, arena_len),
            slot_len,
        })
    }

    /// What every rank must have alike (`describe_settings` names them).
    pub fn words(&self) -> [u64; 8] {
        [
            self.ll_slot,
            (self.ll_grid.0 as u64) << 32 | self.ll_grid.1 as u64,
            self.auto.ll_max,
            self.auto.one_shot_max,
            self.check_symmetry as u64,
            self.shared_gpu as u64,
            self.arena_len,
            self.split_slots,
        ]
    }
}

/// What `build` needs to make a communicator, from `init` or from a split.
pub(in crate::comm) struct Setup {
    pub rank: usize,
    pub world: usize,
    pub device: i32,
    pub alloc: &'static Allocator,
    /// What runs the communicator's plans (chosen from the heap's backend at init; a split's
    /// child gets a fresh one of its parent's kind).
    pub exec: Box<dyn Executor>,
    pub mesh: Mesh,
    /// The settings, or why this rank could not read them (sent as its refusal).
    pub settings: std::result::Result<Settings, String>,
    /// The registry place, or why there is none (sent as this rank's refusal).
    pub claim: std::result::Result<Claim, String>,
    /// Every rank's identity.
    pub members: Vec<PeerIdent>,
    /// The windows: fresh over the peer heaps, or a parent's subset (split.rs).
    pub windows: PeerWindows,
    /// Records of the peers' release logs already handled (a child starts at its parent's).
    pub seen: Vec<u64>,
    pub sms: u32,
    pub clusters: bool,
    pub fewest_sms: u32,
    /// For errors of a child: which parent ranks its ranks are.
    pub lineage: Option<String>,
    /// The ranks' free address ranges, when a split gathered them already.
    pub terms: Option<super::arena::Terms>,
    /// Where the internal block comes from (slots.rs): `None` for init, which reserves the
    /// settings' slots; a split's choice otherwise.
    pub plan: Option<Plan>,
    /// The arena every rank of a split's child claimed before the split's first round (its
    /// id here; split.rs): no claim round.
    pub arena: Option<u64>,
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
        // The executor of the heap's backend, chosen here as the heap chose its `Backend`.
        let exec = exec::for_backend(alloc.backend().name(), device);
        let setup = Self::bootstrap(world as usize, rank as usize, device, id, alloc, exec)?;
        Self::build(setup)
    }

    fn bootstrap(
        world: usize,
        rank: usize,
        device: i32,
        id: &UniqueId,
        alloc: &'static Allocator,
        exec: Box<dyn Executor>,
    ) -> Result<Setup> {
        let settings = Settings::read(world, alloc, device)?;
        let sms = exec.sm_count()?;
        let backend = exec.backend();
        // Make sure the heap exists before any peer exchange.
        let heap_size = crate::heap::comm_view::CommView::new(alloc, device).size()?;
        // The limit is checked here and refused at the agreement (build), by every rank alike.
        let claim = registry::claim(device);
        let me = PeerIdent::me(device)?;
        let mesh = Mesh::connect(id, rank, world, settings.timeout)?;

        // Agree on devices, heap sizes, backend and every setting that shapes a collective;
        // learn who every rank is.
        let words = settings.words();
        let mut hello = Vec::new();
        for w in [device as u64, heap_size, backend_word(backend)]
            .iter()
            .chain(&words)
            .chain(&me.words())
        {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        // Each rank's heap release log travels with its hello (peer/retire.rs reads the peers').
        let log_fd = crate::heap::comm_view::CommView::new(alloc, device).release_log_fd()?;
        let all = mesh.all_gather(&hello, &[log_fd.as_fd()], "init")?;
        drop(log_fd);
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        let n = words.len();
        let mut devices = Vec::new();
        let mut members = Vec::new();
        for (r, (msg, _)) in all.iter().enumerate() {
            if msg.len() != hello.len() {
                return Err(Error::peer(format!(
                    "rank {r} sent a malformed init message"
                )));
            }
            let (d, hs, b) = (word(msg, 0) as i32, word(msg, 1), word(msg, 2));
            let theirs: Vec<u64> = (0..n).map(|i| word(msg, 3 + i)).collect();
            if theirs != words {
                return Err(Error::invalid(format!(
                    "rank {r} has {}, rank {rank} has {}; set them alike on every rank",
                    describe_settings(&theirs),
                    describe_settings(&words)
                )));
            }
            if b != backend_word(backend) {
                return Err(Error::invalid(format!(
                    "rank {r} uses the {} backend, rank {rank} the {backend}; set \
                     SYMMALLOC_BACKEND alike",
                    backend_name(b)
                )));
            }
            if hs != heap_size {
                return Err(Error::invalid(format!(
                    "rank {r} has a heap of {hs} bytes, rank {rank} of {heap_size}; set \
                     SYMMALLOC_HEAP_SIZE alike on every rank"
                )));
            }
            if let Some(prev) = devices.iter().position(|&x| x == d) {
                if !settings.shared_gpu {
                    return Err(Error::invalid(format!(
                        "ranks {prev} and {r} both use device {d}; expected one device per rank \
                         (SYMMALLOC_SHARED_GPU=1 lets ranks share a GPU, for testing only)"
                    )));
                }
            }
            let ident =
                PeerIdent::from_words(&(3 + n..6 + n).map(|i| word(msg, i)).collect::<Vec<_>>());
            if let Some(prev) = members.iter().position(|m: &PeerIdent| *m == ident) {
                return Err(Error::invalid(format!(
                    "ranks {prev} and {r} are one process (pid {}) on one device ({d}): a \
                     process is one rank of a communicator per device",
                    ident.pid
                )));
            }
            devices.push(d);
            members.push(ident);
        }
        let (clusters, fewest_sms) = exec.check_peers(rank, &devices, sms)?;

        // The peers' heaps: those a live communicator of this process maps already, else new
        // windows over their release logs.
        let mut heaps: Vec<Option<Arc<PeerHeap>>> = Vec::with_capacity(world);
        for (r, (_, fds)) in all.iter().enumerate() {
            if r == rank {
                heaps.push(None);
                continue;
            }
            let fd = fds
                .first()
                .ok_or_else(|| Error::peer(format!("rank {r} sent no release log at init")))?;
            let p = peers::open(alloc, device, members[r], heap_size, fd.as_fd())
                .map_err(|e| e.context(format!("reserving the window of rank {r}")))?;
            heaps.push(Some(p));
        }
        let seen = PeerReleases::starting_now(&heaps).seen;
        let own_base = crate::heap::comm_view::CommView::new(alloc, device).base()?;
        Ok(Setup {
            rank,
            world,
            device,
            alloc,
            exec,
            mesh,
            settings: Ok(settings),
            claim,
            members,
            windows: PeerWindows::new(rank, own_base, heaps),
            seen,
            sms,
            clusters,
            fewest_sms,
            lineage: None,
            terms: None,
            plan: None,
            arena: None,
        })
    }

    /// Makes the communicator from a `Setup` (collective over `setup.mesh`): agreement and
    /// arena, internal block, first exchange. Every rank fails alike where one refuses.
    pub(in crate::comm) fn build(setup: Setup) -> Result<Box<Communicator>> {
        let Setup {
            rank,
            world,
            device,
            alloc,
            exec,
            mesh,
            settings,
            claim,
            members,
            windows,
            seen,
            sms,
            clusters,
            fewest_sms,
            lineage,
            terms,
            plan,
            arena,
        } = setup;
        let mut refusal = match (&claim, &settings) {
            (Err(why), _) | (_, Err(why)) => Some(why.clone()),
            _ => None,
        };
        if let (Ok(c), None) = (&claim, &refusal) {
            refusal = registry::check_members(c, device, &members);
        }
        let words = settings.as_ref().map_or([0; 8], |s| s.words());
        let arena_len = settings.as_ref().map_or(0, |s| s.arena_len);
        let started = std::time::Instant::now();
        let bet = arena.is_some();
        let arena = match arena {
            // Claimed alike on every rank before the split's first round. What can still refuse
            // here is the child's settings, equal on every rank (that round compared their
            // text): every rank fails alike without a round.
            Some(id) => match refusal {
                Some(why) => {
                    let _ = alloc.release_arena(device, id);
                    return Err(Error::invalid(format!(
                        "the communicator of {world} ranks cannot be created: rank {rank}: {why}"
                    )));
                }
                None => id,
            },
            None => {
                // A split gathered the terms in its first round (and its refusals); `init`
                // here.
                let (terms, late_refusal) = match terms {
                    Some(t) => (t, refusal.as_deref()),
                    None => (
                        super::arena::terms(
                            &mesh,
                            alloc,
                            device,
                            refusal.as_deref(),
                            &words,
                            describe_settings,
                        )?,
                        None,
                    ),
                };
                super::arena::claim(&mesh, alloc, device, arena_len, terms, late_refusal)?
            }
        };
        let claimed = started.elapsed();
        let (Ok(claim), Ok(settings)) = (claim, settings) else {
            // The agreement refused every rank already.
            return Err(Error::internal(
                "a refused communicator passed the agreement",
            ));
        };
        let errors = match exec.mapped_word().map(ErrorWords::new) {
            Ok(e) => e,
            Err(e) => {
                let _ = alloc.release_arena(device, arena);
                return Err(e);
            }
        };
        let mut releases = PeerReleases::starting_now(&windows.peers);
        releases.seen = seen;
        let (grids, meets) = (exec.grids(), exec.meets());
        let comm = Box::new(Communicator {
            rank,
            world,
            device,
            alloc,
            exec,
            mesh,
            settings: CollSettings {
                ll_slot: settings.ll_slot,
                ll_grid: settings.ll_grid,
                auto: settings.auto,
                check_symmetry: settings.check_symmetry,
                timeout: settings.timeout,
                sms,
                clusters,
                fewest_sms,
                grids,
                meets,
            },
            group: Group {
                internal: 0,
                internal_seg: 0,
                arena,
                claim,
                members,
                lineage,
                block: Internal::Own,
            },
            peer: PeerView {
                windows,
                releases,
                pads: Vec::new(),
                mc: HashMap::new(),
            },
            coll: Collectives::new(errors, alloc.heap_releases(device)?),
            p2p: P2p::new(0),
        });
        let plan = plan.unwrap_or(match settings.reserve {
            0 => Plan::Own,
            n => Plan::Reserve(n),
        });
        comm.finish_init(&settings, plan, started, (claimed, bet))
    }
}

/// The executor's backend as a word of the init agreement: its name's bytes (at most 8,
/// `Executor::backend`), so no backend is named here.
fn backend_word(name: &str) -> u64 {
    let mut b = [0u8; 8];
    let n = name.len().min(8);
    b[..n].copy_from_slice(&name.as_bytes()[..n]);
    u64::from_le_bytes(b)
}

/// The backend's name in an agreement word, for messages.
fn backend_name(word: u64) -> String {
    let b = word.to_le_bytes();
    String::from_utf8_lossy(&b[..b.iter().position(|&c| c == 0).unwrap_or(8)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::{backend_name, backend_word};

    #[test]
    fn a_backend_word_names_its_backend_and_tells_backends_apart() {
        for name in ["cuda", "host"] {
            assert_eq!(backend_name(backend_word(name)), name);
        }
        assert_ne!(backend_word("cuda"), backend_word("host"));
        assert_ne!(backend_word("cuda"), 0);
    }
}
