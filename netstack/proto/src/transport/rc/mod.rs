//! Reliable Connection (RC) transport with the semantics of the InfiniBand spec as RoCEv2 uses
//! them: 24-bit PSNs, MTU segmentation, FIRST/MIDDLE/LAST/ONLY opcodes, coalesced ACKs with
//! AckReq, NAKs (PSN sequence error, RNR, remote access, invalid request), retransmission timeout
//! with backoff and a retry budget, READ responses, atomics with a responder replay cache, FENCE.
//!
//! Two loss-recovery modes per QP ([`Recovery`]): go-back-N (the standard) and IRN-style
//! selective repeat, where every data packet carries an [`crate::wire::SrExt`] so it can be
//! placed when it arrives out of order, and ACKs carry a [`crate::wire::SackExt`].
//!
//! An [`RcQp`] holds both halves of a QP: the requester (its send queue) and the responder (its
//! receive queue and the peer's requests). Drive it with [`RcQp::handle_packet`],
//! [`RcQp::poll_transmit`], [`RcQp::poll_timeout`] / [`RcQp::handle_timeout`] and drain
//! [`RcQp::poll_completion`].

mod multipath;
pub mod offload;
mod requester;
mod responder;
#[cfg(test)]
mod tests;
pub mod validation;

use crate::cc::header::GrantHdr;
use crate::cc::{CcAlgorithm, CcEnv, CcOutput, Generate, HeaderSpec, RxKind, RxMeta, StartInfo, Traced, Verdict};
use crate::memory::{KeyTable, SharedRegion};
use crate::wire::MAX_CC_HDR_LEN;
use crate::wire::{Bth, HeaderBuf, Opcode};
use crate::wire::{PacketView, MASK24};
use crate::work::{RecvWr, SendWr, Wc, WcStatus};
use requester::Requester;
use responder::Responder;
use std::collections::VecDeque;
use std::sync::Arc;

pub use requester::rnr_delay_ns;

/// Default burst allowance of a congestion-controlled QP's pacer ([`RcConfig::pacing_burst`]).
pub const CC_BURST_BYTES: u64 = 256 << 10;

/// Loss recovery of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recovery {
    /// Standard RC: the responder accepts only the expected PSN, the requester resends from the
    /// first lost packet.
    #[default]
    GoBackN,
    /// IRN-style: out-of-order packets are placed directly, ACKs carry a SACK bitmap, only lost
    /// packets are resent.
    SelectiveRepeat,
}

/// What covers a QP's packets against corruption: RoCEv2's ICRC, or (between flexns peers on a
/// trusted link) the UDP checksum alone. A connection runs [`IcrcMode::None`] only when both
/// ends offer it and both send UDP checksums (the driver negotiates it when connecting; this
/// crate only carries the setting). With `None` the ICRC field is sent as 0 and not checked,
/// so no CRC pass touches the payload; every bound and key check stays as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IcrcMode {
    /// The ICRC is computed on every packet sent and verified on every packet received.
    #[default]
    Icrc,
    /// No ICRC (the field is 0 and ignored): the UDP checksum protects the bytes.
    None,
}

impl IcrcMode {
    /// Its name in configuration, on the wire of the connection manager and in reports.
    pub fn name(self) -> &'static str {
        match self {
            IcrcMode::Icrc => "icrc",
            IcrcMode::None => "none",
        }
    }
}

impl std::fmt::Display for IcrcMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for IcrcMode {
    type Err = String;
    fn from_str(s: &str) -> Result<IcrcMode, String> {
        match s {
            "icrc" => Ok(IcrcMode::Icrc),
            "none" => Ok(IcrcMode::None),
            o => Err(format!("unknown ICRC mode {o:?}: use \"icrc\" or \"none\"")),
        }
    }
}

/// QP states (`IBV_QPS_*`; SQD and SQE are not modelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum QpState {
    /// Made, not configured.
    Reset,
    /// Configured; receives may be posted.
    Init,
    /// Ready to receive: connected to its peer.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: work requests are flushed.
    Err,
}

/// Per-QP transport parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RcConfig {
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub mtu: u32,
    /// How losses are recovered (go-back-N or selective repeat).
    pub recovery: Recovery,
    /// Local ACK timeout in nanoseconds (ibverbs encodes it as 4.096 µs × 2^timeout).
    pub timeout_ns: u64,
    /// Retries after a timeout before the WQE completes with RETRY_EXC_ERR.
    pub retry_cnt: u8,
    /// RNR retries (7 means infinite, as in ibverbs).
    pub rnr_retry: u8,
    /// RNR timer code this QP's responder advertises in RNR NAKs.
    pub min_rnr_timer: u8,
    /// Outstanding READ/atomic requests this QP may have in flight (initiator depth).
    pub max_rd_atomic: u32,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Most unacknowledged packets in flight.
    pub window_pkts: u32,
    /// The responder ACKs at least every this many packets.
    pub ack_every: u32,
    /// The responder ACKs pending packets at the latest after this long.
    pub ack_delay_ns: u64,
    /// Retransmission timeouts double up to this many times.
    pub max_backoff_shift: u8,
    /// Congestion control algorithm.
    pub cc: crate::cc::CcKind,
    /// Bytes a congestion-controlled QP may send back to back above its pacing rate. The
    /// default (256 KiB, one engine transmit batch) keeps GSO batches whole at tens of Gbit/s;
    /// a few MTUs make the pacing per-packet, as a NIC's, at the price of more sends.
    pub pacing_burst: u32,
    /// The ICRC mode this QP offers its peer (`icrc` or `none`); see [`IcrcMode`]. Once
    /// connected, the mode the connection runs.
    pub icrc: IcrcMode,
}

/// The longest local ACK timeout a QP takes: ibverbs' largest, 4.096 µs × 2^31.
pub const MAX_TIMEOUT_NS: u64 = 4_096 << 31;

impl Default for RcConfig {
    fn default() -> Self {
        RcConfig {
            mtu: 4096,
            recovery: Recovery::GoBackN,
            timeout_ns: 4_096 << 12, // ibverbs' encoding: 4.096 µs × 2^12 ≈ 16.8 ms
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_send_wr: 4096,
            max_recv_wr: 4096,
            window_pkts: 512,
            ack_every: 16,
            ack_delay_ns: 20_000,
            max_backoff_shift: 4,
            cc: crate::cc::CcKind::None,
            pacing_burst: CC_BURST_BYTES as u32,
            icrc: IcrcMode::Icrc,
        }
    }
}

impl RcConfig {
    /// Checks the parameters; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if ![256, 512, 1024, 2048, 4096].contains(&self.mtu) {
            return Err(format!("mtu: {} is not one of 256, 512, 1024, 2048, 4096", self.mtu));
        }
        // bounded so that deadlines (`now + timeout << backoff`) cannot overflow: ibverbs'
        // largest timeout is 4.096 µs × 2^31, about 2.4 hours
        if self.timeout_ns == 0 || self.timeout_ns > MAX_TIMEOUT_NS {
            return Err(format!("timeout_ns: {} not in 1..={MAX_TIMEOUT_NS}", self.timeout_ns));
        }
        if self.max_backoff_shift > 16 {
            return Err(format!("max_backoff_shift: {} > 16", self.max_backoff_shift));
        }
        if self.ack_delay_ns > 1_000_000_000 {
            return Err(format!("ack_delay_ns: {} > 1 s", self.ack_delay_ns));
        }
        // a queue's depth is memory the engine keeps per QP (one peer must not claim it all)
        for (f, v) in [
            ("max_send_wr", self.max_send_wr),
            ("max_recv_wr", self.max_recv_wr),
            ("max_rd_atomic", self.max_rd_atomic),
            ("ack_every", self.ack_every),
        ] {
            if v > 1 << 20 {
                return Err(format!("{f}: {v} > 1048576"));
            }
        }
        if self.retry_cnt > 7 {
            return Err(format!("retry_cnt: {} > 7", self.retry_cnt));
        }
        if self.rnr_retry > 7 {
            return Err(format!("rnr_retry: {} > 7", self.rnr_retry));
        }
        if self.min_rnr_timer > 31 {
            return Err(format!("min_rnr_timer: {} > 31", self.min_rnr_timer));
        }
        if self.window_pkts == 0 || self.window_pkts > 1 << 20 {
            return Err(format!("window_pkts: {} not in 1..=1048576", self.window_pkts));
        }
        if self.pacing_burst < self.mtu {
            return Err(format!(
                "pacing_burst: {} is below the MTU {}",
                self.pacing_burst, self.mtu
            ));
        }
        if self.max_rd_atomic == 0 || self.max_send_wr == 0 || self.max_recv_wr == 0 || self.ack_every == 0 {
            return Err("max_rd_atomic, max_send_wr, max_recv_wr and ack_every must be > 0".into());
        }
        Ok(())
    }

    /// Longest time a requester keeps retrying an unanswered packet before RETRY_EXC_ERR once
    /// its peer is silent. A multipath QP whose other paths keep delivering (a path failed, not
    /// the peer) first spends up to 32 timeouts of `timeout_ns` without backing off.
    pub fn retry_bound_ns(&self) -> u64 {
        (0..=self.retry_cnt as u32)
            .map(|i| self.timeout_ns << i.min(self.max_backoff_shift as u32))
            .sum()
    }
}

/// Why a post was refused (the work request was not queued).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The QP's state does not take this work request.
    #[error("QP is in state {0:?}, which does not accept this work request")]
    InvalidState(QpState),
    /// The queue holds its depth already.
    #[error("queue is full ({0} outstanding work requests)")]
    QueueFull(u32),
    /// The work request is malformed (what is wrong with it).
    #[error("invalid work request: {0}")]
    Invalid(&'static str),
}

/// Why a state transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid QP state transition {from:?} -> {to:?}")]
pub struct ModifyError {
    /// The QP's state.
    pub from: QpState,
    /// The state asked for.
    pub to: QpState,
}

/// Duplicate READ and atomic requests a responder keeps what it needs to answer again: the
/// last this many it accepted (an RNIC's `max_dest_rd_atomic` resources). A requester has at
/// most [`RcConfig::max_rd_atomic`] (16 by default) READs and atomics outstanding, and a
/// duplicate it sends is for one of them, so a responder at least that deep answers every
/// legitimate duplicate; the bound is the larger of this and the QP's `max_rd_atomic`.
pub const RESPONDER_RD_ATOMIC: usize = 16;

/// Why a QP entered the error state (the `cause` of `flexns_qp_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpErrorCause {
    /// The peer NAKed an outstanding request with a remote access error.
    RemoteAccess,
    /// The peer NAKed an outstanding request with a remote operational error.
    RemoteOperation,
    /// The peer NAKed an outstanding request as invalid.
    RemoteInvalidRequest,
    /// The peer did not answer within the retry budget (RETRY_EXC_ERR).
    RetryExceeded,
    /// The peer had no receive posted within the RNR retry budget (RNR_RETRY_EXC_ERR).
    RnrRetryExceeded,
    /// A work request failed a local check (memory key, length) or a loopback execution.
    Local,
    /// Congestion control stopped the QP (e.g. HPCC without INT telemetry).
    CongestionControl,
    /// The application (or a RedN chain's abort) moved it to ERR.
    Application,
}

impl QpErrorCause {
    /// How many causes there are.
    pub const COUNT: usize = 8;
    /// Every cause, in index order.
    pub const ALL: [QpErrorCause; Self::COUNT] = [
        QpErrorCause::RemoteAccess,
        QpErrorCause::RemoteOperation,
        QpErrorCause::RemoteInvalidRequest,
        QpErrorCause::RetryExceeded,
        QpErrorCause::RnrRetryExceeded,
        QpErrorCause::Local,
        QpErrorCause::CongestionControl,
        QpErrorCause::Application,
    ];

    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            QpErrorCause::RemoteAccess => "remote_access",
            QpErrorCause::RemoteOperation => "remote_operation",
            QpErrorCause::RemoteInvalidRequest => "remote_invalid_request",
            QpErrorCause::RetryExceeded => "retry_exceeded",
            QpErrorCause::RnrRetryExceeded => "rnr_retry_exceeded",
            QpErrorCause::Local => "local",
            QpErrorCause::CongestionControl => "congestion_control",
            QpErrorCause::Application => "application",
        }
    }

    /// The cause a failed work completion's status stands for.
    fn of_status(st: WcStatus) -> QpErrorCause {
        match st {
            WcStatus::RemAccessErr => QpErrorCause::RemoteAccess,
            WcStatus::RemOpErr => QpErrorCause::RemoteOperation,
            WcStatus::RemInvReqErr => QpErrorCause::RemoteInvalidRequest,
            WcStatus::RetryExcErr => QpErrorCause::RetryExceeded,
            WcStatus::RnrRetryExcErr => QpErrorCause::RnrRetryExceeded,
            _ => QpErrorCause::Local,
        }
    }
}

/// Counters of one QP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RcStats {
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets received, probes and challenges aside (they say nothing of use).
    pub rx_packets: u64,
    /// Packets sent again.
    pub retransmitted_packets: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// PSN sequence error NAKs sent.
    pub seq_naks_sent: u64,
    /// Congestion notification packets sent.
    pub cnps_sent: u64,
    /// Congestion notification packets received.
    pub cnps_received: u64,
    /// RNR NAKs sent (no receive posted).
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// Requests received again (answered again, not executed twice).
    pub duplicate_requests: u64,
    /// Duplicate READ, atomic and offload requests refused: a READ that matches none of the
    /// READs this QP recently accepted (PSN, address, length, R_Key; see
    /// [`RESPONDER_RD_ATOMIC`]), an atomic whose saved result is gone or whose header differs,
    /// an offload request unknown to its cache. Dropped unanswered: a forged or stale copy
    /// never makes the responder send memory it was not asked for by the live connection.
    pub duplicate_requests_refused: u64,
    /// Packets that arrived ahead of the expected PSN.
    pub out_of_order_packets: u64,
    /// Responses for requests already completed.
    pub stale_responses: u64,
    /// Positive ACKs naming a PSN this QP never sent (at or past the highest PSN sent):
    /// dropped ("ghost" responses, IBA 9.7.5.1).
    pub ghost_acks: u64,
    /// NAKs (sequence error, RNR, fatal) naming no outstanding PSN (behind the oldest
    /// unacknowledged one, or never sent; any PSN when nothing is outstanding): dropped, never
    /// fatal.
    pub ghost_naks: u64,
    /// READ, atomic and offload responses naming a PSN this QP never sent: dropped.
    pub ghost_responses: u64,
    /// Times this QP entered the error state, by cause (indexed by [`QpErrorCause`]; kept
    /// across a reset to RESET).
    pub qp_errors: [u64; QpErrorCause::COUNT],
    /// Retransmissions whose first copy turned out to have arrived (overtaken, not lost).
    pub spurious_retransmissions: u64,
    /// Packets dropped (malformed, or refused by a check).
    pub dropped_packets: u64,
    /// ACKs sent.
    pub acks_sent: u64,
    /// Credit grants sent (Homa).
    pub grants_sent: u64,
    /// Credit grants received.
    pub grants_received: u64,
    /// Packets the congestion-control TX function deferred or held.
    pub cc_deferred: u64,
    /// Multipath: probes sent on down paths, probes answered for the peer, paths taken out of
    /// the rotation.
    pub probes_sent: u64,
    /// Probes answered for the peer.
    pub probes_received: u64,
    /// Paths taken out of the rotation.
    pub path_downs: u64,
    /// Payload bytes copied into registered memory: receives, WRITE and READ-response
    /// placement (the one copy from a receive buffer), loopback execution.
    pub payload_copy_bytes: u64,
    /// Peer validation ([`validation`]): challenges sent.
    pub challenges_sent: u64,
    /// Routes of the peer validated by a correct challenge reply.
    pub routes_validated: u64,
    /// Challenge replies with a wrong nonce or route (forged or stale): dropped.
    pub bad_challenge_replies: u64,
    /// Times a packet waited because the allowance of an unvalidated peer was spent.
    pub gated_packets: u64,
    /// Packets the driver dropped on a route not validated, the allowance spent.
    pub refused_unvalidated: u64,
}

impl RcStats {
    /// Adds `o`'s counters to these (a context's QPs summed).
    pub fn add(&mut self, o: &RcStats) {
        let RcStats {
            tx_packets,
            rx_packets,
            retransmitted_packets,
            timeouts,
            seq_naks_sent,
            cnps_sent,
            cnps_received,
            rnr_naks_sent,
            rnr_naks_received,
            duplicate_requests,
            duplicate_requests_refused,
            out_of_order_packets,
            stale_responses,
            ghost_acks,
            ghost_naks,
            ghost_responses,
            qp_errors,
            spurious_retransmissions,
            dropped_packets,
            acks_sent,
            grants_sent,
            grants_received,
            cc_deferred,
            probes_sent,
            probes_received,
            path_downs,
            payload_copy_bytes,
            challenges_sent,
            routes_validated,
            bad_challenge_replies,
            gated_packets,
            refused_unvalidated,
        } = *o;
        self.tx_packets += tx_packets;
        self.rx_packets += rx_packets;
        self.retransmitted_packets += retransmitted_packets;
        self.timeouts += timeouts;
        self.seq_naks_sent += seq_naks_sent;
        self.cnps_sent += cnps_sent;
        self.cnps_received += cnps_received;
        self.rnr_naks_sent += rnr_naks_sent;
        self.rnr_naks_received += rnr_naks_received;
        self.duplicate_requests += duplicate_requests;
        self.duplicate_requests_refused += duplicate_requests_refused;
        self.out_of_order_packets += out_of_order_packets;
        self.stale_responses += stale_responses;
        self.ghost_acks += ghost_acks;
        self.ghost_naks += ghost_naks;
        self.ghost_responses += ghost_responses;
        for (t, v) in self.qp_errors.iter_mut().zip(qp_errors) {
            *t += v;
        }
        self.spurious_retransmissions += spurious_retransmissions;
        self.dropped_packets += dropped_packets;
        self.acks_sent += acks_sent;
        self.grants_sent += grants_sent;
        self.grants_received += grants_received;
        self.cc_deferred += cc_deferred;
        self.probes_sent += probes_sent;
        self.probes_received += probes_received;
        self.path_downs += path_downs;
        self.payload_copy_bytes += payload_copy_bytes;
        self.challenges_sent += challenges_sent;
        self.routes_validated += routes_validated;
        self.bad_challenge_replies += bad_challenge_replies;
        self.gated_packets += gated_packets;
        self.refused_unvalidated += refused_unvalidated;
    }
}

/// Most control-loop delay samples a QP keeps before the owner collects them.
pub const MAX_LOOP_SAMPLES: usize = 1 << 16;

/// One RC queue pair's transport state.
pub struct RcQp<R> {
    qpn: u32,
    pd: u32,
    cfg: RcConfig,
    state: QpState,
    dest_qpn: u32,
    req: Requester<R>,
    resp: Responder<R>,
    completions: VecDeque<Wc>,
    stats: RcStats,
    cc_env: Arc<CcEnv>,
    cc: CcSlot<R>,
    probe: multipath::ProbeSlot,
    /// The path the latest request came on: responses, ACKs and CNPs go back on it.
    rx_path: u8,
    /// Where OFFLOAD_REQUESTs go; without one they are answered NO_HANDLER.
    offload: Option<Arc<dyn offload::OffloadSink>>,
    /// Why it entered ERR, once it did.
    error_cause: Option<QpErrorCause>,
    /// Peer address validation, when the driver asked for it.
    validation: Option<validation::Validation<R>>,
}

/// A QP's congestion control: the algorithm's context, whether it started, its timer, the
/// packets it asked for, the data packet its TX function is holding back, and the CC header to
/// echo in ACKs.
#[derive(Debug)]
struct CcSlot<R> {
    alg: Option<Box<dyn CcAlgorithm>>,
    traced: Traced,
    header: HeaderSpec,
    started: bool,
    timer: Option<u64>,
    /// A CNP to send, with the arrival time of the CE mark that caused it.
    cnp_pending: Option<u64>,
    grant_pending: Option<GrantHdr>,
    /// The TX function deferred (until a time) or held (until the next CC event) this packet.
    stash: Option<(crate::transport::TxPacket<R>, crate::cc::TxMeta)>,
    defer_until: Option<u64>,
    held: bool,
    echo: Vec<u8>,
    /// When the host took in the latest request packet (engine clock): an ACK reports how long
    /// it has waited since ([`crate::cc::HeaderSpec::host_delay`]).
    rx_arrived: u64,
    fault: Option<&'static str>,
    /// Control-loop delays (CE arrival at the receiver to the sender's new rate), ns.
    loop_samples: Vec<u32>,
}

impl<R> Default for CcSlot<R> {
    fn default() -> Self {
        CcSlot {
            alg: None,
            traced: Traced::default(),
            header: HeaderSpec::default(),
            started: false,
            timer: None,
            cnp_pending: None,
            grant_pending: None,
            stash: None,
            defer_until: None,
            held: false,
            echo: Vec::new(),
            rx_arrived: 0,
            fault: None,
            loop_samples: Vec::new(),
        }
    }
}

/// Bytes of the host-delay report at the end of an ACK's CC header.
const HOST_DELAY_LEN: usize = 4;

static DEFAULT_CC_ENV: std::sync::OnceLock<Arc<CcEnv>> = std::sync::OnceLock::new();

impl<R: SharedRegion> RcQp<R> {
    /// A QP in RESET.
    pub fn new(qpn: u32, pd: u32, cfg: RcConfig) -> RcQp<R> {
        RcQp {
            qpn: qpn & MASK24,
            pd,
            cfg,
            state: QpState::Reset,
            dest_qpn: 0,
            req: Requester::new(0),
            resp: Responder::new(0),
            completions: VecDeque::new(),
            stats: RcStats::default(),
            cc_env: DEFAULT_CC_ENV.get_or_init(CcEnv::default_env).clone(),
            cc: CcSlot::default(),
            probe: Default::default(),
            rx_path: 0,
            offload: None,
            error_cause: None,
            validation: None,
        }
    }

    /// Hands this QP's incoming offload requests to `sink`.
    pub fn set_offload_sink(&mut self, sink: Arc<dyn offload::OffloadSink>) {
        self.offload = Some(sink);
    }

    /// Uses `env`'s congestion-control parameters (and its host-wide state, such as Homa's
    /// receiver scheduler) for the algorithm this QP builds when it connects.
    /// Sets the shared congestion-control state its algorithm is built from.
    pub fn set_cc_env(&mut self, env: Arc<CcEnv>) {
        self.cc_env = env;
    }

    /// Its QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// The peer's QP number.
    pub fn dest_qpn(&self) -> u32 {
        self.dest_qpn
    }
    /// Its state.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// Why it entered ERR, if it is there.
    pub fn error_cause(&self) -> Option<QpErrorCause> {
        self.error_cause
    }
    /// Its transport parameters.
    pub fn config(&self) -> &RcConfig {
        &self.cfg
    }
    /// Payload bytes this QP copied into registered memory so far (see
    /// [`RcStats::payload_copy_bytes`]).
    pub fn payload_copy_bytes(&self) -> u64 {
        self.stats.payload_copy_bytes
    }

    /// Counts bytes the engine copied into memory on this QP's behalf (loopback execution).
    pub fn note_payload_copy(&mut self, n: u64) {
        self.stats.payload_copy_bytes += n;
    }

    /// Its counters.
    pub fn stats(&self) -> RcStats {
        RcStats {
            spurious_retransmissions: self.req.spurious,
            ..self.stats
        }
    }
    /// Completes a send WR that never entered the send queue (posted in ERR, or refused by
    /// [`RcQp::post_send`] after it was accepted by an asynchronous queue) with `status`.
    pub fn reject_send(&mut self, wr: &SendWr, status: WcStatus) {
        let mut wc = requester::flush_wc(wr, self.qpn, self.dest_qpn);
        wc.status = status;
        self.push_completion(wc);
        self.req.retire_unqueued();
    }

    /// Completes receive WR `wr_id`, which the QP could not take, with `status` (its queue was full, or
    /// the QP in a state that takes none).
    pub fn reject_recv(&mut self, wr_id: u64, status: WcStatus) {
        let wc = responder::recv_error_wc(wr_id, status, self.qpn, self.dest_qpn);
        self.push_completion(wc);
    }

    /// Offload job `id` (see [`offload::OffloadJob::id`]) ended with `outcome`: its response
    /// goes out at the next transmit. The first outcome wins (the responder may have answered
    /// TIMEOUT); returns whether this one was taken.
    pub fn offload_finished(&mut self, id: u64, outcome: offload::Outcome) -> bool {
        self.resp.offload_finished(id, outcome)
    }

    /// Receive WRs posted and not yet consumed or flushed.
    pub fn recv_queue_len(&self) -> usize {
        self.resp.rq_len()
    }

    /// The protection domain.
    pub fn pd(&self) -> u32 {
        self.pd
    }

    /// Whether the send queue is empty (a request executed outside the transport now
    /// completes in order).
    pub fn send_queue_idle(&self) -> bool {
        self.req.outstanding() == 0
    }

    /// Completes a send WR the engine executed itself (a RedN chain's operation on this
    /// host's memory through a loopback QP, as a NIC executes loopback traffic internally); an
    /// error status moves the QP to ERR. Only while [`RcQp::send_queue_idle`] holds.
    pub fn complete_local(&mut self, wr: &SendWr, status: WcStatus, byte_len: u32) {
        let mut wc = requester::flush_wc(wr, self.qpn, self.dest_qpn);
        wc.status = status;
        wc.byte_len = byte_len;
        self.req.retire_unqueued();
        if status != WcStatus::Success {
            self.complete_error(wc);
        } else if wr.flags.contains(crate::work::SendFlags::SIGNALED) {
            self.push_completion(wc);
        }
    }

    /// Limits this QP's requester to `bytes_per_sec` (with a burst of `burst_bytes`), or lifts
    /// the limit: the pacing hook congestion control drives.
    pub fn set_rate(&mut self, bytes_per_sec: Option<u64>, burst_bytes: u64) {
        self.req.pacer.set_rate(bytes_per_sec, burst_bytes);
    }

    /// Limits the payload bytes this QP's requester has in flight, or lifts the limit.
    pub fn set_window_bytes(&mut self, bytes: Option<u64>) {
        self.req.pacer.set_window(bytes);
    }

    /// The current pacing limits.
    pub fn pacer(&self) -> &crate::transport::pacing::Pacer {
        &self.req.pacer
    }

    /// Send WQEs retired so far (completed, failed or flushed, signaled or not): with a count
    /// of posts, the number still in the send queue.
    pub fn retired_sends(&self) -> u64 {
        self.req.retired()
    }

    /// Bytes of state this QP holds beyond its fixed struct (queues and windows).
    pub fn state_bytes(&self) -> usize {
        std::mem::size_of::<RcQp<R>>() + self.req.heap_bytes() + self.resp.heap_bytes()
    }

    /// RESET -> INIT (receive WRs may be posted from now on).
    pub fn modify_to_init(&mut self) -> Result<(), ModifyError> {
        self.transition(&[QpState::Reset, QpState::Init], QpState::Init)
    }

    /// INIT -> RTR: connect to the remote QP; `rq_psn` is the first PSN expected from it.
    pub fn modify_to_rtr(&mut self, dest_qpn: u32, rq_psn: u32, cfg: RcConfig) -> Result<(), ModifyError> {
        self.transition(&[QpState::Init], QpState::Rtr)?;
        self.cfg = cfg;
        let alg = cfg.cc.build(&self.cc_env);
        let header = alg.as_ref().map(|a| a.header()).unwrap_or_default();
        if header.echo_in_ack {
            // per-packet feedback (HPCC's INT echo): every data packet is acknowledged
            self.cfg.ack_every = 1;
        }
        self.cc = CcSlot {
            traced: alg.as_ref().map(|a| a.traced()).unwrap_or_default(),
            header,
            alg,
            ..CcSlot::default()
        };
        self.dest_qpn = dest_qpn & MASK24;
        self.resp.reset_psn(rq_psn as u64 & MASK24 as u64);
        Ok(())
    }

    /// RTR -> RTS; `sq_psn` is the first PSN this QP sends.
    pub fn modify_to_rts(&mut self, sq_psn: u32) -> Result<(), ModifyError> {
        self.transition(&[QpState::Rtr], QpState::Rts)?;
        self.req.reset_psn(sq_psn as u64 & MASK24 as u64);
        Ok(())
    }

    /// Any state -> ERR: outstanding work requests complete with WR_FLUSH_ERR.
    pub fn modify_to_err(&mut self) {
        self.enter_error(QpErrorCause::Application);
    }

    /// Any state -> RESET: everything is dropped without completions (the count of errors
    /// stays: it is a counter).
    pub fn modify_to_reset(&mut self) {
        let qpn = self.qpn;
        let env = self.cc_env.clone();
        let errors = self.stats.qp_errors;
        let host_delay = self.req.paths.host_delay();
        *self = RcQp::new(qpn, self.pd, self.cfg);
        self.cc_env = env;
        self.stats.qp_errors = errors;
        // the host's delay is the driver's to say: a reset QP keeps what it was told
        self.req.paths.set_host_delay(host_delay);
    }

    fn transition(&mut self, from: &[QpState], to: QpState) -> Result<(), ModifyError> {
        if from.contains(&self.state) {
            self.state = to;
            Ok(())
        } else {
            Err(ModifyError { from: self.state, to })
        }
    }

    /// Queues a send work request. Its local memory is checked now; a bad lkey completes the
    /// WR with LOC_PROT_ERR when its turn comes.
    pub fn post_send(&mut self, wr: SendWr, mrs: &impl KeyTable<Region = R>) -> Result<(), PostError> {
        self.post_send_with_inline(wr, None, mrs)
    }

    /// [`RcQp::post_send`] for an INLINE WR whose payload was already copied out of the
    /// caller's memory (into the WQE slots of the engine's send queue).
    pub fn post_send_with_inline(
        &mut self,
        wr: SendWr,
        inline: Option<&[u8]>,
        mrs: &impl KeyTable<Region = R>,
    ) -> Result<(), PostError> {
        match self.state {
            QpState::Rts => {}
            QpState::Err => {
                // ibverbs: WRs posted to a QP in ERR complete with WR_FLUSH_ERR
                self.reject_send(&wr, WcStatus::WrFlushErr);
                return Ok(());
            }
            s => return Err(PostError::InvalidState(s)),
        }
        if self.req.outstanding() >= self.cfg.max_send_wr as usize {
            return Err(PostError::QueueFull(self.cfg.max_send_wr));
        }
        self.req.post(wr, inline, self.pd, &self.cfg, mrs)?;
        Requester::progress(self);
        Ok(())
    }

    /// Queues a receive work request.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        match self.state {
            QpState::Init | QpState::Rtr | QpState::Rts => {}
            QpState::Err => {
                self.push_completion(responder::flush_recv_wc(&wr, self.qpn, self.dest_qpn));
                return Ok(());
            }
            s => return Err(PostError::InvalidState(s)),
        }
        if self.resp.rq_len() >= self.cfg.max_recv_wr as usize {
            return Err(PostError::QueueFull(self.cfg.max_recv_wr));
        }
        self.resp.post(wr);
        Ok(())
    }

    /// Handles a received packet addressed to this QP (the caller has verified its ICRC).
    pub fn handle_packet(&mut self, now: u64, pkt: &PacketView<'_>, mrs: &impl KeyTable<Region = R>) {
        self.handle_packet_ecn(now, pkt, false, mrs)
    }

    /// [`RcQp::handle_packet`] with the ECN congestion-experienced bit of its IP header.
    pub fn handle_packet_ecn(&mut self, now: u64, pkt: &PacketView<'_>, ce: bool, mrs: &impl KeyTable<Region = R>) {
        self.handle_received(now, now, pkt, ce, mrs, false)
    }

    /// Where the payload of `pkt` belongs if it is the next expected packet of a WRITE whose
    /// first packet this QP accepted: go-back-N recovery, a middle or last WRITE packet at the
    /// expected PSN, of the length its place in the message needs. The range is the one the
    /// message's packets are checked against (R_Key, protection domain, bounds and access of the
    /// whole message, IBA 9.7.4.1.5); the region and the byte offset of this packet's payload in it.
    ///
    /// A driver may copy the payload there in the same pass that computes its ICRC, before it
    /// knows the packet is intact: the target of a WRITE is undefined until the WRITE completes
    /// (IBA 9.4.3), and a corrupt packet is dropped, so its PSN is sent and placed again. It then
    /// hands an intact packet to [`RcQp::handle_received`] with `placed`. Every other packet, including
    /// a first packet whose RETH names the range, is checked before a byte of it is placed.
    pub fn write_placement(&self, pkt: &PacketView<'_>, mrs: &impl KeyTable<Region = R>) -> Option<(Arc<R>, usize)> {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return None;
        }
        Responder::write_placement(self, pkt, mrs)
    }

    /// [`RcQp::handle_packet_ecn`] for a packet the host took in at `arrived` (the driver's
    /// receive timestamp on the engine clock; a later one counts as `now`), its payload already
    /// where [`RcQp::write_placement`] said or not (`placed`). The time it waited for this call
    /// is host delay, not network delay, to an algorithm that asks for it
    /// ([`crate::cc::HeaderSpec::host_delay`]).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_received(
        &mut self,
        now: u64,
        arrived: u64,
        pkt: &PacketView<'_>,
        ce: bool,
        mrs: &impl KeyTable<Region = R>,
        placed: bool,
    ) {
        let arrived = arrived.min(now);
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            self.stats.dropped_packets += 1;
            return;
        }
        if matches!(pkt.opcode, Opcode::Probe | Opcode::ProbeReply) {
            // liveness and address validation, not traffic: `rx_packets` says whether the peer
            // ever used the QP (a connection manager reaps those it never did)
            self.handle_probe(now, pkt);
            return;
        }
        self.stats.rx_packets += 1;
        let bytes = (pkt.payload.len() + 16) as u32;
        let t = self.cc.traced;
        // an ACK's host-delay report is the last 4 bytes of its CC header; the algorithm sees
        // the rest, and the report plus this host's wait
        let (cc_hdr, host_delay_ns) = match pkt.cc.len().checked_sub(HOST_DELAY_LEN) {
            Some(n) if self.cc.header.host_delay && pkt.opcode == Opcode::Acknowledge => {
                let remote = u32::from_be_bytes(pkt.cc[n..].try_into().unwrap_or_default());
                (&pkt.cc[..n], Some(remote as u64 + (now - arrived)))
            }
            _ => (pkt.cc, None),
        };
        let meta = |kind, payload, rtt_ns| RxMeta {
            kind,
            bytes,
            payload,
            ce,
            rtt_ns,
            host_delay_ns,
            cc: cc_hdr,
        };
        match pkt.opcode {
            Opcode::Cnp => {
                self.stats.cnps_received += 1;
                if t.rx_cnp {
                    let out = self.cc_event(now, |a, now, out| a.on_rx(now, &meta(RxKind::Cnp, 0, None), out));
                    // the CNP carries the arrival time of the CE mark (hosts share the clock)
                    let ce_at = pkt
                        .trailer
                        .get(..8)
                        .map_or(0, |b| u64::from_be_bytes(b.try_into().unwrap_or_default()));
                    if out.rate.is_some() && ce_at != 0 && ce_at <= now && self.cc.loop_samples.len() < MAX_LOOP_SAMPLES
                    {
                        self.cc.loop_samples.push((now - ce_at).min(u32::MAX as u64) as u32);
                    }
                }
                return;
            }
            Opcode::Grant => {
                self.stats.grants_received += 1;
                if t.rx_grant {
                    self.cc_event(now, |a, now, out| a.on_rx(now, &meta(RxKind::Grant, 0, None), out));
                }
                return;
            }
            _ => {}
        }
        let una = self.req.una();
        if pkt.opcode.is_request() {
            self.rx_path = pkt.bth.path;
            self.cc.rx_arrived = arrived;
            if self.cc.header.echo_in_ack && !pkt.cc.is_empty() {
                self.cc.echo.clear();
                self.cc.echo.extend_from_slice(pkt.cc);
            }
            Responder::handle(self, now, pkt, mrs, placed);
        } else if self.state == QpState::Rts {
            self.req.rtt_sample = None;
            Requester::handle(self, now, pkt);
            // losses found by this ACK may condemn a path
            self.check_paths(now);
        } else {
            self.stats.dropped_packets += 1;
        }
        // congestion control sees the packet after the transport (an ACK's RTT sample is known)
        if t.rx_data && pkt.opcode.is_request() && !pkt.payload.is_empty() && t.data_opcodes.admits(pkt.opcode as u8) {
            let n = pkt.payload.len() as u32;
            self.cc_event(now, |a, now, out| a.on_rx(now, &meta(RxKind::Data, n, None), out));
        } else if t.rx_ack && matches!(pkt.opcode, Opcode::Acknowledge | Opcode::AtomicAcknowledge) {
            let rtt = self.req.rtt_sample.take();
            let acked = (self.req.una().saturating_sub(una) * self.cfg.mtu as u64).min(u32::MAX as u64) as u32;
            self.cc_event(now, |a, now, out| a.on_rx(now, &meta(RxKind::Ack, acked, rtt), out));
        }
    }

    /// Next packet to send, if any. Generated CC packets and responses (read data, atomics,
    /// NAKs, ACKs) go first; the requester's data packets pass the CC TX function's verdict.
    pub fn poll_transmit(&mut self, now: u64) -> Option<crate::transport::TxPacket<R>> {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return None;
        }
        let mut p = self.gated_transmit(now)?;
        p.hdr.set_path(p.path);
        Some(p)
    }

    fn next_packet(&mut self, now: u64) -> Option<crate::transport::TxPacket<R>> {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return None;
        }
        if let Some(ce_at) = self.cc.cnp_pending.take() {
            self.stats.cnps_sent += 1;
            self.stats.tx_packets += 1;
            let mut bth = Bth::new(Opcode::Cnp as u8, self.dest_qpn, 0);
            bth.becn = true;
            let mut hdr = HeaderBuf::with_bth(&bth);
            // 16 reserved bytes; flexns puts the CE arrival time in the first 8
            hdr.push_u32((ce_at >> 32) as u32).push_u32(ce_at as u32).push_zeros(8);
            return Some(crate::transport::TxPacket {
                path: self.rx_path,
                hdr,
                payload: Default::default(),
            });
        }
        if let Some(g) = self.cc.grant_pending.take() {
            self.stats.grants_sent += 1;
            self.stats.tx_packets += 1;
            let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::Grant as u8, self.dest_qpn, 0));
            let mut b = [0u8; GrantHdr::LEN];
            g.emit(&mut b);
            hdr.insert_cc(&b);
            return Some(crate::transport::TxPacket {
                path: self.rx_path,
                hdr,
                payload: Default::default(),
            });
        }
        if let Some(p) = self.poll_probe() {
            return Some(p);
        }
        if let Some(mut p) = Responder::poll_transmit(self, now) {
            self.stats.tx_packets += 1;
            p.path = self.rx_path;
            if p.hdr.bth().opcode == Opcode::Acknowledge as u8 {
                self.insert_ack_cc(now, &mut p.hdr);
            }
            return Some(p);
        }
        if self.state != QpState::Rts {
            return None;
        }
        if !self.cc.started && self.cc.alg.is_some() {
            // the algorithm's initial rate and window apply from the first packet on, whatever
            // events it traces (a window-based one that only sees ACKs would start too late)
            self.cc_event(now, |_, _, _| {});
        }
        if self.cc.stash.is_some() {
            // a packet the TX function deferred or held: ask again once it may go
            if self.cc.held || self.cc.defer_until.is_some_and(|t| t > now) {
                return None;
            }
            let (mut pkt, meta) = self.cc.stash.take()?;
            self.cc.defer_until = None;
            if !self.cc_verdict(now, &meta) {
                self.cc.stash = Some((pkt, meta));
                return None;
            }
            self.finish_data(now, &mut pkt, &meta);
            return Some(pkt);
        }
        let mut pkt = Requester::poll_transmit(self, now)?;
        let Some(meta) = self.req.last_meta.take() else {
            self.stats.tx_packets += 1;
            return Some(pkt);
        };
        if !self.cc_verdict(now, &meta) {
            self.cc.stash = Some((pkt, meta));
            return None;
        }
        self.finish_data(now, &mut pkt, &meta);
        Some(pkt)
    }

    /// Runs the TX function on a data packet (if the algorithm traces them): whether it may
    /// leave now. A deferred or held packet is counted and remembered by the caller.
    fn cc_verdict(&mut self, now: u64, meta: &crate::cc::TxMeta) -> bool {
        if !self.cc.traced.tx_data || !self.cc.traced.data_opcodes.admits(meta.opcode) {
            return true;
        }
        let Some(alg) = self.cc.alg.as_deref_mut() else {
            return true;
        };
        // the per-packet path: apply only what the TX function changed
        let mut out = CcOutput::default();
        let verdict = alg.on_tx(now, meta, &mut out);
        self.cc.held = false;
        if out != CcOutput::default() {
            self.apply_cc(now, out);
        }
        match verdict {
            Verdict::Send => return true,
            Verdict::DeferUntil(t) => self.cc.defer_until = Some(t),
            Verdict::Hold => self.cc.held = true,
        }
        self.stats.cc_deferred += 1;
        false
    }

    /// Adds the algorithm's CC header to a data packet that leaves.
    fn finish_data(&mut self, now: u64, pkt: &mut crate::transport::TxPacket<R>, meta: &crate::cc::TxMeta) {
        self.stats.tx_packets += 1;
        let n = self.cc.header.data_bytes as usize;
        if n > 0 {
            if let Some(alg) = self.cc.alg.as_deref_mut() {
                let mut b = [0u8; MAX_CC_HDR_LEN];
                alg.write_header(now, meta, &mut b[..n]);
                pkt.hdr.insert_cc(&b[..n]);
            }
        }
    }

    /// An ACK's CC header: the echo of the latest data packet's, then, with
    /// [`crate::cc::HeaderSpec::host_delay`], how long that packet has waited here since the
    /// host took it in (ns, saturating at `u32::MAX`).
    fn insert_ack_cc(&self, now: u64, hdr: &mut crate::wire::HeaderBuf) {
        if !self.cc.header.host_delay {
            if !self.cc.echo.is_empty() {
                hdr.insert_cc(&self.cc.echo);
            }
            return;
        }
        let mut b = [0u8; MAX_CC_HDR_LEN];
        let n = self.cc.echo.len().min(MAX_CC_HDR_LEN - HOST_DELAY_LEN);
        b[..n].copy_from_slice(&self.cc.echo[..n]);
        let held = now.saturating_sub(self.cc.rx_arrived).min(u32::MAX as u64) as u32;
        b[n..n + HOST_DELAY_LEN].copy_from_slice(&held.to_be_bytes());
        hdr.insert_cc(&b[..n + HOST_DELAY_LEN]);
    }

    /// Runs `alg`, an algorithm of the caller's (not one of [`crate::cc::CcKind`]'s), on this QP
    /// from now on, replacing the configured one. Call it after RTR; the peer must run a
    /// matching receiving half (or none, for an algorithm that needs no receiver).
    pub fn install_cc(&mut self, alg: Box<dyn CcAlgorithm>) {
        self.cc = CcSlot {
            traced: alg.traced(),
            header: alg.header(),
            alg: Some(alg),
            ..CcSlot::default()
        };
        if self.cc.header.echo_in_ack {
            self.cfg.ack_every = 1;
        }
    }

    /// The reason congestion control stopped this QP, if it did (e.g. HPCC on a path without
    /// INT telemetry).
    pub fn cc_fault(&self) -> Option<&'static str> {
        self.cc.fault
    }

    /// Takes the control-loop delay samples collected so far (ns from a CE mark's arrival at the
    /// receiver to the rate change its CNP caused here).
    pub fn take_control_loop_samples(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.cc.loop_samples)
    }

    /// Whether [`RcQp::poll_transmit`] may return a packet now.
    pub fn wants_transmit(&self, now: u64) -> bool {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return false;
        }
        if self.challenge_pending(now) || self.challenge_reply_pending() || self.gate_ready() {
            return true;
        }
        if self.gate_closed() {
            return false;
        }
        self.cc.cnp_pending.is_some()
            || self.cc.grant_pending.is_some()
            || self.probe_pending()
            || self.resp.wants_transmit(now)
            || (self.state == QpState::Rts && self.requester_ready(now))
    }

    fn requester_ready(&self, now: u64) -> bool {
        if self.cc.stash.is_some() {
            !self.cc.held && self.cc.defer_until.is_none_or(|t| t <= now)
        } else {
            self.req.wants_transmit(now, &self.cfg)
        }
    }

    /// How long this QP's host has lately kept packets waiting (its driver measures it),
    /// added to the ACK timeout and to each path's RTO: a
    /// retry is spent on a peer that did not answer, not on a host whose threads waited for a
    /// core. Deadlines already armed keep theirs (see [`crate::path::PathSet::set_host_delay`]).
    pub fn set_host_delay(&mut self, ns: u64) {
        self.req.paths.set_host_delay(ns);
    }

    /// The earliest time at which [`RcQp::handle_timeout`] has work to do.
    pub fn poll_timeout(&self) -> Option<u64> {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return None;
        }
        let paths = if self.state == QpState::Rts {
            self.req.paths.next_deadline()
        } else {
            None
        };
        [
            paths,
            self.req.deadline(),
            self.resp.deadline(),
            self.cc.timer,
            self.cc.defer_until,
            self.challenge_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs expired timers (retransmission, RNR wait, delayed ACK).
    pub fn handle_timeout(&mut self, now: u64) {
        if !matches!(self.state, QpState::Rtr | QpState::Rts) {
            return;
        }
        self.resp.handle_timeout(now);
        if self.cc.timer.is_some_and(|t| t <= now) {
            self.cc.timer = None;
            self.cc_event(now, |a, now, out| a.on_timer(now, out));
        }
        if self.state == QpState::Rts {
            self.check_paths(now);
            let timeouts = self.stats.timeouts;
            Requester::handle_timeout(self, now);
            if self.stats.timeouts > timeouts && self.cc.traced.timeout {
                self.cc_event(now, |a, now, out| a.on_rx(now, &RxMeta::plain(RxKind::Timeout, 0), out));
            }
        }
    }

    /// The next work completion, left in place.
    pub fn peek_completion(&self) -> Option<Wc> {
        self.completions.front().copied()
    }

    /// Next work completion.
    pub fn poll_completion(&mut self) -> Option<Wc> {
        self.completions.pop_front()
    }

    /// Whether completions are waiting.
    pub fn has_completions(&self) -> bool {
        !self.completions.is_empty()
    }

    /// Runs a congestion-control event (starting the algorithm first if needed), applies its
    /// output (pacing rate and window, timer, generated packet, fault) and returns it. Any event
    /// releases a packet the TX function held, so it is asked again.
    fn cc_event(&mut self, now: u64, f: impl FnOnce(&mut dyn CcAlgorithm, u64, &mut CcOutput)) -> CcOutput {
        let mtu = self.cfg.mtu;
        let Some(alg) = self.cc.alg.as_deref_mut() else {
            return CcOutput::default();
        };
        let mut out = CcOutput::default();
        if !self.cc.started {
            self.cc.started = true;
            alg.on_start(now, &StartInfo { mtu }, &mut out);
            self.apply_cc(now, out);
            out = CcOutput::default();
        }
        let Some(alg) = self.cc.alg.as_deref_mut() else {
            return out;
        };
        f(alg, now, &mut out);
        self.cc.held = false;
        if out != CcOutput::default() {
            self.apply_cc(now, out);
        }
        out
    }

    fn apply_cc(&mut self, now: u64, out: CcOutput) {
        if let Some(r) = out.rate {
            // the burst (by default one engine transmit batch) keeps batches and their GSO
            // messages whole; the rate stays exact over time either way
            self.req.pacer.set_rate(r, self.cfg.pacing_burst as u64);
        }
        if let Some(w) = out.window {
            self.req.pacer.set_window(w);
        }
        if let Some(t) = out.timer {
            self.cc.timer = Some(t);
        }
        match out.generate {
            Some(Generate::Cnp) => self.cc.cnp_pending = Some(now),
            Some(Generate::Grant { offset, prio }) => self.cc.grant_pending = Some(GrantHdr { offset, prio }),
            Some(Generate::Ack) => self.resp.ack_now(),
            None => {}
        }
        if let Some(reason) = out.fault {
            if self.cc.fault.is_none() {
                tracing::warn!(qpn = self.qpn, cc = self.cc_info().map_or("", |c| c.0), "{reason}");
                self.cc.fault = Some(reason);
                self.enter_error(QpErrorCause::CongestionControl);
            }
        }
    }

    /// The congestion-control algorithm's name and per-QP context bytes, if one runs.
    pub fn cc_info(&self) -> Option<(&'static str, usize)> {
        self.cc.alg.as_ref().map(|a| (a.name(), a.context_bytes()))
    }

    fn push_completion(&mut self, wc: Wc) {
        self.completions.push_back(wc);
    }

    fn enter_error(&mut self, cause: QpErrorCause) {
        if self.state == QpState::Err {
            return;
        }
        if cause == QpErrorCause::Application {
            tracing::debug!(
                qpn = self.qpn,
                dest_qpn = self.dest_qpn,
                "QP moved to ERR by the application"
            );
        } else {
            tracing::warn!(
                qpn = self.qpn,
                dest_qpn = self.dest_qpn,
                cause = cause.label(),
                "QP entered the error state"
            );
        }
        self.error_cause = Some(cause);
        self.stats.qp_errors[cause as usize] += 1;
        self.state = QpState::Err;
        self.cc.stash = None;
        let (qpn, dq) = (self.qpn, self.dest_qpn);
        for wc in self.req.flush(qpn, dq) {
            self.completions.push_back(wc);
        }
        for wc in self.resp.flush(qpn, dq) {
            self.completions.push_back(wc);
        }
    }

    fn complete_error(&mut self, wc: Wc) {
        debug_assert_ne!(wc.status, WcStatus::Success);
        let cause = QpErrorCause::of_status(wc.status);
        self.completions.push_back(wc);
        self.enter_error(cause);
    }
}
