//! The CUDA executor: plans enqueued on the caller's stream. The one place that launches a
//! kernel, with the one kernel cache (every kernel a communicator launches, looked up in the
//! device's module on its first launch) and the communicator's stream order (`StreamOrder`,
//! below).
//!
//! Invariants: nothing here reads from the device or waits for it on a plan's path, so every
//! plan is capturable; an ordered plan is ordered after the previous ordered plan before its
//! first work on the stream (the copy in uses the scratch the previous call's kernel may still
//! read).

use super::{Copy, Device, Executor, KernelId, Launch, Plan};
use crate::cuda;
use crate::cuda::module::Function;
use crate::error::{Error, Result};
use std::collections::HashMap;

pub struct GpuExec {
    device: i32,
    /// Every kernel launched so far, so a launch does no name formatting, module lock or hash
    /// of a string.
    kernels: HashMap<KernelId, Function>,
    /// Blocks per SM by (kernel, block size): the driver's occupancy answer, asked once.
    resident: HashMap<(KernelId, u32), u32>,
    /// The previous ordered plan's stream.
    streams: StreamOrder,
}

impl GpuExec {
    pub fn new(device: i32) -> GpuExec {
        GpuExec {
            device,
            kernels: HashMap::new(),
            resident: HashMap::new(),
            streams: StreamOrder::default(),
        }
    }

    /// The kernel `id`, looked up in the module on first use.
    fn function(&mut self, id: KernelId, name: fn(KernelId) -> Result<String>) -> Result<Function> {
        if let Some(&f) = self.kernels.get(&id) {
            return Ok(f);
        }
        let f = cuda::module::function(self.device, &name(id)?)?;
        self.kernels.insert(id, f);
        Ok(f)
    }

    fn copy(&self, c: Copy, stream: u64) -> Result<()> {
        cuda::mem::copy_async(self.device, c.dst, c.src, c.bytes, stream)
    }

    /// The launch site.
    fn launch(&mut self, l: &Launch, stream: u64) -> Result<()> {
        let f = self.function(l.id, l.name)?;
        if l.shared != 0 {
            return Err(Error::internal(format!(
                "a launch asked for {} bytes of dynamic shared memory; no kernel takes any",
                l.shared
            )));
        }
        if l.cluster > 1 {
            return cuda::module::launch_cluster(
                self.device,
                f,
                l.grid,
                l.block,
                l.cluster,
                stream,
                &l.args,
            );
        }
        cuda::module::launch(self.device, f, l.grid, l.block, stream, &l.args)
    }
}

impl Executor for GpuExec {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn submit(&mut self, plan: Plan<'_>) -> Result<()> {
        let stream = plan.stream;
        if plan.ordered {
            self.streams.before_launch(self.device, stream)?;
        }
        if let Some(c) = plan.copy_in {
            self.copy(c, stream)?;
        }
        match &plan.device {
            Device::Nothing => {}
            Device::Kernel(l) => self.launch(l, stream)?,
            &Device::StreamWrite {
                word_addr,
                word,
                value_addr,
                value,
            } => cuda::stream_ops::write_u32_then_u64(
                self.device,
                stream,
                word_addr,
                word,
                value_addr,
                value,
            )?,
            &Device::StreamWait { addr, value } => {
                cuda::stream_ops::wait_geq_u64(self.device, stream, addr, value)?
            }
        }
        if let Some(c) = plan.copy_out {
            self.copy(c, stream)?;
        }
        Ok(())
    }

    fn grids(&self) -> bool {
        true
    }

    fn blocks_per_sm(
        &mut self,
        kernel: KernelId,
        name: fn(KernelId) -> Result<String>,
        block: u32,
    ) -> Result<u32> {
        if let Some(&n) = self.resident.get(&(kernel, block)) {
            return Ok(n);
        }
        let f = self.function(kernel, name)?;
        let n = cuda::module::blocks_per_sm(self.device, f, block)?;
        self.resident.insert((kernel, block), n);
        Ok(n)
    }

    fn multicast(&self) -> Result<bool> {
        Ok(cuda::driver()?.device(self.device)?.multicast)
    }

    fn meets(&self) -> bool {
        false
    }

    fn zero(&self, addr: u64, bytes: u64) -> Result<()> {
        cuda::mem::memset_sync(self.device, addr, 0, bytes)
    }

    fn reset_internal(&self, zero_at: u64, zero_len: u64, ll: (u64, u8, u64)) -> Result<()> {
        cuda::mem::memset2_sync(self.device, zero_at, zero_len, ll.0, ll.1, ll.2)
    }

    fn quiesce(&self, stream: u64) -> Result<bool> {
        if cuda::driver::is_capturing(self.device, stream)? {
            return Ok(false);
        }
        cuda::mem::sync_device(self.device)?;
        Ok(true)
    }

    fn sync(&self) -> Result<()> {
        cuda::mem::sync_device(self.device)
    }

    fn mapped_word(&self) -> Result<Option<cuda::mem::MappedWord>> {
        cuda::mem::MappedWord::new(self.device).map(Some)
    }

    fn sm_count(&self) -> Result<u32> {
        Ok(cuda::driver()?.device(self.device)?.sm_count as u32)
    }

    fn check_peers(&self, rank: usize, devices: &[i32], sms: u32) -> Result<(bool, u32)> {
        let drv = cuda::driver()?;
        let (mut clusters, mut fewest) = (true, sms);
        let device = self.device;
        for (r, &d) in devices.iter().enumerate() {
            let info = drv.device(d)?;
            clusters &= info.cc_major >= 9;
            fewest = fewest.min(info.sm_count as u32);
            if !drv.can_access_peer(device, d)? {
                return Err(Error::unsupported(format!(
                    "device {device} (rank {rank}) cannot access device {d} (rank {r}) \
                     directly; symmalloc needs NVLink or PCIe peer access between all ranks"
                )));
            }
        }
        Ok((clusters, fewest))
    }

    fn fresh(&self) -> Box<dyn Executor> {
        Box::new(GpuExec::new(self.device))
    }
}

// One communicator, several streams. The kernels of a communicator share state that is only
// right when they run one after another: the barrier epochs, the LL call counters and the LL
// buffers they alternate between. A user who issues collectives on two streams without ordering
// them would otherwise get two kernels at once on one rank (a wrong sum, or a wait that never
// ends). So a call on a stream other than the previous call's first makes its stream wait for
// everything submitted to the previous stream so far (one event), and the collectives of a
// communicator stay in one order on every rank, whatever streams carry them.
//
// Work being captured into a graph runs only when the graph is launched, so it cannot be ordered
// against work outside its capture (the driver refuses to join the two). The order is added when
// neither stream is capturing, or both belong to the same capture (the graph then carries the
// edge); otherwise graphs of one communicator must be launched in order by the user, as the
// README says. The previous stream must still exist at the next call on another stream (the
// same rule as `symm_free`'s stream).

/// A stream's capture state: `None` when it is not being captured, else the capture's id.
type Capture = Option<u64>;

/// Whether a call whose stream is in state `next` can be ordered after the previous stream, in
/// state `prev`.
fn can_order(prev: Capture, next: Capture) -> bool {
    match (prev, next) {
        (None, None) => true,
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// The previous call's stream and the event that orders the next one after it.
#[derive(Default)]
struct StreamOrder {
    last: Option<u64>,
    event: Option<cuda::driver::OrderingEvent>,
}

impl StreamOrder {
    /// Called before a kernel of the communicator is enqueued on `stream`; a comparison when the
    /// stream is the previous call's.
    fn before_launch(&mut self, device: i32, stream: u64) -> Result<()> {
        match self.last {
            Some(prev) if prev != stream => {
                let (p, n) = (
                    cuda::driver::capture_id(device, prev)?,
                    cuda::driver::capture_id(device, stream)?,
                );
                if can_order(p, n) {
                    if self.event.is_none() {
                        self.event = Some(cuda::driver::OrderingEvent::new(device)?);
                    }
                    let ev = self.event.as_ref().expect("created above");
                    ev.order(device, stream, prev)?;
                }
            }
            _ => {}
        }
        self.last = Some(stream);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::can_order;

    #[test]
    fn eager_streams_are_ordered() {
        assert!(can_order(None, None));
    }

    #[test]
    fn one_capture_is_ordered_within_itself_only() {
        assert!(can_order(Some(7), Some(7)));
        assert!(
            !can_order(Some(7), Some(8)),
            "two captures cannot be joined"
        );
        assert!(
            !can_order(None, Some(7)),
            "eager work cannot be joined into a capture"
        );
        assert!(
            !can_order(Some(7), None),
            "a capture cannot be waited on from outside"
        );
    }
}
