//! The execution seam: every piece of work a communicator puts on a stream (a collective, a
//! p2p signal, wait or put, a MoE dispatch or combine) is a `Plan`, and one `Executor` runs it.
//! The executor is chosen at init from the heap's backend (`for_backend`), as the heap picks its
//! `Backend`: `gpu.rs` enqueues on a CUDA stream, `cpu.rs` runs the plan's CPU twin at once.
//! Nothing outside those two files asks which backend runs.
//!
//! A plan is what a stage decided, as data: the kernel (an id and how to name it the first
//! time), its grid, block, cluster and shared memory, its argument struct (bytes, copied as the
//! kernel takes them), the copies before and after it, whether it joins the communicator's
//! stream order, and the CPU twin (what the host backend runs instead). The stages build plans
//! (collective/plan.rs and launch.rs, p2p/, moe/launch.rs); the executor applies what every
//! launch needs: the order after the communicator's previous launch (gpu.rs, `StreamOrder`),
//! the kernel looked up once (one cache for every kernel), the copies, the launch. A stage reaches the
//! executor only through a begun call (comm/calls.rs, `begin`: the error words read, the
//! peers' released segments retired), so every launch gets those too.
//!
//! Owns: the executor (the communicator's `exec`), its kernel cache, occupancy answers and
//! stream order. Imports nothing of the stages: a kernel is an opaque id here, its arguments
//! bytes, its twin a closure.
//!
//! Invariants: `gpu.rs` is the one place that launches a kernel (cuLaunchKernel or, for a
//! cluster grid, cuLaunchKernelEx); a plan's argument bytes are exactly the `#[repr(C)]` struct
//! its builder gave (`ArgBlock::of`), so what the kernel reads is unchanged; a plan with
//! `ordered` set runs after every earlier ordered plan of the communicator, whatever stream it
//! names (the collectives and MoE, which share the barrier epochs and call counters); p2p plans
//! are not ordered (they share no state with those kernels: p2p/mod.rs).

pub mod cpu;
pub mod gpu;

use crate::error::Result;

/// A copy between two buffers of this address space, stream-ordered around a plan's kernel
/// (on the CPU: a memmove).
#[derive(Clone, Copy, Debug)]
pub struct Copy {
    pub dst: u64,
    pub src: u64,
    pub bytes: u64,
}

/// A kernel, as its builder names it: a key unique among the module's kernels (each stage
/// packs its own family and choices into it), turned into the kernel's name only on the first
/// launch (`Launch::name`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelId(pub u64);

/// The kernel families of the module, one per builder, so their keys never meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// The collectives' instances (collective/kernels.rs, `kernel_name`).
    Collective = 1,
    /// The fused call's FP8-output instances (`quant_kernel_name`).
    CollectiveFp8 = 2,
    /// kernels/p2p.cu.
    P2p = 3,
    /// kernels/moe.cu.
    Moe = 4,
}

impl KernelId {
    /// The id of `key` (below 2^56) in `family`.
    pub const fn new(family: Family, key: u64) -> KernelId {
        KernelId((family as u64) << 56 | key)
    }

    /// The key its builder packed.
    pub const fn key(self) -> u64 {
        self.0 & ((1 << 56) - 1)
    }
}

/// Bytes an argument block holds: the largest argument struct, the throughput MoE's 536,
/// rounded up to the block's alignment (`ArgBlock::of` refuses a larger one at compile time).
/// Kept tight: a plan is built and moved on every call.
pub const ARG_BYTES: usize = 544;

/// A kernel's argument struct, as bytes: the kernels take one struct by value, and the driver
/// copies as many bytes as the kernel's parameter has from the start of the block.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct ArgBlock {
    bytes: [u8; ARG_BYTES],
}

impl ArgBlock {
    /// The bytes of `args` (a `#[repr(C)]` mirror of the kernel's parameter).
    pub fn of<T: std::marker::Copy>(args: &T) -> ArgBlock {
        const { assert!(std::mem::size_of::<T>() <= ARG_BYTES) };
        const { assert!(std::mem::align_of::<T>() <= 16) };
        let mut b = ArgBlock {
            bytes: [0; ARG_BYTES],
        };
        // SAFETY: T is Copy (plain data) and fits in the block (asserted above); the source and
        // the destination are distinct.
        unsafe {
            std::ptr::copy_nonoverlapping(
                args as *const T as *const u8,
                b.bytes.as_mut_ptr(),
                std::mem::size_of::<T>(),
            )
        };
        b
    }
}

/// One kernel launch.
#[derive(Clone, Copy)]
pub struct Launch {
    pub id: KernelId,
    /// The kernel's name in the module, or why there is no such kernel (first launch only).
    pub name: fn(KernelId) -> Result<String>,
    pub grid: u32,
    pub block: u32,
    /// Blocks per thread-block cluster (1: no cluster).
    pub cluster: u32,
    /// Dynamic shared memory bytes (0 for every kernel today).
    pub shared: u32,
    pub args: ArgBlock,
}

/// What a plan runs on the GPU between its copies. (A plan lives on the caller's stack for one
/// submit; boxing the launch would cost an allocation per call.)
#[allow(clippy::large_enum_variant)]
pub enum Device {
    /// Nothing (the copies alone: a put).
    Nothing,
    Kernel(Launch),
    /// Two stream memory writes, the 32-bit word first (a signal by stream write).
    StreamWrite {
        word_addr: u64,
        word: u32,
        value_addr: u64,
        value: u64,
    },
    /// The stream waits until the 64-bit word at `addr` is >= `value` (unbounded).
    StreamWait {
        addr: u64,
        value: u64,
    },
}

/// Everything one operation puts on a stream.
pub struct Plan<'a> {
    pub stream: u64,
    /// Ordered after the communicator's previous ordered plan (collectives, MoE).
    pub ordered: bool,
    pub copy_in: Option<Copy>,
    pub device: Device,
    /// What the host backend runs instead of `device` (between the same copies).
    pub cpu: Option<&'a mut dyn FnMut() -> Result<()>>,
    pub copy_out: Option<Copy>,
}

impl<'a> Plan<'a> {
    /// A plan of one piece of work and no copies: `device` where kernels run, its twin `cpu` on
    /// the host backend (the MoE calls, p2p's signal and wait).
    pub fn work(
        stream: u64,
        ordered: bool,
        device: Device,
        cpu: &'a mut dyn FnMut() -> Result<()>,
    ) -> Self {
        Plan {
            stream,
            ordered,
            copy_in: None,
            device,
            cpu: Some(cpu),
            copy_out: None,
        }
    }
}

/// Runs plans, and answers what a plan builder must know of where they run.
pub trait Executor: Send {
    /// "cuda" or "host" (the heap's backend it was chosen for; at most 8 bytes: the ranks agree
    /// on it as one word, group/init.rs).
    fn backend(&self) -> &'static str;
    /// Runs (enqueues) a plan: the stream order, the copy in, the work, the copy out.
    fn submit(&mut self, plan: Plan<'_>) -> Result<()>;
    /// Whether plans carry a kernel grid (the GPU's do; the CPU runs twins, which have none):
    /// the builders work out a grid (asking `blocks_per_sm` where they must) only then. Asked
    /// once, at init (`CollSettings::grids`), so a call does not ask.
    fn grids(&self) -> bool;
    /// Blocks of `kernel` with `block` threads one SM holds at once (asked once per pair).
    fn blocks_per_sm(
        &mut self,
        kernel: KernelId,
        name: fn(KernelId) -> Result<String>,
        block: u32,
    ) -> Result<u32>;
    /// Whether this device supports multicast objects (the gate decides whether they are used).
    fn multicast(&self) -> Result<bool>;
    /// Whether the ranks meet before one makes or shares a segment (collective/place.rs):
    /// where the collectives run on the CPU and can meet; kernels cannot, so on the GPU they
    /// do not (and nothing of the meeting is worked out on a call's path). Asked once, at init
    /// (`CollSettings::meets`).
    fn meets(&self) -> bool;
    /// Zeroes `bytes` bytes at `addr` before any peer can see them; synchronous.
    fn zero(&self, addr: u64, bytes: u64) -> Result<()>;
    /// Readies an internal block: `zero_len` bytes at `zero_at` to 0 and, where kernels use
    /// them, `ll_len` bytes of LL buffers at `ll_at` to `ll_byte` (the CPU's collectives never
    /// touch the LL buffers, so the CPU leaves them alone); synchronous.
    fn reset_internal(&self, zero_at: u64, zero_len: u64, ll: (u64, u8, u64)) -> Result<()>;
    /// Waits for the device's queued work, unless `stream` is being captured (then false, and
    /// nothing waited: a synchronization would break the capture).
    fn quiesce(&self, stream: u64) -> Result<bool>;
    /// Waits for the device's queued work.
    fn sync(&self) -> Result<()>;
    /// A host-mapped word block kernels store into (error and status words); None on the CPU.
    fn mapped_word(&self) -> Result<Option<crate::cuda::mem::MappedWord>>;
    /// SMs of this device (1 on the CPU).
    fn sm_count(&self) -> Result<u32>;
    /// Checks every rank's device can be reached from this one; returns whether all of them run
    /// thread-block clusters and the fewest SMs among them (starting from `sms`).
    fn check_peers(&self, rank: usize, devices: &[i32], sms: u32) -> Result<(bool, u32)>;
    /// A fresh executor for another communicator on the same device (a split's child).
    fn fresh(&self) -> Box<dyn Executor>;
}

/// The executor for the heap's backend (`name`: `Backend::name()`) on `device`.
pub fn for_backend(name: &str, device: i32) -> Box<dyn Executor> {
    match name {
        "host" => Box::new(cpu::CpuExec),
        _ => Box::new(gpu::GpuExec::new(device)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Args {
        a: u64,
        b: u32,
        c: i32,
        d: [u64; 3],
    }

    #[test]
    fn an_arg_block_starts_with_the_struct_bytes() {
        let v = Args {
            a: 0x0102_0304_0506_0708,
            b: 7,
            c: -1,
            d: [1, 2, 3],
        };
        let b = ArgBlock::of(&v);
        // SAFETY: Args is plain data without padding (8 + 4 + 4 + 24 bytes).
        let raw = unsafe {
            std::slice::from_raw_parts(&v as *const Args as *const u8, std::mem::size_of::<Args>())
        };
        assert_eq!(&b.bytes[..raw.len()], raw);
        assert!(b.bytes[raw.len()..].iter().all(|&x| x == 0));
        assert_eq!(&b as *const ArgBlock as usize % 16, 0);
    }

    #[test]
    fn the_cpu_runs_copy_in_twin_copy_out_in_order() {
        let src = [1u8, 2, 3, 4];
        let mut mid = [0u8; 4];
        let mut out = [0u8; 4];
        let (src_p, mid_p, out_p) = (
            src.as_ptr() as u64,
            mid.as_mut_ptr() as u64,
            out.as_mut_ptr() as u64,
        );
        let mut seen = None;
        let mut twin = || {
            // SAFETY: mid is a live 4-byte buffer; the copy in wrote it before the twin runs.
            seen = Some(unsafe { *(mid_p as *const [u8; 4]) });
            // SAFETY: as above; the twin doubles what the copy in brought.
            unsafe {
                for i in 0..4 {
                    *(mid_p as *mut u8).add(i) *= 2;
                }
            }
            Ok(())
        };
        let mut e = for_backend("host", 0);
        assert_eq!(e.backend(), "host");
        e.submit(Plan {
            stream: 0,
            ordered: true,
            copy_in: Some(Copy {
                dst: mid_p,
                src: src_p,
                bytes: 4,
            }),
            device: Device::Nothing,
            cpu: Some(&mut twin),
            copy_out: Some(Copy {
                dst: out_p,
                src: mid_p,
                bytes: 4,
            }),
        })
        .unwrap();
        assert_eq!(seen, Some([1, 2, 3, 4]));
        assert_eq!(out, [2, 4, 6, 8]);
        let mut failing = || Err(crate::error::Error::invalid("twin refused"));
        let e2 = e.submit(Plan {
            stream: 0,
            ordered: false,
            copy_in: None,
            device: Device::Nothing,
            cpu: Some(&mut failing),
            copy_out: Some(Copy {
                dst: out_p,
                src: src_p,
                bytes: 4,
            }),
        });
        assert!(e2.is_err());
        assert_eq!(out, [2, 4, 6, 8], "no copy out after a failed twin");
    }
}
