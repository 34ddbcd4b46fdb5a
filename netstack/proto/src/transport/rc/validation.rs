//! Peer address validation: a QP serves its peer in full only after the peer has shown that it
//! receives at the addresses the QP sends to (RFC 9000 §8's rule for QUIC, in RC's terms).
//!
//! Whoever sets up a QP names the peer's addresses (over the connection manager, for
//! instance), and nothing there proves that the peer owns them: a caller could name a victim
//! and have the QP's READ responses, hundreds of megabytes for one request, sent there. So a
//! QP whose driver asks for it ([`RcQp::require_validation`]) sends each of its routes (here:
//! each address of the peer it sends to, numbered by the driver, 0 the main one) a
//! *challenge*: a PROBE packet whose PSN field carries [`CHALLENGE`] and the route's index
//! ([`challenge_route`]), and
//! whose trailer carries a 64-bit nonce the driver drew at random for that route. A flexns
//! peer echoes a probe's PSN field and trailer in its PROBE_REPLY; the reply carrying the
//! right nonce proves that the peer received what was sent to that route (an attacker who
//! named a victim never sees the nonce).
//!
//! Until route 0 (the peer's main address) is validated, everything the QP sends other than
//! its timed challenges counts against an allowance of three times the bytes it received from the
//! peer (the driver credits them, [`RcQp::credit_received`]); a packet that does not fit waits
//! (it is not lost) until more arrives or the route is validated. The driver applies the same
//! allowance to packets it would send on any other route not validated yet
//! ([`RcQp::spend_unvalidated`]). Challenges go out when the QP reaches RTR, again with
//! exponential backoff while unanswered (a peer not yet in RTR drops the first), and at once
//! when a packet arrives from the peer and the latest challenge is older than
//! [`RECHALLENGE_NS`]; each is as small as the packet that can trigger it.

use super::RcQp;
use crate::memory::SharedRegion;
use crate::transport::TxPacket;
use crate::wire::{Bth, HeaderBuf, Opcode, PacketView};

/// Bit of a PROBE's PSN field that marks a challenge (path probes carry a path index below it).
pub const CHALLENGE: u32 = 0x80_0000;

/// The route (peer address) a challenge's PSN field names.
pub fn challenge_route(psn: u32) -> usize {
    (psn & !CHALLENGE) as usize
}

/// Bytes of a challenge's nonce (the probe's trailer).
pub const NONCE_LEN: usize = 8;

/// Bytes of a challenge on the wire: BTH, nonce, ICRC.
const CHALLENGE_LEN: usize = 12 + NONCE_LEN + 4;

/// How many times the received bytes a QP may send to a peer not validated yet.
pub const AMPLIFICATION: u64 = 3;

/// First wait before a challenge is sent again; it doubles up to [`MAX_BACKOFF_NS`].
const FIRST_BACKOFF_NS: u64 = 500_000;
/// Longest wait between timed challenges.
const MAX_BACKOFF_NS: u64 = 100_000_000;
/// Timed challenges per route of a QP whose peer chose the addresses ([`Chooser::Remote`])
/// before it stops sending them on a timer (a packet from the peer still triggers one); all
/// but the first are paid from the allowance.
const MAX_TIMED_TRIES: u32 = 24;
/// A packet from the peer triggers a new challenge if the latest is older than this.
pub const RECHALLENGE_NS: u64 = 200_000;

/// One route's challenge.
#[derive(Debug, Clone)]
struct Route {
    nonce: u64,
    validated: bool,
    /// When the next timed challenge is due (`None`: timed challenges are over).
    due: Option<u64>,
    last_sent: Option<u64>,
    tries: u32,
}

/// A QP's validation state: its routes' challenges, the allowance left, the packet waiting
/// for more of it.
#[derive(Debug)]
pub(super) struct Validation<R> {
    routes: Vec<Route>,
    /// Bytes the QP may still send before route 0 is validated.
    allowance: u64,
    /// A packet that did not fit the allowance, sent first once it does.
    gated: Option<TxPacket<R>>,
    /// Challenges to send now (route indexes), before anything else.
    now_due: Vec<u8>,
    /// Timed retries go unpaid, without end (addresses this side chose); otherwise only the
    /// first challenge does, and retries wait for the allowance.
    unpaid_retries: bool,
}

/// Who named the peer's addresses a QP validates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chooser {
    /// This side did (it connected to a peer it chose, with the addresses that peer's
    /// connection manager answered): challenges are retried on a timer, unpaid, until answered
    /// (backoff up to [`MAX_BACKOFF_NS`]), since a side that has nothing to receive would
    /// otherwise never be validated after a lost challenge.
    Local,
    /// The peer did (a connection manager accepted its request): only the first challenge goes
    /// unpaid; every later one, timed ([`MAX_TIMED_TRIES`]) or triggered by a packet, waits
    /// for the allowance what the peer sent brought. A caller who names a victim gets one
    /// challenge sent there per connection request, nothing more.
    Remote,
}

/// Bytes a packet takes on the wire (the UDP payload: headers, payload, pad, ICRC).
pub fn wire_len<R: SharedRegion>(p: &TxPacket<R>) -> u64 {
    (p.hdr.len() + p.payload_len() + p.hdr.bth().pad as usize + 4) as u64
}

impl<R: SharedRegion> RcQp<R> {
    /// Validates the peer before serving it in full: one challenge per route, `nonces[k]`
    /// (unpredictable, drawn by the driver) for route `k`, a destination of the QP's packets
    /// as the driver numbers them (route 0 is the peer's main address; the engine numbers the
    /// peer's distinct addresses). Call at RTR; a QP without this
    /// call trusts its peer (the simulator, tests).
    pub fn require_validation(&mut self, nonces: &[u64], chosen: Chooser) {
        let routes = nonces
            .iter()
            .map(|&nonce| Route {
                nonce,
                validated: false,
                due: Some(0),
                last_sent: None,
                tries: 0,
            })
            .collect::<Vec<_>>();
        if routes.is_empty() {
            self.validation = None;
            return;
        }
        self.validation = Some(Validation {
            routes,
            allowance: 0,
            gated: None,
            now_due: Vec::new(),
            unpaid_retries: chosen == Chooser::Local,
        });
    }

    /// Whether the QP may send to route `k` without limit (validated, or never asked for).
    pub fn route_validated(&self, k: usize) -> bool {
        match &self.validation {
            None => true,
            Some(v) => v.routes.get(k).is_some_and(|r| r.validated),
        }
    }

    /// Whether every route is validated (or validation was never asked for).
    pub fn peer_validated(&self) -> bool {
        self.validation
            .as_ref()
            .is_none_or(|v| v.routes.iter().all(|r| r.validated))
    }

    /// The driver took in `bytes` (a whole datagram) from this QP's peer: while a route is
    /// not validated, the QP may send [`AMPLIFICATION`] times as much more. A challenge is
    /// due again if the latest is older than [`RECHALLENGE_NS`].
    pub fn credit_received(&mut self, now: u64, bytes: usize) {
        let Some(v) = &mut self.validation else {
            return;
        };
        if v.routes.iter().all(|r| r.validated) {
            return;
        }
        v.allowance = v.allowance.saturating_add(AMPLIFICATION * bytes as u64);
        for (k, r) in v.routes.iter().enumerate() {
            if !r.validated
                && r.last_sent.is_none_or(|t| now.saturating_sub(t) >= RECHALLENGE_NS)
                && !v.now_due.contains(&(k as u8))
            {
                v.now_due.push(k as u8);
            }
        }
    }

    /// The driver is about to send `bytes` on route `k`: true if it may (the route is
    /// validated, or the allowance covers it, which it then spends); false means drop it.
    pub fn spend_unvalidated(&mut self, k: usize, bytes: usize) -> bool {
        let Some(v) = &mut self.validation else {
            return true;
        };
        if v.routes.get(k).is_some_and(|r| r.validated) {
            return true;
        }
        if v.allowance >= bytes as u64 {
            v.allowance -= bytes as u64;
            return true;
        }
        self.stats.refused_unvalidated += 1;
        false
    }

    /// A PROBE_REPLY carrying [`CHALLENGE`]: validates its route if the nonce is right.
    pub(super) fn handle_challenge_reply(&mut self, pkt: &PacketView<'_>) {
        let k = challenge_route(pkt.bth.psn);
        let nonce = pkt
            .trailer
            .get(..NONCE_LEN)
            .filter(|_| pkt.trailer.len() == NONCE_LEN)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap_or_default()));
        let Some(v) = &mut self.validation else {
            // validated already (a late echo of a retried challenge), or never asked for
            return;
        };
        match (v.routes.get_mut(k), nonce) {
            (Some(r), Some(n)) if n == r.nonce => {
                if !r.validated {
                    r.validated = true;
                    r.due = None;
                    self.stats.routes_validated += 1;
                    tracing::debug!("QP {:#x}: route {k} of the peer validated", self.qpn);
                }
            }
            _ => self.stats.bad_challenge_replies += 1,
        }
    }

    /// The next challenge due at `now`, if any: a timed one (the first at RTR, then with
    /// backoff, [`MAX_TIMED_TRIES`] in all), or one a packet from the peer triggered, which the
    /// allowance that packet brought pays for.
    pub(super) fn poll_challenge(&mut self, now: u64) -> Option<TxPacket<R>> {
        let dest_qpn = self.dest_qpn;
        let v = self.validation.as_mut()?;
        let (allowance, unpaid_retries) = (v.allowance, v.unpaid_retries);
        let affordable = allowance >= CHALLENGE_LEN as u64;
        // (route, paid from the allowance)
        let due = |k: usize, r: &Route| -> Option<bool> {
            if r.validated {
                None
            } else if r.due.is_some_and(|t| t <= now) && (r.tries == 0 || unpaid_retries) {
                Some(false)
            } else if (r.due.is_some_and(|t| t <= now) || v.now_due.contains(&(k as u8))) && affordable {
                Some(true)
            } else {
                None
            }
        };
        let (k, paid) = v
            .routes
            .iter()
            .enumerate()
            .find_map(|(k, r)| due(k, r).map(|p| (k, p)))?;
        v.now_due.retain(|&i| i as usize != k);
        if paid {
            v.allowance -= CHALLENGE_LEN as u64;
        }
        let r = &mut v.routes[k];
        r.tries += 1;
        r.last_sent = Some(now);
        let backoff = (FIRST_BACKOFF_NS << r.tries.min(20).saturating_sub(1)).min(MAX_BACKOFF_NS);
        r.due = (unpaid_retries || r.tries < MAX_TIMED_TRIES).then_some(now + backoff);
        self.stats.challenges_sent += 1;
        self.stats.tx_packets += 1;
        let psn = CHALLENGE | k as u32;
        let mut hdr = HeaderBuf::with_bth(&Bth::new(Opcode::Probe as u8, dest_qpn, psn));
        hdr.push_u32((r.nonce >> 32) as u32).push_u32(r.nonce as u32);
        Some(TxPacket {
            hdr,
            payload: Default::default(),
            // the driver sends it on route `k` (a challenge names its route, not a path)
            path: 0,
        })
    }

    /// When the next challenge is due (0: now).
    pub(super) fn challenge_deadline(&self) -> Option<u64> {
        let v = self.validation.as_ref()?;
        let affordable = v.allowance >= CHALLENGE_LEN as u64;
        let triggered = |k: usize| v.now_due.contains(&(k as u8)) && affordable;
        // a timed retry that must be paid for waits for the allowance, not for its time
        let timed = |r: &Route| r.due.filter(|_| r.tries == 0 || v.unpaid_retries || affordable);
        v.routes
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.validated)
            .filter_map(|(k, r)| if triggered(k) { Some(0) } else { timed(r) })
            .min()
    }

    /// Whether a challenge waits to be sent at `now`.
    pub(super) fn challenge_pending(&self, now: u64) -> bool {
        self.challenge_deadline().is_some_and(|t| t <= now)
    }

    /// Whether route 0 is validated: the QP's own packets flow without the allowance.
    fn primary_validated(&self) -> bool {
        self.validation
            .as_ref()
            .is_none_or(|v| v.routes.first().is_none_or(|r| r.validated))
    }

    /// [`RcQp::poll_transmit`]'s gate: challenges first; then, while route 0 is not
    /// validated, a packet goes only if the allowance covers it, else it waits.
    pub(super) fn gated_transmit(&mut self, now: u64) -> Option<TxPacket<R>> {
        if let Some(c) = self.poll_challenge(now) {
            return Some(c);
        }
        // the peer's challenges are answered ahead of a held packet: two sides that both hold
        // one would otherwise wait for each other (each challenge brought 3x its size)
        if let Some(r) = self.poll_challenge_reply() {
            if let Some(v) = self.validation.as_mut() {
                v.allowance = v.allowance.saturating_sub(wire_len(&r));
            }
            return Some(r);
        }
        if self.primary_validated() {
            if let Some(p) = self.validation.as_mut().and_then(|v| v.gated.take()) {
                return Some(p);
            }
            if self.peer_validated() {
                // every address answered and nothing waits: the per-packet checks end here
                self.validation = None;
            }
            return self.next_packet(now);
        }
        let (p, fresh) = match self.validation.as_mut().and_then(|v| v.gated.take()) {
            Some(p) => (p, false),
            None => (self.next_packet(now)?, true),
        };
        let n = wire_len(&p);
        let v = self.validation.as_mut()?;
        if v.allowance >= n {
            v.allowance -= n;
            return Some(p);
        }
        v.gated = Some(p);
        if fresh {
            self.stats.gated_packets += 1;
        }
        None
    }

    /// Whether the gate holds a packet it cannot send yet.
    pub(super) fn gate_closed(&self) -> bool {
        !self.primary_validated()
            && self
                .validation
                .as_ref()
                .is_some_and(|v| v.gated.as_ref().is_some_and(|p| wire_len(p) > v.allowance))
    }

    /// Whether the gate holds a packet that may go now.
    pub(super) fn gate_ready(&self) -> bool {
        self.validation.as_ref().is_some_and(|v| v.gated.is_some()) && !self.gate_closed()
    }
}
