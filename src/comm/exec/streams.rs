//! One communicator, several streams. The kernels of a communicator share state that is only
//! right when they run one after another: the barrier epochs, the LL call counters and the LL
//! buffers they alternate between. A user who issues collectives on two streams without
//! ordering them would otherwise get two kernels at once on one rank (a wrong sum, or a wait that
//! never ends). So a call on a stream other than the previous call's first makes its stream wait
//! for everything submitted to the previous stream so far (one event), and the collectives of a
//! communicator stay in one order on every rank, whatever streams carry them.
//!
//! Work being captured into a graph runs only when the graph is launched, so it cannot be ordered
//! against work outside its capture (the driver refuses to join the two). The order is added when
//! neither stream is capturing, or both belong to the same capture (the graph then carries the
//! edge); otherwise graphs of one communicator must be launched in order by the user, as the
//! README says. The previous stream must still exist at the next call on another stream (the
//! same rule as `symm_free`'s stream).

use crate::cuda;
use crate::error::Result;

/// A stream's capture state: `None` when it is not being captured, else the capture's id.
pub type Capture = Option<u64>;

/// Whether a call whose stream is in state `next` can be ordered after the previous stream, in
/// state `prev`.
pub fn can_order(prev: Capture, next: Capture) -> bool {
    match (prev, next) {
        (None, None) => true,
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// The previous call's stream and the event that orders the next one after it.
#[derive(Default)]
pub struct StreamOrder {
    last: Option<u64>,
    event: Option<cuda::driver::OrderingEvent>,
}

impl StreamOrder {
    /// Called before a kernel of the communicator is enqueued on `stream`; a comparison when the
    /// stream is the previous call's.
    pub fn before_launch(&mut self, device: i32, stream: u64) -> Result<()> {
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
