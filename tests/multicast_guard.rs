//! The multicast safety rule, checked in the source: only `src/cuda/multicast.rs` calls the
//! driver's multicast functions, and each of its functions that creates, joins, sizes or binds
//! a multicast object asks the gate (`ensure_allowed`) before the driver call. (No test may
//! create a multicast object on a machine with a GPU, so this is checked by reading, and the
//! gate itself by the pure-function tests in src/cuda/multicast_gate.rs.)

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn only_the_gated_wrapper_calls_the_multicast_driver_functions() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for d in ["src", "bench", "tests", "pluggable", "examples"] {
        if root.join(d).is_dir() {
            rust_files(&root.join(d), &mut files);
        }
    }
    let wrapper = root.join("src/cuda/multicast.rs");
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let calls = text.contains("sys::cuMulticast") || text.contains("cuMulticastCreate(");
        if f != &wrapper && f.file_name().unwrap() != "multicast_guard.rs" {
            assert!(!calls, "{} calls a multicast driver function", f.display());
        }
    }
    let src = std::fs::read_to_string(&wrapper).unwrap();
    let mut guarded = 0;
    for func in src.split("\npub fn ").skip(1) {
        let name = func.split('(').next().unwrap();
        let Some(call) = func.find("sys::cuMulticast") else {
            continue;
        };
        if func[call..].starts_with("sys::cuMulticastUnbind") {
            continue; // teardown of an object that already exists
        }
        let gate = func.find("ensure_allowed(device)?;");
        assert!(
            gate.is_some_and(|g| g < call),
            "{name} must call ensure_allowed(device)? before the driver"
        );
        guarded += 1;
    }
    assert_eq!(
        guarded, 4,
        "granularity, create, add_device and bind_mem are gated"
    );
}
