//! Per-packet programmable congestion control (SwCC's model, in software).
//!
//! An algorithm is a TX function, an RX function and a timer function over a per-QP context
//! (the algorithm value itself, budget 128 bytes, see [`CcAlgorithm::context_bytes`]). The three
//! are separate so an engine may run them on different cores. Each algorithm declares which
//! packets raise events ([`Traced`], SwCC's selective triggering); an event's effects come back
//! as a [`CcOutput`]: a new pacing rate or window for the QP's pacer, the next timer, and a
//! packet to generate (a CNP for DCQCN). The transport applies them; algorithms never touch
//! packets or clocks themselves, so the same code runs in the engine and in the simulator.

pub mod dcqcn;
pub mod timely;

/// Which events an algorithm wants (selective triggering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traced {
    /// Every data packet the QP sends (SEND/WRITE/READ-response payload).
    pub tx_data: bool,
    /// Every data packet the QP receives (the notification point: ECN marks arrive here).
    pub rx_data: bool,
    /// ACKs the QP receives (delay- or INT-based algorithms).
    pub rx_ack: bool,
    /// Congestion notification packets the QP receives.
    pub rx_cnp: bool,
}

/// A received packet as congestion control sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta {
    pub kind: RxKind,
    /// Bytes of the packet above UDP.
    pub bytes: u32,
    /// The IP header carried ECN CE (congestion experienced).
    pub ce: bool,
    /// For an ACK: the round-trip time of the packet it acknowledges (none when that packet was
    /// retransmitted).
    pub rtt_ns: Option<u64>,
}

/// What kind of packet arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxKind {
    Data,
    Ack,
    Cnp,
}

/// A packet an algorithm asks the transport to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generate {
    /// A RoCEv2 congestion notification packet to the peer QP.
    Cnp,
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
    pub generate: Option<Generate>,
}

/// A congestion-control algorithm: a per-QP context with TX, RX and timer functions.
pub trait CcAlgorithm: Send + std::fmt::Debug {
    /// The name `--cc` selects it by.
    fn name(&self) -> &'static str;
    /// Which packets raise events.
    fn traced(&self) -> Traced;
    /// Bytes of extensible CC header this algorithm carries after the BTH (0 for DCQCN).
    fn header_bytes(&self) -> usize {
        0
    }
    /// The QP starts sending (connected): initial rate, window and timer.
    fn on_start(&mut self, now: u64, out: &mut CcOutput);
    /// A traced packet of `bytes` is being sent.
    fn on_tx(&mut self, now: u64, bytes: u32, out: &mut CcOutput);
    /// A traced packet arrived.
    fn on_rx(&mut self, now: u64, pkt: &RxMeta, out: &mut CcOutput);
    /// The timer this algorithm asked for expired.
    fn on_timer(&mut self, now: u64, out: &mut CcOutput);
    /// Bytes of per-QP context (the budget is 128).
    fn context_bytes(&self) -> usize;
}

/// The algorithm a QP runs, as configured (per QP, selectable at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CcKind {
    #[default]
    None,
    Dcqcn,
    Timely,
}

impl CcKind {
    /// A fresh per-QP context, or `None` for no congestion control.
    pub fn build(self) -> Option<Box<dyn CcAlgorithm>> {
        match self {
            CcKind::None => None,
            CcKind::Dcqcn => Some(Box::new(dcqcn::Dcqcn::new(std::sync::Arc::new(
                dcqcn::DcqcnParams::default(),
            )))),
            CcKind::Timely => Some(Box::new(timely::Timely::new(std::sync::Arc::new(
                timely::TimelyParams::default(),
            )))),
        }
    }
}

impl std::str::FromStr for CcKind {
    type Err = String;
    fn from_str(s: &str) -> Result<CcKind, String> {
        match s {
            "none" | "off" => Ok(CcKind::None),
            "dcqcn" => Ok(CcKind::Dcqcn),
            "timely" => Ok(CcKind::Timely),
            o => Err(format!("unknown congestion control {o:?}: use none, dcqcn or timely")),
        }
    }
}
