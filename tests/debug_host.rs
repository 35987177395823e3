//! SYMMALLOC_DEBUG on the host backend, two processes: INFO names the version, the heap, the
//! communicator, AUTO's choice per new size (once) and the segment exchanges; TRACE adds every
//! call; off prints nothing; an unknown level fails the first call, named.

use crate::common;
use common::*;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

fn calls_rank(c: Child) {
    if c.arg == "refused" {
        // An unknown level fails the first call (the allocator's creation), named.
        let (st, comm) = try_init(&c);
        assert_eq!(st, symm_status_t::SYMM_ERR_INVALID_ARGUMENT, "{}", err());
        assert!(comm.is_null());
        let e = err();
        assert!(
            e.contains(
                "SYMMALLOC_DEBUG=\"LOUD\" is not accepted; expected one of OFF, WARN, INFO, TRACE"
            ),
            "{e}"
        );
        assert!(symm_malloc(64, c.rank, null_mut()).is_null());
        assert!(err().contains("SYMMALLOC_DEBUG=\"LOUD\""), "{}", err());
        return;
    }
    let comm = init(&c);
    for (n, algo) in [
        (1000usize, SYMM_ALGO_AUTO),
        (1000, SYMM_ALGO_AUTO),
        (5000, SYMM_ALGO_AUTO),
        (1000, SYMM_ALGO_TWO_SHOT),
    ] {
        let p = symm_malloc(n * 4, c.rank, null_mut());
        assert!(!p.is_null(), "{}", err());
        let st = symm_all_reduce_algo(comm, algo, p, p, n, SYMM_FP32, SYMM_SUM, null_mut());
        assert_eq!(st, symm_status_t::SYMM_SUCCESS, "{}", err());
        symm_free(p, n * 4, c.rank, null_mut());
    }
    destroy(comm);
}

/// Each rank's stderr lines that symmalloc printed.
fn diagnostics(level: &str) -> Vec<Vec<String>> {
    let outs = run_ranks(
        "diagnostics_follow_symmalloc_debug",
        2,
        &[HOST, ("SYMMALLOC_DEBUG", level)],
        "",
    );
    assert_all_ok(&outs);
    outs.iter()
        .map(|o| {
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .filter(|l| l.starts_with("symmalloc:"))
                .map(str::to_string)
                .collect()
        })
        .collect()
}

fn count(lines: &[String], what: &str) -> usize {
    lines.iter().filter(|l| l.contains(what)).count()
}

#[test]
fn diagnostics_follow_symmalloc_debug() {
    if let Some(c) = child() {
        return calls_rank(c);
    }
    for (rank, lines) in diagnostics("INFO").iter().enumerate() {
        let text = lines.join("\n");
        let version = format!("INFO symmalloc {}", env!("CARGO_PKG_VERSION"));
        assert_eq!(count(lines, &version), 1, "{text}");
        assert!(
            count(
                lines,
                &format!("device {rank}: host backend, symmetric heap of")
            ) == 1,
            "{text}"
        );
        let me = format!("rank {rank}/2: ");
        assert_eq!(
            count(
                lines,
                &format!("{me}communicator on device {rank} (ranks' devices [0, 1], host backend)")
            ),
            1,
            "{text}"
        );
        assert!(
            count(lines, "SYMMALLOC_LL_BYTES=") >= 1,
            "settings named: {text}"
        );
        // AUTO's choice once per new size: 4000 and 20000 bytes.
        assert_eq!(count(lines, &format!("{me}AUTO chose")), 2, "{text}");
        assert_eq!(count(lines, "for 4000 bytes"), 1, "{text}");
        assert!(count(lines, &format!("{me}exchanged")) >= 2, "{text}");
        assert!(count(lines, "peer mapping(s) made") >= 2, "{text}");
        assert_eq!(
            count(
                lines,
                &format!("{me}communicator on device {rank} destroyed")
            ),
            1
        );
        assert_eq!(count(lines, " TRACE "), 0, "{text}");
    }
    for lines in diagnostics("trace") {
        // One line per collective call (4), and the heap's: every malloc, free and segment.
        assert_eq!(count(&lines, " TRACE rank "), 4, "{}", lines.join("\n"));
        assert!(
            count(&lines, " TRACE malloc 4000 at ") == 1,
            "{}",
            lines.join("\n")
        );
        assert!(
            count(&lines, ": new segment of ") >= 1,
            "{}",
            lines.join("\n")
        );
        assert_eq!(
            count(&lines, "all_reduce two_shot 1000 x fp32 sum"),
            1,
            "{}",
            lines.join("\n")
        );
    }
    for lines in diagnostics("") {
        assert!(lines.is_empty(), "off by default: {lines:?}");
    }
    let outs = run_ranks(
        "diagnostics_follow_symmalloc_debug",
        2,
        &[HOST, ("SYMMALLOC_DEBUG", "LOUD")],
        "refused",
    );
    assert_all_ok(&outs);
}
