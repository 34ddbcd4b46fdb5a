//! Chain operations on this host's memory, executed by the engine itself: a managed QP whose
//! peer is a QP on the same data core (its loopback peer) has its READ, WRITE, CMP_AND_SWP,
//! FETCH_AND_ADD and NOOP performed right away, with the peer's access checks and an in-order
//! completion, as a NIC executes loopback traffic internally instead of sending it through its
//! port. SEND and WRITE_WITH_IMM, which consume the peer's receives, take the transport path.

use crate::mem::{Access, MrTable};
use crate::transport::rc::RcQp;
use crate::work::{SendWr, WcStatus, WrOpcode};
use smallvec::SmallVec;

/// Executes `wr` for `qp` against memory whose remote side belongs to protection domain
/// `peer_pd`; returns false when the operation needs the transport.
pub(crate) fn execute(qp: &mut RcQp, mrs: &MrTable, wr: &SendWr, peer_pd: u32) -> bool {
    let (remote_access, local_access) = match wr.opcode {
        WrOpcode::Noop => {
            qp.complete_local(wr, WcStatus::Success, 0);
            return true;
        }
        WrOpcode::RdmaRead => (Access::REMOTE_READ, Access::LOCAL_WRITE),
        WrOpcode::RdmaWrite => (Access::REMOTE_WRITE, Access(0)),
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => (Access::REMOTE_ATOMIC, Access::LOCAL_WRITE),
        _ => return false,
    };
    if crate::work::validate_send(wr).is_err() {
        qp.complete_local(wr, WcStatus::LocQpOpErr, 0);
        return true;
    }
    let len = wr.total_len();
    let local = match wr.sg_list.first() {
        Some(g) => match mrs.check(g.lkey, qp.pd(), g.addr, g.length as u64, local_access) {
            Ok(x) => Some(x),
            Err(_) => {
                qp.complete_local(wr, WcStatus::LocProtErr, 0);
                return true;
            }
        },
        None => None,
    };
    let rlen = if matches!(wr.opcode, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd) {
        8
    } else {
        len
    };
    let remote = if rlen == 0 {
        None
    } else {
        match mrs.check(wr.rkey, peer_pd, wr.remote_addr, rlen, remote_access) {
            Ok(x) => Some(x),
            Err(_) => {
                qp.complete_local(wr, WcStatus::RemAccessErr, 0);
                return true;
            }
        }
    };
    let mut buf: SmallVec<[u8; 256]> = SmallVec::from_elem(0, len as usize);
    match (wr.opcode, local, remote) {
        (_, _, None) | (_, None, _) => {}
        (WrOpcode::RdmaRead, Some((l, lo)), Some((r, ro))) => {
            r.read(ro, &mut buf);
            l.write(lo, &buf);
            qp.note_payload_copy(2 * len);
        }
        (WrOpcode::RdmaWrite, Some((l, lo)), Some((r, ro))) => {
            l.read(lo, &mut buf);
            r.write(ro, &buf);
            qp.note_payload_copy(2 * len);
        }
        (op, Some((l, lo)), Some((r, ro))) => {
            let orig = if op == WrOpcode::AtomicCmpAndSwp {
                r.compare_swap(ro, wr.compare_add, wr.swap)
            } else {
                r.fetch_add(ro, wr.compare_add)
            };
            let Some(orig) = orig else {
                qp.complete_local(wr, WcStatus::RemInvReqErr, 0);
                return true;
            };
            l.write(lo, &orig.to_le_bytes());
        }
    }
    qp.complete_local(wr, WcStatus::Success, len as u32);
    true
}
