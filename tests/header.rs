//! The checked-in header must equal what cbindgen generates from src/ffi (drift check).
//! `SYMMALLOC_BLESS=1 cargo test --test header` (or `make header`) rewrites it.

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    // Only the FFI layer and the structs it exports: nothing internal leaks into the header.
    // cbindgen follows mod.rs's `mod` lines into every file of src/ffi; naming one of those
    // files again would declare its functions twice.
    let bindings = cbindgen::Builder::new()
        .with_src(root.join("src/ffi/mod.rs"))
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

/// The name each top-level declaration of `h` declares (a function, a typedef, a macro), once
/// per declaration.
fn declared_names(h: &str) -> Vec<(String, &'static str)> {
    let mut names = Vec::new();
    // Comments out, then one declaration per `;` or line for macros.
    let mut text = String::new();
    let mut rest = h;
    while let Some(i) = rest.find("/*") {
        text.push_str(&rest[..i]);
        rest = &rest[i + 2..];
        rest = &rest[rest.find("*/").map_or(rest.len(), |j| j + 2)..];
    }
    text.push_str(rest);
    for line in text.lines() {
        if let Some(def) = line.strip_prefix("#define ") {
            let name = def.split_whitespace().next().unwrap_or("");
            names.push((name.to_string(), "macro"));
        }
    }
    let body: String = text
        .lines()
        // Preprocessor lines and the C++ linkage block's braces (`extern "C" {`, `}  // ...`).
        .filter(|l| {
            !l.starts_with('#') && !l.starts_with("extern \"C\"") && !l.starts_with("}  //")
        })
        .collect::<Vec<_>>()
        .join(" ");
    let mut depth = 0usize;
    let mut decl = String::new();
    for c in body.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ';' if depth == 0 => {
                let d = std::mem::take(&mut decl);
                let d = d.trim();
                if let Some(open) = d.find('(').filter(|_| !d.starts_with("typedef")) {
                    let name = d[..open].split_whitespace().last().unwrap_or("");
                    names.push((name.trim_start_matches('*').to_string(), "function"));
                } else if d.starts_with("typedef") {
                    // The name is the last identifier, or the one inside `(*name)`.
                    let name = match d.find("(*") {
                        Some(i) => d[i + 2..].split(')').next().unwrap_or(""),
                        None => d
                            .trim_end_matches(|c: char| c == ']' || c.is_ascii_digit() || c == '[')
                            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                            .rfind(|w| !w.is_empty())
                            .unwrap_or(""),
                    };
                    names.push((name.to_string(), "typedef"));
                }
                continue;
            }
            _ => {}
        }
        if depth == 0 && c != '}' {
            decl.push(c);
        }
    }
    names
}

#[test]
fn header_declares_each_name_once() {
    let h = generate();
    let names = declared_names(&h);
    let functions = names.iter().filter(|(_, k)| *k == "function").count();
    // The exported entry points are many more than this; a parser that finds none proves nothing.
    assert!(
        functions > 50,
        "found only {functions} functions in the header: {names:?}"
    );
    assert!(names
        .iter()
        .any(|(n, k)| n == "symm_moe_layout_t" && *k == "typedef"));
    assert!(names
        .iter()
        .any(|(n, k)| n == "symm_pool_filter_fn" && *k == "typedef"));
    let mut seen = std::collections::BTreeMap::new();
    for (name, kind) in &names {
        *seen.entry((name.as_str(), *kind)).or_insert(0) += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "declared more than once in the header: {twice:?}"
    );
}

#[test]
fn the_duplicate_check_sees_a_duplicate() {
    let h = "int f(int a);\n/* g(x); */\ntypedef struct {\n  int x;\n} s_t;\nint f(int a);\n";
    let names = declared_names(h);
    assert_eq!(
        names,
        [("f", "function"), ("s_t", "typedef"), ("f", "function")].map(|(n, k)| (n.to_string(), k))
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
