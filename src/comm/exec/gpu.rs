//! The CUDA executor: plans enqueued on the caller's stream. The one place that launches a
//! kernel, with the one kernel cache (every kernel a communicator launches, looked up in the
//! device's module on its first launch) and the communicator's stream order (streams.rs).
//!
//! Invariants: nothing here reads from the device or waits for it on a plan's path, so every
//! plan is capturable; an ordered plan is ordered after the previous ordered plan before its
//! first work on the stream (the copy in uses the scratch the previous call's kernel may still
//! read).

use super::streams::StreamOrder;
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

    fn has_grid(&self) -> bool {
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

    fn meets_before_sharing(&self) -> bool {
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
