//! Shared memory: memfd mappings and the rings laid out in them (docs/FLEXNSD.md, "Data path").
//!
//! A ring's pages are written by another process at any time, so no Rust reference to their
//! bytes is ever formed: every word is an [`AtomicU64`] reached through a raw pointer into the
//! mapping, at an offset checked against the mapping's length, and every index read from the
//! other side is validated before it is used.

use crate::verbs::{SendFlags, SendWr, Sge, Wc, WcOpcode, WcStatus, WrOpcode};
use std::sync::atomic::{AtomicU64, Ordering};

/// A shared mapping of a whole memfd, unmapped on drop (the file, when kept, closes with it):
/// netstack's [`crate::samehost::Mapping`] (the one mmap of shared memory both use) with the
/// file it maps, addressed by byte offsets.
pub struct Mapping {
    map: crate::samehost::Mapping,
    /// Kept by the side that passes it on (the application); the daemon closes it once mapped.
    file: Option<std::fs::File>,
}

impl Mapping {
    /// Creates a sealable memfd of `len` bytes (`name` shows in /proc/*/maps) and maps it.
    pub fn create(name: &std::ffi::CStr, len: usize) -> std::io::Result<Mapping> {
        let file = super::sys::memfd(name)?;
        file.set_len(len as u64)?;
        Mapping::map(file, len)
    }

    /// Maps the first `len` bytes of `file` shared. The caller has checked (after sealing it
    /// against shrinking, for a file another process holds) that it has at least `len`.
    pub fn map(file: std::fs::File, len: usize) -> std::io::Result<Mapping> {
        let map = crate::samehost::Mapping::map(&file, len)?;
        Ok(Mapping { map, file: Some(file) })
    }

    /// Maps like [`Mapping::map`], then closes the file (the mapping keeps the memory): what the
    /// daemon does with a ring, so that each costs it no descriptor.
    pub fn map_and_close(file: std::fs::File, len: usize) -> std::io::Result<Mapping> {
        let map = crate::samehost::Mapping::map(&file, len)?;
        Ok(Mapping { map, file: None })
    }

    /// The file, unless it was closed once mapped ([`Mapping::map_and_close`]).
    pub fn file(&self) -> Option<&std::fs::File> {
        self.file.as_ref()
    }

    /// The address of the first byte in this process.
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it has no bytes (never: a mapping has at least one).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The 8-byte word at `off`.
    ///
    /// # Panics
    /// If `off` is not 8-aligned or the word passes the end: callers compute offsets from
    /// validated indices, so this is a bug of this crate, never of the peer.
    pub fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8), "word {off} not 8-aligned");
        self.map.word(off / 8)
    }

    /// Copies `src` in at `off` (word by word; `off` and the length must be 8-aligned).
    pub fn write_words(&self, off: usize, src: &[u64]) {
        for (i, w) in src.iter().enumerate() {
            self.word(off + 8 * i).store(*w, Ordering::Relaxed);
        }
    }

    /// Copies `n` words out from `off`.
    pub fn read_words<const N: usize>(&self, off: usize) -> [u64; N] {
        std::array::from_fn(|i| self.word(off + 8 * i).load(Ordering::Relaxed))
    }
}

/// Bytes before a ring's first entry: its index words, each on its own cache line.
pub const RING_HEADER: usize = 256;
/// Send ring: the index of the next entry the application writes (app stores, release).
pub const SQ_TAIL: usize = 0;
/// Send ring: the index of the next entry the daemon reads (daemon stores, release).
pub const SQ_HEAD: usize = 64;
/// Send ring: nonzero while the daemon sleeps on the doorbell (daemon stores, SeqCst).
pub const SQ_SLEEPING: usize = 128;
/// Send ring: nonzero once the daemon closed the ring for a fault ([`RingFault`]).
pub const SQ_ERROR: usize = 192;
/// Bytes of a send-ring entry.
pub const WQE_BYTES: usize = 64;
/// Completion ring: the index of the next completion the daemon writes.
pub const CQ_TAIL: usize = 0;
/// Completion ring: the index of the next completion the application reads.
pub const CQ_HEAD: usize = 64;
/// Completion ring: nonzero while the application sleeps on the notify eventfd.
pub const CQ_ARMED: usize = 128;
/// Bytes of a completion-ring entry.
pub const CQE_BYTES: usize = 32;
/// Most entries a ring has.
pub const MAX_SLOTS: usize = 1 << 16;

/// Why the daemon closed a send ring (the value in its `SQ_ERROR` word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingFault {
    /// `tail - head` exceeded the ring's slots (an out-of-range index or an overrun).
    Overrun = 1,
    /// The ring's memfd could not be read any more.
    Gone = 2,
}

impl RingFault {
    /// The fault a nonzero `SQ_ERROR` word names.
    pub fn from_word(w: u64) -> Option<RingFault> {
        match w {
            1 => Some(RingFault::Overrun),
            2 => Some(RingFault::Gone),
            _ => None,
        }
    }
}

/// Bytes of a send ring of `slots` entries.
pub fn sq_bytes(slots: usize) -> usize {
    RING_HEADER + slots * WQE_BYTES
}

/// Bytes of a completion ring of `slots` entries.
pub fn cq_bytes(slots: usize) -> usize {
    RING_HEADER + slots * CQE_BYTES
}

/// The offset of index `i`'s entry in a ring of `slots` (a power of two) `bytes`-sized entries.
pub fn slot_off(i: u64, slots: usize, bytes: usize) -> usize {
    RING_HEADER + (i as usize & (slots - 1)) * bytes
}

/// Send-ring entry kind: a send work request.
pub const KIND_SEND: u64 = 1;
/// Send-ring entry kind: a receive work request.
pub const KIND_RECV: u64 = 2;

fn op_code(op: WrOpcode) -> Option<u64> {
    Some(match op {
        WrOpcode::Send => 1,
        WrOpcode::SendWithImm => 2,
        WrOpcode::RdmaWrite => 3,
        WrOpcode::RdmaWriteWithImm => 4,
        WrOpcode::RdmaRead => 5,
        WrOpcode::AtomicCmpAndSwp => 6,
        WrOpcode::AtomicFetchAndAdd => 7,
        _ => return None,
    })
}

fn code_op(c: u64) -> Option<WrOpcode> {
    Some(match c {
        1 => WrOpcode::Send,
        2 => WrOpcode::SendWithImm,
        3 => WrOpcode::RdmaWrite,
        4 => WrOpcode::RdmaWriteWithImm,
        5 => WrOpcode::RdmaRead,
        6 => WrOpcode::AtomicCmpAndSwp,
        7 => WrOpcode::AtomicFetchAndAdd,
        _ => return None,
    })
}

/// An atomic takes one SGE (the 8 bytes the old value lands in): its entry carries the compare
/// (or add) and swap operands where a second SGE would be.
fn is_atomic(op: WrOpcode) -> bool {
    matches!(op, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd)
}

fn sge_words(s: Option<&Sge>) -> [u64; 2] {
    s.map_or([0, 0], |s| [s.addr, u64::from(s.length) | u64::from(s.lkey) << 32])
}

fn words_sge(w: [u64; 2]) -> Sge {
    Sge {
        addr: w[0],
        length: w[1] as u32,
        lkey: (w[1] >> 32) as u32,
    }
}

/// A decoded send-ring entry.
#[derive(Debug, Clone)]
pub enum Wqe {
    /// A send work request.
    Send(SendWr),
    /// A receive work request.
    Recv(crate::verbs::RecvWr),
}

/// Encodes a send WR as an entry: the ring carries SEND, SEND with immediate, WRITE, WRITE with
/// immediate and READ, with at most two SGEs, and the two atomics (one SGE; their operands where
/// a second SGE would be). INLINE is refused: the daemon reads the payload only when it takes the
/// entry, after the post has returned.
pub fn encode_send(wr: &SendWr) -> Result<[u64; 8], &'static str> {
    let op = op_code(wr.opcode)
        .ok_or("opcode: only SEND, WRITE, READ (with or without immediate) and the atomics go through flexnsd")?;
    if wr.flags.contains(SendFlags::INLINE) {
        // the daemon reads the payload when it takes the entry, after the post has returned:
        // the caller could already have changed it, which INLINE promises it may
        return Err("flags: INLINE is not carried through flexnsd's ring (post from registered memory)");
    }
    if is_atomic(wr.opcode) {
        if wr.sg_list.len() != 1 {
            return Err("sg_list: an atomic takes one 8-byte scatter-gather element");
        }
        let [a, b] = sge_words(wr.sg_list.first());
        return Ok([
            wr.wr_id,
            KIND_SEND | op << 8 | 1 << 16 | u64::from(wr.flags.0) << 32,
            wr.remote_addr,
            u64::from(wr.rkey),
            a,
            b,
            wr.compare_add,
            wr.swap,
        ]);
    }
    entry(
        [
            wr.wr_id,
            KIND_SEND | op << 8 | (wr.sg_list.len() as u64) << 16 | u64::from(wr.flags.0) << 32,
            wr.remote_addr,
            u64::from(wr.rkey) | u64::from(wr.imm_data) << 32,
        ],
        &wr.sg_list,
    )
}

/// Encodes a receive WR as an entry (at most two SGEs).
pub fn encode_recv(wr: &crate::verbs::RecvWr) -> Result<[u64; 8], &'static str> {
    entry(
        [wr.wr_id, KIND_RECV | (wr.sg_list.len() as u64) << 16, 0, 0],
        &wr.sg_list,
    )
}

/// An entry: the four words `head`, then the SGEs of `sg` (at most two; an absent one is zeros).
fn entry(head: [u64; 4], sg: &[Sge]) -> Result<[u64; 8], &'static str> {
    if sg.len() > 2 {
        return Err("sg_list: at most 2 scatter-gather elements");
    }
    let [a, b] = sge_words(sg.first());
    let [c, d] = sge_words(sg.get(1));
    Ok([head[0], head[1], head[2], head[3], a, b, c, d])
}

/// Decodes an entry the application wrote (any bit pattern: a bad one is an error naming the
/// field, never a panic).
pub fn decode(w: [u64; 8]) -> Result<Wqe, &'static str> {
    let kind = w[1] & 0xff;
    let nsge = ((w[1] >> 16) & 0xff) as usize;
    if nsge > 2 {
        return Err("num_sge: more than 2");
    }
    let mut sg = crate::verbs::SgList::new();
    for i in 0..nsge {
        sg.push(words_sge([w[4 + 2 * i], w[5 + 2 * i]]));
    }
    match kind {
        KIND_SEND => {
            let opcode = code_op((w[1] >> 8) & 0xff).ok_or("opcode: not one flexnsd carries")?;
            let flags = SendFlags((w[1] >> 32) as u32);
            if flags.contains(SendFlags::INLINE) {
                return Err("flags: INLINE is not carried through the ring");
            }
            if is_atomic(opcode) {
                if nsge != 1 {
                    return Err("num_sge: an atomic takes one");
                }
                return Ok(Wqe::Send(SendWr {
                    wr_id: w[0],
                    opcode,
                    sg_list: sg,
                    flags,
                    imm_data: 0,
                    remote_addr: w[2],
                    rkey: w[3] as u32,
                    compare_add: w[6],
                    swap: w[7],
                }));
            }
            Ok(Wqe::Send(SendWr {
                wr_id: w[0],
                opcode,
                sg_list: sg,
                flags: SendFlags((w[1] >> 32) as u32),
                imm_data: (w[3] >> 32) as u32,
                remote_addr: w[2],
                rkey: w[3] as u32,
                compare_add: 0,
                swap: 0,
            }))
        }
        KIND_RECV => Ok(Wqe::Recv(crate::verbs::RecvWr {
            wr_id: w[0],
            sg_list: sg,
        })),
        _ => Err("kind: neither send nor receive"),
    }
}

const STATUSES: [WcStatus; 10] = [
    WcStatus::Success,
    WcStatus::LocLenErr,
    WcStatus::LocQpOpErr,
    WcStatus::LocProtErr,
    WcStatus::WrFlushErr,
    WcStatus::RemInvReqErr,
    WcStatus::RemAccessErr,
    WcStatus::RemOpErr,
    WcStatus::RetryExcErr,
    WcStatus::RnrRetryExcErr,
];
const OPCODES: [WcOpcode; 9] = [
    WcOpcode::Send,
    WcOpcode::RdmaWrite,
    WcOpcode::RdmaRead,
    WcOpcode::CompSwap,
    WcOpcode::FetchAdd,
    WcOpcode::Recv,
    WcOpcode::RecvRdmaWithImm,
    WcOpcode::Offload,
    WcOpcode::Noop,
];

/// Encodes a completion as a completion-ring entry.
pub fn encode_wc(wc: &Wc) -> [u64; 4] {
    let st = STATUSES.iter().position(|s| *s == wc.status).unwrap_or(2) as u64;
    let op = OPCODES.iter().position(|o| *o == wc.opcode).unwrap_or(8) as u64;
    [
        wc.wr_id,
        st | op << 8 | u64::from(wc.imm_data.is_some()) << 16 | u64::from(wc.byte_len) << 32,
        u64::from(wc.imm_data.unwrap_or(0)) | u64::from(wc.qp_num) << 32,
        u64::from(wc.src_qp) | u64::from(wc.vendor_err) << 32,
    ]
}

/// Decodes a completion-ring entry (a bad status or opcode from a broken daemon reads as
/// `LocQpOpErr` / `Noop`).
pub fn decode_wc(w: [u64; 4]) -> Wc {
    Wc {
        wr_id: w[0],
        status: *STATUSES.get((w[1] & 0xff) as usize).unwrap_or(&WcStatus::LocQpOpErr),
        opcode: *OPCODES.get(((w[1] >> 8) & 0xff) as usize).unwrap_or(&WcOpcode::Noop),
        byte_len: (w[1] >> 32) as u32,
        imm_data: ((w[1] >> 16) & 1 == 1).then_some(w[2] as u32),
        qp_num: (w[2] >> 32) as u32,
        src_qp: w[3] as u32,
        vendor_err: (w[3] >> 32) as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_garbage_is_an_error() {
        let wr = SendWr::new(7, WrOpcode::RdmaWriteWithImm)
            .sge(Sge {
                addr: 0x1000,
                length: 64,
                lkey: 9,
            })
            .sge(Sge {
                addr: 0x2000,
                length: 8,
                lkey: 10,
            })
            .remote(0x3000, 11)
            .imm(0xdead);
        let Wqe::Send(back) = decode(encode_send(&wr).unwrap()).unwrap() else {
            panic!("a send entry decodes as a send")
        };
        assert_eq!(format!("{back:?}"), format!("{wr:?}"));
        assert!(decode([0, 3 << 16 | KIND_SEND, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode([0, 99 << 8 | KIND_SEND, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode([0, 7, 0, 0, 0, 0, 0, 0]).is_err());
        // atomics: one SGE, the operands where the second would be
        let one = Sge {
            addr: 0x4000,
            length: 8,
            lkey: 12,
        };
        let cas = SendWr::new(8, WrOpcode::AtomicCmpAndSwp)
            .sge(one)
            .remote(0x5000, 13)
            .atomic(u64::MAX - 1, 0x0123_4567_89ab_cdef);
        let Wqe::Send(back) = decode(encode_send(&cas).unwrap()).unwrap() else {
            panic!("an atomic entry decodes as a send")
        };
        assert_eq!(format!("{back:?}"), format!("{cas:?}"));
        assert!(encode_send(&cas.clone().sge(one)).is_err(), "an atomic with two SGEs");
        let mut two = encode_send(&cas).unwrap();
        two[1] = two[1] & !(0xff << 16) | 2 << 16;
        assert!(decode(two).is_err(), "an atomic entry naming two SGEs");
        let inline = SendWr::new(9, WrOpcode::Send).sge(one).flags(SendFlags::INLINE);
        assert!(encode_send(&inline).is_err());
        let mut e = encode_send(&SendWr::new(9, WrOpcode::Send).sge(one)).unwrap();
        e[1] |= u64::from(SendFlags::INLINE.0) << 32;
        assert!(decode(e).is_err(), "an INLINE entry a hostile application wrote");
        let wc = Wc {
            wr_id: 5,
            status: WcStatus::RemAccessErr,
            opcode: WcOpcode::RecvRdmaWithImm,
            byte_len: 4096,
            imm_data: Some(3),
            qp_num: 77,
            src_qp: 88,
            vendor_err: 0,
        };
        assert_eq!(format!("{:?}", decode_wc(encode_wc(&wc))), format!("{wc:?}"));
    }
}
