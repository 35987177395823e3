//! The integration tests that need no GPU and no process of their own, as one test binary:
//! each file named below is a module here (its tests are `FILE::TEST`, e.g.
//! `cargo test --test host comm_host::`), so `cargo test` compiles and links one binary for
//! them instead of one per file. Tests that run ranks start this binary again for their own
//! test by its full name (`common::test_path`).
//!
//! Test binaries of their own (Cargo.toml's `[[test]]` list; `autotests` is off, and
//! `every_test_file_is_built` below keeps the two lists complete):
//! - the GPU tests, which scripts/stage-device.sh stages by binary name: gpu_alloc, gpu_comm,
//!   gpu_scatter_gather, gpu_p2p, gpu_groups, gpu_moe, bitwise, fused_quant, grown_host;
//! - the tests that use the process-wide allocator in the test process itself, each on devices
//!   it takes as its own (statistics, the segment log and the backend choice are per process):
//!   ffi_errors, ipc_export_host, peer_access_host, torch_alloc_host, torch_history_host.

#[path = "support/capture_backend.rs"]
mod capture_backend;
#[path = "common/mod.rs"]
mod common;

#[path = "comm_host.rs"]
mod comm_host;
#[path = "config_env.rs"]
mod config_env;
#[path = "debug_host.rs"]
mod debug_host;
#[path = "determinism.rs"]
mod determinism;
#[path = "exports.rs"]
mod exports;
#[path = "groups_host.rs"]
mod groups_host;
#[path = "groups_slots_host.rs"]
mod groups_slots_host;
#[path = "header.rs"]
mod header;
#[path = "heap_arena.rs"]
mod heap_arena;
#[path = "heap_grow.rs"]
mod heap_grow;
#[path = "heap_ladder.rs"]
mod heap_ladder;
#[path = "heap_placement.rs"]
mod heap_placement;
#[path = "heap_pools.rs"]
mod heap_pools;
#[path = "heap_props.rs"]
mod heap_props;
#[path = "heap_reads.rs"]
mod heap_reads;
#[path = "heap_routes.rs"]
mod heap_routes;
#[path = "heap_trim.rs"]
mod heap_trim;
#[path = "hosts.rs"]
mod hosts;
#[path = "kernel_table.rs"]
mod kernel_table;
#[path = "moe_host.rs"]
mod moe_host;
#[path = "moe_split_host.rs"]
mod moe_split_host;
#[path = "moe_tp_host.rs"]
mod moe_tp_host;
#[path = "multicast_guard.rs"]
mod multicast_guard;
#[path = "p2p_host.rs"]
mod p2p_host;
#[path = "peer_destroyed_host.rs"]
mod peer_destroyed_host;
#[path = "rms_norm_host.rs"]
mod rms_norm_host;
#[path = "scatter_gather_host.rs"]
mod scatter_gather_host;
#[path = "staging_host.rs"]
mod staging_host;

/// Every tests/*.rs file is a module of this binary or a test binary of its own in Cargo.toml:
/// with `autotests = false` a new file listed in neither would never run.
#[test]
fn every_test_file_is_built() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let here = std::fs::read_to_string(root.join("tests/host.rs")).unwrap();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let mut missing = Vec::new();
    for e in std::fs::read_dir(root.join("tests")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        let Some(stem) = name.strip_suffix(".rs") else {
            continue;
        };
        let module = here.contains(&format!("#[path = \"{name}\"]\nmod {stem};"));
        let binary = manifest.contains(&format!("path = \"tests/{name}\""));
        if module == binary {
            missing.push(format!(
                "{name} (module here: {module}, [[test]]: {binary})"
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "each tests/*.rs is either a module of tests/host.rs or a [[test]] of Cargo.toml: {missing:?}"
    );
}

/// Children are started by full test name: a module's test resolves to `FILE::name`, a test of
/// this file to its own name, and a name that is no test here fails the caller.
#[test]
fn test_names_resolve_to_this_binarys_tests() {
    assert_eq!(
        common::test_path("diagnostics_follow_symmalloc_debug"),
        "debug_host::diagnostics_follow_symmalloc_debug"
    );
    assert_eq!(
        common::test_path("every_test_file_is_built"),
        "every_test_file_is_built"
    );
    let missing = std::panic::catch_unwind(|| common::test_path("no_such_test"));
    assert!(missing.is_err(), "an unknown test name must fail");
}
