//! Exported symbols: libsymmalloc.so exports only symm_*; the pluggable shim exports exactly
//! malloc, free, begin_pool, end_pool, release_pool, and its own heap use still binds to libc.
//! Runs on the release build (`make test` builds it first); skips visibly if it is missing.

use std::path::PathBuf;
use std::process::Command;

fn lib_dir() -> Option<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/release");
    if d.join("libsymmalloc.so").exists() && d.join("libsymmalloc_pluggable.so").exists() {
        Some(d)
    } else {
        println!("SKIPPED exports: build the release .so files first (cargo build --release)");
        None
    }
}

fn defined_dynamic(path: &PathBuf) -> Vec<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(path)
        .output()
        .expect("nm");
    assert!(out.status.success(), "nm failed on {}", path.display());
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .filter(|s| !s.starts_with('_') || s.starts_with("_Z"))
        .collect();
    v.sort();
    v
}

#[test]
fn library_exports_only_symm_functions() {
    let Some(d) = lib_dir() else { return };
    let syms = defined_dynamic(&d.join("libsymmalloc.so"));
    assert!(syms.len() >= 17, "{syms:?}");
    for s in &syms {
        assert!(s.starts_with("symm_"), "libsymmalloc.so exports {s}");
    }
    assert!(!syms.iter().any(|s| s == "malloc" || s == "free"));
}

#[test]
fn shim_exports_exactly_the_bare_names() {
    let Some(d) = lib_dir() else { return };
    let syms = defined_dynamic(&d.join("libsymmalloc_pluggable.so"));
    assert_eq!(
        syms,
        [
            "begin_allocate_to_pool",
            "begin_pool",
            "end_pool",
            "free",
            "malloc",
            "release_pool"
        ]
    );
}

#[test]
fn shim_heap_use_binds_to_libc() {
    let Some(d) = lib_dir() else { return };
    let harness = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("build/c/dlopen_shim");
    if !harness.exists() {
        println!("SKIPPED shim bindings: build the C harness first (make test-c)");
        return;
    }
    let out = Command::new(&harness)
        .arg(&d)
        .env("SYMMALLOC_BACKEND", "host")
        .env("LD_DEBUG", "bindings")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = String::from_utf8_lossy(&out.stderr);
    // The shim is linked BIND_NOW: its own references are bound while it loads, before the
    // harness's dlsym(handle, "malloc") lookups (which bind to the shim by design). Every
    // heap function the shim itself calls must resolve to libc.
    let mut own = Vec::new();
    for l in log
        .lines()
        .filter(|l| l.contains("binding file") && l.contains("libsymmalloc_pluggable.so [0] to"))
    {
        if let Some(sym) = ["malloc", "free", "calloc", "realloc"]
            .iter()
            .find(|s| l.contains(&format!("`{s}'")))
        {
            own.push((*sym, l.to_string()));
        }
    }
    let first_malloc = own
        .iter()
        .position(|(s, _)| *s == "malloc")
        .expect("no malloc binding logged");
    let (_, line) = &own[first_malloc];
    assert!(
        line.contains("libc.so"),
        "the shim's own malloc binds elsewhere than libc: {line}"
    );
    for (sym, line) in own
        .iter()
        .filter(|(s, _)| *s == "calloc" || *s == "realloc")
    {
        assert!(
            line.contains("libc.so"),
            "the shim's {sym} binds elsewhere than libc: {line}"
        );
    }
}

/// The library carries a SONAME (libsymmalloc.so.MAJOR, or .so.0.MINOR before 1.0), so programs
/// and pkg-config/CMake users record the ABI version rather than a path.
#[test]
fn library_has_a_versioned_soname() {
    let Some(d) = lib_dir() else { return };
    let out = Command::new("readelf")
        .args(["-d"])
        .arg(d.join("libsymmalloc.so"))
        .output()
        .expect("readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    let minor = env!("CARGO_PKG_VERSION_MINOR");
    let want = match env!("CARGO_PKG_VERSION_MAJOR") {
        "0" => format!("[libsymmalloc.so.0.{minor}]"),
        major => format!("[libsymmalloc.so.{major}]"),
    };
    assert!(
        text.lines()
            .any(|l| l.contains("(SONAME)") && l.contains(&want)),
        "no SONAME {want} in:\n{text}"
    );
}
