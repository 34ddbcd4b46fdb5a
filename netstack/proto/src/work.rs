//! Work requests and work completions, with ibverbs' names and statuses.

use smallvec::SmallVec;

/// A scatter-gather element: `length` bytes at `addr` in the memory region of `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (in the region's address space).
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The local key of the region it lies in.
    pub lkey: u32,
}

/// Scatter-gather list (two elements inline).
pub type SgList = SmallVec<[Sge; 2]>;

/// Send work request opcodes (`IBV_WR_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOpcode {
    /// SEND: consumes a receive work request at the peer.
    Send,
    /// SEND with immediate data.
    SendWithImm,
    /// RDMA WRITE to `remote_addr`/`rkey`.
    RdmaWrite,
    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    RdmaWriteWithImm,
    /// RDMA READ from `remote_addr`/`rkey` into the scatter list.
    RdmaRead,
    /// 8-byte compare-and-swap at `remote_addr` (`compare_add`, `swap`).
    AtomicCmpAndSwp,
    /// 8-byte fetch-and-add at `remote_addr` (`compare_add`).
    AtomicFetchAndAdd,
    /// A request to an offload handler of the peer's stack (see netstack's `offload`): the
    /// handler's opcode in `imm_data`, the request bytes as the INLINE payload, the response
    /// buffer as the scatter list. Posted with netstack's `verbs::Qp::post_offload`.
    Offload,
    /// Does nothing; completes in order with the QP's other work requests. On a managed QP it is
    /// the placeholder a RedN `if` turns into a real verb (see netstack's `redn`).
    Noop,
    /// Managed QPs only: stops fetching this QP's later work requests until the completion
    /// queue numbered `rkey` has produced `remote_addr` completions (see [`SendWr::wait`]).
    Wait,
    /// Managed QPs only: lets the managed QP numbered `rkey` fetch its work requests up to index
    /// `remote_addr` (exclusive; see [`SendWr::enable`]).
    Enable,
}

/// Send flags (`IBV_SEND_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// Wait for earlier READs and atomics to complete before starting.
    pub const FENCE: SendFlags = SendFlags(1);
    /// Produce a completion (an unsignaled one completes silently).
    pub const SIGNALED: SendFlags = SendFlags(2);
    /// Ask the receiver's CQ for an event.
    pub const SOLICITED: SendFlags = SendFlags(4);
    /// Copy the payload at post time (the buffer may be reused at once).
    pub const INLINE: SendFlags = SendFlags(8);
    /// Whether every flag of `o` is set.
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
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: WrOpcode,
    /// The local memory: source of sends and writes, destination of reads and atomics.
    pub sg_list: SgList,
    /// [`SendFlags`].
    pub flags: SendFlags,
    /// Immediate data for the `*_WITH_IMM` opcodes (network order, opaque).
    pub imm_data: u32,
    /// Remote address for RDMA and atomic operations.
    pub remote_addr: u64,
    /// Remote key for RDMA and atomic operations.
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
    /// Appends a scatter-gather element.
    pub fn sge(mut self, s: Sge) -> Self {
        self.sg_list.push(s);
        self
    }
    /// Sets the remote address and key.
    pub fn remote(mut self, addr: u64, rkey: u32) -> Self {
        self.remote_addr = addr;
        self.rkey = rkey;
        self
    }
    /// Sets the immediate data.
    pub fn imm(mut self, imm: u32) -> Self {
        self.imm_data = imm;
        self
    }
    /// Sets the flags (replacing the default SIGNALED).
    pub fn flags(mut self, f: SendFlags) -> Self {
        self.flags = f;
        self
    }
    /// Sets an atomic's operands.
    pub fn atomic(mut self, compare_add: u64, swap: u64) -> Self {
        self.compare_add = compare_add;
        self.swap = swap;
        self
    }
    /// A NOOP work request.
    pub fn noop(wr_id: u64) -> SendWr {
        SendWr::new(wr_id, WrOpcode::Noop).flags(SendFlags(0))
    }
    /// A WAIT: later work requests of this (managed) QP are not fetched until completion queue
    /// `cq_num` has produced `count` completions in total (counts are monotonic).
    pub fn wait(wr_id: u64, cq_num: u32, count: u64) -> SendWr {
        SendWr::new(wr_id, WrOpcode::Wait)
            .remote(count, cq_num)
            .flags(SendFlags(0))
    }
    /// An ENABLE: managed QP `qpn` may fetch its work requests with index below `index`
    /// (indices are monotonic: they count posts since the QP was created, they do not wrap).
    pub fn enable(wr_id: u64, qpn: u32, index: u64) -> SendWr {
        SendWr::new(wr_id, WrOpcode::Enable)
            .remote(index, qpn)
            .flags(SendFlags(0))
    }
    /// Total bytes of the scatter-gather list.
    pub fn total_len(&self) -> u64 {
        self.sg_list.iter().map(|s| s.length as u64).sum()
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone)]
pub struct RecvWr {
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// Where a received message lands.
    pub sg_list: SgList,
}

/// Work completion status (`IBV_WC_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// A message longer than the receive buffer, or a local length error.
    LocLenErr,
    /// A local QP operation error.
    LocQpOpErr,
    /// A local memory key, PD or access check failed.
    LocProtErr,
    /// Flushed: the QP went to the error state before it ran.
    WrFlushErr,
    /// The responder refused the request as invalid (NAK).
    RemInvReqErr,
    /// The responder's rkey, PD, bounds or access check failed (NAK).
    RemAccessErr,
    /// The responder failed carrying it out (NAK).
    RemOpErr,
    /// Retransmissions ran out (no answer).
    RetryExcErr,
    /// RNR retries ran out (the peer had no receive posted).
    RnrRetryExcErr,
}

/// Work completion opcode (`IBV_WC_*` opcodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (with or without immediate) completed.
    Send,
    /// An RDMA WRITE completed.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// A compare-and-swap completed.
    CompSwap,
    /// A fetch-and-add completed.
    FetchAdd,
    /// A message was received.
    Recv,
    /// A WRITE with immediate data consumed a receive.
    RecvRdmaWithImm,
    /// An offload request completed.
    Offload,
    /// A NOOP, WAIT or ENABLE completed.
    Noop,
}

impl WcOpcode {
    /// The completion opcode of a send work request's opcode.
    pub fn from_wr(op: WrOpcode) -> WcOpcode {
        match op {
            WrOpcode::Send | WrOpcode::SendWithImm => WcOpcode::Send,
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
            WrOpcode::Offload => WcOpcode::Offload,
            WrOpcode::Noop | WrOpcode::Wait | WrOpcode::Enable => WcOpcode::Noop,
        }
    }
}

/// A work completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred.
    pub byte_len: u32,
    /// Immediate data of a received message that had some.
    pub imm_data: Option<u32>,
    /// The local QP.
    pub qp_num: u32,
    /// The sending QP (receives).
    pub src_qp: u32,
    /// Why an offload request failed (an [`crate::transport::rc::offload::OffloadStatus`] code), else 0; like
    /// `ibv_wc.vendor_err`.
    pub vendor_err: u32,
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
    if matches!(wr.opcode, WrOpcode::Wait | WrOpcode::Enable) && !wr.sg_list.is_empty() {
        return Err("WAIT and ENABLE take no scatter-gather elements");
    }
    if wr.opcode == WrOpcode::Offload && wr.imm_data > u16::MAX as u32 {
        return Err("offload opcodes are 16 bits");
    }
    Ok(())
}
