//! The collectives' kernels as the executor knows them (comm/exec/): an id per instance (kernel,
//! type, op, vector width; or the fused call's FP8-output instance), packed into `KernelId`, and
//! its name in the module (kernels.rs), asked only on the instance's first launch.
//!
//! Invariants: distinct instances have distinct ids (tested below); an id names exactly the
//! instance `kernels::kernel_name` / `quant_kernel_name` name for its parts.

use super::algo::{DType, Kernel, Quant, ReduceOp};
use super::kernels;
use crate::comm::exec::{Family, KernelId};
use crate::error::{Error, Result};

const KERNELS: [Kernel; 11] = [
    Kernel::OneShot,
    Kernel::OneShotLL,
    Kernel::TwoShot,
    Kernel::Multimem,
    Kernel::ReduceScatter,
    Kernel::ReduceScatterLL,
    Kernel::AllGather,
    Kernel::AddRmsNorm,
    Kernel::AddRmsNormLL,
    Kernel::AddRmsNormLL1,
    Kernel::AddRmsNormLLC,
];
const DTYPES: [DType; 3] = [DType::Bf16, DType::Fp16, DType::Fp32];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
const QUANTS: [Quant; 3] = [Quant::Static, Quant::PerToken, Quant::PerGroup128];

/// The id of the instance (kernel, type, op, vector width) (`kernels::kernel_name`).
pub(in crate::comm) fn kernel_id(
    kernel: Kernel,
    dtype: DType,
    op: ReduceOp,
    vec: bool,
) -> KernelId {
    let key = (kernel as u64) << 16 | (dtype as u64) << 8 | (op as u64) << 4 | vec as u64;
    KernelId::new(Family::Collective, key)
}

/// The id of a fused kernel's instance: its bf16/fp16-output one (`kernel_id`), or its FP8 one
/// of `quant`'s mode (`kernels::quant_kernel_name`).
pub(in crate::comm) fn fused_kernel_id(
    kernel: Kernel,
    dtype: DType,
    quant: Option<Quant>,
) -> KernelId {
    match quant {
        None => kernel_id(kernel, dtype, ReduceOp::Sum, true),
        Some(q) => KernelId::new(
            Family::CollectiveFp8,
            (kernel as u64) << 16 | (dtype as u64) << 8 | q as u64,
        ),
    }
}

/// The name of a collective kernel id, or why the module has no such instance.
pub(in crate::comm) fn kernel_id_name(id: KernelId) -> Result<String> {
    let k = id.key();
    let kernel = KERNELS[(k >> 16) as usize & 0xff];
    let dtype = DTYPES[(k >> 8) as usize & 0xf];
    if id == KernelId::new(Family::Collective, k) {
        let (op, vec) = (OPS[(k >> 4) as usize & 0xf], k & 1 == 1);
        return kernels::kernel_name(kernel, dtype, op, vec).ok_or_else(|| {
            Error::unsupported(format!(
                "no {} kernel for {} {}",
                kernel.name(),
                dtype.name(),
                op.name()
            ))
        });
    }
    let q = QUANTS[k as usize & 0xf];
    kernels::quant_kernel_name(kernel, dtype, q).ok_or_else(|| {
        Error::unsupported(format!(
            "no {} kernel with {} output for {}",
            kernel.name(),
            q.name(),
            dtype.name()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_id_names_its_instance() {
        for &k in &KERNELS {
            for &d in &DTYPES {
                for &op in &OPS {
                    for vec in [false, true] {
                        let id = kernel_id(k, d, op, vec);
                        match kernels::kernel_name(k, d, op, vec) {
                            Some(n) => assert_eq!(kernel_id_name(id).unwrap(), n),
                            None => assert!(kernel_id_name(id).is_err()),
                        }
                    }
                }
                for &q in &QUANTS {
                    let id = fused_kernel_id(k, d, Some(q));
                    match kernels::quant_kernel_name(k, d, q) {
                        Some(n) => assert_eq!(kernel_id_name(id).unwrap(), n),
                        None => assert!(kernel_id_name(id).is_err()),
                    }
                }
            }
        }
    }

    #[test]
    fn kernel_ids_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for &k in &KERNELS {
            for &d in &DTYPES {
                for &op in &OPS {
                    for vec in [false, true] {
                        assert!(seen.insert(kernel_id(k, d, op, vec)));
                    }
                }
                for &q in &QUANTS {
                    assert!(seen.insert(fused_kernel_id(k, d, Some(q))));
                }
            }
        }
    }
}
