//! The RC transport's side of offloads (sans-IO): an OFFLOAD_REQUEST becomes an [`OffloadJob`]
//! handed to an [`OffloadSink`] (the engine's offload threads, netstack's `offload`); the
//! responder holds the job's place in its response queue and answers when the job is finished
//! or its time budget has passed, whichever comes first.
//!
//! Wire format (opcodes in the manufacturer-specific range):
//! - `OFFLOAD_REQUEST` (0xC0), one packet: BTH, [`crate::wire::OffloadReqHdr`], request bytes
//!   (at most MTU - 8). It consumes as many PSNs as its response has packets, like a READ.
//! - `OFFLOAD_RESPONSE_{FIRST, MIDDLE, LAST, ONLY}` (0xC1..0xC4): READ-response-like packets
//!   (AETH on FIRST, LAST and ONLY); packet `k`'s data lands at offset `k × MTU` of the
//!   requester's response buffer; LAST and ONLY start with an [`crate::wire::OffloadResult`]
//!   (status, total length), so their data is at most MTU - 8. Packets past the end of a short
//!   response carry no data.
//!
//! A job that ends within [`OffloadSink::submit`] (refused at once, or a handler of bounded
//! cost run on the receiving core) is answered in the pass that received it. Otherwise its
//! outcome comes back as an event: the engine applies it to the QP on the QP's own
//! data core ([`crate::transport::rc::RcQp::offload_finished`]), so the transport state has one
//! writer. The first outcome wins: the responder answers TIMEOUT itself when the budget passes,
//! and a handler's later outcome is dropped.

use std::sync::Arc;

/// Largest response buffer an offload request may announce (1 MiB).
pub const MAX_OFFLOAD_RESP: u32 = 1 << 20;

/// How an offload request ended (the wire's result status; the requester's completion carries
/// it in `Wc::vendor_err`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OffloadStatus {
    /// The handler answered.
    Ok = 0,
    /// No handler is registered for the opcode on this QP.
    NoHandler = 1,
    /// The handler refused the request as malformed.
    BadRequest = 2,
    /// The handler returned an error.
    HandlerError = 3,
    /// The handler panicked (caught; the engine keeps serving).
    Panicked = 4,
    /// The handler did not answer within its time budget.
    Timeout = 5,
    /// The handler's response is longer than the requester's buffer.
    ResponseTooLong = 6,
    /// The handler touched memory outside its DMA regions.
    DmaFault = 7,
    /// The offload threads are saturated (too many requests in progress).
    Overloaded = 8,
}

impl OffloadStatus {
    /// The status of a wire code (unknown codes read as handler errors).
    pub fn from_u8(v: u8) -> OffloadStatus {
        use OffloadStatus::*;
        match v {
            0 => Ok,
            1 => NoHandler,
            2 => BadRequest,
            4 => Panicked,
            5 => Timeout,
            6 => ResponseTooLong,
            7 => DmaFault,
            8 => Overloaded,
            _ => HandlerError,
        }
    }
}

impl std::fmt::Display for OffloadStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OffloadStatus::Ok => "ok",
            OffloadStatus::NoHandler => "no handler for the opcode",
            OffloadStatus::BadRequest => "bad request",
            OffloadStatus::HandlerError => "handler error",
            OffloadStatus::Panicked => "handler panicked",
            OffloadStatus::Timeout => "handler exceeded its time budget",
            OffloadStatus::ResponseTooLong => "response longer than the requester's buffer",
            OffloadStatus::DmaFault => "DMA outside the registered regions",
            OffloadStatus::Overloaded => "offload engine overloaded",
        })
    }
}

/// One offload request in progress: what the handler gets.
#[derive(Debug)]
pub struct OffloadJob {
    /// The job's id on its QP (the request's PSN, in the transport's 64-bit PSN space): what
    /// its outcome names.
    pub id: u64,
    /// The QP the request arrived on.
    pub qpn: u32,
    /// That QP's protection domain: what the handler's DMA is checked against.
    pub pd: u32,
    /// The handler opcode.
    pub opcode: u16,
    /// The request bytes.
    pub request: Vec<u8>,
    /// Most response bytes the requester can take.
    pub resp_cap: u32,
    /// Transport time (ns) after which the responder answers TIMEOUT.
    pub deadline: u64,
}

/// How a job ended: its status and response bytes (empty unless it succeeded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// How it ended.
    pub status: OffloadStatus,
    /// The handler's response.
    pub response: Arc<[u8]>,
}

impl Outcome {
    /// A job that ended with `status` and `response`.
    pub fn new(status: OffloadStatus, response: Arc<[u8]>) -> Outcome {
        Outcome { status, response }
    }

    /// A job that ended with `status` and no response (refused, failed, timed out).
    pub fn empty(status: OffloadStatus) -> Outcome {
        Outcome::new(status, Arc::from(&[][..]))
    }
}

/// Where a QP's responder hands offload jobs. The engine's implementation runs the registered
/// handler on an offload thread and sends the outcome to the QP's data core as an event.
pub trait OffloadSink: Send + Sync {
    /// Starts `job`; must not block. Returns its outcome when the job ended within the call
    /// (no handler, the offload threads saturated, or a handler run on the calling core that
    /// finished); otherwise (`None`) the outcome arrives later, through
    /// [`crate::transport::rc::RcQp::offload_finished`].
    fn submit(&self, job: Arc<OffloadJob>) -> Option<Outcome>;
    /// Time budget of a handler for `opcode` on QP `qpn`, in nanoseconds.
    fn budget_ns(&self, qpn: u32, opcode: u16) -> u64;
}

/// Packets of an offload response whose requester buffer holds `cap` bytes: the LAST (or ONLY)
/// packet gives 8 bytes to the result header.
pub fn response_packets(cap: u32, mtu: u32) -> u32 {
    (cap as u64 + 8).div_ceil(mtu as u64).max(1) as u32
}
