//! Settings through the public entry points (host backend): each `SYMMALLOC_*` variable set to
//! an empty, garbage, negative, huge, NaN and infinite value, one child process per value (the
//! environment is process-global, and the allocator reads its settings once). A bad value makes
//! the entry point that reads it return SYMM_ERR_INVALID_ARGUMENT naming the variable and the
//! value, never SYMM_ERR_INTERNAL; empty means the default. And docs/environment.md's table lists
//! every `SYMMALLOC_*` variable of the source, with no stale rows.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::ptr::null_mut;
use symmalloc::ffi::types::*;
use symmalloc::ffi::*;

const HOST: (&str, &str) = ("SYMMALLOC_BACKEND", "host");

/// Which public call reads a variable.
#[derive(Clone, Copy, Debug)]
enum Entry {
    /// `symm_malloc` (the allocator's settings, read when it is created).
    Malloc,
    /// `symm_comm_init` with world 1 (the communicator's settings).
    CommInit,
    /// `symm_comm_init_from_env` as torchrun's only rank.
    CommInitFromEnv,
}

/// Every runtime variable the library reads, and the call that reads it.
/// `SYMMALLOC_ENABLE_MULTICAST` is left out on purpose (never set in a test that could run on a
/// GPU machine; src/config/'s unit tests cover its reader over a fake lookup), and so is
/// `SYMMALLOC_HOST_ID`, which takes any short word (`abc` is a host name): src/config/'s unit
/// tests cover its refusals, tests/hosts.rs its effect through `symm_comm_init`.
const VARIABLES: &[(&str, Entry)] = &[
    ("SYMMALLOC_BACKEND", Entry::Malloc),
    ("SYMMALLOC_HEAP_SIZE", Entry::Malloc),
    ("SYMMALLOC_THREAD_CACHE", Entry::Malloc),
    ("SYMMALLOC_DEBUG", Entry::Malloc),
    ("SYMMALLOC_TIMEOUT_S", Entry::CommInit),
    ("SYMMALLOC_CHECK_SYMMETRY", Entry::CommInit),
    ("SYMMALLOC_SHARED_GPU", Entry::CommInit),
    ("SYMMALLOC_LL_BYTES", Entry::CommInit),
    ("SYMMALLOC_LL_GRID", Entry::CommInit),
    ("SYMMALLOC_LL_MAX_BYTES", Entry::CommInit),
    ("SYMMALLOC_ONE_SHOT_MAX_BYTES", Entry::CommInit),
    ("SYMMALLOC_COMM_ARENA_SIZE", Entry::CommInit),
    ("SYMMALLOC_SPLIT_SLOTS", Entry::CommInit),
    ("SYMMALLOC_UNIQUE_ID", Entry::CommInitFromEnv),
];

/// Values no variable accepts.
const BAD: &[&str] = &["abc", "-1", "99999999999999999999999", "nan", "inf"];

fn last_error() -> String {
    // SAFETY: symm_last_error returns a valid NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(symm_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// In a child: calls `entry` and prints its status and message on one line.
fn call(entry: &str) {
    let (st, msg) = match entry {
        "Malloc" => {
            let p = symm_malloc(4096, 0, null_mut());
            let msg = last_error();
            if p.is_null() {
                let st = if msg.starts_with("SYMM_ERR_INVALID_ARGUMENT") {
                    symm_status_t::SYMM_ERR_INVALID_ARGUMENT
                } else {
                    symm_status_t::SYMM_ERR_INTERNAL // any other failure: the parent says which
                };
                (st, msg)
            } else {
                symm_free(p, 4096, 0, null_mut());
                (symm_status_t::SYMM_SUCCESS, msg)
            }
        }
        "CommInit" | "CommInitFromEnv" => {
            let mut comm = null_mut();
            let st = if entry == "CommInit" {
                let mut id = symm_unique_id_t { internal: [0; 128] };
                assert_eq!(symm_get_unique_id(&mut id), symm_status_t::SYMM_SUCCESS);
                symm_comm_init(&mut comm, 1, 0, 0, &id)
            } else {
                symm_comm_init_from_env(&mut comm)
            };
            let msg = last_error();
            if st == symm_status_t::SYMM_SUCCESS {
                assert_eq!(symm_comm_destroy(comm), symm_status_t::SYMM_SUCCESS);
            }
            (st, msg)
        }
        other => panic!("unknown entry {other}"),
    };
    println!("RESULT {} {}", st as i32, msg.replace('\n', " "));
}

/// The child's entry: a no-op unless the parent started this process for one case.
#[test]
fn config_child() {
    if let Ok(entry) = std::env::var("SYMM_CONFIG_ENTRY") {
        call(&entry);
    }
}

/// Runs `entry` in a fresh process with `name=value` on the host backend: (status, message).
fn run(name: &str, value: &str, entry: Entry) -> (i32, String) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    let child = crate::common::test_path("config_child");
    c.args([child.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env("SYMM_CONFIG_ENTRY", format!("{entry:?}"));
    for v in VARIABLES {
        c.env_remove(v.0);
    }
    if name != HOST.0 {
        c.env(HOST.0, HOST.1);
    }
    if let Entry::CommInitFromEnv = entry {
        c.env("LOCAL_RANK", "0").env("LOCAL_WORLD_SIZE", "1").env(
            "TORCHELASTIC_RUN_ID",
            format!("config_env-{}", std::process::id()),
        );
    }
    c.env(name, value);
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| {
            panic!(
                "{name}={value:?}: the child printed no result ({:?})\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let (st, msg) = line.split_once(' ').unwrap_or((line, ""));
    (st.parse().unwrap(), msg.to_string())
}

#[test]
fn a_bad_value_fails_the_call_that_reads_it_naming_variable_and_value() {
    let invalid = symm_status_t::SYMM_ERR_INVALID_ARGUMENT as i32;
    let mut failures = Vec::new();
    for &(name, entry) in VARIABLES {
        for &value in BAD {
            let (st, msg) = run(name, value, entry);
            let named = format!("{name}={value:?}");
            if st != invalid || !msg.contains(&named) || !msg.contains("is not accepted") {
                failures.push(format!(
                    "{name}={value:?} through {entry:?}: status {st}, {msg}"
                ));
            }
        }
        // Empty means the default: the call succeeds (the default backend, CUDA, needs a GPU,
        // so without one the call may fail, but not for the value).
        let (st, msg) = run(name, "", entry);
        let ok = st == 0 || (name == HOST.0 && st != invalid && !msg.contains("is not accepted"));
        if !ok {
            failures.push(format!(
                "{name}=\"\" (the default) through {entry:?}: status {st}, {msg}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A good value passes, so the cases above fail for the value alone.
#[test]
fn good_values_pass_through_the_same_calls() {
    for (name, value, entry) in [
        ("SYMMALLOC_HEAP_SIZE", "1G", Entry::Malloc),
        ("SYMMALLOC_THREAD_CACHE", "off", Entry::Malloc),
        ("SYMMALLOC_DEBUG", "warn", Entry::Malloc),
        ("SYMMALLOC_TIMEOUT_S", "2.5", Entry::CommInit),
        ("SYMMALLOC_CHECK_SYMMETRY", "true", Entry::CommInit),
        ("SYMMALLOC_SHARED_GPU", "0", Entry::CommInit),
        ("SYMMALLOC_LL_BYTES", "64K", Entry::CommInit),
        ("SYMMALLOC_LL_GRID", "64x256", Entry::CommInit),
        ("SYMMALLOC_LL_MAX_BYTES", "0", Entry::CommInit),
        ("SYMMALLOC_ONE_SHOT_MAX_BYTES", "8K", Entry::CommInit),
        ("SYMMALLOC_COMM_ARENA_SIZE", "64M", Entry::CommInit),
        ("SYMMALLOC_SPLIT_SLOTS", "0", Entry::CommInit),
        ("SYMMALLOC_SPLIT_SLOTS", "64", Entry::CommInit),
    ] {
        let (st, msg) = run(name, value, entry);
        assert_eq!(st, 0, "{name}={value:?}: {msg}");
    }
}

// --- docs/environment.md's table --------------------------------------------------------------

/// `SYMMALLOC_*` names in the source that are not environment variables: the C header's version
/// constants, and the fatbin path build.rs hands the compiler (`cargo:rustc-env`, read by
/// `env!`). `SYMMALLOC_DEMO_COUNT` is the demo binary's message to its own children.
const NOT_SETTINGS: &[&str] = &[
    "SYMMALLOC_VERSION_MAJOR",
    "SYMMALLOC_VERSION_MINOR",
    "SYMMALLOC_VERSION_PATCH",
    "SYMMALLOC_VERSION_CODE",
    "SYMMALLOC_VERSION_", // as in `SYMMALLOC_VERSION_*`
    "SYMMALLOC_FATBIN",
    "SYMMALLOC_DEMO_COUNT",
];

/// Every `SYMMALLOC_[A-Z0-9_]+` in `text` (names ending in `_` are prefixes, as in
/// `SYMMALLOC_LL_*`, and kept with their `_`).
fn names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("SYMMALLOC_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

fn source_text(dir: &Path, out: &mut String) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            source_text(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "py") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
            out.push('\n');
        }
    }
}

/// The rows of docs/environment.md's table: (names in the first cell, the other cells).
fn table_rows() -> Vec<(Vec<String>, Vec<String>)> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/environment.md"))
        .unwrap();
    let start = page
        .find("\n## The variables\n")
        .expect("docs/environment.md has a section \"The variables\"");
    let section = &page[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<String> = line
            .trim_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_string())
            .collect();
        if cells[0] == "variable" || cells[0].starts_with("---") {
            continue;
        }
        let vars: Vec<String> = cells[0]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        assert!(!vars.is_empty(), "a row without a variable: {line}");
        rows.push((vars, cells[1..].to_vec()));
    }
    rows
}

#[test]
fn the_environment_table_lists_every_variable_with_its_default_and_accepted_values() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut src = String::new();
    source_text(&root.join("src"), &mut src);
    src.push_str(&std::fs::read_to_string(root.join("build.rs")).unwrap());
    let rows = table_rows();
    let mut table = BTreeSet::new();
    for (vars, cells) in &rows {
        assert_eq!(
            cells.len(),
            3,
            "{vars:?}: expected the cells default | accepted | meaning, got {cells:?}"
        );
        assert!(
            !cells[0].is_empty() && !cells[1].is_empty(),
            "{vars:?}: the default and the accepted values must be given: {cells:?}"
        );
        table.extend(vars.iter().cloned());
    }

    // Every variable of the source has a row (a prefix such as SYMMALLOC_LL_ names rows).
    for name in names(&src) {
        if NOT_SETTINGS.contains(&name.as_str()) {
            continue;
        }
        let listed = if name.ends_with('_') {
            table.iter().any(|t| t.starts_with(&name))
        } else {
            table.contains(&name)
        };
        assert!(
            listed,
            "{name} appears in the source but not in docs/environment.md's table"
        );
    }

    // Every row names a variable that something reads: the library, build.rs or the Python
    // package (SYMMALLOC_LIBRARY_DIR).
    source_text(&root.join("python/symmalloc"), &mut src);
    for name in &table {
        assert!(
            src.contains(&format!("\"{name}\"")),
            "docs/environment.md's table lists {name}, which nothing reads"
        );
    }
    for name in NOT_SETTINGS {
        assert!(!table.contains(*name), "{name} is not a setting");
    }
}

/// Every `SYMMALLOC_*` setting the library itself reads is read in src/config/ (ipc/env.rs reads
/// the launcher's through config::var: src/config/mod.rs's header says so).
#[test]
fn settings_are_read_in_config() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config = String::new();
    source_text(&root.join("src/config"), &mut config);
    for name in [
        "SYMMALLOC_BACKEND",
        "SYMMALLOC_HEAP_SIZE",
        "SYMMALLOC_TIMEOUT_S",
        "SYMMALLOC_THREAD_CACHE",
        "SYMMALLOC_CHECK_SYMMETRY",
        "SYMMALLOC_SHARED_GPU",
        "SYMMALLOC_DEBUG",
        "SYMMALLOC_ENABLE_MULTICAST",
        "SYMMALLOC_LL_BYTES",
        "SYMMALLOC_LL_GRID",
    ] {
        assert!(
            config.contains(&format!("\"{name}\"")),
            "{name} is not read in src/config/"
        );
    }
    // No other file of the library reads the process environment itself, except the demo
    // binary (named in src/config/mod.rs's header).
    let mut offenders = Vec::new();
    let mut stack = vec![root.join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel.starts_with("src/config/") || rel.starts_with("src/bin/") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            if text.contains("env::var") || text.contains("var_os(") || text.contains("getenv") {
                offenders.push(rel);
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "these read the environment outside src/config/: {offenders:?}"
    );
}
