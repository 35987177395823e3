//! The kernel-id table: every kernel family of kernels/, and from it every instance's name, the
//! generated `kernels/instances.cu` (the `extern "C"` kernels) and `kernels/symm_constants.cuh`
//! (the constants of kernel_args.rs). One list, three uses: the launch looks kernels up by the
//! names made here, and tests/kernel_table.rs checks the two checked-in files are what this
//! table generates (`make kernels` rewrites them), so names, instances and constants cannot
//! drift apart (NCCL keeps its kernel ids in step with names the same way).

use super::algo::{DType, Kernel, Quant, ReduceOp};
use super::kernel_args::SHARED_CONSTANTS;

/// How a family's body template is instantiated.
#[derive(Clone, Copy)]
enum TParams {
    /// `<T, OP, VEC>`
    TypeOpVec,
    /// `<T, OP>`
    TypeOp,
    /// `<T, VEC>`
    TypeVec,
    /// `<T>`
    Type,
    /// `<T, X>` with a fixed second argument.
    TypeAnd(&'static str),
    /// `<0|1|2>`: the type as an index (multimem's PTX differs by type).
    TypeIndex,
}

/// One kernel family: a body template in a header of kernels/, instantiated for some types,
/// ops and vector widths. Names: `symm_<name>_<type>[_<op>][_vec|_scalar]`; a family without
/// ops has one kernel per type (listed under `Sum`), one without widths only vectors.
pub struct Family {
    pub kernel: Kernel,
    name: &'static str,
    header: &'static str,
    body: &'static str,
    args: &'static str,
    bounds: &'static str,
    dtypes: &'static [DType],
    ops: &'static [ReduceOp],
    vecs: &'static [bool],
    tparams: TParams,
}

const ALL_TYPES: &[DType] = &[DType::Bf16, DType::Fp16, DType::Fp32];
const HALF_TYPES: &[DType] = &[DType::Bf16, DType::Fp16];
const ALL_OPS: &[ReduceOp] = &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
const SUM: &[ReduceOp] = &[ReduceOp::Sum];
const BOTH: &[bool] = &[true, false];
const VEC: &[bool] = &[true];

/// Every kernel family, in the order instances.cu lists them.
pub const FAMILIES: &[Family] = &[
    Family {
        kernel: Kernel::OneShot,
        name: "one_shot",
        header: "one_shot.cuh",
        body: "one_shot_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: ALL_OPS,
        vecs: BOTH,
        tparams: TParams::TypeOpVec,
    },
    Family {
        kernel: Kernel::OneShotLL,
        name: "one_shot_ll",
        header: "one_shot_ll.cuh",
        body: "one_shot_ll_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: ALL_OPS,
        vecs: BOTH,
        tparams: TParams::TypeOpVec,
    },
    Family {
        kernel: Kernel::TwoShot,
        name: "two_shot",
        header: "two_shot.cuh",
        body: "two_shot_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: ALL_OPS,
        vecs: BOTH,
        tparams: TParams::TypeOpVec,
    },
    Family {
        kernel: Kernel::Multimem,
        name: "multimem",
        header: "multimem.cuh",
        body: "multimem_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: SUM,
        vecs: VEC,
        tparams: TParams::TypeIndex,
    },
    Family {
        kernel: Kernel::ReduceScatter,
        name: "reduce_scatter",
        header: "scatter_gather.cuh",
        body: "reduce_scatter_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: ALL_OPS,
        vecs: BOTH,
        tparams: TParams::TypeOpVec,
    },
    Family {
        kernel: Kernel::ReduceScatterLL,
        name: "reduce_scatter_ll",
        header: "scatter_gather.cuh",
        body: "reduce_scatter_ll_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: ALL_OPS,
        vecs: VEC,
        tparams: TParams::TypeOp,
    },
    Family {
        kernel: Kernel::AllGather,
        name: "all_gather",
        header: "scatter_gather.cuh",
        body: "all_gather_body",
        args: "SymmArgs",
        bounds: "SYMM_THREADS",
        dtypes: ALL_TYPES,
        ops: &[],
        vecs: BOTH,
        tparams: TParams::TypeVec,
    },
    Family {
        kernel: Kernel::AddRmsNorm,
        name: "all_reduce_add_rms_norm",
        header: rms_header(Kernel::AddRmsNorm),
        body: "rms_body",
        args: "RmsArgs",
        bounds: "SYMM_THREADS",
        dtypes: HALF_TYPES,
        ops: &[],
        vecs: &[],
        tparams: TParams::Type,
    },
    Family {
        kernel: Kernel::AddRmsNormLL,
        name: "all_reduce_add_rms_norm_ll",
        header: rms_header(Kernel::AddRmsNormLL),
        body: "rms_ll_body",
        args: "RmsArgs",
        bounds: "SYMM_THREADS",
        dtypes: HALF_TYPES,
        ops: &[],
        vecs: &[],
        tparams: TParams::TypeAnd("SYMM_RMS_VECS"),
    },
    Family {
        kernel: Kernel::AddRmsNormLL1,
        name: "all_reduce_add_rms_norm_ll1",
        header: rms_header(Kernel::AddRmsNormLL1),
        body: "rms_ll_body",
        args: "RmsArgs",
        bounds: "SYMM_RMS_LL1_THREADS",
        dtypes: HALF_TYPES,
        ops: &[],
        vecs: &[],
        tparams: TParams::TypeAnd("1"),
    },
    Family {
        kernel: Kernel::AddRmsNormLLC,
        name: "all_reduce_add_rms_norm_llc",
        header: rms_header(Kernel::AddRmsNormLLC),
        body: "rms_llc_body",
        args: "RmsArgs",
        bounds: "SYMM_RMS_LLC_THREADS",
        dtypes: HALF_TYPES,
        ops: &[],
        vecs: &[],
        tparams: TParams::Type,
    },
    // The FP8 outputs (kernels/quant.cuh): each fused kernel once per symm_quant_t mode.
    fp8(
        Kernel::AddRmsNorm,
        "all_reduce_add_rms_norm_fp8_static",
        "rms_body",
        "SYMM_THREADS",
        "QUANT_STATIC",
    ),
    fp8(
        Kernel::AddRmsNorm,
        "all_reduce_add_rms_norm_fp8_token",
        "rms_body",
        "SYMM_THREADS",
        "QUANT_PER_TOKEN",
    ),
    fp8(
        Kernel::AddRmsNorm,
        "all_reduce_add_rms_norm_fp8_group",
        "rms_body",
        "SYMM_THREADS",
        "QUANT_PER_GROUP",
    ),
    fp8(
        Kernel::AddRmsNormLL,
        "all_reduce_add_rms_norm_ll_fp8_static",
        "rms_ll_body",
        "SYMM_THREADS",
        "SYMM_RMS_VECS, QUANT_STATIC",
    ),
    fp8(
        Kernel::AddRmsNormLL,
        "all_reduce_add_rms_norm_ll_fp8_token",
        "rms_ll_body",
        "SYMM_THREADS",
        "SYMM_RMS_VECS, QUANT_PER_TOKEN",
    ),
    fp8(
        Kernel::AddRmsNormLL,
        "all_reduce_add_rms_norm_ll_fp8_group",
        "rms_ll_body",
        "SYMM_THREADS",
        "SYMM_RMS_VECS, QUANT_PER_GROUP",
    ),
    fp8(
        Kernel::AddRmsNormLL1,
        "all_reduce_add_rms_norm_ll1_fp8_static",
        "rms_ll_body",
        "SYMM_RMS_LL1_THREADS",
        "1, QUANT_STATIC",
    ),
    fp8(
        Kernel::AddRmsNormLL1,
        "all_reduce_add_rms_norm_ll1_fp8_token",
        "rms_ll_body",
        "SYMM_RMS_LL1_THREADS",
        "1, QUANT_PER_TOKEN",
    ),
    fp8(
        Kernel::AddRmsNormLL1,
        "all_reduce_add_rms_norm_ll1_fp8_group",
        "rms_ll_body",
        "SYMM_RMS_LL1_THREADS",
        "1, QUANT_PER_GROUP",
    ),
    fp8(
        Kernel::AddRmsNormLLC,
        "all_reduce_add_rms_norm_llc_fp8_static",
        "rms_llc_body",
        "SYMM_RMS_LLC_THREADS",
        "QUANT_STATIC",
    ),
    fp8(
        Kernel::AddRmsNormLLC,
        "all_reduce_add_rms_norm_llc_fp8_token",
        "rms_llc_body",
        "SYMM_RMS_LLC_THREADS",
        "QUANT_PER_TOKEN",
    ),
    fp8(
        Kernel::AddRmsNormLLC,
        "all_reduce_add_rms_norm_llc_fp8_group",
        "rms_llc_body",
        "SYMM_RMS_LLC_THREADS",
        "QUANT_PER_GROUP",
    ),
];

/// The header of a fused kernel's body: the cluster kernel's own (kernels/rms_norm_cluster.cuh)
/// or rms_norm.cuh.
const fn rms_header(kernel: Kernel) -> &'static str {
    match kernel {
        Kernel::AddRmsNormLLC => "rms_norm_cluster.cuh",
        _ => "rms_norm.cuh",
    }
}

/// A fused kernel's FP8 instance family: bf16 and fp16 inputs, `mode` (the template's
/// QUANT_* argument, after `extra`) its output. Its name is the bf16-output family's plus
/// `_fp8_<static|token|group>` (`quant_kernel_name` finds it by that).
const fn fp8(
    kernel: Kernel,
    name: &'static str,
    body: &'static str,
    bounds: &'static str,
    targs: &'static str,
) -> Family {
    Family {
        kernel,
        name,
        header: rms_header(kernel),
        body,
        args: "RmsArgs",
        bounds,
        dtypes: HALF_TYPES,
        ops: &[],
        vecs: &[],
        tparams: TParams::TypeAnd(targs),
    }
}

fn c_type(d: DType) -> &'static str {
    match d {
        DType::Bf16 => "__nv_bfloat16",
        DType::Fp16 => "__half",
        DType::Fp32 => "float",
    }
}

fn c_op(o: ReduceOp) -> &'static str {
    match o {
        ReduceOp::Sum => "OP_SUM",
        ReduceOp::Max => "OP_MAX",
        ReduceOp::Min => "OP_MIN",
    }
}

impl Family {
    /// An FP8-output family (`fp8`).
    fn is_fp8(&self) -> bool {
        self.name.contains("_fp8_")
    }

    /// Whether the family has an instance for (type, op, width).
    fn has(&self, dtype: DType, op: ReduceOp, vec: bool) -> bool {
        self.dtypes.contains(&dtype)
            && (if self.ops.is_empty() {
                op == ReduceOp::Sum
            } else {
                self.ops.contains(&op)
            })
            && (if self.vecs.is_empty() {
                vec
            } else {
                self.vecs.contains(&vec)
            })
    }

    fn instance_name(&self, dtype: DType, op: ReduceOp, vec: bool) -> String {
        let mut n = format!("symm_{}_{}", self.name, dtype.name());
        if !self.ops.is_empty() {
            n += "_";
            n += op.name();
        }
        if !self.vecs.is_empty() {
            n += if vec { "_vec" } else { "_scalar" };
        }
        n
    }

    fn template_args(&self, dtype: DType, op: ReduceOp, vec: bool) -> String {
        let (t, o) = (c_type(dtype), c_op(op));
        match self.tparams {
            TParams::TypeOpVec => format!("{t}, {o}, {vec}"),
            TParams::TypeOp => format!("{t}, {o}"),
            TParams::TypeVec => format!("{t}, {vec}"),
            TParams::Type => t.to_string(),
            TParams::TypeAnd(x) => format!("{t}, {x}"),
            TParams::TypeIndex => (dtype as usize).to_string(),
        }
    }

    /// Every (type, op, width) the family instantiates, in instances.cu's order.
    fn instances(&self) -> Vec<(DType, ReduceOp, bool)> {
        let ops: &[ReduceOp] = if self.ops.is_empty() { SUM } else { self.ops };
        let vecs: &[bool] = if self.vecs.is_empty() { VEC } else { self.vecs };
        let mut out = Vec::new();
        for &vec in vecs {
            for &dtype in self.dtypes {
                for &op in ops {
                    out.push((dtype, op, vec));
                }
            }
        }
        out
    }
}

/// Name of the kernel of `kernel` for (type, op, width), None where the family has no such
/// instance.
pub fn kernel_name(kernel: Kernel, dtype: DType, op: ReduceOp, vec: bool) -> Option<String> {
    let f = FAMILIES
        .iter()
        .find(|f| f.kernel == kernel && !f.is_fp8())?;
    f.has(dtype, op, vec)
        .then(|| f.instance_name(dtype, op, vec))
}

/// Name of the FP8-output instance of the fused kernel `kernel` for `dtype` in `quant` mode,
/// None where there is none.
pub fn quant_kernel_name(kernel: Kernel, dtype: DType, quant: Quant) -> Option<String> {
    let base = FAMILIES
        .iter()
        .find(|f| f.kernel == kernel && !f.is_fp8())?;
    let name = format!("{}_fp8_{}", base.name, quant.suffix());
    let f = FAMILIES
        .iter()
        .find(|f| f.kernel == kernel && f.name == name)?;
    f.has(dtype, ReduceOp::Sum, true)
        .then(|| f.instance_name(dtype, ReduceOp::Sum, true))
}

/// Every collective kernel name the library may ask the module for.
pub fn all_kernel_names() -> Vec<String> {
    FAMILIES
        .iter()
        .flat_map(|f| {
            f.instances()
                .into_iter()
                .map(|(d, o, v)| f.instance_name(d, o, v))
        })
        .collect()
}

const GENERATED: &str =
    "// Generated by `make kernels` from src/comm/collective/kernels.rs and kernel_args.rs\n\
// (tests/kernel_table.rs fails when it is stale): do not edit.";

/// The text of kernels/instances.cu: every family's header, then one `extern "C"` kernel per
/// instance.
pub fn instances_source() -> String {
    let mut s = format!("// Every collective kernel of symmalloc.\n{GENERATED}\n");
    let mut headers: Vec<&str> = Vec::new();
    for f in FAMILIES {
        if !headers.contains(&f.header) {
            headers.push(f.header);
        }
    }
    for h in headers {
        s += &format!("#include \"{h}\"\n");
    }
    for f in FAMILIES {
        s += "\n";
        for (d, o, v) in f.instances() {
            s += &format!(
                "extern \"C\" __global__ void __launch_bounds__({}) {}({} a) {{ {}<{}>(a); }}\n",
                f.bounds,
                f.instance_name(d, o, v),
                f.args,
                f.body,
                f.template_args(d, o, v)
            );
        }
    }
    s
}

/// The text of kernels/symm_constants.cuh: kernel_args.rs's shared constants as macros.
pub fn constants_header() -> String {
    let mut s = format!(
        "// The constants the host shares with the kernels.\n{GENERATED}\n#pragma once\n\n"
    );
    for c in SHARED_CONSTANTS {
        s += &format!("// {}\n#define {} {}{}\n", c.doc, c.name, c.value, c.suffix);
    }
    s
}
