//! The kernel-id table (src/comm/collective/kernels.rs) and the kernels' instantiations stay in step, and
//! the Rust mirror of the argument struct matches kernels/common.cuh field by field.

use std::collections::BTreeSet;
use symmalloc::comm::kernels::all_kernel_names;
use symmalloc::comm::moe::launch::MOE_KERNELS;
use symmalloc::comm::moe::throughput::TP_KERNELS;
use symmalloc::comm::p2p::{P2P_SIGNAL_KERNEL, P2P_WAIT_KERNEL};
use symmalloc::cuda::util::SELFTEST_SAXPY;

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

/// The two generated files of kernels/ are what the table generates. `make kernels`
/// (`SYMMALLOC_BLESS=1 cargo test --test host kernel_table::`) rewrites them.
#[test]
fn generated_kernel_sources_are_up_to_date() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let bless = std::env::var("SYMMALLOC_BLESS").as_deref() == Ok("1");
    for (file, fresh) in [
        ("instances.cu", symmalloc::comm::kernels::instances_source()),
        (
            "symm_constants.cuh",
            symmalloc::comm::kernels::constants_header(),
        ),
    ] {
        let path = dir.join(file);
        if bless {
            std::fs::write(&path, &fresh).unwrap();
            continue;
        }
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            current == fresh,
            "kernels/{file} is stale: src/comm/collective/kernels.rs or kernel_args.rs changed. Run `make \
             kernels` and commit the result."
        );
    }
}

#[test]
fn every_table_name_is_instantiated_and_vice_versa() {
    let src = sources();
    let mut instantiated = BTreeSet::new();
    for line in src.lines() {
        let l = line.trim();
        if l.starts_with("extern \"C\" __global__") {
            // `extern "C" __global__ void [__launch_bounds__(N)] NAME(ArgsType a)`
            let at = l
                .find("(SymmArgs")
                .or_else(|| l.find("(SaxpyArgs"))
                .or_else(|| l.find("(RmsArgs"))
                .or_else(|| l.find("(P2pArgs"))
                .or_else(|| l.find("(MoeArgs"))
                .or_else(|| l.find("(MoeTpArgs"))
                .expect("kernel signature");
            instantiated.insert(l[..at].split_whitespace().last().unwrap().to_string());
        }
    }
    let mut table: BTreeSet<String> = all_kernel_names().into_iter().collect();
    table.insert(SELFTEST_SAXPY.to_string());
    table.insert(P2P_WAIT_KERNEL.to_string());
    table.insert(P2P_SIGNAL_KERNEL.to_string());
    table.extend(MOE_KERNELS.iter().map(|s| s.to_string()));
    table.extend(TP_KERNELS.iter().map(|s| s.to_string()));
    assert_eq!(
        table, instantiated,
        "kernel table and kernels/*.cu disagree"
    );
    // one-shot, LL, two-shot, multimem, reduce-scatter (barrier, LL), all-gather, fused RMSNorm (barrier,
    // LL with four vectors per thread, with one, and over a cluster), their FP8 outputs (4 kernels
    // x 3 modes x 2 types), self-test, p2p wait and signal, moe dispatch (2 payloads x 2 index
    // types) and combine, their send halves (4 + 1) and receive halves (2 payloads + 1), the
    // quantizing dispatch (2 index types), its send halves (2) and receive half (1), all of these
    // again as probe instances; the throughput mode's dispatch (3 payloads, the quantizing one
    // included, x 2 index types) and combine, its send halves (6), receive halves (3) and the
    // combine's halves (2), and their probe instances
    assert_eq!(
        table.len(),
        18 + 18 + 18 + 3 + 18 + 9 + 6 + 2 + 2 + 2 + 2 + 24 + 1 + 2 + 2 * (5 + 5 + 3 + 5) + 2 * 18
    );
    // Names the profiles and earlier results use stay as they were.
    for name in [
        "symm_one_shot_ll_bf16_sum_vec",
        "symm_two_shot_fp32_min_scalar",
        "symm_multimem_fp16_sum_vec",
        "symm_reduce_scatter_ll_bf16_max_vec",
        "symm_all_gather_fp32_scalar",
        "symm_all_reduce_add_rms_norm_bf16",
        "symm_all_reduce_add_rms_norm_ll1_fp16",
        "symm_all_reduce_add_rms_norm_llc_bf16",
        "symm_all_reduce_add_rms_norm_llc_fp8_token_bf16",
        "symm_all_reduce_add_rms_norm_fp8_group_fp16",
    ] {
        assert!(table.contains(name), "{name}");
    }
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
        "kernels/common.cuh SymmArgs changed: update src/comm/collective/kernel_args.rs in step"
    );
    assert_eq!(
        std::mem::size_of::<symmalloc::comm::kernel_args::SymmArgs>(),
        256
    );
    // The internal block's layout (docs/DESIGN.md, "Internal buffer layout").
    use symmalloc::comm::kernel_args as k;
    assert_eq!(k::PAD_BYTES, 128 * 8 * 16);
    assert_eq!(k::ABORT_OFFSET, k::PAD_BYTES + 128 * 4);
    assert_eq!(k::LL_COUNTERS_OFFSET, k::ABORT_OFFSET + k::CONTROL_BYTES);
    assert_eq!(k::LL_DESC_OFFSET, k::LL_COUNTERS_OFFSET + 128 * 4);
    assert_eq!(k::LL_DATA_OFFSET, k::LL_DESC_OFFSET + 4096);
    assert_eq!(k::LL_EMPTY, 0xffff_ffff);
    // No kernel source defines a shared constant by hand (it would shadow the generated one).
    for c in k::SHARED_CONSTANTS {
        let defs = src.matches(&format!("#define {} ", c.name)).count();
        assert_eq!(defs, 1, "{} is defined {defs} times in kernels/", c.name);
    }
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
            "uint64_t scale",
        ],
        "kernels/rms_norm.cuh RmsArgs changed: update src/comm/collective/kernel_args.rs in step"
    );
}

#[test]
fn p2p_argument_struct_matches_the_cuda_source() {
    let src = sources();
    assert_eq!(
        struct_fields(&src, "P2pArgs"),
        [
            "symm_device_comm_t d",
            "uint64_t value",
            "uint32_t slot",
            "int32_t peer",
        ],
        "kernels/p2p.cu P2pArgs changed: update src/comm/p2p/signal_pad.rs in step"
    );
}

/// The device helpers follow the same rule as the kernels: device code only ever *stores* to
/// the host-mapped error words (through the `e` pointer of `symm_report_signal_timeout`, after
/// winning the abort word), and the spin loop reads only its slot, the clock and the abort word.
#[test]
fn the_device_header_only_stores_to_the_host_mapped_error_words() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include/symmalloc_device.cuh");
    let src = std::fs::read_to_string(path).unwrap();
    let code: Vec<&str> = src
        .lines()
        .map(|l| l.split("//").next().unwrap().trim())
        .filter(|l| !l.starts_with('*') && !l.starts_with("/*"))
        .collect();
    let uses: Vec<&&str> = code.iter().filter(|l| l.contains("error_word")).collect();
    assert_eq!(
        uses,
        [
            &"if (atomicCAS((unsigned int *)(uintptr_t)d.abort_word, 0u, w) != 0u || d.error_word == 0) return;",
            &"volatile uint32_t *e = (volatile uint32_t *)(uintptr_t)d.error_word;",
        ],
        "the device header touches the host-mapped error words other than by the timeout report"
    );
    // `e` is only ever the target of a store.
    for l in code.iter().filter(|l| l.contains("e[")) {
        assert!(
            l.starts_with("e[") && l.contains("] = "),
            "a load of the host-mapped error words: {l}"
        );
    }
}

/// kernels/moe.cu's `MoeArgs` is src/comm/moe/launch.rs's, field by field, and the constants it
/// shares with the host (control words, flag rows, status codes) are the Rust ones.
#[test]
fn moe_argument_struct_and_constants_match_the_cuda_source() {
    use symmalloc::comm::moe::{config, launch, layout as l, status as st};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/moe.cu");
    let src = std::fs::read_to_string(path).unwrap();
    let mut u64s = vec!["uint64_t x", "uint64_t x_scales", "uint64_t topk_idx"];
    u64s.extend(["uint64_t topk_weights", "uint64_t expert_out", "uint64_t y"]);
    u64s.extend(["uint64_t status", "uint64_t off_flags"]);
    u64s.extend([
        "uint64_t off_recv_counts",
        "uint64_t off_recv_src",
        "uint64_t off_recv_x",
    ]);
    u64s.extend([
        "uint64_t off_recv_scales",
        "uint64_t off_idx",
        "uint64_t off_weights",
    ]);
    u64s.extend([
        "uint64_t off_pos",
        "uint64_t off_list",
        "uint64_t off_xstage",
    ]);
    u64s.extend([
        "uint64_t off_xscales",
        "uint64_t off_cbuf",
        "uint64_t max_recv",
    ]);
    u64s.push("uint64_t num_tokens");
    let mut want = vec!["SymmArgs s", "uint64_t blocks[SYMM_MAX_RANKS]"];
    want.extend(u64s);
    want.extend([
        "int64_t refuse_value",
        "uint32_t max_tokens",
        "uint32_t hidden",
        "int32_t k",
        "int32_t topk",
        "int32_t experts",
    ]);
    want.extend(["int32_t local", "int32_t refuse_code", "int32_t scale_mode"]);
    assert_eq!(
        struct_fields(&src, "MoeArgs"),
        want,
        "kernels/moe.cu MoeArgs changed: update src/comm/moe/launch.rs in step"
    );
    assert_eq!(
        std::mem::size_of::<launch::MoeArgs>(),
        256 + 64 + 22 * 8 + 8 * 4
    );
    let define = |name: &str| -> u64 {
        let at = src
            .find(&format!("#define {name} "))
            .unwrap_or_else(|| panic!("kernels/moe.cu does not define {name}"));
        let rest = &src[at + name.len() + 9..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    let pairs: [(&str, u64); 41] = [
        ("MOE_SCALE_UE8M0", launch::SCALE_MODE_UE8M0 as u64),
        ("MOE_SCALE_COL_TMA", launch::SCALE_MODE_COL_TMA as u64),
        ("MOE_THREADS", symmalloc::comm::moe::THREADS as u64),
        ("MOE_MAX_EXPERTS", config::MAX_EXPERTS as u64),
        ("MOE_ROW_EXTRA", l::ROW_EXTRA),
        ("MOE_ROW_BLOCKS", l::ROW_BLOCKS),
        ("MOE_SCALE_GROUP", config::SCALE_GROUP),
        ("MOE_CTRL_D_DONE", l::CTRL_D_DONE),
        ("MOE_CTRL_D_SENT", l::CTRL_D_SENT),
        ("MOE_CTRL_C_DONE", l::CTRL_C_DONE),
        ("MOE_CTRL_C_SENT", l::CTRL_C_SENT),
        ("MOE_CTRL_OK_EPOCH", l::CTRL_OK_EPOCH),
        ("MOE_CTRL_D_FIN", l::CTRL_D_FIN),
        ("MOE_CTRL_BYTES", l::CTRL_BYTES),
        ("MOE_CTRL_C_FIN", l::CTRL_C_FIN),
        ("MOE_CTRL_D_HALF", l::CTRL_D_HALF),
        ("MOE_CTRL_PROBE", l::CTRL_PROBE),
        ("MOE_P_D_START", l::PROBE_D_START),
        ("MOE_P_D_ROUTED", l::PROBE_D_ROUTED),
        ("MOE_P_D_STAGED", l::PROBE_D_STAGED),
        ("MOE_P_D_PUBLISHED", l::PROBE_D_PUBLISHED),
        ("MOE_P_D_RECV", l::PROBE_D_RECV),
        ("MOE_P_D_WAITED", l::PROBE_D_WAITED),
        ("MOE_P_D_PULLED", l::PROBE_D_PULLED),
        ("MOE_P_D_EPOCH", l::PROBE_D_EPOCH),
        ("MOE_P_C_START", l::PROBE_C_START),
        ("MOE_P_C_PUSHED", l::PROBE_C_PUSHED),
        ("MOE_P_C_RECV", l::PROBE_C_RECV),
        ("MOE_P_C_WAITED", l::PROBE_C_WAITED),
        ("MOE_P_C_SUMMED", l::PROBE_C_SUMMED),
        ("MOE_P_C_EPOCH", l::PROBE_C_EPOCH),
        ("MOE_P_D_SCANNED", l::PROBE_D_SCANNED),
        ("MOE_P_D_SORTED", l::PROBE_D_SORTED),
        ("MOE_FLAG_COMBINE", l::FLAG_COMBINE),
        ("MOE_ST_OUT_OF_RANGE", st::ST_OUT_OF_RANGE as u64),
        ("MOE_ST_DUPLICATE", st::ST_DUPLICATE as u64),
        ("MOE_ST_CAPACITY", st::ST_CAPACITY as u64),
        ("MOE_ST_TOO_MANY_TOKENS", st::ST_TOO_MANY_TOKENS as u64),
        ("MOE_ST_BAD_K", st::ST_BAD_K as u64),
        ("MOE_ST_REFUSED", st::ST_REFUSED as u64),
        ("MOE_ST_COMBINE_REFUSED", st::ST_COMBINE_REFUSED as u64),
    ];
    for (name, value) in pairs {
        assert_eq!(
            define(name),
            value,
            "kernels/moe.cu {name} differs from the Rust constant"
        );
    }
    // The status words are host-mapped: the kernels of both modes only ever store to them, in
    // moe_record_at (`w` is the volatile pointer to them), and nowhere else name them.
    let tp = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/moe_tp.cu"),
    )
    .unwrap();
    for (file, text) in [("moe.cu", &src), ("moe_tp.cu", &tp)] {
        let uses: Vec<&str> = text
            .lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| l.contains("a.status") || l.contains("(volatile uint32_t*)status"))
            .collect();
        let want: &[&str] = if file == "moe.cu" {
            &[
                "volatile uint32_t* w = (volatile uint32_t*)status;",
                "moe_record_at(a.status, code, rank, token, k, value, call);",
            ]
        } else {
            &["moe_record_at(a.status, code, rank, token, k, value, call);"]
        };
        assert_eq!(uses, want, "kernels/{file} names the status words");
    }
    let body = &src[src.find("void moe_record_at(").unwrap()..];
    let body = &body[..body.find("\n}\n").unwrap()];
    assert!(
        body.lines()
            .skip(2)
            .all(|l| !l.contains("w[") || l.contains("] = ")),
        "moe_record_at reads its host-mapped words"
    );
    // Every MoE kernel is launched with moe::THREADS threads, one block per SM (MOE_BOUNDS).
    assert!(
        src.contains("#define MOE_BOUNDS __launch_bounds__(MOE_THREADS, 1)"),
        "MOE_BOUNDS: MOE_THREADS threads and one block per SM"
    );
    // The index dtype and payload variants the launch picks exist.
    for p in [config::Payload::Bf16, config::Payload::Fp8] {
        for it in [config::IndexType::I32, config::IndexType::I64] {
            assert!(src.contains(&format!(
                "void MOE_BOUNDS {}(MoeArgs a)",
                launch::dispatch_kernel(p, it)
            )));
        }
    }
    for it in [config::IndexType::I32, config::IndexType::I64] {
        assert!(src.contains(&format!(
            "void MOE_BOUNDS {}(MoeArgs a)",
            launch::MOE_KERNELS[launch::quantize_index(it)]
        )));
    }
    // Every (phase, probe) launch names the instance of that phase and probe: the split halves
    // and the probe instances of the kernel the one-call form uses.
    use launch::Phase;
    let named = |i: usize, phase: Phase, probe: bool| {
        let n = launch::MOE_KERNELS[i];
        let half = match phase {
            Phase::Both => !n.contains("_send") && !n.contains("_recv"),
            Phase::Send => n.contains("_send_"),
            Phase::Recv => n.contains("_recv_"),
        };
        assert!(half && n.ends_with("_probe") == probe, "{i}: {n}");
        assert!(
            src.contains(&format!("void MOE_BOUNDS {n}(MoeArgs a)")),
            "{n}"
        );
        n
    };
    for probe in [false, true] {
        for phase in [Phase::Both, Phase::Send, Phase::Recv] {
            let n = named(launch::combine_index(phase, probe), phase, probe);
            assert!(n.starts_with("symm_moe_combine"), "{n}");
            for p in [config::Payload::Bf16, config::Payload::Fp8] {
                for it in [config::IndexType::I32, config::IndexType::I64] {
                    let n = named(
                        launch::dispatch_index(p, it, false, phase, probe),
                        phase,
                        probe,
                    );
                    assert!(n.contains(&format!("_{}", p.name())), "{n}");
                    if phase != Phase::Recv {
                        assert!(n.contains(&format!("_{}", it.name())), "{n}");
                    }
                }
            }
            for it in [config::IndexType::I32, config::IndexType::I64] {
                let i = launch::dispatch_index(config::Payload::Fp8, it, true, phase, probe);
                let n = named(i, phase, probe);
                assert!(n.contains("_bf16_to_fp8"), "{n}");
                if phase != Phase::Recv {
                    assert!(n.contains(&format!("_{}", it.name())), "{n}");
                }
            }
        }
    }
    for (i, n) in launch::MOE_KERNELS[..launch::PROBE_OFFSET]
        .iter()
        .enumerate()
    {
        assert_eq!(
            launch::MOE_KERNELS[i + launch::PROBE_OFFSET],
            format!("{n}_probe")
        );
    }
}

/// kernels/moe_tp.cu's `MoeTpArgs` is src/comm/moe/throughput.rs's, field by field, and the
/// control words and flag rows it shares with the host are the Rust ones.
#[test]
fn moe_tp_argument_struct_and_constants_match_the_cuda_source() {
    use symmalloc::comm::moe::throughput as tp;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/moe_tp.cu");
    let src = std::fs::read_to_string(path).unwrap();
    let u64s = [
        "x_or_expert_out",
        "x_scales",
        "topk_idx",
        "weights_or_y",
        "status",
        "off_flags",
        "off_meta",
        "off_recv_src",
        "off_recv_idx",
        "off_recv_weights",
        "off_expert_rows",
        "off_recv_x",
        "off_recv_scales",
        "off_idx",
        "off_weights",
        "off_pos",
        "off_list",
        "off_xstage",
        "off_xscales",
        "off_cstage",
        "off_csr",
        "num_tokens",
    ];
    let mut want = vec![
        "SymmArgs s".to_string(),
        "uint64_t blocks[SYMM_MAX_RANKS]".to_string(),
    ];
    want.extend(u64s.iter().map(|f| format!("uint64_t {f}")));
    want.push("int64_t refuse_value".into());
    want.extend(["uint32_t max_tokens", "uint32_t hidden"].map(String::from));
    for f in ["k", "topk", "experts", "local", "refuse_code", "scale_mode"] {
        want.push(format!("int32_t {f}"));
    }
    let got: Vec<String> = struct_fields(&src, "MoeTpArgs")
        .into_iter()
        .map(|f| f.to_string())
        .collect();
    assert_eq!(
        got, want,
        "kernels/moe_tp.cu MoeTpArgs changed: update src/comm/moe/throughput.rs in step"
    );
    assert_eq!(
        std::mem::size_of::<tp::MoeTpArgs>(),
        256 + 64 + 23 * 8 + 8 * 4
    );
    // Every (payload, index type, phase) launch names its instance; the probe instances follow.
    use symmalloc::comm::moe::config::{IndexType, Payload};
    use symmalloc::comm::moe::launch::Phase;
    let half = |n: &str, phase: Phase| match phase {
        Phase::Both => !n.contains("_send_") && !n.contains("_recv_"),
        Phase::Send => n.contains("_send_"),
        Phase::Recv => n.contains("_recv_"),
    };
    for phase in [Phase::Both, Phase::Send, Phase::Recv] {
        let n = tp::TP_KERNELS[tp::tp_combine_index(phase)];
        assert!(
            n.starts_with("symm_moe_tp_combine") && half(n, phase),
            "{n}"
        );
        for (p, q, name) in [
            (Payload::Bf16, false, "_bf16"),
            (Payload::Fp8, false, "_fp8_"),
            (Payload::Fp8, true, "_fp8q"),
        ] {
            for it in [IndexType::I32, IndexType::I64] {
                let n = tp::TP_KERNELS[tp::tp_dispatch_index(p, q, it, phase)];
                let payload = n.contains(name) || (name == "_fp8_" && n.ends_with("_fp8"));
                assert!(
                    n.starts_with("symm_moe_tp_dispatch") && half(n, phase) && payload,
                    "{n}"
                );
                assert!(phase == Phase::Recv || n.ends_with(it.name()), "{n}");
                assert!(
                    src.contains(&format!("void MOE_BOUNDS {n}(MoeTpArgs a)")),
                    "{n}"
                );
            }
        }
    }
    for (i, n) in tp::TP_KERNELS[..tp::TP_PROBE_OFFSET].iter().enumerate() {
        assert_eq!(
            tp::TP_KERNELS[i + tp::TP_PROBE_OFFSET],
            format!("{n}_probe")
        );
    }
    let define = |name: &str| -> u64 {
        let at = src
            .find(&format!("#define {name} "))
            .unwrap_or_else(|| panic!("kernels/moe_tp.cu does not define {name}"));
        let rest = &src[at + name.len() + 9..];
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    for (name, v) in [
        ("MOE_CTRL_TP_FIRST", tp::CTRL_TP_FIRST),
        ("MOE_CTRL_TP_SYNC", tp::CTRL_TP_SYNC),
        ("MOE_TP_MAX_GRID", symmalloc::comm::moe::MAX_GRID as u64),
        ("MOE_CTRL_TP_ROW", tp::CTRL_TP_ROW),
        (
            "MOE_TP_FLAG_STAGED",
            symmalloc::comm::moe::layout::TP_FLAG_STAGED,
        ),
        (
            "MOE_TP_FLAG_READ",
            symmalloc::comm::moe::layout::TP_FLAG_READ,
        ),
    ] {
        assert_eq!(
            define(name),
            v,
            "kernels/moe_tp.cu {name} differs from the Rust constant"
        );
    }
}
