//! `symm_segment_export` on the host backend (memfd chunks): a live block's chunks, exported by
//! one process, are taken by another with `pidfd_open` + `pidfd_getfd` (the protocol PyTorch's
//! expandable segments use for CUDA IPC) and mapped there: both see the same bytes, both ways.
//! Descriptors of chunks the heap gave back are closed (symm_segment_export_close_stale), a
//! live block's stay. And bad input (a pointer outside the heap, inside a block, a freed block,
//! NULL arguments) fails with SYMM_ERR_INVALID_ARGUMENT, naming the pointer, with every
//! allocation intact.

mod common;
use common::err;
use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn host() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set before any other thread of this test binary touches the library.
    ONCE.call_once(|| unsafe { std::env::set_var("SYMMALLOC_BACKEND", "host") });
}

fn alloc(size: usize) -> *mut c_void {
    let mut p = null_mut();
    let st = symm_malloc_checked(size, 0, null_mut(), &mut p);
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    p
}

fn export(p: *const c_void) -> Result<Vec<symm_export_chunk_t>, (symm_status_t, String)> {
    let mut n = 0usize;
    let st = symm_segment_export(p, null_mut(), 0, &mut n);
    if st != symm_status_t::SYMM_SUCCESS {
        return Err((st, err()));
    }
    let mut v = vec![symm_export_chunk_t::default(); n];
    let mut m = 0usize;
    let st = symm_segment_export(p, v.as_mut_ptr(), v.len(), &mut m);
    if st != symm_status_t::SYMM_SUCCESS {
        return Err((st, err()));
    }
    assert_eq!(
        m, n,
        "the count changed between two exports of one live block"
    );
    Ok(v)
}

const SIZE: usize = 3 << 20;

/// The fill pattern of byte `i` written by `who`.
fn pattern(who: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(who)
}

/// Run as a child by `another_process_maps_the_exported_block`: allocates and fills a block,
/// exports it, prints `EXPORT pid addr fd:address:size ...`, waits for a line on stdin, then
/// checks that the parent's writes through its own mapping landed in the block.
#[test]
fn child_exports_a_block() {
    if std::env::var("SYMM_IPC_EXPORT_CHILD").is_err() {
        return; // only as the child of the test below
    }
    host();
    let p = alloc(SIZE) as *mut u8;
    for i in 0..SIZE {
        // SAFETY: p is a live block of SIZE bytes, mapped in this process (host backend).
        unsafe { *p.add(i) = pattern(1, i) };
    }
    let chunks = export(p as *const c_void).expect("export a live block");
    let mut line = format!("EXPORT {} {}", std::process::id(), p as u64);
    for c in &chunks {
        line += &format!(" {}:{}:{}", c.fd, c.address, c.size);
    }
    println!("{line}");
    std::io::stdout().flush().unwrap();
    let mut ack = String::new();
    std::io::stdin().read_line(&mut ack).unwrap();
    for i in 0..SIZE {
        // SAFETY: as above.
        let b = unsafe { *p.add(i) };
        assert_eq!(
            b,
            pattern(2, i),
            "byte {i}: the parent's write is not in the block"
        );
    }
    println!("CHILD OK");
}

/// SAFETY: a raw syscall with integer arguments.
fn pidfd_getfd(pid: i32, fd: i32) -> std::io::Result<i32> {
    // SAFETY: pidfd_open takes a pid and flags; returns a descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number of that process and flags.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd as i32, fd, 0) };
    let e = std::io::Error::last_os_error();
    // SAFETY: pidfd is a descriptor this function opened.
    unsafe { libc::close(pidfd as i32) };
    if got < 0 {
        return Err(e);
    }
    Ok(got as i32)
}

#[test]
fn another_process_maps_the_exported_block() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_exports_a_block",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SYMM_IPC_EXPORT_CHILD", "1")
        .env("SYMMALLOC_BACKEND", "host")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let export_line = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child exited before exporting"
        );
        // libtest prints "test NAME ... " before the test's own output, on the same line.
        if let Some(at) = line.find("EXPORT ") {
            break line[at + "EXPORT ".len()..].trim().to_string();
        }
    };
    let mut words = export_line.split_whitespace();
    let pid: i32 = words.next().unwrap().parse().unwrap();
    let block: u64 = words.next().unwrap().parse().unwrap();
    let chunks: Vec<(i32, u64, u64)> = words
        .map(|w| {
            let v: Vec<u64> = w.split(':').map(|x| x.parse().unwrap()).collect();
            (v[0] as i32, v[1], v[2])
        })
        .collect();
    assert!(!chunks.is_empty());
    let first = chunks[0].1;
    let total: u64 = chunks.iter().map(|c| c.2).sum();
    assert!(
        first <= block && block + SIZE as u64 <= first + total,
        "{chunks:?}"
    );
    // Map the chunks one after another, as PyTorch's fromShared does.
    // SAFETY: a fresh private reservation, replaced below chunk by chunk with MAP_FIXED.
    let base = unsafe {
        libc::mmap(
            null_mut(),
            total as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let mut at = 0u64;
    for &(fd, _, size) in &chunks {
        let mine = pidfd_getfd(pid, fd).unwrap_or_else(|e| panic!("pidfd_getfd({pid}, {fd}): {e}"));
        // SAFETY: maps the taken memfd over our own reservation.
        let m = unsafe {
            libc::mmap(
                (base as *mut u8).add(at as usize) as *mut c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                mine,
                0,
            )
        };
        assert_ne!(m, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        // SAFETY: our own copy of the descriptor; the mapping keeps the memory.
        unsafe { libc::close(mine) };
        at += size;
    }
    let view = (base as *mut u8).wrapping_add((block - first) as usize);
    for i in 0..SIZE {
        // SAFETY: inside the mapping made above.
        let b = unsafe { *view.add(i) };
        assert_eq!(b, pattern(1, i), "byte {i}: not what the child wrote");
        // SAFETY: as above.
        unsafe { *view.add(i) = pattern(2, i) };
    }
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    while out.read_line(&mut line).unwrap() > 0 {
        rest += &line;
        line.clear();
    }
    let status = child.wait().unwrap();
    assert!(
        status.success() && rest.contains("CHILD OK"),
        "child: {status}\n{rest}"
    );
    // SAFETY: the reservation made above, no longer used.
    unsafe { libc::munmap(base, total as usize) };
}

#[test]
fn one_live_block_exports_the_same_descriptors_twice() {
    host();
    let p = alloc(SIZE);
    let a = export(p).unwrap();
    let b = export(p).unwrap();
    assert_eq!(
        a, b,
        "a second export of the same chunk must reuse its open descriptor"
    );
    for c in &a {
        // SAFETY: fcntl on a descriptor number only queries it.
        assert!(
            unsafe { libc::fcntl(c.fd, libc::F_GETFD) } >= 0,
            "fd {} is not open",
            c.fd
        );
    }
    assert_eq!(symm_free_block(p), symm_status_t::SYMM_SUCCESS, "{}", err());
}

#[test]
fn bad_pointers_are_refused_and_allocations_stay() {
    host();
    let p = alloc(SIZE) as *mut u8;
    // SAFETY: p is a live block of SIZE bytes.
    unsafe { std::ptr::write_bytes(p, 0x5a, SIZE) };
    let q = alloc(4096);
    let outside = Box::new(0u64);
    let cases: Vec<(*const c_void, &str)> = vec![
        (
            &*outside as *const u64 as *const c_void,
            "not in symmalloc's heap",
        ),
        (
            p.wrapping_add(512) as *const c_void,
            "expected the start of a live block",
        ),
        (null_mut(), "not in symmalloc's heap"),
    ];
    for (ptr, want) in cases {
        let (st, msg) = export(ptr).expect_err("a bad pointer must be refused");
        assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{msg}");
        assert!(
            msg.contains(want) && msg.contains(&format!("{:#x}", ptr as u64)),
            "{msg}"
        );
    }
    // A freed block.
    assert_eq!(symm_free_block(q), symm_status_t::SYMM_SUCCESS, "{}", err());
    let (st, msg) = export(q).expect_err("a freed block must be refused");
    assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("expected the start of a live block"), "{msg}");
    // NULL arguments.
    let mut n = 0usize;
    assert_eq!(
        symm_segment_export(p as *const c_void, null_mut(), 0, null_mut()),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(err().contains("count is NULL"), "{}", err());
    assert_eq!(
        symm_segment_export(p as *const c_void, null_mut(), 4, &mut n),
        symm_status_t::SYMM_ERR_INVALID_ARGUMENT
    );
    assert!(
        err().contains("chunks is NULL with capacity 4"),
        "{}",
        err()
    );
    // The live block is intact and still exports.
    for i in 0..SIZE {
        // SAFETY: p is still live.
        assert_eq!(unsafe { *p.add(i) }, 0x5a, "byte {i} changed");
    }
    assert!(export(p as *const c_void).is_ok());
    assert_eq!(
        symm_free_block(p as *mut c_void),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
}

#[test]
fn descriptors_of_chunks_given_back_are_closed() {
    host();
    let keep = alloc(SIZE);
    let kept = export(keep).unwrap();
    // A block large enough to sit in chunks of its own, exported, freed, given back.
    let big = alloc(256 << 20);
    assert!(!export(big).unwrap().is_empty());
    assert_eq!(
        symm_free_block(big),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    symm_empty_cache();
    let mut closed = 0usize;
    assert_eq!(
        symm_segment_export_close_stale(&mut closed),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
    assert!(
        closed >= 1,
        "the given-back chunk's descriptor was not closed"
    );
    // A live block keeps its descriptors: the same ones, still open.
    assert_eq!(export(keep).unwrap(), kept);
    for c in &kept {
        // SAFETY: fcntl on a descriptor number only queries it.
        assert!(unsafe { libc::fcntl(c.fd, libc::F_GETFD) } >= 0);
    }
    assert_eq!(
        symm_segment_export_close_stale(std::ptr::null_mut()),
        symm_status_t::SYMM_SUCCESS
    );
    assert_eq!(
        symm_free_block(keep),
        symm_status_t::SYMM_SUCCESS,
        "{}",
        err()
    );
}
