//! A peer that destroys its communicator while this rank still uses its own: this rank's next
//! call unmaps the peer's released memory (its release log says so) and must then report the
//! peer, never touch the unmapped signal pads (a segfault before) and keep reporting it. Host
//! backend, 2 and 3 ranks: the last rank destroys its communicator after one agreed call; the
//! others, once it has, call again (staged and in the heap) and expect SYMM_ERR_PEER naming it.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn rank(c: Child) {
    let comm = init(&c);
    let marker = format!("{}/destroyed", c.arg);
    let n = 1024usize;
    let p = symm_malloc(n * 4, c.device, null_mut());
    let mut outside = vec![1f32; n];
    let st = symm_all_reduce(comm, p, p, n, SYMM_FP32, SYMM_SUM, null_mut());
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let st = symm_all_reduce(
        comm,
        outside.as_ptr() as _,
        outside.as_mut_ptr() as _,
        n,
        SYMM_FP32,
        SYMM_SUM,
        null_mut(),
    );
    assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
    let last = c.rank == c.world - 1;
    if last {
        destroy(comm);
        symm_empty_cache(); // the peer's memory goes back to the host: unmapped on the others
        std::fs::write(&marker, b"1").unwrap();
        return;
    }
    while std::fs::metadata(&marker).is_err() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    for (what, send) in [("heap", p as u64), ("staged", outside.as_ptr() as u64)] {
        for _ in 0..2 {
            let st = symm_all_reduce(
                comm,
                send as _,
                send as _,
                n,
                SYMM_FP32,
                SYMM_SUM,
                null_mut(),
            );
            assert_eq!(st, symm_status_t::SYMM_ERR_PEER, "{what}: {}", err());
            let e = err();
            assert!(
                e.contains(&format!("rank {} destroyed its communicator", c.world - 1)),
                "{e}"
            );
        }
    }
    assert_eq!(symm_barrier(comm, null_mut()), symm_status_t::SYMM_ERR_PEER);
    destroy(comm);
}

#[test]
fn a_peer_that_destroyed_its_communicator_is_reported_not_touched() {
    if let Some(c) = child() {
        return rank(c);
    }
    for world in [2, 3] {
        let dir = std::env::temp_dir().join(format!(
            "symm-peer-destroyed-{}-{world}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_all_ok(&run_ranks(
            "a_peer_that_destroyed_its_communicator_is_reported_not_touched",
            world,
            &[HOST],
            dir.to_str().unwrap(),
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
