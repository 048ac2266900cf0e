//! Queue pairs: the send and receive work queues (rings of WQEs in guest memory), ring indices, peer and rights,
//! and the ibverbs state machine that says which MODIFY_QP transitions are legal and which attributes they need.

use vhca_proto::{QpState, QP_ATTR_ACCESS_FLAGS, QP_ATTR_DEST_QPN, WQE_SIZE};

use crate::mapped_pages::MappedPages;

pub struct WorkQueue {
    pub entries: u32,
    pub registers: MappedPages,
    /// Count of WQEs the driver posted (its doorbell index).
    pub producer: u32,
    /// Count of WQEs the device consumed.
    pub consumer: u32,
}

impl WorkQueue {
    pub fn new(entries: u32, registers: MappedPages) -> WorkQueue {
        WorkQueue { entries, registers, producer: 0, consumer: 0 }
    }

    pub fn pending(&self) -> u32 {
        self.producer.wrapping_sub(self.consumer)
    }

    /// Byte offset in the ring of the WQE at monotonic index `index`.
    pub fn offset_of(&self, index: u32) -> u64 {
        u64::from(index % self.entries.max(1)) * WQE_SIZE as u64
    }

    /// Whether the driver may move the producer to `index`: forwards only, and never more than a ring ahead.
    pub fn accepts_producer(&self, index: u32) -> bool {
        index.wrapping_sub(self.consumer) <= self.entries && index.wrapping_sub(self.producer) <= self.entries
    }
}

pub struct Qp {
    pub qpn: u32,
    pub pd: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub sq: WorkQueue,
    pub rq: WorkQueue,
    pub state: QpState,
    pub dest_qpn: Option<u32>,
    /// ACCESS_REMOTE_* the QP grants its peer.
    pub access: u32,
}

impl Qp {
    /// The responder side accepts incoming requests in RTR and later sending states.
    pub fn can_receive(&self) -> bool {
        matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
    }
}

/// Why a transition is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransitionError {
    NotAllowed,
    MissingAttribute(&'static str),
}

/// ibverbs' RC state machine: any state may go to RESET or ERR; otherwise RESET→INIT→RTR→RTS, INIT→INIT,
/// RTS↔SQD, SQE→RTS. RESET→INIT needs access flags, INIT→RTR needs the peer (dest_qpn).
pub fn check_transition(from: QpState, to: QpState, attr_mask: u32) -> Result<(), TransitionError> {
    use QpState as S;
    let allowed = matches!(
        (from, to),
        (_, S::Reset)
            | (_, S::Err)
            | (S::Reset, S::Init)
            | (S::Init, S::Init)
            | (S::Init, S::Rtr)
            | (S::Rtr, S::Rts)
            | (S::Rts, S::Rts)
            | (S::Rts, S::Sqd)
            | (S::Sqd, S::Sqd)
            | (S::Sqd, S::Rts)
            | (S::Sqe, S::Rts)
    );
    if !allowed {
        return Err(TransitionError::NotAllowed);
    }
    if from == S::Reset && to == S::Init && attr_mask & QP_ATTR_ACCESS_FLAGS == 0 {
        return Err(TransitionError::MissingAttribute("access_flags"));
    }
    if from == S::Init && to == S::Rtr && attr_mask & QP_ATTR_DEST_QPN == 0 {
        return Err(TransitionError::MissingAttribute("dest_qpn"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vhca_proto::QP_ATTR_STATE;

    #[test]
    fn ibverbs_transitions() {
        use QpState as S;
        let all = QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS | QP_ATTR_DEST_QPN;
        let missing = |a| Err(TransitionError::MissingAttribute(a));
        assert_eq!(check_transition(S::Reset, S::Init, all), Ok(()));
        assert_eq!(check_transition(S::Reset, S::Init, QP_ATTR_STATE), missing("access_flags"));
        assert_eq!(check_transition(S::Init, S::Rtr, QP_ATTR_STATE), missing("dest_qpn"));
        assert_eq!(check_transition(S::Rtr, S::Rts, QP_ATTR_STATE), Ok(()));
        assert_eq!(check_transition(S::Reset, S::Rts, all), Err(TransitionError::NotAllowed));
        assert_eq!(check_transition(S::Init, S::Rts, all), Err(TransitionError::NotAllowed));
        assert_eq!(check_transition(S::Err, S::Rts, all), Err(TransitionError::NotAllowed));
        assert_eq!(check_transition(S::Err, S::Reset, 0), Ok(()));
        assert_eq!(check_transition(S::Rts, S::Err, 0), Ok(()));
    }

    #[test]
    fn producer_index_bounds() {
        let mut wq = WorkQueue::new(4, MappedPages::default());
        assert!(wq.accepts_producer(4));
        assert!(!wq.accepts_producer(5));
        wq.producer = 3;
        assert!(!wq.accepts_producer(2), "backwards");
        wq.consumer = u32::MAX - 1;
        wq.producer = u32::MAX;
        assert!(wq.accepts_producer(1), "wraps");
    }
}
