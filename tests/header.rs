//! The checked-in header must equal what cbindgen generates from src/ffi (drift check).
//! `SYMMALLOC_BLESS=1 cargo test --test header` (or `make header`) rewrites it.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    // Only the FFI layer and the stats struct it exports: nothing internal leaks into the header.
    let bindings = cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
        .with_src(root.join("src/ffi/pool_calls.rs"))
        .with_src(root.join("src/ffi/types.rs"))
        .with_src(root.join("src/comm/p2p/device_comm.rs"))
        .with_src(root.join("src/heap/stats.rs"))
        .with_src(root.join("src/heap/device_stats.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    let text = String::from_utf8(out).unwrap();
    // Spell the stream type as the CUDA headers do, without a typedef of our own.
    text.replace("CUstream_st *", "struct CUstream_st *")
        .replace("struct struct", "struct")
}

#[test]
fn header_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/symmalloc.h");
    let fresh = generate();
    if std::env::var("SYMMALLOC_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == fresh,
        "include/symmalloc.h is stale: the FFI changed. Run `make header` and commit the result."
    );
}

#[test]
fn header_names_the_contract() {
    let h = generate();
    for name in [
        "symm_malloc",
        "symm_free",
        "symm_begin_pool",
        "symm_begin_pool_filtered",
        "symm_pool_filter_fn",
        "symm_end_pool",
        "symm_release_pool",
        "symm_record_stream",
        "symm_empty_cache",
        "symm_memory_stats",
        "symm_memory_stats_sized",
        "symm_version",
        "symm_moe_create",
        "symm_moe_create_config",
        "symm_moe_destroy",
        "symm_moe_layout",
        "symm_moe_dispatch",
        "symm_moe_combine",
        "symm_moe_check",
        "symm_moe_config_t",
        "symm_moe_layout_t",
        "SYMM_MOE_CONFIG_VERSION",
        "SYMMALLOC_VERSION_CODE",
        "SYMM_MEMORY_STATS_V1_SIZE",
        "symm_last_error",
        "symm_status_string",
        "symm_get_unique_id",
        "symm_comm_init",
        "symm_comm_init_from_env",
        "symm_comm_destroy",
        "symm_all_reduce",
        "symm_all_reduce_algo",
        "symm_reduce_scatter",
        "symm_all_gather",
        "symm_all_reduce_add_rms_norm",
        "symm_barrier",
        "symm_rendezvous",
        "symm_peer_ptr",
        "symm_put",
        "symm_signal",
        "symm_wait",
        "symm_comm_device",
        "symm_device_comm_t",
        "SYMM_SIGNAL_SLOTS",
        "SYMM_DEVICE_COMM_V1_SIZE",
        "SYMM_ERR_INTERNAL",
        "SYMM_BF16",
        "SYMM_ALGO_MULTIMEM",
        "SYMM_ALGO_ONE_SHOT_LL",
        "symm_memory_stats_t",
        "staged_collectives",
        "struct CUstream_st *",
    ] {
        assert!(h.contains(name), "header lacks {name}");
    }
    assert!(
        !h.contains("typedef struct CUstream_st"),
        "header must not typedef CUstream_st"
    );
}
