//! The checked-in header must equal what cbindgen generates from src/ffi (drift check).
//! `SYMMALLOC_BLESS=1 cargo test --test host header::` (or `make header`) rewrites it.

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
        "symm_moe_dispatch_send",
        "symm_moe_dispatch_recv",
        "symm_moe_combine_send",
        "symm_moe_combine_recv",
        "symm_moe_probe",
        "SYMM_MOE_FLAG_PROBE",
        "SYMM_MOE_PROBE_WORDS",
        "symm_moe_config_t",
        "symm_moe_layout_t",
        "symm_moe_tp_layout",
        "symm_moe_tp_layout_t",
        "SYMM_MOE_THROUGHPUT",
        "SYMM_MOE_LOW_LATENCY",
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

// ---- pluggable/src/lib.rs's declarations of libsymmalloc's functions, against the header ----

/// A C type of the header in a form both languages map to: `int`, `size`, `u64`, `u32`, `f32`,
/// `void`, `mut*` / `const*` (`const*char` for a string), `optfn(args)->ret` (a function pointer).
fn c_type(t: &str, typedefs: &std::collections::HashMap<String, String>) -> String {
    let t = t.trim();
    if let Some(p) = t.strip_suffix('*') {
        let p = p.trim();
        return match p.strip_prefix("const ") {
            Some(q) if q.trim() == "char" => "const*char".into(),
            Some(_) => "const*".into(),
            None => "mut*".into(),
        };
    }
    match t {
        "int" | "symm_status_t" => "int".into(),
        "size_t" => "size".into(),
        "uint64_t" => "u64".into(),
        "uint32_t" => "u32".into(),
        "float" => "f32".into(),
        "void" => "void".into(),
        other => typedefs
            .get(other)
            .cloned()
            .unwrap_or_else(|| panic!("header type {other:?} has no mapping here")),
    }
}

/// `(ret, [args])` with the argument names dropped.
fn c_signature(
    ret: &str,
    args: &str,
    typedefs: &std::collections::HashMap<String, String>,
) -> String {
    let args: Vec<String> = if args.trim() == "void" {
        vec![]
    } else {
        args.split(',')
            .map(|a| {
                let a = a.trim();
                // The name is the last identifier; what precedes it is the type.
                let cut = a
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                c_type(&a[..cut], typedefs)
            })
            .collect()
    };
    format!("fn({})->{}", args.join(","), c_type(ret, typedefs))
}

/// The header's function-pointer typedefs and prototypes, in the canonical form.
fn header_signatures(h: &str) -> std::collections::HashMap<String, String> {
    let mut typedefs = std::collections::HashMap::new();
    let flat = h.split_whitespace().collect::<Vec<_>>().join(" ");
    for d in flat.split(';') {
        let d = d.trim().rsplit("*/").next().unwrap().trim();
        if let Some(rest) = d.strip_prefix("typedef ") {
            if let Some(i) = rest.find("(*") {
                let name = rest[i + 2..].split(')').next().unwrap().to_string();
                let args = rest[i..].split_once(")(").unwrap().1.trim_end_matches(')');
                let sig = c_signature(&rest[..i], args, &typedefs);
                typedefs.insert(name, format!("opt{sig}"));
            } else if let Some((ty, name)) = rest.rsplit_once(' ') {
                // A scalar typedef (`typedef uint32_t symm_dtype_t`).
                if ["uint32_t", "uint64_t", "int", "size_t", "float"].contains(&ty) {
                    typedefs.insert(name.to_string(), c_type(ty, &typedefs));
                }
            }
        }
    }
    let mut fns = std::collections::HashMap::new();
    for d in flat.split(';') {
        let d = d.trim().rsplit("*/").next().unwrap().trim();
        let d = d.rsplit("extern \"C\" {").next().unwrap().trim();
        let d = d.rsplit("#endif // __cplusplus").next().unwrap().trim();
        if d.starts_with("typedef") || d.starts_with('#') {
            continue;
        }
        let Some(open) = d.find('(') else { continue };
        let (head, args) = (&d[..open], d[open + 1..].trim_end_matches(')'));
        let name_at = head
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = &head[name_at..];
        if name.starts_with("symm_") {
            fns.insert(
                name.to_string(),
                c_signature(&head[..name_at], args, &typedefs),
            );
        }
    }
    fns
}

/// A Rust type of the shim (whitespace removed) in the canonical form; `aliases` resolves its
/// `type` items.
fn rust_type(t: &str, aliases: &std::collections::HashMap<String, String>) -> String {
    if let Some(inner) = t.strip_prefix("Option<").and_then(|r| r.strip_suffix('>')) {
        let f = rust_type(inner, aliases);
        assert!(f.starts_with("fn("), "Option of a non-function {t}");
        return format!("opt{f}");
    }
    if let Some(rest) = t.strip_prefix("unsafeextern\"C\"fn(") {
        let close = rest.find(')').expect(t);
        let (args, ret) = (&rest[..close], &rest[close + 1..]);
        let ret = ret
            .strip_prefix("->")
            .map_or("void".into(), |r| rust_type(r, aliases));
        let args: Vec<String> = if args.is_empty() {
            vec![]
        } else {
            split_top(args)
                .iter()
                .map(|a| rust_type(a, aliases))
                .collect()
        };
        return format!("fn({})->{ret}", args.join(","));
    }
    match t {
        "*constc_char" => "const*char".into(),
        p if p.starts_with("*const") => "const*".into(),
        p if p.starts_with("*mut") => "mut*".into(),
        "c_int" => "int".into(),
        "usize" => "size".into(),
        "u64" => "u64".into(),
        "u32" => "u32".into(),
        "f32" => "f32".into(),
        other => aliases
            .get(other)
            .map(|a| rust_type(a, aliases))
            .unwrap_or_else(|| panic!("shim type {other:?} has no mapping here")),
    }
}

/// `a,b<c,d>,e` split at the commas outside angle brackets.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (vec![], 0i32, 0);
    let b = s.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'<' => depth += 1,
            b'>' if i == 0 || b[i - 1] != b'-' => depth -= 1,
            b',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().filter(|a| !a.is_empty()).collect()
}

/// The shim's bindings: (symbol, canonical signature of the type it is transmuted to).
fn pluggable_bindings(src: &str) -> Vec<(String, String)> {
    let flat: String = src.chars().filter(|c| !c.is_whitespace()).collect();
    let mut aliases = std::collections::HashMap::new();
    // `type NAME = TYPE;` items (a statement may start after comments on earlier lines).
    for stmt in format!("\n{src}").split(';') {
        let Some(at) = stmt.find("\ntype ") else {
            continue;
        };
        let joined: String = stmt[at + 6..]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let (name, ty) = joined.split_once('=').expect("type NAME = TYPE");
        aliases.insert(name.to_string(), ty.to_string());
    }
    let mut out = vec![];
    let marker = "transmute::<*mutc_void,";
    let mut rest = flat.as_str();
    while let Some(i) = rest.find(marker) {
        rest = &rest[i + marker.len()..];
        // The target type ends at the first `>(` that is not part of `->(`.
        let end = (1..rest.len())
            .find(|&k| rest[k..].starts_with(">(") && !rest[..k].ends_with('-'))
            .expect("a transmute's target type");
        let ty = &rest[..end];
        // Only the symbols of libsymmalloc (`sym(c"symm_...")`); the driver's are not ours.
        let Some(name_at) = rest[end + 2..].strip_prefix("sym(c\"") else {
            continue;
        };
        let name = &name_at[..name_at.find('"').unwrap()];
        out.push((name.to_string(), rust_type(ty, &aliases)));
    }
    out
}

#[test]
fn the_pluggable_shim_declares_each_function_as_the_header_does() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = header_signatures(&generate());
    assert!(header.len() > 50, "read only {} prototypes", header.len());
    assert_eq!(
        header["symm_begin_pool_filtered"],
        "fn(int,u64,u64,optfn(mut*,mut*)->int,mut*,optfn(mut*)->void)->int"
    );
    let src = std::fs::read_to_string(root.join("pluggable/src/lib.rs")).unwrap();
    let bindings = pluggable_bindings(&src);
    let names: Vec<&str> = bindings.iter().map(|(n, _)| n.as_str()).collect();
    // Every function the shim forwards to (its module comment names them).
    for want in [
        "symm_malloc",
        "symm_free",
        "symm_begin_pool",
        "symm_begin_pool_filtered",
    ] {
        assert!(names.contains(&want), "the shim binds no {want}: {names:?}");
    }
    for (name, sig) in &bindings {
        let want = header
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not in the header"));
        assert_eq!(
            sig, want,
            "pluggable/src/lib.rs declares {name} unlike include/symmalloc.h"
        );
    }
}

#[test]
fn the_signature_comparison_tells_a_wrong_argument() {
    let mut aliases = std::collections::HashMap::new();
    aliases.insert(
        "F".to_string(),
        "unsafeextern\"C\"fn(*mutc_void)->c_int".to_string(),
    );
    let src = "type PoolFn = unsafe extern \"C\" fn(c_int, u64, u32);\n\
               let a = std::mem::transmute::<*mut c_void, PoolFn>(sym(c\"symm_end_pool\")?);";
    let b = pluggable_bindings(src);
    assert_eq!(
        b,
        [(
            "symm_end_pool".to_string(),
            "fn(int,u64,u32)->void".to_string()
        )]
    );
    let h = header_signatures(&generate());
    assert_ne!(
        b[0].1, h["symm_end_pool"],
        "u32 for a uint64_t must not compare equal"
    );
    assert_eq!(rust_type("Option<F>", &aliases), "optfn(mut*)->int");
}
