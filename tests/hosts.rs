//! Ranks on several hosts (simulated on one machine with `SYMMALLOC_HOST_ID`, host backend): an
//! id made on another host is refused before any wait, the bootstrap handshake refuses a peer
//! on another host on both sides at once, naming ranks and hosts, and ids derived from the
//! launcher's variables are per host (two hosts of one torchrun job each get their own
//! communicator).

use crate::common;
use common::*;
use std::process::{Command, Output, Stdio};
use std::ptr::null_mut;
use std::time::{Duration, Instant};
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;
use symmalloc::ipc::host::Host;
use symmalloc::ipc::UniqueId;

fn id_hex(id: &UniqueId) -> String {
    id.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Starts this binary's test `name` once per entry of `envs` (each child's extra variables),
/// on the host backend, and waits for all.
fn run_children(name: &str, envs: &[Vec<(&str, String)>]) -> Vec<Output> {
    run_children_after(name, envs, &[])
}

/// As `run_children`, child i started `delays[i]` after the one before it (0 when absent).
fn run_children_after(name: &str, envs: &[Vec<(&str, String)>], delays: &[u64]) -> Vec<Output> {
    let exe = std::env::current_exe().unwrap();
    let name = test_path(name);
    let children: Vec<_> = envs
        .iter()
        .enumerate()
        .map(|(i, env)| {
            std::thread::sleep(Duration::from_millis(delays.get(i).copied().unwrap_or(0)));
            let mut c = Command::new(&exe);
            c.args([&name, "--exact", "--nocapture", "--test-threads=1"])
                .env("SYMMALLOC_BACKEND", "host")
                .env_remove("SYMMALLOC_HOST_ID")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    wait_all(children)
}

/// Each child's `RESULT status seconds message` line.
fn results(outs: &[Output]) -> Vec<(i32, f64, String)> {
    outs.iter()
        .enumerate()
        .map(|(r, o)| {
            let stdout = String::from_utf8_lossy(&o.stdout);
            let line = stdout
                .lines()
                .find_map(|l| l.split_once("RESULT ").map(|(_, x)| x.to_string()))
                .unwrap_or_else(|| {
                    panic!(
                        "child {r} printed no result ({:?}):\n{stdout}\n{}",
                        o.status,
                        String::from_utf8_lossy(&o.stderr)
                    )
                });
            let mut it = line.splitn(3, ' ');
            let st = it.next().unwrap().parse().unwrap();
            let secs = it.next().unwrap().parse().unwrap();
            (st, secs, it.next().unwrap_or("").to_string())
        })
        .collect()
}

/// In a child: `symm_comm_init` with the given id; prints the status, the seconds it took and
/// the message.
fn init_child() {
    let c = child().expect("started as a rank");
    let start = Instant::now();
    let (st, comm) = try_init(&c);
    let secs = start.elapsed().as_secs_f64();
    let msg = err().replace('\n', " ");
    println!("RESULT {} {secs:.3} {msg}", st as i32);
    if st == symm_status_t::SYMM_SUCCESS {
        destroy(comm);
    }
}

fn rank_env(
    world: usize,
    rank: usize,
    id: &str,
    host: &str,
    timeout: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("SYMM_TEST_RANK", rank.to_string()),
        ("SYMM_TEST_WORLD", world.to_string()),
        ("SYMM_TEST_DEVICE", rank.to_string()),
        ("SYMM_TEST_ID", id.to_string()),
        ("SYMMALLOC_HOST_ID", host.to_string()),
        ("SYMMALLOC_TIMEOUT_S", timeout.to_string()),
    ]
}

#[test]
fn an_id_made_on_another_host_is_refused_before_any_wait() {
    if std::env::var("SYMM_TEST_RANK").is_ok() {
        return init_child();
    }
    let id = id_hex(&UniqueId::generate_for(&Host::from_override("node-a")).unwrap());
    let outs = run_children(
        "an_id_made_on_another_host_is_refused_before_any_wait",
        &[
            rank_env(2, 0, &id, "node-a", "3"),
            rank_env(2, 1, &id, "node-b", "3"),
        ],
    );
    let r = results(&outs);
    let invalid = symm_status_t::SYMM_ERR_INVALID_ARGUMENT as i32;
    let (st, secs, msg) = &r[1];
    assert_eq!(*st, invalid, "rank 1: {msg}");
    assert!(*secs < 1.0, "rank 1 took {secs} s to refuse: {msg}");
    for part in [
        "rank 1 runs on host 'node-b'",
        "made on host 'node-a'",
        "one host",
    ] {
        assert!(msg.contains(part), "rank 1 lacks {part:?}: {msg}");
    }
    // Rank 0 cannot hear from a rank on another host: it waits out its timeout, and is told
    // that such a rank refuses the id.
    let (st, secs, msg) = &r[0];
    assert_eq!(*st, symm_status_t::SYMM_ERR_TIMEOUT as i32, "rank 0: {msg}");
    assert!(*secs < 10.0, "rank 0 took {secs} s");
    for part in ["rank 1 did not connect", "another host than 'node-a'"] {
        assert!(msg.contains(part), "rank 0 lacks {part:?}: {msg}");
    }
}

#[test]
fn the_handshake_refuses_a_peer_on_another_host_on_both_sides() {
    if std::env::var("SYMM_TEST_RANK").is_ok() {
        return init_child();
    }
    // An id that names no host (as ids of the first layout): only the handshake can tell.
    let id = UniqueId {
        host: None,
        ..UniqueId::generate().unwrap()
    };
    let id = id_hex(&id);
    let start = Instant::now();
    // Rank 2 comes last, once rank 1 has met rank 0 and waits for rank 2: rank 0 refuses rank
    // 2 and rank 2 rank 0, at once. Rank 1, a bystander, waits out its (shorter) timeout for
    // rank 2, which never comes: no rank can tell it (the bootstrap keeps a rank waiting for a
    // late peer rather than failing it when another leaves, so that a late rank is blamed
    // for itself and not for the ranks that gave up on it).
    let outs = run_children_after(
        "the_handshake_refuses_a_peer_on_another_host_on_both_sides",
        &[
            rank_env(3, 0, &id, "node-a", "60"),
            rank_env(3, 1, &id, "node-a", "4"),
            rank_env(3, 2, &id, "node-b", "60"),
        ],
        &[0, 0, 1500],
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the ranks took {:?} (the timeout is 60 s)",
        start.elapsed()
    );
    let invalid = symm_status_t::SYMM_ERR_INVALID_ARGUMENT as i32;
    for (r, (st, secs, msg)) in results(&outs).iter().enumerate() {
        if r == 1 {
            assert_eq!(*st, symm_status_t::SYMM_ERR_TIMEOUT as i32, "rank 1: {msg}");
            assert!(
                *secs < 10.0 && msg.contains("rank 2 did not connect to rank 1"),
                "rank 1 after {secs} s: {msg}"
            );
            continue;
        }
        assert_eq!(*st, invalid, "rank {r}: {msg}");
        assert!(*secs < 10.0, "rank {r} took {secs} s: {msg}");
        for part in [
            "rank 2 runs on host 'node-b'",
            "on host 'node-a'",
            "one host",
        ] {
            let part = if r == 2 {
                part.replace("rank 2 runs on host 'node-b'", "on host 'node-b'")
            } else {
                part.to_string()
            };
            assert!(msg.contains(&part), "rank {r} lacks {part:?}: {msg}");
        }
    }
}

/// In a child: `symm_comm_init_from_env` as torchrun's local rank, then an all-reduce of
/// (local rank + 1) whose sum must count the ranks of this host only.
fn from_env_child() {
    let start = Instant::now();
    let mut comm = null_mut();
    let st = symm_comm_init_from_env(&mut comm);
    let secs = start.elapsed().as_secs_f64();
    if st != symm_status_t::SYMM_SUCCESS {
        println!(
            "RESULT {} {secs:.3} {}",
            st as i32,
            err().replace('\n', " ")
        );
        return;
    }
    let local: i32 = std::env::var("LOCAL_RANK").unwrap().parse().unwrap();
    let world: i32 = std::env::var("LOCAL_WORLD_SIZE").unwrap().parse().unwrap();
    // On the communicator's device (from_env: the local rank's), like any collective's buffer.
    let p = symm_malloc(64, local, null_mut());
    // SAFETY: 64 bytes of host memory.
    unsafe { (p as *mut f32).write((local + 1) as f32) };
    let st = symm_all_reduce(comm, p, p, 1, SYMM_FP32, SYMM_SUM, null_mut());
    // SAFETY: as above.
    let got = unsafe { (p as *const f32).read() };
    let want = (world * (world + 1) / 2) as f32;
    println!(
        "RESULT {} {secs:.3} sum {got} want {want} {}",
        st as i32,
        err()
    );
    symm_free(p, 64, local, null_mut());
    destroy(comm);
}

#[test]
fn ids_derived_from_the_launcher_are_per_host() {
    if std::env::var("SYMM_TEST_FROM_ENV").is_ok() {
        return from_env_child();
    }
    // One torchrun job over two simulated hosts: the same variables on both but the host.
    let job = format!("hosts-{}", std::process::id());
    let envs: Vec<Vec<(&str, String)>> = (0..4)
        .map(|g| {
            vec![
                ("SYMM_TEST_FROM_ENV", "1".to_string()),
                ("LOCAL_RANK", (g % 2).to_string()),
                ("LOCAL_WORLD_SIZE", "2".to_string()),
                ("TORCHELASTIC_RUN_ID", job.clone()),
                ("SYMMALLOC_HOST_ID", format!("node-{}", g / 2)),
                ("SYMMALLOC_TIMEOUT_S", "20".to_string()),
            ]
        })
        .collect();
    let outs = run_children("ids_derived_from_the_launcher_are_per_host", &envs);
    for (g, (st, _, msg)) in results(&outs).iter().enumerate() {
        assert_eq!(*st, 0, "rank {g}: {msg}");
        assert!(msg.starts_with("sum 3 want 3"), "rank {g}: {msg}");
    }
}
