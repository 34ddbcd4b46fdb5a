//! Work requests and work completions, with ibverbs' names and statuses.

use smallvec::SmallVec;

/// A scatter-gather element: `length` bytes at `addr` in the memory region of `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// Scatter-gather list (two elements inline).
pub type SgList = SmallVec<[Sge; 2]>;

/// Send work request opcodes (`IBV_WR_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOpcode {
    Send,
    SendWithImm,
    RdmaWrite,
    RdmaWriteWithImm,
    RdmaRead,
    AtomicCmpAndSwp,
    AtomicFetchAndAdd,
}

/// Send flags (`IBV_SEND_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    pub const FENCE: SendFlags = SendFlags(1);
    pub const SIGNALED: SendFlags = SendFlags(2);
    pub const SOLICITED: SendFlags = SendFlags(4);
    pub const INLINE: SendFlags = SendFlags(8);
    pub fn contains(self, o: SendFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, o: SendFlags) -> SendFlags {
        SendFlags(self.0 | o.0)
    }
}

/// A send work request (`ibv_send_wr`).
#[derive(Debug, Clone)]
pub struct SendWr {
    pub wr_id: u64,
    pub opcode: WrOpcode,
    pub sg_list: SgList,
    pub flags: SendFlags,
    /// Immediate data for the `*_WITH_IMM` opcodes (network order, opaque).
    pub imm_data: u32,
    /// Remote address for RDMA and atomic operations.
    pub remote_addr: u64,
    pub rkey: u32,
    /// CMP_AND_SWP: the compare value; FETCH_AND_ADD: the value to add.
    pub compare_add: u64,
    /// CMP_AND_SWP: the swap value.
    pub swap: u64,
}

impl SendWr {
    /// A work request with no memory targets yet.
    pub fn new(wr_id: u64, opcode: WrOpcode) -> SendWr {
        SendWr {
            wr_id,
            opcode,
            sg_list: SgList::new(),
            flags: SendFlags::SIGNALED,
            imm_data: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
        }
    }
    pub fn sge(mut self, s: Sge) -> Self {
        self.sg_list.push(s);
        self
    }
    pub fn remote(mut self, addr: u64, rkey: u32) -> Self {
        self.remote_addr = addr;
        self.rkey = rkey;
        self
    }
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm_data = imm;
        self
    }
    pub fn flags(mut self, f: SendFlags) -> Self {
        self.flags = f;
        self
    }
    pub fn atomic(mut self, compare_add: u64, swap: u64) -> Self {
        self.compare_add = compare_add;
        self.swap = swap;
        self
    }
    /// Total bytes of the scatter-gather list.
    pub fn total_len(&self) -> u64 {
        self.sg_list.iter().map(|s| s.length as u64).sum()
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sg_list: SgList,
}

/// Work completion status (`IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    LocLenErr,
    LocQpOpErr,
    LocProtErr,
    WrFlushErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
}

/// Work completion opcode (`IBV_WC_*` opcodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    CompSwap,
    FetchAdd,
    Recv,
    RecvRdmaWithImm,
}

impl WcOpcode {
    pub fn from_wr(op: WrOpcode) -> WcOpcode {
        match op {
            WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
        }
    }
}

/// A work completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    pub imm_data: Option<u32>,
    pub qp_num: u32,
    pub src_qp: u32,
}

/// Checks what can be checked of a send WR without its QP or memory: atomics take one 8-byte
/// SGE and an aligned remote address, messages are at most 2 GiB, INLINE is for SEND and WRITE.
pub fn validate_send(wr: &SendWr) -> Result<(), &'static str> {
    let atomic = matches!(wr.opcode, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
    if atomic && (wr.sg_list.len() != 1 || wr.total_len() != 8) {
        return Err("atomic work requests take one 8-byte scatter-gather element");
    }
    if atomic && !wr.remote_addr.is_multiple_of(8) {
        return Err("atomic remote address must be 8-byte aligned");
    }
    if wr.total_len() > 1 << 31 {
        return Err("message longer than 2 GiB");
    }
    if wr.flags.contains(SendFlags::INLINE)
        && !matches!(
            wr.opcode,
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm
        )
    {
        return Err("INLINE is only valid for SEND and WRITE");
    }
    Ok(())
}
