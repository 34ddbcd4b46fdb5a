//! The fixed layout of a managed QP's work-queue entries in memory (RedN programs patch them
//! by address, so it is part of the API and never changes).
//!
//! A managed QP's send queue is a ring of `slots` entries of 64 bytes, eight little-endian u64
//! words each. The entry of work request index `i` (indices count posts from 0 and never wrap)
//! is at byte `64 × (i mod slots)` of the ring.
//!
//! | word | byte offset | contents |
//! | --- | --- | --- |
//! | 0 | 0 | opcode (byte 0), flags (byte 1), **operand** (bytes 2..8, 48 bits, ignored by the engine) |
//! | 1 | 8 | `wr_id` |
//! | 2 | 16 | remote address; WAIT: completion count; ENABLE: WR index (exclusive) |
//! | 3 | 24 | rkey (bits 0..32), immediate data (bits 32..64); WAIT: CQ number; ENABLE: QPN |
//! | 4 | 32 | compare (CAS) or add (FETCH_ADD) value |
//! | 5 | 40 | swap value (CAS) |
//! | 6 | 48 | local address of the one scatter-gather element |
//! | 7 | 56 | length (bits 0..32) and lkey (bits 32..64) of that element; length 0 = none |
//!
//! Opcodes (byte 0): 0 NOOP, 1 SEND, 2 SEND_WITH_IMM, 3 WRITE, 4 WRITE_WITH_IMM, 5 READ,
//! 6 CMP_AND_SWP, 7 FETCH_AND_ADD, 8 WAIT, 9 ENABLE; anything else aborts the chain.
//! Flags (byte 1): bit 0 SIGNALED, bit 1 FENCE, bit 2 SOLICITED.
//!
//! Word 0 is what a RedN `if` compares and swaps: `{NOOP, flags, x}` against
//! `{NOOP, flags, y}`, swapped for `{WRITE, flags, x}` (see [`word0`]).

use crate::work::{SendFlags, SendWr, Sge, WrOpcode};

/// Bytes per entry.
pub const WQE_BYTES: usize = 64;

/// Byte offsets of the fields (for RECV scatter, READ, WRITE and CAS targets).
pub mod off {
    /// Byte 0: the opcode; byte 1: the flags; bytes 2..8: the operand (word 0).
    pub const WORD0: usize = 0;
    /// The 48-bit operand inside word 0.
    pub const OPERAND: usize = 2;
    /// The work request id.
    pub const WR_ID: usize = 8;
    /// The remote address (WAIT: the completion count; ENABLE: the index).
    pub const REMOTE_ADDR: usize = 16;
    /// The remote key (WAIT: the CQ number; ENABLE: the QP number).
    pub const RKEY: usize = 24;
    /// Immediate data.
    pub const IMM: usize = 28;
    /// An atomic's compare or add value.
    pub const COMPARE_ADD: usize = 32;
    /// A compare-and-swap's swap value.
    pub const SWAP: usize = 40;
    /// The local buffer's address (one scatter-gather element).
    pub const LOCAL_ADDR: usize = 48;
    /// Its length.
    pub const LENGTH: usize = 56;
    /// Its local key.
    pub const LKEY: usize = 60;
}

/// Largest operand of word 0.
pub const OPERAND_MASK: u64 = (1 << 48) - 1;

/// Opcode byte: NOOP.
pub const OP_NOOP: u8 = 0;
/// Opcode byte: SEND.
pub const OP_SEND: u8 = 1;
/// Opcode byte: SEND with immediate.
pub const OP_SEND_IMM: u8 = 2;
/// Opcode byte: RDMA WRITE.
pub const OP_WRITE: u8 = 3;
/// Opcode byte: RDMA WRITE with immediate.
pub const OP_WRITE_IMM: u8 = 4;
/// Opcode byte: RDMA READ.
pub const OP_READ: u8 = 5;
/// Opcode byte: compare-and-swap.
pub const OP_CAS: u8 = 6;
/// Opcode byte: fetch-and-add.
pub const OP_FAA: u8 = 7;
/// Opcode byte: WAIT.
pub const OP_WAIT: u8 = 8;
/// Opcode byte: ENABLE.
pub const OP_ENABLE: u8 = 9;

/// Flag byte: produce a completion.
pub const FLAG_SIGNALED: u8 = 1;
/// Flag byte: fence (wait for earlier READs and atomics).
pub const FLAG_FENCE: u8 = 2;
/// Flag byte: solicited event.
pub const FLAG_SOLICITED: u8 = 4;

/// Word 0 from its parts (the operand is truncated to 48 bits).
pub fn word0(opcode: u8, flags: u8, operand: u64) -> u64 {
    opcode as u64 | (flags as u64) << 8 | (operand & OPERAND_MASK) << 16
}

fn op_code(op: WrOpcode) -> u8 {
    match op {
        WrOpcode::Noop => OP_NOOP,
        WrOpcode::Send => OP_SEND,
        WrOpcode::SendWithImm => OP_SEND_IMM,
        WrOpcode::RdmaWrite => OP_WRITE,
        WrOpcode::RdmaWriteWithImm => OP_WRITE_IMM,
        WrOpcode::RdmaRead => OP_READ,
        WrOpcode::AtomicCmpAndSwp => OP_CAS,
        WrOpcode::AtomicFetchAndAdd => OP_FAA,
        WrOpcode::Wait => OP_WAIT,
        WrOpcode::Enable => OP_ENABLE,
        // refused before encoding (not valid on managed QPs)
        WrOpcode::Offload => 0xFF,
    }
}

/// The flags byte of a work request's send flags.
pub fn flags_of(f: SendFlags) -> u8 {
    let mut b = 0;
    if f.contains(SendFlags::SIGNALED) {
        b |= FLAG_SIGNALED;
    }
    if f.contains(SendFlags::FENCE) {
        b |= FLAG_FENCE;
    }
    if f.contains(SendFlags::SOLICITED) {
        b |= FLAG_SOLICITED;
    }
    b
}

/// Encodes a work request (at most one SGE, no INLINE, no OFFLOAD) with `operand` in word 0.
pub fn encode(wr: &SendWr, operand: u64) -> Result<[u64; 8], &'static str> {
    if wr.sg_list.len() > 1 {
        return Err("managed-QP work requests take at most one scatter-gather element");
    }
    if wr.flags.contains(SendFlags::INLINE) {
        return Err("managed-QP work requests cannot be INLINE (their data is read at execution)");
    }
    if wr.opcode == WrOpcode::Offload {
        return Err("OFFLOAD cannot be posted to a managed QP");
    }
    let (addr, len, lkey) = wr.sg_list.first().map_or((0, 0, 0), |s| (s.addr, s.length, s.lkey));
    Ok([
        word0(op_code(wr.opcode), flags_of(wr.flags), operand),
        wr.wr_id,
        wr.remote_addr,
        wr.rkey as u64 | (wr.imm_data as u64) << 32,
        wr.compare_add,
        wr.swap,
        addr,
        len as u64 | (lkey as u64) << 32,
    ])
}

/// Decodes an entry as the engine executes it; `None` for an unknown opcode.
pub fn decode(w: &[u64; 8]) -> Option<SendWr> {
    let opcode = match w[0] as u8 {
        OP_NOOP => WrOpcode::Noop,
        OP_SEND => WrOpcode::Send,
        OP_SEND_IMM => WrOpcode::SendWithImm,
        OP_WRITE => WrOpcode::RdmaWrite,
        OP_WRITE_IMM => WrOpcode::RdmaWriteWithImm,
        OP_READ => WrOpcode::RdmaRead,
        OP_CAS => WrOpcode::AtomicCmpAndSwp,
        OP_FAA => WrOpcode::AtomicFetchAndAdd,
        OP_WAIT => WrOpcode::Wait,
        OP_ENABLE => WrOpcode::Enable,
        _ => return None,
    };
    let fb = (w[0] >> 8) as u8;
    let mut flags = SendFlags(0);
    if fb & FLAG_SIGNALED != 0 {
        flags = flags | SendFlags::SIGNALED;
    }
    if fb & FLAG_FENCE != 0 {
        flags = flags | SendFlags::FENCE;
    }
    if fb & FLAG_SOLICITED != 0 {
        flags = flags | SendFlags::SOLICITED;
    }
    let mut wr = SendWr::new(w[1], opcode).flags(flags);
    wr.remote_addr = w[2];
    wr.rkey = w[3] as u32;
    wr.imm_data = (w[3] >> 32) as u32;
    wr.compare_add = w[4];
    wr.swap = w[5];
    let len = w[7] as u32;
    if len > 0 {
        wr.sg_list.push(Sge {
            addr: w[6],
            length: len,
            lkey: (w[7] >> 32) as u32,
        });
    }
    Some(wr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_word0_holds_opcode_flags_operand() {
        let wr = SendWr::new(7, WrOpcode::AtomicCmpAndSwp)
            .sge(Sge {
                addr: 0x1000,
                length: 8,
                lkey: 0x55,
            })
            .remote(0x2000, 0x66)
            .atomic(1, 2)
            .imm(9);
        let w = encode(&wr, 0xABCD_EF01_2345).unwrap();
        assert_eq!(w[0], word0(OP_CAS, FLAG_SIGNALED, 0xABCD_EF01_2345));
        assert_eq!(w[0] >> 16, 0xABCD_EF01_2345);
        let d = decode(&w).unwrap();
        assert_eq!(
            (d.wr_id, d.opcode, d.remote_addr, d.rkey, d.imm_data),
            (7, wr.opcode, 0x2000, 0x66, 9)
        );
        assert_eq!((d.compare_add, d.swap, d.sg_list.clone()), (1, 2, wr.sg_list.clone()));
        assert!(d.flags.contains(SendFlags::SIGNALED));
        let mut bad = w;
        bad[0] = 0x77;
        assert!(decode(&bad).is_none());
        assert!(encode(&SendWr::new(1, WrOpcode::Offload), 0).is_err());
    }
}
