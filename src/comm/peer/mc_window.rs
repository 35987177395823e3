//! Multicast windows: for `SYMM_ALGO_MULTIMEM`, one NVLink multicast object per heap segment
//! the kernel writes, bound to every rank's copy of that segment and mapped at an address of
//! its own (`multimem.ld_reduce` / `multimem.st` go through it).
//!
//! Built collectively, inside the all-reduce call that first needs it, by every rank at once
//! (the same call on every rank needs the same segment): rank 0 creates the object and sends
//! its file descriptor; every rank imports it, adds its device; all meet; every rank binds its
//! own physical segment and maps the object; all meet again. A window is keyed by the
//! segment's offset and generation; a new generation at that offset tears the old one down.
//!
//! Safety rule: `build` runs only after `cuda::multicast_gate::multicast_gate_from_env` allowed it, and
//! every driver call in `cuda::multicast` checks the gate again. On machines that disable multicast the gate
//! refuses, so none of this runs there: it is written to be correct, not exercised.
//!
//! Invariants: a window's handle is bound (this rank's segment, `bound` bytes at offset 0) and
//! mapped at `va` for `size` bytes until `teardown`, which undoes both and releases the handle.

use super::{PeerView, Who};
use crate::cuda::{self, vmm};
use crate::error::{Error, Result};
use crate::heap::device_heap::SegmentInfo;
use std::os::fd::AsFd;

#[derive(Debug)]
pub struct McWindow {
    pub generation: u64,
    pub handle: u64,
    pub va: u64,
    /// Mapped bytes (the segment rounded up to the multicast granularity).
    pub size: u64,
    /// Bytes of this rank's segment bound at offset 0.
    pub bound: u64,
}

/// Undoes a window, as far as it got; errors are reported, not stopped at.
fn teardown(device: i32, w: &McWindow) -> Result<()> {
    let mut first_err = None;
    let mut note = |r: Result<()>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    if w.va != 0 {
        note(vmm::unmap(device, w.va, w.size));
        note(vmm::unreserve(device, w.va, w.size));
    }
    if w.bound != 0 {
        note(cuda::multicast::unbind(device, w.handle, 0, w.bound));
    }
    note(vmm::release(w.handle));
    first_err.map_or(Ok(()), Err)
}

impl PeerView {
    /// The multicast address of segment `seg` (built on first use; collective).
    pub(in crate::comm) fn multicast_window(&mut self, who: &Who, seg: SegmentInfo) -> Result<u64> {
        if let Some(w) = self.mc.get(&seg.offset) {
            if w.generation == seg.generation {
                return Ok(w.va);
            }
            let old = self.mc.remove(&seg.offset).expect("present");
            teardown(who.device, &old)?;
        }
        cuda::multicast::ensure_allowed(who.device)?;
        let gran = cuda::multicast::granularity(who.device, who.world as u32, seg.size)?;
        let size = seg.size.next_multiple_of(gran);
        let (created, fds) = if who.rank == 0 {
            let h = cuda::multicast::create(who.device, who.world as u32, size)?;
            match vmm::export_fd(who.device, h) {
                Ok(fd) => (Some(h), vec![fd]),
                Err(e) => {
                    let _ = vmm::release(h);
                    return Err(e);
                }
            }
        } else {
            (None, vec![])
        };
        let mut msg = Vec::new();
        for w in [seg.offset, seg.size, size] {
            msg.extend_from_slice(&w.to_le_bytes());
        }
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let gathered = who.mesh.all_gather(&msg, &borrowed, "multicast setup");
        drop(fds);
        let release_created = || {
            if let Some(h) = created {
                let _ = vmm::release(h);
            }
        };
        let all = match gathered {
            Ok(a) => a,
            Err(e) => {
                release_created();
                return Err(e);
            }
        };
        if let Some(r) = (0..who.world).find(|&r| all[r].0 != msg) {
            release_created();
            return Err(Error::not_symmetric(format!(
                "multicast setup: rank {r} describes another segment or size than rank {} \
                 (offset {:#x}, {} bytes)",
                who.rank, seg.offset, seg.size
            )));
        }
        let handle = match created {
            Some(h) => h,
            None => {
                let fd = all[0].1.first().ok_or_else(|| {
                    Error::peer("multicast setup: rank 0 sent no multicast handle")
                })?;
                vmm::import_fd(who.device, fd)?
            }
        };
        let mut w = McWindow {
            generation: seg.generation,
            handle,
            va: 0,
            size,
            bound: 0,
        };
        let built = Self::bind_and_map(who, &mut w, seg, gran);
        if let Err(e) = built {
            let _ = teardown(who.device, &w);
            return Err(e);
        }
        let va = w.va;
        self.mc.insert(seg.offset, w);
        Ok(va)
    }

    fn bind_and_map(who: &Who, w: &mut McWindow, seg: SegmentInfo, gran: u64) -> Result<()> {
        cuda::multicast::add_device(who.device, w.handle)?;
        // Every device must be added before anyone binds memory.
        who.mesh.barrier("multicast add device")?;
        let phys = crate::heap::comm_view::CommView::new(who.alloc, who.device)
            .segment_cuda_handle(seg.offset)?;
        cuda::multicast::bind_mem(who.device, w.handle, 0, phys, 0, seg.size)?;
        w.bound = seg.size;
        let va = vmm::reserve(who.device, w.size, gran)?;
        if let Err(e) = vmm::map(who.device, va, w.size, w.handle) {
            let _ = vmm::unreserve(who.device, va, w.size);
            return Err(e);
        }
        w.va = va;
        // No rank may issue multimem operations before every rank has bound its memory.
        who.mesh.barrier("multicast bind")
    }

    /// Tears down every multicast window (at destroy).
    pub(in crate::comm) fn destroy_multicast_windows(&mut self, device: i32) {
        for (_, w) in std::mem::take(&mut self.mc) {
            let _ = teardown(device, &w);
        }
    }
}
