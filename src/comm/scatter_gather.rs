//! Reduce-scatter and all-gather (kernels/scatter_gather.cu; host_reduce.rs on the host
//! backend), with the guarantees of all-reduce: buffers in the heap are used in place and
//! others staged through the scratch (counted in `staged_collectives`); the call descriptor
//! (offsets, count, type, op, collective) is compared across ranks; stream-ordered and
//! capturable; errors and timeouts as for all-reduce.
//!
//! Only what peers touch must be symmetric: every rank's `send` for reduce-scatter, every
//! rank's `recv` for all-gather (CallDesc::words leaves the other out of the comparison).
//!
//! Shapes: reduce-scatter reads `world * count` elements and writes `count` (rank r gets
//! elements [r * count, (r + 1) * count) of the reduction); all-gather reads `count` and writes
//! `world * count` (rank r's input lands at r * count everywhere). In place means NCCL's rule:
//! recv = send + rank * count for reduce-scatter, send = recv + rank * count for all-gather.
//! Any other overlap is refused.

use super::algo::{Algo, DType, ReduceOp};
use super::exchange::CallDesc;
use super::{byte_size, check_pointers, Communicator};
use crate::error::{Error, Result};

impl Communicator {
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter(
        &mut self,
        send: u64,
        recv: u64,
        recv_count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        self.scatter_gather(
            Algo::ReduceScatter,
            send,
            recv,
            recv_count,
            dtype,
            op,
            stream,
        )
    }

    pub fn all_gather(
        &mut self,
        send: u64,
        recv: u64,
        send_count: u64,
        dtype: DType,
        stream: u64,
    ) -> Result<()> {
        self.scatter_gather(
            Algo::AllGather,
            send,
            recv,
            send_count,
            dtype,
            ReduceOp::Sum,
            stream,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn scatter_gather(
        &mut self,
        algo: Algo,
        send: u64,
        recv: u64,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: u64,
    ) -> Result<()> {
        self.begin_call(stream)?;
        if count == 0 {
            return Ok(());
        }
        check_pointers(send, recv, dtype)?;
        let (es, world) = (dtype.size() as u64, self.world as u64);
        let slot = byte_size(count, es, 1)?;
        let whole = byte_size(count, es, world)?;
        let (send_bytes, recv_bytes) = match algo {
            Algo::ReduceScatter => (whole, slot),
            _ => (slot, whole),
        };
        check_overlap(
            algo,
            send,
            send_bytes,
            recv,
            recv_bytes,
            self.rank as u64 * slot,
        )?;
        let in_send = self.locate(send, send_bytes)?;
        let in_recv = self.locate(recv, recv_bytes)?;
        // Only the buffer peers touch is shared: every rank's input (reduce-scatter), every
        // rank's output (all-gather).
        let (work_send, work_recv, staged, seg) = match (in_send, in_recv) {
            (Some(a), Some(b)) => (
                send,
                recv,
                false,
                if algo == Algo::AllGather { b } else { a },
            ),
            _ => {
                // Both halves in the scratch, apart: the kernel then runs out of place.
                let recv_at = send_bytes.next_multiple_of(256);
                let s = self.ensure_scratch(recv_at + recv_bytes)?;
                let seg = self
                    .locate(s, recv_at + recv_bytes)?
                    .expect("scratch is in the heap");
                (s, s + recv_at, true, seg)
            }
        };
        let base = self.windows.bases[self.rank];
        let desc = CallDesc {
            send_off: work_send - base,
            recv_off: work_recv - base,
            count,
            dtype: dtype as u64,
            op: op as u64,
            algo: algo as u64,
        };
        self.exchange(&[seg], desc, self.check_symmetry)?;
        self.order_streams(stream)?;
        if staged {
            self.stage_in(work_send, send, send_bytes, stream)?;
        }
        self.trace_call(
            format_args!("{}", algo.name()),
            &desc,
            dtype,
            op,
            stream,
            staged,
        );
        self.run(algo, desc, dtype, op, stream, 0)?;
        if staged {
            self.copy(recv, work_recv, recv_bytes, stream)?;
        }
        Ok(())
    }
}

/// Refuses overlapping buffers unless they are in place by NCCL's rule: the smaller buffer is
/// this rank's slot (at `slot_at` bytes) of the larger one.
fn check_overlap(
    algo: Algo,
    send: u64,
    send_bytes: u64,
    recv: u64,
    recv_bytes: u64,
    slot_at: u64,
) -> Result<()> {
    if send + send_bytes <= recv || recv + recv_bytes <= send {
        return Ok(());
    }
    let (ok, rule) = match algo {
        Algo::ReduceScatter => (recv == send + slot_at, "recv = send + rank * recv_count"),
        _ => (send == recv + slot_at, "send = recv + rank * send_count"),
    };
    if ok {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{}: send {send:#x} ({send_bytes} bytes) and recv {recv:#x} ({recv_bytes} bytes) \
         overlap; in place means {rule} (here {:#x}), otherwise the buffers must be apart",
        algo.name(),
        match algo {
            Algo::ReduceScatter => send + slot_at,
            _ => recv + slot_at,
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_refused_unless_in_place_by_the_rule() {
        let rs = Algo::ReduceScatter;
        // Rank 1 of 2, 100-byte slots: send 200 bytes at 0x1000.
        assert!(
            check_overlap(rs, 0x1000, 200, 0x2000, 100, 100).is_ok(),
            "apart"
        );
        assert!(check_overlap(rs, 0x1000, 200, 0x1000 + 100, 100, 100).is_ok());
        let e = check_overlap(rs, 0x1000, 200, 0x1000, 100, 100).unwrap_err();
        assert!(e
            .message
            .contains("recv = send + rank * recv_count (here 0x1064)"));
        let ag = Algo::AllGather;
        assert!(check_overlap(ag, 0x2000 + 100, 100, 0x2000, 200, 100).is_ok());
        let e = check_overlap(ag, 0x2000, 100, 0x2000, 200, 100).unwrap_err();
        assert!(e.message.contains("send = recv + rank * send_count"));
    }
}
