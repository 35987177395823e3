//! The host backend's executor: a plan runs at once, on the calling thread: the copy in, the
//! plan's CPU twin (collective/host_reduce.rs, p2p/signal_pad.rs, moe/host.rs and
//! host_combine.rs: the kernels' semantics on the peers' memfd mappings), the copy out. No
//! stream, no grid, no device.
//!
//! Invariants: a plan without a twin runs its copies alone (a put); calls are synchronous, so
//! there is no stream order to keep; kernels never run, so no word is mapped for them.

use super::{Copy, Executor, KernelId, Plan};
use crate::error::{Error, Result};

pub struct CpuExec;

fn copy(c: Copy) {
    // SAFETY: the builders hand copies between buffers of at least `bytes` bytes of this
    // address space (a caller's checked buffer, the scratch, a rendezvoused peer range); they
    // may overlap (a put to self), so copy as memmove does.
    unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.bytes as usize) };
}

impl Executor for CpuExec {
    fn backend(&self) -> &'static str {
        "host"
    }

    fn submit(&mut self, plan: Plan<'_>) -> Result<()> {
        if let Some(c) = plan.copy_in {
            copy(c);
        }
        if let Some(twin) = plan.cpu {
            twin()?;
        }
        if let Some(c) = plan.copy_out {
            copy(c);
        }
        Ok(())
    }

    fn grids(&self) -> bool {
        false
    }

    fn blocks_per_sm(
        &mut self,
        _kernel: KernelId,
        _name: fn(KernelId) -> Result<String>,
        _block: u32,
    ) -> Result<u32> {
        Err(Error::internal(
            "the host backend has no occupancy: its plans carry no grid",
        ))
    }

    fn multicast(&self) -> Result<bool> {
        Ok(false)
    }

    fn meets(&self) -> bool {
        true
    }

    fn zero(&self, addr: u64, bytes: u64) -> Result<()> {
        // SAFETY: addr..addr + bytes is a live block of this rank's mapped host memory (the
        // callers: a block just allocated, not yet shared).
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, bytes as usize) };
        Ok(())
    }

    fn reset_internal(&self, zero_at: u64, zero_len: u64, _ll: (u64, u8, u64)) -> Result<()> {
        self.zero(zero_at, zero_len)
    }

    fn quiesce(&self, _stream: u64) -> Result<bool> {
        Ok(true)
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn mapped_word(&self) -> Result<Option<crate::cuda::mem::MappedWord>> {
        Ok(None)
    }

    fn sm_count(&self) -> Result<u32> {
        Ok(1)
    }

    fn check_peers(&self, _rank: usize, _devices: &[i32], sms: u32) -> Result<(bool, u32)> {
        Ok((false, sms))
    }

    fn fresh(&self) -> Box<dyn Executor> {
        Box::new(CpuExec)
    }
}
