//! The demo on the host backend (`SYMMALLOC_BACKEND=host`), for machines without a GPU: two
//! processes, each a rank of one communicator on its own virtual device, allocate a symmetric
//! buffer, all-reduce it, then do the same inside a memory pool and give the pool back. Every
//! step is checked; a wrong value or a failed call makes the rank, and the demo, fail.

use super::{fail, last_error};
use std::process::{Command, ExitCode};
use std::ptr::null_mut;
use symmalloc::ffi::{self, types::*};

const WORLD: i32 = 2;
const COUNT: usize = 4096;
/// The pool the demo routes its second buffer to (any id unused by the default pool).
const POOL: (u64, u64) = (7, 0);

/// Starts the two ranks and waits for both.
pub fn run(exe: &std::path::Path, hex: &str) -> ExitCode {
    let children: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(exe)
                .args(["--child", &r.to_string(), &WORLD.to_string(), hex])
                .env("SYMMALLOC_BACKEND", "host")
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    let mut ok = true;
    for mut c in children {
        ok &= c.wait().map(|s| s.success()).unwrap_or(false);
    }
    if ok {
        println!(
            "symmalloc-demo: host memory, {WORLD} processes: allocation, all-reduce and pool \
             correct on every rank"
        );
        ExitCode::SUCCESS
    } else {
        eprintln!("symmalloc-demo: a rank failed (see above)");
        ExitCode::FAILURE
    }
}

/// Fills `buf` with rank `rank`'s input, all-reduces it in place (fp32 sum) and checks every
/// element: element i of rank r holds (r + 1) * (i % 7), so the sum is (i % 7) * 3 at two ranks.
fn all_reduce_checked(comm: *mut ffi::symm_comm_t, buf: *mut f32, rank: i32) -> Result<(), String> {
    // SAFETY: buf is a live host-backend block of COUNT f32s, mapped in this process.
    let data = unsafe { std::slice::from_raw_parts_mut(buf, COUNT) };
    for (i, x) in data.iter_mut().enumerate() {
        *x = ((rank + 1) * (i % 7) as i32) as f32;
    }
    let st = ffi::symm_all_reduce(
        comm,
        buf as _,
        buf as _,
        COUNT,
        SYMM_FP32,
        SYMM_SUM,
        null_mut(),
    );
    if st != symm_status_t::SYMM_SUCCESS {
        return Err(format!("symm_all_reduce: {}", last_error()));
    }
    let tri = (WORLD * (WORLD + 1) / 2) as f32;
    for (i, &got) in data.iter().enumerate() {
        let want = (i % 7) as f32 * tri;
        if got != want {
            return Err(format!("element {i} = {got}, expected {want}"));
        }
    }
    Ok(())
}

/// The blocks pool `POOL` holds on `device`, as (address, size).
fn pool_blocks(device: i32) -> Result<Vec<(u64, u64)>, String> {
    let mut count = 0usize;
    let (f, s) = POOL;
    if ffi::symm_heap_blocks(device, 0, f, s, null_mut(), 0, &mut count)
        != symm_status_t::SYMM_SUCCESS
    {
        return Err(format!("symm_heap_blocks: {}", last_error()));
    }
    let mut out = vec![ffi::symm_block_info_t::default(); count];
    let mut n = 0usize;
    if ffi::symm_heap_blocks(device, 0, f, s, out.as_mut_ptr(), count, &mut n)
        != symm_status_t::SYMM_SUCCESS
    {
        return Err(format!("symm_heap_blocks: {}", last_error()));
    }
    out.truncate(n.min(count));
    Ok(out.iter().map(|b| (b.address, b.size)).collect())
}

/// One rank: device `rank` of the host backend.
pub fn child(rank: i32, world: i32, id: &symm_unique_id_t) -> ExitCode {
    let mut comm: *mut ffi::symm_comm_t = null_mut();
    if ffi::symm_comm_init(&mut comm, world, rank, rank, id) != symm_status_t::SYMM_SUCCESS {
        return fail("symm_comm_init");
    }
    let bytes = COUNT * 4;
    let buf = ffi::symm_malloc(bytes, rank, null_mut()) as *mut f32;
    if buf.is_null() {
        return fail("symm_malloc");
    }
    if let Err(e) = all_reduce_checked(comm, buf, rank) {
        eprintln!("symmalloc-demo: rank {rank}: {e}");
        return ExitCode::FAILURE;
    }
    ffi::symm_free(buf as _, bytes, rank, null_mut());
    println!("  rank {rank} (host device {rank}): fp32 sum of {COUNT} elements correct");

    // The same in a pool (as a CUDA graph's allocations are): the block is the pool's, and
    // releasing the pool gives its memory back.
    let (f, s) = POOL;
    ffi::symm_begin_pool(rank, f, s);
    let pooled = ffi::symm_malloc(bytes, rank, null_mut()) as *mut f32;
    ffi::symm_end_pool(rank, f, s);
    if pooled.is_null() {
        return fail("symm_malloc in a pool");
    }
    let checked = pool_blocks(rank).and_then(|blocks| {
        if blocks.iter().any(|&(a, _)| a == pooled as u64) {
            Ok(())
        } else {
            Err(format!(
                "pool {POOL:?} holds {blocks:x?}, not the block at {pooled:p}"
            ))
        }
    });
    let checked = checked.and_then(|()| all_reduce_checked(comm, pooled, rank));
    ffi::symm_free(pooled as _, bytes, rank, null_mut());
    ffi::symm_release_pool(rank, f, s);
    let checked = checked.and_then(|()| match pool_blocks(rank)? {
        b if b.is_empty() => Ok(()),
        b => Err(format!(
            "pool {POOL:?} still holds {b:x?} after symm_release_pool"
        )),
    });
    if let Err(e) = checked {
        eprintln!("symmalloc-demo: rank {rank}: pool: {e}");
        return ExitCode::FAILURE;
    }
    println!("  rank {rank}: the same in a pool, then the pool released: correct, no block left");
    if ffi::symm_comm_destroy(comm) != symm_status_t::SYMM_SUCCESS {
        return fail("symm_comm_destroy");
    }
    ExitCode::SUCCESS
}
