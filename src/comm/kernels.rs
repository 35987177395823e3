//! The kernel-id table: every kernel the communicator can launch, by name. Kept in step with
//! the `extern "C"` instantiations in kernels/*.cu (tests/kernel_table.rs checks both ways).

use super::algo::{Algo, DType, ReduceOp};

/// Name of the kernel for an algorithm (not AUTO), type, op and vector/scalar variant.
pub fn kernel_name(algo: Algo, dtype: DType, op: ReduceOp, vec: bool) -> Option<String> {
    let a = match algo {
        Algo::OneShot => "one_shot",
        Algo::TwoShot => "two_shot",
        Algo::OneShotLL => "one_shot_ll",
        Algo::Multimem if op == ReduceOp::Sum && vec => "multimem",
        Algo::ReduceScatter => "reduce_scatter",
        // 16-byte vectors only (the launch falls back to ReduceScatter otherwise).
        Algo::ReduceScatterLL if vec => "reduce_scatter_ll",
        // All-gather moves data and has no op: one kernel per type, listed under Sum.
        Algo::AllGather if op == ReduceOp::Sum => {
            let v = if vec { "vec" } else { "scalar" };
            return Some(format!("symm_all_gather_{}_{v}", dtype.name()));
        }
        // One kernel per 16-bit type (16-byte vectors only).
        Algo::AddRmsNorm if op == ReduceOp::Sum && vec && dtype != DType::Fp32 => {
            return Some(format!("symm_all_reduce_add_rms_norm_{}", dtype.name()));
        }
        Algo::AddRmsNormLL if op == ReduceOp::Sum && vec && dtype != DType::Fp32 => {
            return Some(format!("symm_all_reduce_add_rms_norm_ll_{}", dtype.name()));
        }
        Algo::AddRmsNormLL1 if op == ReduceOp::Sum && vec && dtype != DType::Fp32 => {
            return Some(format!("symm_all_reduce_add_rms_norm_ll1_{}", dtype.name()));
        }
        Algo::AddRmsNormLLC if op == ReduceOp::Sum && vec && dtype != DType::Fp32 => {
            return Some(format!("symm_all_reduce_add_rms_norm_llc_{}", dtype.name()));
        }
        _ => return None,
    };
    let v = if vec { "vec" } else { "scalar" };
    Some(format!("symm_{a}_{}_{}_{v}", dtype.name(), op.name()))
}

/// Every collective kernel name the library may ask the module for.
pub fn all_kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for algo in [
        Algo::OneShot,
        Algo::OneShotLL,
        Algo::TwoShot,
        Algo::Multimem,
        Algo::ReduceScatter,
        Algo::ReduceScatterLL,
        Algo::AllGather,
        Algo::AddRmsNorm,
        Algo::AddRmsNormLL,
        Algo::AddRmsNormLL1,
        Algo::AddRmsNormLLC,
    ] {
        for dtype in [DType::Bf16, DType::Fp16, DType::Fp32] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                for vec in [true, false] {
                    out.extend(kernel_name(algo, dtype, op, vec));
                }
            }
        }
    }
    out
}

/// Kernels that are not collectives.
pub const SELFTEST_SAXPY: &str = "symm_selftest_saxpy";
