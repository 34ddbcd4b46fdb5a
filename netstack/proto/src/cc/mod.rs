//! Per-packet programmable congestion control (SwCC's model, in software).
//!
//! An algorithm is a TX function, an RX function and a timer function over a per-QP context
//! (the algorithm value itself, budget 128 bytes, see [`CcAlgorithm::context_bytes`]). The
//! functions are separate so an engine may run them on different cores:
//!
//! - **TX** ([`CcAlgorithm::on_tx`]) sees each traced data packet before it leaves and returns a
//!   [`Verdict`]: send now, defer until a time, or hold until an RX event or timer (SwCC's
//!   `LoopBack`, the credit wait of receiver-driven schemes). It may write the packet's
//!   congestion-control header ([`CcAlgorithm::write_header`]).
//! - **RX** ([`CcAlgorithm::on_rx`]) sees each traced arriving packet ([`RxMeta`]: kind, size,
//!   ECN CE, RTT sample, the CC header) and may generate a packet ([`Generate`]: CNP, GRANT or
//!   an immediate ACK).
//! - **Timer** ([`CcAlgorithm::on_timer`]) runs when the algorithm's timer expires.
//!
//! Each event's effects come back as a [`CcOutput`]: a new pacing rate or window for the QP's
//! pacer, the next timer, a packet to generate. SwCC's "done" is an event whose output is empty.
//! Algorithms declare which packets raise events ([`Traced`], selective triggering) and how
//! many bytes of CC header their data packets carry after the BTH ([`HeaderSpec`], 0–64 bytes,
//! negotiated per QP when it connects). Algorithms never touch packets or clocks themselves, so
//! the same code runs in the engine and in the simulator.

pub mod dcqcn;
pub mod header;
pub mod homa;
pub mod hpcc;
pub mod params;
pub mod swift;
pub mod timely;

pub use params::CcParams;

/// A set of RC opcodes (bit `n` for opcode `n`, 0x00..=0x1F).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpcodeSet(pub u32);

impl OpcodeSet {
    /// The given opcodes.
    pub fn of(ops: &[crate::wire::Opcode]) -> OpcodeSet {
        OpcodeSet(
            ops.iter()
                .filter(|&&o| (o as u8) < 32)
                .fold(0, |m, &o| m | 1 << (o as u8)),
        )
    }
    /// Whether `op` is in the set; the empty set stands for every opcode.
    pub fn admits(self, op: u8) -> bool {
        self.0 == 0 || (op < 32 && self.0 & (1 << op) != 0)
    }
}

/// Which events an algorithm wants (selective triggering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traced {
    /// Every data packet the QP sends (SEND/WRITE payload): the TX function and its verdict.
    pub tx_data: bool,
    /// Every data packet the QP receives (the notification point: ECN marks arrive here).
    pub rx_data: bool,
    /// ACKs the QP receives (delay- or INT-based algorithms).
    pub rx_ack: bool,
    /// Congestion notification packets the QP receives.
    pub rx_cnp: bool,
    /// Credit grants the QP receives.
    pub rx_grant: bool,
    /// Retransmission timeouts of the QP's requester.
    pub timeout: bool,
    /// The data opcodes that raise `tx_data` and `rx_data` events (empty: all of them), e.g.
    /// only the last packet of each message.
    pub data_opcodes: OpcodeSet,
}

/// The congestion-control header an algorithm's QPs carry after the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderSpec {
    /// Bytes on every data packet the QP sends (a multiple of 4, at most 64; 0 = none).
    pub data_bytes: u8,
    /// The responder copies the CC header of the latest data packet into its ACKs (HPCC's INT
    /// echo).
    pub echo_in_ack: bool,
    /// The responder reports in each ACK how long the packet it answers waited at its host (from
    /// the kernel's receive timestamp to the ACK leaving: scheduling, ACK coalescing), 4 bytes
    /// at the end of the ACK's CC header; the requester adds its own wait and hands the sum to
    /// the algorithm as [`RxMeta::host_delay_ns`] (Swift's endpoint delay, which its NIC
    /// timestamps measure).
    pub host_delay: bool,
}

/// A data packet as the TX function sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxMeta {
    /// Its BTH opcode.
    pub opcode: u8,
    /// Bytes of the packet above UDP.
    pub bytes: u32,
    /// Payload bytes.
    pub payload: u32,
    /// First packet of a message (FIRST or ONLY).
    pub first: bool,
    /// Bytes of the message this packet belongs to.
    pub msg_bytes: u64,
    /// Payload bytes of the message after this packet.
    pub msg_remaining: u64,
    /// A retransmission.
    pub retransmit: bool,
}

/// The TX function's decision for a packet (SwCC's verdicts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Send it now.
    Send,
    /// Not before this time (ns): the packet waits, the QP asks again then.
    DeferUntil(u64),
    /// Wait for the next RX event or timer of this algorithm, then ask again (SwCC's LoopBack;
    /// a credit-based sender without credit).
    Hold,
}

/// A received packet as congestion control sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta<'a> {
    /// What arrived.
    pub kind: RxKind,
    /// Bytes of the packet above UDP.
    pub bytes: u32,
    /// Payload bytes (data packets).
    pub payload: u32,
    /// The IP header carried ECN CE (congestion experienced).
    pub ce: bool,
    /// For an ACK: the round-trip time of the packet it acknowledges (none when that packet was
    /// retransmitted).
    pub rtt_ns: Option<u64>,
    /// For an ACK, with [`HeaderSpec::host_delay`]: how much of `rtt_ns` the packet and its ACK
    /// spent waiting at the two hosts rather than in the network: at the responder from its
    /// arrival to the ACK's transmission, and here from the ACK's arrival to this event.
    pub host_delay_ns: Option<u64>,
    /// The packet's congestion-control header (empty when it carries none).
    pub cc: &'a [u8],
}

impl<'a> RxMeta<'a> {
    /// A packet of `kind` with no header, CE mark or RTT sample.
    pub fn plain(kind: RxKind, bytes: u32) -> RxMeta<'a> {
        RxMeta {
            kind,
            bytes,
            payload: 0,
            ce: false,
            rtt_ns: None,
            host_delay_ns: None,
            cc: &[],
        }
    }
}

/// What kind of packet arrived (or, for `Timeout`, what happened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxKind {
    /// A data packet (the receiver's side).
    Data,
    /// An acknowledgement of this QP's data.
    Ack,
    /// A RoCEv2 congestion notification packet.
    Cnp,
    /// A credit grant (Homa).
    Grant,
    /// The requester's retransmission timer fired.
    Timeout,
}

/// A packet an algorithm asks the transport to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generate {
    /// A RoCEv2 congestion notification packet to the peer QP.
    Cnp,
    /// A credit grant: the peer may send data up to byte `offset` of this QP's stream, with
    /// priority `prio` (0 = highest).
    Grant {
        /// The stream byte the peer may send up to.
        offset: u64,
        /// The priority of its scheduled packets.
        prio: u8,
    },
    /// An ACK now, without waiting for the coalescing threshold.
    Ack,
}

/// The effects of one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CcOutput {
    /// New pacing rate in bytes per second (`Some(None)` lifts the limit).
    pub rate: Option<Option<u64>>,
    /// New in-flight window in bytes (`Some(None)` lifts it).
    pub window: Option<Option<u64>>,
    /// When to call [`CcAlgorithm::on_timer`] next (replaces the previous timer).
    pub timer: Option<u64>,
    /// A packet to send now.
    pub generate: Option<Generate>,
    /// The algorithm cannot run on this path (HPCC without INT telemetry): the transport stops
    /// the QP with this reason rather than let it guess.
    pub fault: Option<&'static str>,
}

/// What a QP tells its algorithm when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartInfo {
    /// Path MTU in bytes.
    pub mtu: u32,
}

/// A congestion-control algorithm: a per-QP context with TX, RX and timer functions.
pub trait CcAlgorithm: Send + std::fmt::Debug {
    /// The name `--cc` selects it by.
    fn name(&self) -> &'static str;
    /// Which packets raise events.
    fn traced(&self) -> Traced;
    /// The CC header this algorithm's data packets carry.
    fn header(&self) -> HeaderSpec {
        HeaderSpec::default()
    }
    /// The QP starts sending (connected): initial rate, window and timer.
    fn on_start(&mut self, now: u64, info: &StartInfo, out: &mut CcOutput);
    /// TX function: a traced data packet is ready to leave (rate- and window-based algorithms
    /// that only pace need not trace these: the pacer defers their packets).
    fn on_tx(&mut self, _now: u64, _pkt: &TxMeta, _out: &mut CcOutput) -> Verdict {
        Verdict::Send
    }
    /// Fills the CC header (`header().data_bytes` long, zeroed) of a data packet about to leave.
    fn write_header(&mut self, _now: u64, _pkt: &TxMeta, _hdr: &mut [u8]) {}
    /// RX function: a traced packet arrived.
    fn on_rx(&mut self, now: u64, pkt: &RxMeta<'_>, out: &mut CcOutput);
    /// The timer this algorithm asked for expired.
    fn on_timer(&mut self, _now: u64, _out: &mut CcOutput) {}
    /// Bytes of per-QP context (the budget is 128).
    fn context_bytes(&self) -> usize {
        std::mem::size_of_val(self)
    }
}

/// What the QPs of one host share: the parameters and Homa's receiver scheduler.
#[derive(Debug)]
pub struct CcEnv {
    /// Every algorithm's parameters.
    pub params: SharedParams,
    /// Homa's receiver-side SRPT ranking of the host's inbound messages.
    pub homa: std::sync::Arc<dyn homa::SrptRanking>,
}

/// The parameters behind `Arc`s, so each QP's context holds a pointer rather than a copy.
#[derive(Debug, Clone)]
pub struct SharedParams {
    /// DCQCN's.
    pub dcqcn: std::sync::Arc<params::DcqcnParams>,
    /// TIMELY's.
    pub timely: std::sync::Arc<params::TimelyParams>,
    /// HPCC's.
    pub hpcc: std::sync::Arc<params::HpccParams>,
    /// Swift's.
    pub swift: std::sync::Arc<params::SwiftParams>,
    /// Homa's.
    pub homa: std::sync::Arc<params::HomaParams>,
}

impl CcEnv {
    /// The shared state of a host's QPs for parameters `p`, with Homa's ranking `homa`.
    pub fn new(p: &CcParams, homa: std::sync::Arc<dyn homa::SrptRanking>) -> std::sync::Arc<CcEnv> {
        std::sync::Arc::new(CcEnv {
            params: SharedParams {
                dcqcn: std::sync::Arc::new(p.dcqcn.clone()),
                timely: std::sync::Arc::new(p.timely.clone()),
                hpcc: std::sync::Arc::new(p.hpcc.clone()),
                swift: std::sync::Arc::new(p.swift.clone()),
                homa: std::sync::Arc::new(p.homa.clone()),
            },
            homa,
        })
    }

    /// The defaults, with a Homa ranking shared with no other QP ([`homa::Unshared`]).
    pub fn default_env() -> std::sync::Arc<CcEnv> {
        CcEnv::new(&CcParams::default(), std::sync::Arc::new(homa::Unshared))
    }
}

/// The algorithm a QP runs, as configured (per QP, selectable at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CcKind {
    /// No congestion control: the window and rate are the transport's own.
    #[default]
    None,
    /// DCQCN (ECN marks, CNPs, rate-based).
    Dcqcn,
    /// TIMELY (RTT gradient, rate-based).
    Timely,
    /// HPCC (in-band network telemetry, window-based).
    Hpcc,
    /// Swift (delay target, window-based).
    Swift,
    /// Homa (receiver-driven grants, SRPT).
    Homa,
}

impl CcKind {
    /// Every algorithm (and `None`).
    pub const ALL: [CcKind; 6] = [
        CcKind::None,
        CcKind::Dcqcn,
        CcKind::Timely,
        CcKind::Hpcc,
        CcKind::Swift,
        CcKind::Homa,
    ];

    /// A fresh per-QP context with the parameters of `env`, or `None` for no congestion
    /// control.
    pub fn build(self, env: &std::sync::Arc<CcEnv>) -> Option<Box<dyn CcAlgorithm>> {
        let p = &env.params;
        Some(match self {
            CcKind::None => return None,
            CcKind::Dcqcn => Box::new(dcqcn::Dcqcn::new(p.dcqcn.clone())),
            CcKind::Timely => Box::new(timely::Timely::new(p.timely.clone())),
            CcKind::Hpcc => Box::new(hpcc::Hpcc::new(p.hpcc.clone())),
            CcKind::Swift => Box::new(swift::Swift::new(p.swift.clone())),
            CcKind::Homa => Box::new(homa::Homa::new(p.homa.clone(), env.homa.clone())),
        })
    }

    /// The name `--cc` selects it by.
    pub fn name(self) -> &'static str {
        match self {
            CcKind::None => "none",
            CcKind::Dcqcn => "dcqcn",
            CcKind::Timely => "timely",
            CcKind::Hpcc => "hpcc",
            CcKind::Swift => "swift",
            CcKind::Homa => "homa",
        }
    }
}

impl std::fmt::Display for CcKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CcKind {
    type Err = String;
    fn from_str(s: &str) -> Result<CcKind, String> {
        if s == "off" {
            return Ok(CcKind::None);
        }
        CcKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown congestion control {s:?}: use none, dcqcn, timely, hpcc, swift or homa"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_context_fits_the_budget_and_names_round_trip() {
        let env = CcEnv::default_env();
        for k in CcKind::ALL {
            assert_eq!(k.name().parse::<CcKind>(), Ok(k));
            let Some(a) = k.build(&env) else {
                assert_eq!(k, CcKind::None);
                continue;
            };
            eprintln!("{k}: {} bytes of per-QP context", a.context_bytes());
            assert!(a.context_bytes() <= 128, "{k}: {}", a.context_bytes());
            assert_eq!(a.name(), k.name());
            assert!(a.header().data_bytes as usize <= crate::wire::MAX_CC_HDR_LEN);
            assert_eq!(a.header().data_bytes % 4, 0);
        }
        assert!("reno".parse::<CcKind>().is_err());
    }
}
