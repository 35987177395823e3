//! The split halves of dispatch and combine (docs/moe.md, "Split halves"): `symm_moe_dispatch_send`
//! / `_recv` and `symm_moe_combine_send` / `_recv`, and the clock probe's read
//! (`symm_moe_probe`). The object's state machine (`Pending`) pairs the halves on the host: a
//! receive half needs its send half, no other call of the object may come between them, and a
//! combine needs a received dispatch. A call out of that order is refused on its rank before
//! anything is submitted and changes nothing. A send half that fails (this rank's own bad
//! arguments, or an error reported at it) completes its call at once: it submits the receive
//! half too, so nothing is left pending and no peer waits for this rank.
//!
//! Invariant: `Moe::pending` is `Some` exactly between a send half that went out and its receive
//! half, and the device's epochs advance at the receive half (launch.rs, kernels/moe.cu), so the
//! halves of one call share an epoch on every rank.

use super::config::IndexType;
use super::launch::{self, Phase};
use super::{layout, plan_combine, plan_dispatch, Combine, Dispatch, Last, Moe};
use crate::comm::Communicator;
use crate::cuda;
use crate::error::{Error, Result};

/// The send half a receive half must follow (the split API's state).
#[derive(Clone, Copy, Debug)]
pub enum Pending {
    /// `symm_moe_dispatch_send` went out: its arguments and index type, for the receive half.
    Dispatch(Dispatch, IndexType),
    /// `symm_moe_combine_send` went out: its arguments and the dispatch it combines.
    Combine(Combine, Last),
}

impl Moe {
    /// The split API's order: `f` (a call) may come now unless a send half is pending, whose
    /// receive half it names. Nothing is submitted when this refuses.
    pub(super) fn idle(&self, f: &str) -> Result<()> {
        let (sent, expected) = match self.pending {
            None => return Ok(()),
            Some(Pending::Dispatch(..)) => ("symm_moe_dispatch_send", "symm_moe_dispatch_recv"),
            Some(Pending::Combine(..)) => ("symm_moe_combine_send", "symm_moe_combine_recv"),
        };
        Err(Error::invalid(format!(
            "{f}: {sent} was called and its receive half was not; expected {expected} first \
             (every send half is followed by its receive half before any other call on this \
             moe object)"
        )))
    }

    /// The object's clock probe (`symm_moe_probe`): `PROBE_WORDS` words (layout.rs `PROBE_*`):
    /// %globaltimer values on CUDA (after a device synchronization), the wall clock in ns on
    /// the host backend.
    pub fn probe(&self) -> Result<[u64; layout::PROBE_WORDS as usize]> {
        if !self.cfg.probe {
            return Err(Error::invalid(
                "symm_moe_probe: the clock probe is off for this moe object; expected an object \
                 created with flags SYMM_MOE_FLAG_PROBE (Python: comm.moe(..., probe=True))",
            ));
        }
        let mut out = [0u64; layout::PROBE_WORDS as usize];
        let at = self.block + 8 * layout::CTRL_PROBE;
        if self.exec.backend() == "host" {
            for (i, v) in out.iter_mut().enumerate() {
                // SAFETY: at..at + 8 * PROBE_WORDS lies in this rank's control part (host memory
                // on the host backend), 8-byte aligned; the calls on this thread wrote it.
                *v = unsafe { std::ptr::read_volatile((at as *const u64).add(i)) };
            }
        } else {
            self.exec.sync()?;
            let mut bytes = [0u8; 8 * layout::PROBE_WORDS as usize];
            cuda::mem::read_sync(self.device, &mut bytes, at)?;
            for (v, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *v = u64::from_le_bytes(b.try_into().unwrap());
            }
        }
        Ok(out)
    }
}

impl Communicator {
    /// `symm_moe_dispatch_send`: steps 1 and 2 of a dispatch (no wait on a peer). A failure
    /// (this rank's refusal, an error a kernel recorded earlier) completes the call here: the
    /// receive half is submitted too and nothing stays pending (module header).
    pub fn moe_dispatch_send(&mut self, m: &mut Moe, a: &Dispatch) -> Result<()> {
        let mut c = self.begin(a.stream)?;
        m.idle("symm_moe_dispatch_send")?;
        let pending = m.take_status();
        let (it, refusal) = match m.check_dispatch(a) {
            Ok(it) => (it, None),
            Err(r) => (IndexType::I32, Some(r)),
        };
        let sent = plan_dispatch(&mut c, m, a, it, refusal.as_ref(), Phase::Send)
            .map_err(|e| self.moe_fatal(e));
        if sent.is_ok() && refusal.is_none() && pending.is_none() {
            m.pending = Some(Pending::Dispatch(*a, it));
            return Ok(());
        }
        let mut r = sent;
        if r.is_ok() {
            let mut c = self.ctx();
            r = plan_dispatch(&mut c, m, a, it, refusal.as_ref(), Phase::Recv)
                .map_err(|e| self.moe_fatal(e));
        }
        let tokens = if refusal.is_some() { 0 } else { a.tokens };
        m.last = Some(Last {
            tokens,
            k: a.k,
            ok: false,
        });
        match (refusal, pending) {
            (Some(f), _) => Err(f.error),
            (None, Some(e)) if r.is_ok() => Err(e),
            (None, _) => r,
        }
    }

    /// `symm_moe_dispatch_recv`: steps 3 and 4 of the dispatch `symm_moe_dispatch_send` sent.
    pub fn moe_dispatch_recv(&mut self, m: &mut Moe, stream: u64) -> Result<()> {
        let mut c = self.begin(stream)?;
        let Some(Pending::Dispatch(sent, it)) = m.pending else {
            m.idle("symm_moe_dispatch_recv")?;
            return Err(Error::invalid(
                "symm_moe_dispatch_recv: no dispatch was sent; expected symm_moe_dispatch_send \
                 first",
            ));
        };
        m.pending = None;
        let pending = m.take_status();
        let a = Dispatch { stream, ..sent };
        let r = plan_dispatch(&mut c, m, &a, it, None, Phase::Recv)
            .map_err(|e| self.moe_fatal(e))
            .and_then(|()| pending.map_or(Ok(()), Err));
        m.last = Some(Last {
            tokens: a.tokens,
            k: a.k,
            ok: r.is_ok(),
        });
        r
    }

    /// `symm_moe_combine_send`: the rows of the last received dispatch's experts back to their
    /// tokens' ranks and this rank's flag raised (no wait on a peer). A failure completes the
    /// call here, as `moe_dispatch_send`'s does.
    pub fn moe_combine_send(&mut self, m: &mut Moe, a: &Combine) -> Result<()> {
        let mut c = self.begin(a.stream)?;
        m.idle("symm_moe_combine_send")?;
        let Some(last) = m.last else {
            return Err(Error::invalid(
                "symm_moe_combine_send: no dispatch on this object yet; expected \
                 symm_moe_dispatch (or symm_moe_dispatch_send and symm_moe_dispatch_recv) first",
            ));
        };
        let pending = m.take_status();
        let refusal = m.check_combine(a, last.tokens).err();
        let refused = refusal.is_some();
        let sent =
            plan_combine(&mut c, m, a, last, refused, Phase::Send).map_err(|e| self.moe_fatal(e));
        if sent.is_ok() && !refused && pending.is_none() {
            m.pending = Some(Pending::Combine(*a, last));
            return Ok(());
        }
        let nothing = matches!(&sent, Err(e) if e.message == launch::NOTHING_TO_COMBINE);
        let mut r = sent;
        if r.is_ok() {
            let mut c = self.ctx();
            r = plan_combine(&mut c, m, a, last, refused, Phase::Recv)
                .map_err(|e| self.moe_fatal(e));
        }
        match (r, refusal, pending) {
            (Err(e), _, _) if nothing => Err(e),
            (_, Some(e), _) => Err(e),
            (Ok(()), None, Some(e)) => Err(e),
            (r, None, _) => r,
        }
    }

    /// `symm_moe_combine_recv`: the wait and the sum of the combine `symm_moe_combine_send`
    /// sent, into the `y` it was given.
    pub fn moe_combine_recv(&mut self, m: &mut Moe, stream: u64) -> Result<()> {
        let mut c = self.begin(stream)?;
        let Some(Pending::Combine(sent, last)) = m.pending else {
            m.idle("symm_moe_combine_recv")?;
            return Err(Error::invalid(
                "symm_moe_combine_recv: no combine was sent; expected symm_moe_combine_send \
                 first",
            ));
        };
        m.pending = None;
        let pending = m.take_status();
        let a = Combine { stream, ..sent };
        plan_combine(&mut c, m, &a, last, false, Phase::Recv)
            .map_err(|e| self.moe_fatal(e))
            .and_then(|()| pending.map_or(Ok(()), Err))
    }
}
