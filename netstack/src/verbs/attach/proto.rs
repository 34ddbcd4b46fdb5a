//! The control protocol (docs/FLEXNSD.md, "Control protocol"): one `SOCK_SEQPACKET` packet per
//! message, an 8-byte header (`version: u16`, `flags: u16`, `len: u32`, little endian) and
//! `len` bytes of JSON; descriptors ride along as `SCM_RIGHTS`.

use serde::{Deserialize, Serialize};
use std::os::fd::{BorrowedFd, OwnedFd};

/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER: usize = 8;
/// The longest message (header included).
pub const MAX_MSG: usize = 64 << 10;

/// A command from an application. Handles are the attachment's own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    /// First message: carries the attachment's doorbell eventfd.
    Hello {
        /// The application's name (for metrics and logs).
        name: String,
    },
    /// Allocates a protection domain.
    AllocPd,
    /// Registers the passed memfd's first `len` bytes in `pd`; the application maps it at `addr`.
    RegMr {
        /// Its PD.
        pd: u32,
        /// Bytes.
        len: u64,
        /// The application's address of the first byte (what its SGEs and rkeys name).
        addr: u64,
        /// `crate::verbs::Access` bits.
        access: u32,
    },
    /// Deregisters a memory region.
    DeregMr {
        /// Its handle.
        mr: u32,
    },
    /// Creates a CQ over the passed ring memfd (with `slots` entries) and notify eventfd.
    CreateCq {
        /// Entries of the ring (a power of two).
        slots: u32,
    },
    /// Creates an RC QP over the passed send-ring memfd (with `slots` entries).
    CreateQp {
        /// Its PD.
        pd: u32,
        /// The CQ its send completions go to.
        send_cq: u32,
        /// The CQ its receive completions go to.
        recv_cq: u32,
        /// Entries of its send ring (a power of two).
        slots: u32,
        /// Its transport parameters (`None`: the daemon context's defaults), as
        /// `crate::verbs::QpInitAttr::config`.
        #[serde(default)]
        config: Option<crate::transport::rc::RcConfig>,
    },
    /// The QP's half of a connection exchange.
    QpEndpoint {
        /// The QP.
        qp: u32,
    },
    /// Connects the QP to a peer (INIT -> RTR -> RTS).
    Connect {
        /// The QP.
        qp: u32,
        /// The peer's endpoint.
        remote: crate::verbs::Endpoint,
    },
    /// One step of the QP state machine (what `ibv_modify_qp` does), for an application that
    /// takes the steps apart instead of [`Request::Connect`].
    Modify {
        /// The QP.
        qp: u32,
        /// The step.
        step: ModifyStep,
    },
    /// Limits a QP's sending rate (bytes per second and burst), or lifts the limit (`None`).
    RateLimit {
        /// The QP.
        qp: u32,
        /// Bytes per second.
        bytes_per_sec: Option<u64>,
        /// Burst bytes.
        burst: u64,
    },
    /// Limits a QP's payload bytes in flight, or lifts the limit (`None`).
    WindowLimit {
        /// The QP.
        qp: u32,
        /// Bytes.
        bytes: Option<u64>,
    },
    /// The daemon engine's counters (all attachments together).
    EngineStats,
    /// Destroys a QP.
    DestroyQp {
        /// The QP.
        qp: u32,
    },
    /// Destroys a CQ (refused while a QP of the attachment uses it).
    DestroyCq {
        /// The CQ.
        cq: u32,
    },
    /// Deallocates a PD (refused while an MR or QP of the attachment is in it).
    DeallocPd {
        /// The PD.
        pd: u32,
    },
    /// The transport counters of one QP.
    QpStats {
        /// The QP.
        qp: u32,
    },
    /// The daemon's counts.
    Status,
}

/// The daemon's answer to a [`Request`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Attached.
    Hello {
        /// The attachment's id.
        app: u64,
        /// The daemon's data-path address (its first data core's).
        #[serde(default)]
        addr: Option<std::net::SocketAddrV4>,
    },
    /// A new object's handle.
    Handle(u32),
    /// A registered memory region.
    Mr {
        /// Its handle.
        handle: u32,
        /// Local key.
        lkey: u32,
        /// Remote key.
        rkey: u32,
    },
    /// A new QP.
    Qp {
        /// Its handle.
        handle: u32,
        /// Its QP number.
        qpn: u32,
    },
    /// An endpoint.
    Endpoint(crate::verbs::Endpoint),
    /// Done.
    Done,
    /// The daemon's counts.
    Status(Status),
    /// A QP's transport counters.
    QpStats(Box<QpStats>),
    /// The daemon engine's counters.
    EngineStats(Box<crate::engine::StatsSnapshot>),
    /// Refused: the field at fault, and why.
    Err {
        /// The request field (or `fds`, `message`) that was bad.
        field: String,
        /// Why.
        message: String,
    },
}

/// What a daemon holds, in all and per attachment.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Status {
    /// Attached applications.
    pub attachments: u64,
    /// Their objects, summed.
    pub totals: Counts,
    /// Per attachment (by id).
    pub apps: Vec<(u64, Counts)>,
    /// Mappings of application memfds in the daemon's address space (from /proc/self/maps).
    pub mapped_memfds: u64,
    /// The daemon's open file descriptors (from /proc/self/fd).
    pub open_fds: u64,
}

/// Transport counters of one QP (a subset of netstack's `RcStats`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct QpStats {
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets received.
    pub rx_packets: u64,
    /// Packets sent again.
    pub retransmitted_packets: u64,
    /// RNR NAKs sent (a message arrived before a receive was posted).
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// All of the QP's counters, as the in-process engine's `Qp::stats` has them.
    #[serde(default)]
    pub rc: crate::transport::rc::RcStats,
    /// Its state, as its data core last published it.
    #[serde(default)]
    pub state: Option<crate::transport::rc::QpState>,
    /// The ICRC mode its connection runs.
    #[serde(default)]
    pub icrc: crate::transport::rc::IcrcMode,
}

/// A step of the QP state machine ([`Request::Modify`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ModifyStep {
    /// INIT -> RTR towards `remote`; `accept`: as a peer's connection request named it
    /// (`crate::verbs::Qp::accept_rtr`), else as this side chose it (`modify_to_rtr`).
    Rtr {
        /// The peer's endpoint.
        remote: crate::verbs::Endpoint,
        /// Whether the peer's request named the endpoint.
        accept: bool,
    },
    /// RTR -> RTS, sending from `sq_psn` if given (else the PSN drawn at creation).
    Rts {
        /// The first PSN to send.
        sq_psn: Option<u32>,
    },
    /// -> ERR: outstanding work requests complete with `WR_FLUSH_ERR`.
    Err,
}

/// One attachment's objects and traffic.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    /// Protection domains.
    pub pds: u64,
    /// Memory regions.
    pub mrs: u64,
    /// Completion queues.
    pub cqs: u64,
    /// Queue pairs.
    pub qps: u64,
    /// Work requests taken from its rings.
    pub wrs: u64,
    /// Payload bytes of the send WRs taken.
    pub bytes: u64,
    /// Errors (refused commands, ring faults, refused posts).
    pub errors: u64,
}

/// A malformed message.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Malformed {
    /// The field at fault.
    pub field: &'static str,
    /// Why.
    pub message: String,
}

/// Frames `body` as JSON after the header.
pub fn encode<T: Serialize>(body: &T) -> Vec<u8> {
    let json = serde_json::to_vec(body).expect("protocol types serialize");
    let mut out = Vec::with_capacity(HEADER + json.len());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Parses one packet of `n` bytes.
pub fn decode<T: for<'de> Deserialize<'de>>(pkt: &[u8]) -> Result<T, Malformed> {
    let bad = |field, message: String| Malformed { field, message };
    if pkt.len() < HEADER {
        return Err(bad("header", format!("{} bytes, the header has {HEADER}", pkt.len())));
    }
    let version = u16::from_le_bytes([pkt[0], pkt[1]]);
    if version != VERSION {
        return Err(bad("version", format!("{version}, this daemon speaks {VERSION}")));
    }
    let flags = u16::from_le_bytes([pkt[2], pkt[3]]);
    if flags != 0 {
        return Err(bad("flags", format!("{flags:#x}, none are defined")));
    }
    let len = u32::from_le_bytes([pkt[4], pkt[5], pkt[6], pkt[7]]) as usize;
    if len != pkt.len() - HEADER {
        return Err(bad(
            "len",
            format!("{len}, the packet carries {} body bytes", pkt.len() - HEADER),
        ));
    }
    serde_json::from_slice(&pkt[HEADER..]).map_err(|e| bad("body", e.to_string()))
}

/// Sends `body` with `fds`.
pub fn send<T: Serialize>(sock: BorrowedFd<'_>, body: &T, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    super::sys::send_msg(sock, &encode(body), fds)
}

/// A received message: the parsed body (or why it is malformed) and the descriptors it carried.
pub type Received<T> = (Result<T, Malformed>, Vec<OwnedFd>);

/// Receives one message (blocking); `None` at EOF.
pub fn recv<T: for<'de> Deserialize<'de>>(sock: BorrowedFd<'_>) -> std::io::Result<Option<Received<T>>> {
    let mut buf = vec![0u8; MAX_MSG];
    match super::sys::recv_msg(sock, &mut buf, false)? {
        super::sys::Recv::Msg(n, fds) => Ok(Some((decode(&buf[..n]), fds))),
        super::sys::Recv::Eof => Ok(None),
        super::sys::Recv::WouldBlock => Err(std::io::ErrorKind::WouldBlock.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_headers_name_their_field() {
        let good = encode(&Request::AllocPd);
        assert!(matches!(decode::<Request>(&good), Ok(Request::AllocPd)));
        let field = |pkt: &[u8]| decode::<Request>(pkt).unwrap_err().field;
        assert_eq!(field(&good[..5]), "header");
        let mut v = good.clone();
        v[0] = 9;
        assert_eq!(field(&v), "version");
        let mut f = good.clone();
        f[2] = 1;
        assert_eq!(field(&f), "flags");
        assert_eq!(field(&good[..good.len() - 1]), "len");
        let mut b = good.clone();
        let n = b.len();
        b[n - 2] = b'!';
        assert_eq!(field(&b), "body");
    }
}
