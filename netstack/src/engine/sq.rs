//! The shared send queue of a (context, data core): work requests travel from application
//! threads to the data core through a [`crate::pipe`] as 64-byte slots of a fixed layout.
//!
//! # WQE layout (56 payload bytes per slot, as seven little-endian u64 words)
//!
//! A work request is one header slot followed by `extra` slots.
//!
//! Header slot, `kind` = 1 (send), 2 (receive: words 0's SGE count and extra slots, 1's QPN
//! and 2's wr_id are used) or 4 (command: take the next [`super::Command`] from the core's
//! command queue; nothing else is used). Commands travel through the queue as a marker so that
//! they reach the core in the order they were issued among the work requests: a
//! `modify_to_err` after a post sees that post in the QP.
//!
//! | word | bits 0..8 | 8..16 | 16..24 | 24..32 | 32..64 |
//! | --- | --- | --- | --- | --- | --- |
//! | 0 | kind | opcode (send) | SGE count | extra slots | send flags |
//! | 1 | QPN (0..32) | | | | immediate data |
//! | 2 | wr_id | | | | |
//! | 3 | remote address | | | | |
//! | 4 | rkey (0..32) | | | | inline length |
//! | 5 | compare / add | | | | |
//! | 6 | swap | | | | |
//!
//! Then, for an INLINE send, `ceil(inline length / 56)` slots of payload bytes; otherwise
//! `ceil(SGE count / 3)` slots of SGEs, each SGE 16 bytes (address u64, length u32, lkey u32),
//! three to a slot. A producer reserves room for all slots of a request before writing any, so
//! a consumer that sees a header finds its extra slots right behind it.

use crate::pipe::{Consumer, Producer, MAX_PAYLOAD};
use crate::work::{RecvWr, SendFlags, SendWr, SgList, Sge, WrOpcode};

/// One slot's payload.
pub(crate) type Slot = [u64; 7];

const KIND_SEND: u8 = 1;
const KIND_RECV: u8 = 2;
const KIND_COMMAND: u8 = 4;
const SGES_PER_SLOT: usize = 3;

/// Most slots one request may take (header, 256 B of inline data or 16 SGEs).
pub(crate) const MAX_SLOTS: usize = 1 + 6;
/// One request's slots, encoded on the poster's stack (no allocation per post).
pub(crate) type Slots = smallvec::SmallVec<[Slot; MAX_SLOTS]>;
/// Most SGEs per request carried through the queue.
pub(crate) const MAX_SGE: usize = 16;

fn opcode_code(op: WrOpcode) -> u8 {
    match op {
        WrOpcode::Send => 0,
        WrOpcode::SendWithImm => 1,
        WrOpcode::RdmaWrite => 2,
        WrOpcode::RdmaWriteWithImm => 3,
        WrOpcode::RdmaRead => 4,
        WrOpcode::AtomicCmpAndSwp => 5,
        WrOpcode::AtomicFetchAndAdd => 6,
        WrOpcode::Offload => 7,
        WrOpcode::Noop => 8,
        WrOpcode::Wait => 9,
        WrOpcode::Enable => 10,
    }
}

fn code_opcode(c: u8) -> Option<WrOpcode> {
    Some(match c {
        0 => WrOpcode::Send,
        1 => WrOpcode::SendWithImm,
        2 => WrOpcode::RdmaWrite,
        3 => WrOpcode::RdmaWriteWithImm,
        4 => WrOpcode::RdmaRead,
        5 => WrOpcode::AtomicCmpAndSwp,
        6 => WrOpcode::AtomicFetchAndAdd,
        7 => WrOpcode::Offload,
        8 => WrOpcode::Noop,
        9 => WrOpcode::Wait,
        10 => WrOpcode::Enable,
        _ => return None,
    })
}

fn sge_slots(sg: &SgList, out: &mut Slots) {
    for chunk in sg.chunks(SGES_PER_SLOT) {
        let mut s = [0u64; 7];
        for (i, g) in chunk.iter().enumerate() {
            s[i * 2] = g.addr;
            s[i * 2 + 1] = g.length as u64 | (g.lkey as u64) << 32;
        }
        out.push(s);
    }
}

/// Encodes a send WR; `inline` is its payload when the WR is INLINE.
pub(crate) fn encode_send(qpn: u32, wr: &SendWr, inline: Option<&[u8]>, out: &mut Slots) {
    out.clear();
    let (extra, inline_len) = match inline {
        Some(d) => (d.len().div_ceil(MAX_PAYLOAD), d.len()),
        None => (wr.sg_list.len().div_ceil(SGES_PER_SLOT), 0),
    };
    out.push([
        KIND_SEND as u64
            | (opcode_code(wr.opcode) as u64) << 8
            | (wr.sg_list.len() as u64) << 16
            | (extra as u64) << 24
            | (wr.flags.0 as u64) << 32,
        qpn as u64 | (wr.imm_data as u64) << 32,
        wr.wr_id,
        wr.remote_addr,
        wr.rkey as u64 | (inline_len as u64) << 32,
        wr.compare_add,
        wr.swap,
    ]);
    match inline {
        Some(d) => {
            for chunk in d.chunks(MAX_PAYLOAD) {
                let mut b = [0u8; MAX_PAYLOAD];
                b[..chunk.len()].copy_from_slice(chunk);
                out.push(std::array::from_fn(|i| {
                    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default())
                }));
            }
        }
        None => sge_slots(&wr.sg_list, out),
    }
}

/// Encodes a receive WR.
pub(crate) fn encode_recv(qpn: u32, wr: &RecvWr, out: &mut Slots) {
    out.clear();
    let extra = wr.sg_list.len().div_ceil(SGES_PER_SLOT);
    out.push([
        KIND_RECV as u64 | (wr.sg_list.len() as u64) << 16 | (extra as u64) << 24,
        qpn as u64,
        wr.wr_id,
        0,
        0,
        0,
        0,
    ]);
    sge_slots(&wr.sg_list, out);
}

/// The marker of a command: "apply the next command of the core's command queue".
pub(crate) const COMMAND: Slot = [KIND_COMMAND as u64, 0, 0, 0, 0, 0, 0];

/// A decoded request.
pub(crate) enum Request {
    Send {
        qpn: u32,
        wr: SendWr,
        inline: Option<Vec<u8>>,
    },
    Recv {
        qpn: u32,
        wr: RecvWr,
    },
    /// The next command of the core's command queue is due.
    Command,
}

/// Writes all slots of one request, or none when the queue lacks room for all of them.
pub(crate) fn push_all(p: &mut Producer<Slot>, slots: &[Slot]) -> bool {
    if p.free() < slots.len() {
        return false;
    }
    for s in slots {
        // cannot fail: room was reserved above and we are the only producer
        let _ = p.try_push(*s);
    }
    true
}

/// Reads the next request; `None` when the queue is empty. A header whose extra slots are not
/// all visible yet is waited for (its producer writes them right after it).
pub(crate) fn pop_request(c: &mut Consumer<Slot>) -> Option<Request> {
    let h = c.pop()?;
    let kind = h[0] as u8;
    let nsge = ((h[0] >> 16) & 0xFF) as usize;
    let extra = ((h[0] >> 24) & 0xFF) as usize;
    let mut slots = Slots::new();
    for _ in 0..extra {
        loop {
            if let Some(s) = c.pop() {
                slots.push(s);
                break;
            }
            std::hint::spin_loop();
        }
    }
    let sges = || -> SgList {
        let mut sg = SgList::new();
        for i in 0..nsge {
            let s = &slots[i / SGES_PER_SLOT];
            let k = i % SGES_PER_SLOT;
            sg.push(Sge {
                addr: s[k * 2],
                length: s[k * 2 + 1] as u32,
                lkey: (s[k * 2 + 1] >> 32) as u32,
            });
        }
        sg
    };
    let qpn = h[1] as u32;
    match kind {
        KIND_SEND => {
            let opcode = code_opcode((h[0] >> 8) as u8)?;
            let inline_len = (h[4] >> 32) as usize;
            let flags = SendFlags((h[0] >> 32) as u32);
            let (sg_list, inline) = if flags.contains(SendFlags::INLINE) {
                let mut d = Vec::with_capacity(inline_len);
                for s in &slots {
                    for w in s {
                        d.extend_from_slice(&w.to_le_bytes());
                    }
                }
                d.truncate(inline_len);
                (SgList::new(), Some(d))
            } else {
                (sges(), None)
            };
            let wr = SendWr {
                wr_id: h[2],
                opcode,
                sg_list,
                flags,
                imm_data: (h[1] >> 32) as u32,
                remote_addr: h[3],
                rkey: h[4] as u32,
                compare_add: h[5],
                swap: h[6],
            };
            Some(Request::Send { qpn, wr, inline })
        }
        KIND_RECV => Some(Request::Recv {
            qpn,
            wr: RecvWr {
                wr_id: h[2],
                sg_list: sges(),
            },
        }),
        KIND_COMMAND => Some(Request::Command),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipe::pipe;

    #[test]
    fn requests_round_trip_through_slots() {
        let (mut p, mut c) = pipe::<Slot>(64, 1).unwrap();
        let mut wr = SendWr::new(7, WrOpcode::AtomicCmpAndSwp)
            .remote(0x1000, 0xabc)
            .atomic(5, 6)
            .imm(9);
        for i in 0..5 {
            wr.sg_list.push(Sge {
                addr: 100 + i,
                length: 8 + i as u32,
                lkey: 0x300 + i as u32,
            });
        }
        let mut buf = Slots::new();
        encode_send(0x42, &wr, None, &mut buf);
        assert_eq!(buf.len(), 3);
        assert!(push_all(&mut p, &buf));
        let data: Vec<u8> = (0..200u8).collect();
        let iw = SendWr::new(8, WrOpcode::Send).flags(SendFlags::INLINE | SendFlags::SIGNALED);
        encode_send(0x43, &iw, Some(&data), &mut buf);
        assert_eq!(buf.len(), 1 + 4);
        assert!(push_all(&mut p, &buf));
        match pop_request(&mut c) {
            Some(Request::Send { qpn, wr: got, inline }) => {
                assert_eq!(qpn, 0x42);
                assert_eq!(
                    (got.wr_id, got.opcode, got.remote_addr, got.rkey),
                    (7, WrOpcode::AtomicCmpAndSwp, 0x1000, 0xabc)
                );
                assert_eq!((got.compare_add, got.swap, got.imm_data), (5, 6, 9));
                assert_eq!(got.sg_list, wr.sg_list);
                assert!(inline.is_none());
            }
            _ => panic!("expected a send"),
        }
        match pop_request(&mut c) {
            Some(Request::Send {
                qpn: 0x43,
                inline: Some(d),
                wr,
            }) => {
                assert_eq!(d, data);
                assert!(wr.flags.contains(SendFlags::SIGNALED));
            }
            _ => panic!("expected an inline send"),
        }
        let mut rw = RecvWr {
            wr_id: 11,
            sg_list: SgList::new(),
        };
        for i in 0..4 {
            rw.sg_list.push(Sge {
                addr: 500 + i,
                length: 64,
                lkey: 9,
            });
        }
        encode_recv(0x44, &rw, &mut buf);
        assert_eq!(buf.len(), 1 + 2);
        assert!(push_all(&mut p, &buf));
        assert!(push_all(&mut p, &[COMMAND]));
        match pop_request(&mut c) {
            Some(Request::Recv { qpn: 0x44, wr }) => assert_eq!((wr.wr_id, &wr.sg_list), (11, &rw.sg_list)),
            _ => panic!("expected a receive"),
        }
        assert!(matches!(pop_request(&mut c), Some(Request::Command)));
        assert!(pop_request(&mut c).is_none());
    }

    #[test]
    fn a_request_is_written_whole_or_not_at_all() {
        let (mut p, _c) = pipe::<Slot>(4, 1).unwrap();
        let wr = SendWr::new(1, WrOpcode::Send).flags(SendFlags::INLINE);
        let mut buf = Slots::new();
        encode_send(1, &wr, Some(&[0u8; 200]), &mut buf);
        assert_eq!(buf.len(), 5);
        assert!(!push_all(&mut p, &buf), "5 slots do not fit in 4");
        assert_eq!(p.pushed(), 0);
    }
}
