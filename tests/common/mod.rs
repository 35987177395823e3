//! Helpers shared by the integration tests: a seeded PRNG, multi-process rank spawning, and
//! the GPU-presence check that GPU tests use to skip with a visible reason.
#![allow(dead_code)]

mod data;
#[allow(unused_imports)]
pub use data::*;

use std::process::{Command, Output};

/// Writes `v` over `n` bytes of host memory at `ptr` (a block of the host backend's heap).
pub fn fill_host(ptr: u64, n: u64, v: u8) {
    // SAFETY: ptr..ptr+n lies in a live block of host memory returned by the allocator.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, v, n as usize) };
}

/// Checks that the `n` bytes at `ptr` (as `fill_host`) all still hold `v`.
pub fn check_host(ptr: u64, n: u64, v: u8) {
    // SAFETY: as fill_host().
    let s = unsafe { std::slice::from_raw_parts(ptr as *const u8, n as usize) };
    assert!(s.iter().all(|&b| b == v), "block {ptr:#x} was overwritten");
}

/// xorshift64*: deterministic, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Seeds from the clock unless SYMMALLOC_TEST_SEED is set (printed, so failures reproduce).
pub fn seed() -> u64 {
    let s = std::env::var("SYMMALLOC_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("seed: SYMMALLOC_TEST_SEED={s}");
    s
}

/// Rank context of a child process started by `run_ranks`.
pub struct Child {
    pub rank: i32,
    pub world: i32,
    /// The device this rank uses: its rank, or with `SYMM_TEST_RANKS` its rank modulo the GPUs.
    pub device: i32,
    pub id: [u8; 128],
    pub arg: String,
}

pub fn child() -> Option<Child> {
    let rank = std::env::var("SYMM_TEST_RANK").ok()?.parse().ok()?;
    let world = std::env::var("SYMM_TEST_WORLD").ok()?.parse().ok()?;
    let device = std::env::var("SYMM_TEST_DEVICE").ok()?.parse().ok()?;
    let hex = std::env::var("SYMM_TEST_ID").ok()?;
    let mut id = [0u8; 128];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    let arg = std::env::var("SYMM_TEST_ARG").unwrap_or_default();
    Some(Child {
        rank,
        world,
        device,
        id,
        arg,
    })
}

pub fn new_id_hex() -> String {
    let id = symmalloc::ipc::UniqueId::generate().unwrap();
    id.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Starts `world` processes running test `name` of this binary as ranks, in rank order. `env`
/// is added to every child.
pub fn spawn_ranks(
    name: &str,
    world: i32,
    env: &[(&str, &str)],
    arg: &str,
) -> Vec<std::process::Child> {
    spawn_ranks_with(name, world, |_| env.to_vec(), arg)
}

/// As `spawn_ranks`, with each rank's environment additions from `env(rank)`.
pub fn spawn_ranks_with<'a>(
    name: &str,
    world: i32,
    env: impl Fn(i32) -> Vec<(&'a str, &'a str)>,
    arg: &str,
) -> Vec<std::process::Child> {
    let exe = std::env::current_exe().unwrap();
    let name = test_path(name);
    let id = new_id_hex();
    (0..world)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([
                &name,
                "--exact",
                "--nocapture",
                "--test-threads=1",
                "--include-ignored",
            ])
            .env("SYMM_TEST_RANK", r.to_string())
            .env("SYMM_TEST_WORLD", world.to_string())
            .env("SYMM_TEST_DEVICE", device_for(r).to_string())
            .env("SYMM_TEST_ID", &id)
            .env("SYMM_TEST_ARG", arg)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
            for (k, v) in env(r) {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect()
}

/// The full name of this binary's test `name`, as `--exact` takes it: `name` itself in a test
/// binary of one file, `FILE::name` in tests/host.rs's, where each file is a module. Looked up
/// in the binary's own test list (`--list`, once per process); a name that is not a test of
/// this binary, or is one in two modules, fails the caller here rather than start children
/// that run nothing.
pub fn test_path(name: &str) -> String {
    static TESTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let tests = TESTS.get_or_init(|| {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--list", "--format", "terse"])
            .output()
            .expect("listing this binary's tests");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            .map(String::from)
            .collect()
    });
    let suffix = format!("::{name}");
    let found: Vec<&String> = tests
        .iter()
        .filter(|t| *t == name || t.ends_with(&suffix))
        .collect();
    match found[..] {
        [one] => one.clone(),
        _ => panic!(
            "test {name:?}: expected exactly one test of that name in this binary, found {found:?}"
        ),
    }
}

/// `SYMM_TEST_RANKS=N` (GPU tests): run N ranks over this machine's GPUs, rank r on GPU
/// r mod GPUs. More ranks than GPUs needs `SYMMALLOC_SHARED_GPU=1` too: that tests the
/// protocol at N ranks on one GPU (slowly: the ranks' kernels time-slice).
fn ranks_override() -> Option<i32> {
    let v = std::env::var("SYMM_TEST_RANKS").ok()?;
    let n = v.trim().parse::<i32>().ok().filter(|n| (2..=8).contains(n));
    Some(n.unwrap_or_else(|| panic!("SYMM_TEST_RANKS={v:?}; expected 2..=8 ranks")))
}

/// The device rank `rank`'s child uses: the rank itself, or with `SYMM_TEST_RANKS` the rank
/// modulo the number of GPUs.
fn device_for(rank: i32) -> i32 {
    match ranks_override() {
        Some(_) => rank % gpus("SYMM_TEST_RANKS") as i32,
        None => rank,
    }
}

/// The world a multi-rank GPU test runs: one rank per GPU (at most 8), or `SYMM_TEST_RANKS`.
pub fn gpu_world(test: &str) -> i32 {
    let n = gpus(test);
    if let Some(w) = ranks_override() {
        eprintln!("{test}: {w} ranks on {n} GPU(s) (SYMM_TEST_RANKS)");
        return w;
    }
    assert!(
        n >= 2,
        "{test} needs 2 GPUs, found {n} (SYMM_TEST_RANKS=N with SYMMALLOC_SHARED_GPU=1 runs N \
         ranks on fewer GPUs)"
    );
    n.min(8) as i32
}

/// A GPU test's loop count: `full`, or a tenth of it (at least 10) when ranks share a GPU
/// (`SYMMALLOC_SHARED_GPU`: each call then waits for the other ranks' time slices).
pub fn reps(full: u64) -> u64 {
    if symmalloc::config::shared_gpu().unwrap() {
        (full / 10).max(10)
    } else {
        full
    }
}

pub fn wait_all(children: Vec<std::process::Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

pub fn run_ranks(name: &str, world: i32, env: &[(&str, &str)], arg: &str) -> Vec<Output> {
    wait_all(spawn_ranks(name, world, env, arg))
}

pub fn assert_all_ok(outs: &[Output]) {
    let mut report = String::new();
    for (r, o) in outs.iter().enumerate() {
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            let err: String = err
                .lines()
                .filter(|l| !l.starts_with("  "))
                .take(40)
                .collect::<Vec<_>>()
                .join("\n");
            report += &format!(
                "rank {r} failed ({:?}):\n--- stdout\n{}\n--- stderr\n{err}\n",
                o.status,
                String::from_utf8_lossy(&o.stdout)
            );
        }
    }
    assert!(report.is_empty(), "{report}");
}

/// Number of CUDA devices, or None with the reason printed (GPU tests then skip visibly).
/// The number of GPUs. GPU tests are `#[ignore]`d (cargo lists them as ignored, with the
/// reason, and never counts them as passed); one that is asked for with `--include-ignored`
/// on a machine without a GPU fails here rather than pass without running.
pub fn gpus(test: &str) -> usize {
    match symmalloc::cuda::driver() {
        Ok(d) => d.devices.len(),
        Err(e) => panic!("{test} needs a GPU and found none: {}", e.message),
    }
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The calling thread's `symm_last_error()` text.
pub fn err() -> String {
    // SAFETY: symm_last_error returns a valid NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(symmalloc::ffi::symm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// symm_comm_init for this child's rank: the status and the communicator (null on failure).
pub fn try_init(
    c: &Child,
) -> (
    symmalloc::ffi::types::symm_status_t,
    *mut symmalloc::ffi::symm_comm_t,
) {
    use symmalloc::ffi::{symm_comm_init, types::*};
    let mut id = symm_unique_id_t { internal: [0; 128] };
    id.internal
        .iter_mut()
        .zip(c.id)
        .for_each(|(d, s)| *d = s as _);
    let mut comm = std::ptr::null_mut();
    let st = symm_comm_init(&mut comm, c.world, c.rank, c.device, &id);
    (st, comm)
}

pub fn init(c: &Child) -> *mut symmalloc::ffi::symm_comm_t {
    let (st, comm) = try_init(c);
    assert_eq!(
        st,
        symmalloc::ffi::types::symm_status_t::SYMM_SUCCESS,
        "rank {}: {}",
        c.rank,
        err()
    );
    comm
}

/// Destroys a communicator that must go down cleanly.
pub fn destroy(comm: *mut symmalloc::ffi::symm_comm_t) {
    use symmalloc::ffi::{symm_comm_destroy, types::symm_status_t};
    assert_eq!(
        symm_comm_destroy(comm),
        symm_status_t::SYMM_SUCCESS,
        "destroy: {}",
        err()
    );
}

/// The allocator statistics of `device` through the C ABI.
pub fn stats(device: i32) -> symmalloc::heap::stats::Stats {
    use symmalloc::ffi::{symm_memory_stats_sized, types::symm_status_t};
    let mut s = std::mem::MaybeUninit::<symmalloc::heap::stats::Stats>::uninit();
    assert_eq!(
        symm_memory_stats_sized(device, s.as_mut_ptr(), std::mem::size_of_val(&s)),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    // SAFETY: filled on success.
    unsafe { s.assume_init() }
}

/// The opening of both asymmetry tests: rank 0 allocates one extra 3 MiB block first, so the
/// next 8 MiB buffer lands at another offset on each rank, and the all-reduce must fail on
/// every rank with SYMM_ERR_NOT_SYMMETRIC naming both ranks. Returns (extra, buffer) to free.
pub fn expect_exchange_asymmetry(
    c: &Child,
    comm: *mut symmalloc::ffi::symm_comm_t,
) -> (*mut std::ffi::c_void, *mut std::ffi::c_void) {
    use symmalloc::ffi::{symm_all_reduce, symm_malloc, types::*};
    let none = std::ptr::null_mut();
    let extra = if c.rank == 0 {
        symm_malloc(3 << 20, c.device, none)
    } else {
        none as _
    };
    let p = symm_malloc(8 << 20, c.device, none);
    let st = symm_all_reduce(comm, p, p, 1024, SYMM_FP32, SYMM_SUM, none);
    assert_eq!(
        st,
        symm_status_t::SYMM_ERR_NOT_SYMMETRIC,
        "rank {}: {}",
        c.rank,
        err()
    );
    let e = err();
    assert!(e.contains("rank 0") && e.contains("rank 1"), "{e}");
    (extra, p)
}

// ---- Host-backend element helpers (the multi-process host tests share them).

pub const HOST: (&str, &str) = ("SYMMALLOC_BACKEND", "host");
use symmalloc::comm::convert::*;
use symmalloc::ffi::types::{SYMM_BF16, SYMM_FP16, SYMM_FP32};

/// Rank r's input element i for a seed: reproducible on every rank, so each rank can compute
/// the float64 reference of the whole collective.
pub fn input(seed: u64, rank: i32, i: usize) -> f32 {
    let mut r = Rng::new(seed ^ ((rank as u64) << 40) ^ (i as u64).wrapping_mul(0x9E37));
    r.unit() * 4.0
}

pub fn dtypes() -> [(u32, usize); 3] {
    [(SYMM_BF16, 2), (SYMM_FP16, 2), (SYMM_FP32, 4)]
}

pub unsafe fn write_elem(p: *mut u8, dtype: u32, i: usize, v: f32) {
    match dtype {
        SYMM_BF16 => (p as *mut u16).add(i).write(f32_to_bf16(v)),
        SYMM_FP16 => (p as *mut u16).add(i).write(f32_to_f16(v)),
        _ => (p as *mut f32).add(i).write(v),
    }
}

pub unsafe fn read_elem(p: *const u8, dtype: u32, i: usize) -> f32 {
    match dtype {
        SYMM_BF16 => bf16_to_f32((p as *const u16).add(i).read()),
        SYMM_FP16 => f16_to_f32((p as *const u16).add(i).read()),
        _ => (p as *const f32).add(i).read(),
    }
}

pub fn rounded(dtype: u32, v: f32) -> f64 {
    (match dtype {
        SYMM_BF16 => bf16_to_f32(f32_to_bf16(v)),
        SYMM_FP16 => f16_to_f32(f32_to_f16(v)),
        _ => v,
    }) as f64
}

pub fn tolerance(dtype: u32) -> f64 {
    match dtype {
        SYMM_BF16 => 1e-2,
        SYMM_FP16 => 2e-3,
        _ => 1e-5,
    }
}

/// Each rank printed `rank R: outputs hash H...`: every rank's H must be the same (results
/// identical bit for bit on every rank).
pub fn assert_same_output_hash(outs: &[Output]) {
    let hashes: Vec<String> = outs
        .iter()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stdout);
            let l = s
                .lines()
                .find(|l| l.contains("outputs hash"))
                .expect("a rank printed no hash line");
            let h = l.split("outputs hash ").nth(1).unwrap();
            h.split(|ch: char| !ch.is_ascii_hexdigit())
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "ranks differ: {hashes:?}"
    );
}

// ---- Communicator helpers of the groups tests (groups_host.rs, groups_slots_host.rs,
// gpu_groups.rs).

pub type Comm = *mut symmalloc::ffi::symm_comm_t;
pub const OK: symmalloc::ffi::types::symm_status_t =
    symmalloc::ffi::types::symm_status_t::SYMM_SUCCESS;
/// Small LL buffers: internal blocks of a few hundred KiB, so many communicators fit.
pub const SMALL_LL: (&str, &str) = ("SYMMALLOC_LL_BYTES", "64K");

/// Asserts a call succeeded, with `symm_last_error()` in the failure.
pub fn ok(st: symmalloc::ffi::types::symm_status_t, what: &str) {
    assert_eq!(st, OK, "{what}: {}", err());
}

/// `symm_comm_split`, checked: a child exactly where `color` is not SYMM_SPLIT_NOCOLOR.
pub fn split(parent: Comm, color: i32, key: i32) -> Comm {
    let mut child = std::ptr::null_mut();
    ok(
        symmalloc::ffi::groups::symm_comm_split(parent, color, key, &mut child),
        "split",
    );
    assert_eq!(
        child.is_null(),
        color == symmalloc::ffi::groups::SYMM_SPLIT_NOCOLOR
    );
    child
}

// ---- The MoE tests' shared parts (moe_host.rs, gpu_moe.rs).
pub mod moe;
