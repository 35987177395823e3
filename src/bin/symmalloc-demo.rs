//! symmalloc-demo: finds the GPUs, says what each can do, proves the embedded kernels run, and
//! with two or more GPUs runs an all-reduce with one process per GPU through the C ABI.
//! Without a GPU (no libcuda, cuInit failing, or no device) it says so and runs on host memory
//! instead (host.rs: two processes, an allocation, an all-reduce and a pool, checked). A
//! `SYMMALLOC_BACKEND` the user set wins: `host` runs the host demo, `cuda` insists on a GPU.
//!
//! Usage: symmalloc-demo [--count N]   (children are started with --child RANK WORLD ID)

#[path = "symmalloc-demo/host.rs"]
mod host;

use std::ffi::CStr;
use std::process::{Command, ExitCode};
use symmalloc::comm::convert::{bf16_to_f32, f32_to_bf16};
use symmalloc::config::{self, BackendKind};
use symmalloc::cuda::{self, util};
use symmalloc::ffi::{self, types::*};

fn last_error() -> String {
    // SAFETY: symm_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::symm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn fail(what: &str) -> ExitCode {
    eprintln!("symmalloc-demo: {what}: {}", last_error());
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    // The backend the user asked for, if any (an unknown value is refused here, by name).
    let asked = match config::var("SYMMALLOC_BACKEND").filter(|v| !v.trim().is_empty()) {
        None => None,
        Some(_) => match config::backend_kind() {
            Ok(kind) => Some(kind),
            Err(e) => {
                eprintln!("symmalloc-demo: {}", e.message);
                return ExitCode::FAILURE;
            }
        },
    };
    if args.len() == 5 && args[1] == "--child" {
        let (rank, world) = (args[2].parse().unwrap(), args[3].parse().unwrap());
        let id = parse_id(&args[4]);
        return match asked {
            Some(BackendKind::Host) => host::child(rank, world, &id),
            _ => child(rank, world, &id),
        };
    }
    let on_host = match asked {
        Some(BackendKind::Host) => {
            println!("symmalloc-demo: SYMMALLOC_BACKEND=host: running on host memory");
            true
        }
        Some(BackendKind::Cuda) => false,
        None => match cuda::driver() {
            Ok(_) => false,
            Err(e) => {
                println!("symmalloc-demo: no GPU found: {}", e.message);
                println!(
                    "symmalloc-demo: using host memory instead (the host backend), because no \
                     GPU was found"
                );
                true
            }
        },
    };
    if on_host {
        let Some(hex) = unique_id_hex() else {
            return fail("symm_get_unique_id");
        };
        return host::run(&std::env::current_exe().expect("own path"), &hex);
    }
    let count: usize = args
        .iter()
        .position(|a| a == "--count")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let drv = match cuda::driver() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("symmalloc-demo: no GPU to run on: {}", e.message);
            eprintln!(
                "symmalloc-demo: SYMMALLOC_BACKEND=cuda asks for a GPU; unset it (or set it to \
                 host) to run this demo on host memory."
            );
            return ExitCode::FAILURE;
        }
    };
    println!("symmalloc-demo: {} GPU(s)", drv.devices.len());
    for d in &drv.devices {
        let peers: Vec<String> = drv
            .devices
            .iter()
            .filter(|p| p.ordinal != d.ordinal)
            .map(|p| {
                let ok = drv.can_access_peer(d.ordinal, p.ordinal).unwrap_or(false);
                format!("{}:{}", p.ordinal, if ok { "yes" } else { "no" })
            })
            .collect();
        println!(
            "  GPU {}: {} (sm_{}{}, {} SMs, {:.1} GiB) VMM={} fd-export={} multicast={} P2P=[{}]",
            d.ordinal,
            d.name,
            d.cc_major,
            d.cc_minor,
            d.sm_count,
            d.total_mem as f64 / (1u64 << 30) as f64,
            d.vmm,
            d.posix_fd,
            d.multicast,
            peers.join(" ")
        );
    }
    if let Err(e) = selftest(0) {
        eprintln!("symmalloc-demo: self-test kernel failed: {e}");
        return ExitCode::FAILURE;
    }
    println!("  self-test: symm_malloc + embedded saxpy kernel on GPU 0: correct");
    let world = drv.devices.len().min(8);
    if world < 2 {
        println!("symmalloc-demo: one GPU: an all-reduce needs two or more; done.");
        return ExitCode::SUCCESS;
    }
    let Some(hex) = unique_id_hex() else {
        return fail("symm_get_unique_id");
    };
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .args(["--child", &r.to_string(), &world.to_string(), &hex])
                .env("SYMMALLOC_DEMO_COUNT", count.to_string())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    let mut ok = true;
    for mut c in children {
        ok &= c.wait().map(|s| s.success()).unwrap_or(false);
    }
    if ok {
        println!("symmalloc-demo: all-reduce across {world} GPUs: correct on every rank");
        ExitCode::SUCCESS
    } else {
        eprintln!("symmalloc-demo: a rank failed (see above)");
        ExitCode::FAILURE
    }
}

/// A fresh unique id, as hex for a child's command line.
fn unique_id_hex() -> Option<String> {
    let mut id = symm_unique_id_t { internal: [0; 128] };
    if ffi::symm_get_unique_id(&mut id) != symm_status_t::SYMM_SUCCESS {
        return None;
    }
    Some(
        id.internal
            .iter()
            .map(|&c| format!("{:02x}", c as u8))
            .collect(),
    )
}

fn parse_id(hex: &str) -> symm_unique_id_t {
    let mut id = symm_unique_id_t { internal: [0; 128] };
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0) as _;
    }
    id
}

fn selftest(device: i32) -> Result<(), String> {
    let n = 4096usize;
    let bytes = n * 4;
    let x = ffi::symm_malloc(bytes, device, std::ptr::null_mut()) as u64;
    let y = ffi::symm_malloc(bytes, device, std::ptr::null_mut()) as u64;
    if x == 0 || y == 0 {
        return Err(last_error());
    }
    let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let ys: Vec<f32> = (0..n).map(|i| 1.0 + i as f32).collect();
    let e = |e: symmalloc::Error| e.to_string();
    util::htod(device, x, bytemuck(&xs)).map_err(e)?;
    util::htod(device, y, bytemuck(&ys)).map_err(e)?;
    let stream = util::stream_create(device).map_err(e)?;
    util::saxpy(device, stream, 2.0, x, y, n as u64).map_err(e)?;
    util::stream_sync(device, stream).map_err(e)?;
    let mut out = vec![0u8; bytes];
    util::dtoh(device, &mut out, y).map_err(e)?;
    for i in 0..n {
        let got = f32::from_le_bytes(out[i * 4..i * 4 + 4].try_into().unwrap());
        let want = 2.0 * xs[i] + ys[i];
        if got != want {
            return Err(format!("y[{i}] = {got}, expected {want}"));
        }
    }
    ffi::symm_free(x as *mut _, bytes, device, std::ptr::null_mut());
    ffi::symm_free(y as *mut _, bytes, device, std::ptr::null_mut());
    Ok(())
}

fn bytemuck(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding; the slice covers exactly the vector's bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn child(rank: i32, world: i32, id: &symm_unique_id_t) -> ExitCode {
    let count: usize = std::env::var("SYMMALLOC_DEMO_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 20);
    let mut comm: *mut ffi::symm_comm_t = std::ptr::null_mut();
    if ffi::symm_comm_init(&mut comm, world, rank, rank, id) != symm_status_t::SYMM_SUCCESS {
        return fail("symm_comm_init");
    }
    let bytes = count * 2;
    let buf = ffi::symm_malloc(bytes, rank, std::ptr::null_mut());
    if buf.is_null() {
        return fail("symm_malloc");
    }
    // Element i of rank r holds (r + 1) * (i % 7): the sum is (i % 7) * world * (world + 1) / 2.
    let host: Vec<u16> = (0..count)
        .map(|i| f32_to_bf16(((rank + 1) * (i % 7) as i32) as f32))
        .collect();
    // SAFETY: u16 slice viewed as bytes.
    let raw = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, bytes) };
    util::htod(rank, buf as u64, raw).expect("upload");
    let stream = util::stream_create(rank).expect("stream");
    let timer = util::Timer::new(rank).expect("timer");
    for _ in 0..5 {
        let st = ffi::symm_all_reduce(comm, buf, buf, count, SYMM_BF16, SYMM_SUM, stream as _);
        if st != symm_status_t::SYMM_SUCCESS {
            return fail("symm_all_reduce");
        }
        // Re-upload so each iteration reduces the same inputs.
        util::stream_sync(rank, stream).expect("sync");
        util::htod(rank, buf as u64, raw).expect("upload");
        if ffi::symm_barrier(comm, stream as _) != symm_status_t::SYMM_SUCCESS {
            return fail("symm_barrier");
        }
    }
    timer.start(stream).expect("timer");
    let st = ffi::symm_all_reduce(comm, buf, buf, count, SYMM_BF16, SYMM_SUM, stream as _);
    let ms = timer.stop_ms(stream).expect("timer");
    if st != symm_status_t::SYMM_SUCCESS {
        return fail("symm_all_reduce");
    }
    let mut out = vec![0u8; bytes];
    util::dtoh(rank, &mut out, buf as u64).expect("download");
    let tri = (world * (world + 1) / 2) as f32;
    for i in 0..count {
        let got = bf16_to_f32(u16::from_le_bytes([out[2 * i], out[2 * i + 1]]));
        let want = (i % 7) as f32 * tri;
        if got != want {
            eprintln!("rank {rank}: element {i} = {got}, expected {want}");
            return ExitCode::FAILURE;
        }
    }
    println!(
        "  rank {rank} (GPU {rank}): bf16 sum of {count} elements ({:.1} KiB) correct, {:.1} us",
        bytes as f64 / 1024.0,
        ms * 1000.0
    );
    ffi::symm_free(buf, bytes, rank, std::ptr::null_mut());
    if ffi::symm_comm_destroy(comm) != symm_status_t::SYMM_SUCCESS {
        return fail("symm_comm_destroy");
    }
    ExitCode::SUCCESS
}
