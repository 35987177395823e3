//! The kernel-id table (src/comm/kernels.rs) and the kernels' instantiations stay in step, and
//! the Rust mirror of the argument struct matches kernels/common.cuh field by field.

use std::collections::BTreeSet;
use symmalloc::comm::kernels::{all_kernel_names, SELFTEST_SAXPY};

fn sources() -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut s = String::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "cu" || x == "cuh") {
            s += &std::fs::read_to_string(p).unwrap();
        }
    }
    s
}

/// The field declarations of `struct NAME { ... };` in the CUDA source, comments dropped.
fn struct_fields(src: &str, name: &str) -> Vec<String> {
    let start = src.find(&format!("struct {name} {{")).unwrap();
    let body = &src[start..start + src[start..].find("};").unwrap()];
    body.lines()
        .skip(1)
        .filter_map(|l| {
            let l = l.split("//").next().unwrap().trim();
            (!l.is_empty()).then(|| l.trim_end_matches(';').to_string())
        })
        .collect()
}

#[test]
fn every_table_name_is_instantiated_and_vice_versa() {
    let src = sources();
    let mut instantiated = BTreeSet::new();
    for line in src.lines() {
        let l = line.trim();
        for prefix in [
            "SYMM_ONE_SHOT(",
            "SYMM_ONE_SHOT_LL(",
            "SYMM_TWO_SHOT(",
            "SYMM_REDUCE_SCATTER(",
            "SYMM_REDUCE_SCATTER_LL(",
            "SYMM_ALL_GATHER(",
        ] {
            if let Some(rest) = l.strip_prefix(prefix) {
                instantiated.insert(rest.split(',').next().unwrap().trim().to_string());
            }
        }
        if l.starts_with("extern \"C\" __global__") {
            // `extern "C" __global__ void [__launch_bounds__(N)] NAME(ArgsType a)`
            let at = l
                .find("(SymmArgs")
                .or_else(|| l.find("(SaxpyArgs"))
                .or_else(|| l.find("(RmsArgs"))
                .expect("kernel signature");
            let name = l[..at].split_whitespace().last().unwrap();
            if name != "NAME" {
                // (NAME is the parameter of the instantiation macros themselves)
                instantiated.insert(name.to_string());
            }
        }
    }
    let mut table: BTreeSet<String> = all_kernel_names().into_iter().collect();
    table.insert(SELFTEST_SAXPY.to_string());
    assert_eq!(
        table, instantiated,
        "kernel table and kernels/*.cu disagree"
    );
    // one-shot, LL, two-shot, multimem, reduce-scatter (barrier, LL), all-gather, fused RMSNorm (barrier,
    // LL with four vectors per thread, with one, and over a cluster), self-test
    assert_eq!(
        table.len(),
        18 + 18 + 18 + 3 + 18 + 9 + 6 + 2 + 2 + 2 + 2 + 1
    );
}

#[test]
fn argument_struct_matches_the_cuda_source() {
    let src = sources();
    assert_eq!(
        struct_fields(&src, "SymmArgs"),
        [
            "uint64_t in[SYMM_MAX_RANKS]",
            "uint64_t out[SYMM_MAX_RANKS]",
            "uint64_t pads[SYMM_MAX_RANKS]",
            "uint64_t mc_out",
            "uint64_t counters",
            "uint64_t error_word",
            "uint64_t count",
            "uint64_t desc",
            "uint64_t timeout_ns",
            "int32_t rank",
            "int32_t world",
            "int32_t in_place",
            "int32_t ll_slot_kib",
        ],
        "kernels/common.cuh SymmArgs changed: update src/comm/kernel_args.rs in step"
    );
    assert_eq!(
        std::mem::size_of::<symmalloc::comm::kernel_args::SymmArgs>(),
        256
    );
    use symmalloc::comm::kernel_args as k;
    for (name, value) in [
        ("SYMM_MAX_RANKS", k::MAX_RANKS.to_string()),
        ("SYMM_MAX_BLOCKS", k::MAX_BLOCKS.to_string()),
        ("SYMM_THREADS", k::THREADS.to_string()),
        ("SYMM_TWO_SHOT_UNROLL", k::TWO_SHOT_UNROLL.to_string()),
        ("SYMM_SG_UNROLL", k::SG_UNROLL.to_string()),
        ("SYMM_RMS_VECS", k::RMS_VECS.to_string()),
        ("SYMM_RMS_LL1_THREADS", k::RMS_LL1_THREADS.to_string()),
        ("SYMM_RMS_LLC_THREADS", k::RMS_LLC_THREADS.to_string()),
        ("SYMM_ERR_TIMEOUT_CODE", format!("{}u", k::ERR_TIMEOUT)),
        (
            "SYMM_ERR_ASYMMETRIC_CODE",
            format!("{}u", k::ERR_ASYMMETRIC),
        ),
        (
            "SYMM_ERR_NO_MULTIMEM_CODE",
            format!("{}u", k::ERR_NO_MULTIMEM),
        ),
        (
            "SYMM_ERR_LL_ASYMMETRIC_CODE",
            format!("{}u", k::ERR_LL_ASYMMETRIC),
        ),
        ("LL_BUFFERS", k::LL_BUFFERS.to_string()),
        ("SYMM_CONTROL_BYTES", k::CONTROL_BYTES.to_string()),
        ("SYMM_SPIN_CHECK", format!("{}u", k::SPIN_CHECK)),
        (
            "LL_EMPTY",
            format!("0x{0:02x}{0:02x}{0:02x}{0:02x}u", k::LL_EMPTY_BYTE),
        ),
    ] {
        assert!(
            src.contains(&format!("#define {name} {value}\n")),
            "{name} must be {value} (kernel_args.rs)"
        );
    }
    // The internal block's offsets, written in the CUDA source as sums of its parts.
    assert_eq!(k::PAD_BYTES, 128 * 8 * 16);
    assert_eq!(k::ABORT_OFFSET, k::PAD_BYTES + 128 * 4);
    assert_eq!(k::LL_COUNTERS_OFFSET, k::ABORT_OFFSET + k::CONTROL_BYTES);
    for line in [
        "#define SYMM_PAD_BYTES (SYMM_MAX_BLOCKS * SYMM_MAX_RANKS * 16)",
        "#define SYMM_ABORT_OFFSET (SYMM_PAD_BYTES + SYMM_MAX_BLOCKS * 4)",
        "#define LL_COUNTERS_OFFSET (SYMM_ABORT_OFFSET + SYMM_CONTROL_BYTES)",
        "#define LL_DESC_OFFSET (LL_COUNTERS_OFFSET + SYMM_MAX_BLOCKS * 4)",
        "#define LL_DATA_OFFSET (LL_DESC_OFFSET + 4096)",
    ] {
        assert!(
            src.contains(line),
            "kernels/ must keep `{line}` (kernel_args.rs mirrors it)"
        );
    }
    assert_eq!(k::LL_DESC_OFFSET, k::LL_COUNTERS_OFFSET + 128 * 4);
    assert_eq!(k::LL_DATA_OFFSET, k::LL_DESC_OFFSET + 4096);
}

/// What a spin loop may touch (kernels/common.cuh): no kernel reads host-mapped memory. The only
/// host-mapped pointer a kernel gets is `error_word`, so it may appear only in the argument
/// struct and as the target of the one store in `report_to_host`.
#[test]
fn kernels_only_ever_store_to_the_host_mapped_error_words() {
    let src = sources();
    let uses: Vec<&str> = src
        .lines()
        .filter(|l| l.contains("error_word"))
        .map(|l| l.split("//").next().unwrap().trim())
        .collect();
    assert_eq!(
        uses,
        [
            "uint64_t error_word;",
            "((volatile uint32_t*)a.error_word)[which] = w;"
        ],
        "a kernel touches the host-mapped error words other than by report_to_host's store"
    );
}

#[test]
fn rms_argument_struct_matches_the_cuda_source() {
    let src = sources();
    assert_eq!(
        struct_fields(&src, "RmsArgs"),
        [
            "SymmArgs s",
            "uint64_t residual",
            "uint64_t weight",
            "uint64_t out",
            "uint64_t hidden",
            "uint64_t tokens",
            "float eps",
            "uint32_t push_threads",
        ],
        "kernels/rms_norm.cu RmsArgs changed: update src/comm/kernel_args.rs in step"
    );
}
