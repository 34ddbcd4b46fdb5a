//! Address validation for the Solar server: an address is served in full only after the agent
//! there has shown that it receives there (RFC 9000 §8's rule for QUIC, in Solar's terms; the
//! RC transport's is [`crate::transport::rc::validation`]).
//!
//! A server answers each request to the UDP source address it came from, and UDP does not
//! prove that address: one forged READ_REQ of 64 bytes naming a victim as its source would
//! make the server send the victim whole blocks, 4 KiB each, up to 65,535 of them. So, once
//! its driver asks for it ([`super::server::SolarServer::require_validation`]), the server
//! answers a request from an address it has not validated with a CHALLENGE carrying a 64-bit
//! nonce the driver drew at random for that address; the agent echoes the nonce in a
//! CHALLENGE_REPLY from that address, which proves that it received what was sent there (a
//! forger naming a victim never sees the nonce).
//!
//! Until then, everything sent to the address, challenges included, fits in an allowance of
//! [`AMPLIFICATION`] times the bytes received from it; an answer that does not fit waits, in
//! order, and goes out once the allowance grows or the address is validated. What waits is
//! bounded per address ([`ValidationConfig::max_held_bytes_per_peer`]) and over all of them
//! ([`ValidationConfig::max_held_bytes`]); past the bounds an answer is dropped and counted
//! (the agent's retransmission asks again), and a READ_REQ none of whose blocks could go or
//! wait is not served at all (the storage is not read for nothing). A request from an address not validated while
//! its challenge is older than [`RECHALLENGE_NS`] sends the challenge again (the first may
//! have been lost), with the same nonce.
//!
//! Memory is bounded whatever the sources: at most [`ValidationConfig::max_pending`]
//! addresses await validation (when full, the oldest is given up for a newcomer if its
//! challenge is older than [`ValidationConfig::min_pending_age_ns`], else the newcomer's
//! request is refused and counted), and at most [`ValidationConfig::max_validated`] addresses
//! are remembered as validated (when full, the eighth heard from least recently are
//! forgotten; they validate again on their next request). An address not heard from for
//! [`ValidationConfig::idle_ns`] validates again too, so an agent that left does not leave its
//! address open to forgers.

use super::server::ServerStats;
use super::wire::{Header, Op, HDR};
use super::Transmit;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// How many times the bytes received from an address not validated yet the server may send
/// there.
pub const AMPLIFICATION: u64 = 3;

/// A request from an address not validated yet sends its challenge again if the latest is
/// older than this.
pub const RECHALLENGE_NS: u64 = 200_000;

/// The bounds of a server's validation state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationConfig {
    /// Addresses remembered as validated; when full, the least recently heard from eighth is
    /// forgotten.
    pub max_validated: usize,
    /// Addresses awaiting validation at once.
    pub max_pending: usize,
    /// A pending address younger than this (since its first challenge) is not given up for a
    /// newcomer: the newcomer is refused instead. A real agent answers within a round trip.
    pub min_pending_age_ns: u64,
    /// Bytes of answers that may wait for one address's validation.
    pub max_held_bytes_per_peer: u64,
    /// Bytes of answers that may wait, over all addresses.
    pub max_held_bytes: u64,
    /// A validated address not heard from for this long must validate again.
    pub idle_ns: u64,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            max_validated: 16_384,
            max_pending: 1_024,
            min_pending_age_ns: 1_000_000,
            // an agent's whole default window (256 blocks) answered before its echo comes
            max_held_bytes_per_peer: 256 * (HDR as u64 + 4096),
            max_held_bytes: 32 << 20,
            idle_ns: 60_000_000_000,
        }
    }
}

impl ValidationConfig {
    /// Checks the bounds: each must be at least 1 (names the field that is not).
    pub fn check(&self) -> Result<(), String> {
        let fields = [
            ("max_validated", self.max_validated as u64),
            ("max_pending", self.max_pending as u64),
            ("max_held_bytes_per_peer", self.max_held_bytes_per_peer),
            ("max_held_bytes", self.max_held_bytes),
            ("idle_ns", self.idle_ns),
        ];
        match fields.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(format!("validation {name}: must be at least 1")),
            None => Ok(()),
        }
    }
}

/// Where the driver's random nonces come from (one per address to validate).
pub type NonceSource = Box<dyn FnMut() -> u64 + Send>;

/// An address awaiting validation.
struct Pending {
    nonce: u64,
    /// Bytes the server may still send there.
    allowance: u64,
    /// When the first challenge went out (the pending entry's age).
    created: u64,
    last_challenge: u64,
    /// Answers waiting for allowance or validation, in order.
    held: VecDeque<Transmit>,
    held_bytes: u64,
}

/// The bytes a packet takes (the UDP payload).
fn wire_len(t: &Transmit) -> u64 {
    (HDR + t.block.as_ref().map_or(0, |_| super::wire::BLOCK)) as u64
}

/// A server's validation state.
pub(super) struct Gate {
    cfg: ValidationConfig,
    nonces: NonceSource,
    /// Validated addresses and when they were last heard from (ordered: the eviction's scan
    /// is the same every run).
    validated: BTreeMap<u64, u64>,
    pending: HashMap<u64, Pending>,
    /// Pending addresses by age (entries of addresses no longer pending, or pending anew, are
    /// skipped when reached).
    order: VecDeque<(u64, u64)>,
    held_total: u64,
}

impl Gate {
    pub(super) fn new(cfg: ValidationConfig, nonces: NonceSource) -> Gate {
        Gate {
            cfg,
            nonces,
            validated: BTreeMap::new(),
            pending: HashMap::new(),
            order: VecDeque::new(),
            held_total: 0,
        }
    }

    /// Addresses validated and awaiting validation now.
    pub(super) fn sizes(&self) -> (usize, usize) {
        (self.validated.len(), self.pending.len())
    }

    /// Bytes of answers waiting for validation now.
    pub(super) fn held_bytes(&self) -> u64 {
        self.held_total
    }

    /// A request of `bytes` (`h` its header) arrived from `peer`: true if the server may take
    /// it. Credits the allowance of an address not validated, challenges it (again) when due,
    /// and sends what waited and now fits.
    pub(super) fn on_request(
        &mut self,
        now: u64,
        peer: u64,
        bytes: usize,
        h: &Header,
        out: &mut VecDeque<Transmit>,
        stats: &mut ServerStats,
    ) -> bool {
        if let Some(seen) = self.validated.get_mut(&peer) {
            if now.saturating_sub(*seen) < self.cfg.idle_ns {
                *seen = now;
                return true;
            }
            self.validated.remove(&peer);
        }
        let credit = AMPLIFICATION * bytes as u64;
        if let Some(p) = self.pending.get_mut(&peer) {
            p.allowance = p.allowance.saturating_add(credit);
            if now.saturating_sub(p.last_challenge) >= RECHALLENGE_NS {
                p.last_challenge = now;
                Self::challenge(peer, p, h, out, stats);
            }
            Self::release(p, &mut self.held_total, out);
            // a read whose blocks cannot all go or wait is not served: the storage is not read
            // for answers that would be dropped (one 64-byte request may ask for 65,535
            // blocks); a real agent asks again once validated
            if h.op == Op::ReadReq && !Self::read_fits(&self.cfg, self.held_total, p, h) {
                stats.unserved_reads += 1;
                return false;
            }
            return true;
        }
        if self.pending.len() >= self.cfg.max_pending && !self.evict_oldest(now, stats) {
            stats.refused_peers += 1;
            return false;
        }
        let mut p = Pending {
            nonce: (self.nonces)(),
            allowance: credit,
            created: now,
            last_challenge: now,
            held: VecDeque::new(),
            held_bytes: 0,
        };
        Self::challenge(peer, &mut p, h, out, stats);
        let fits = h.op != Op::ReadReq || Self::read_fits(&self.cfg, self.held_total, &p, h);
        self.pending.insert(peer, p);
        self.order.push_back((now, peer));
        if self.order.len() > 2 * self.cfg.max_pending + 16 {
            let pending = &self.pending;
            self.order
                .retain(|&(t, a)| pending.get(&a).is_some_and(|p| p.created == t));
        }
        if !fits {
            stats.unserved_reads += 1;
        }
        fits
    }

    /// Whether all the blocks READ_REQ `h` asks for can go now (the allowance) or wait (room
    /// in `p`'s queue and in all queues).
    fn read_fits(cfg: &ValidationConfig, held_total: u64, p: &Pending, h: &Header) -> bool {
        let blocks = u64::from(h.blk_cnt.saturating_sub(h.blk_idx)).max(1);
        let need = blocks * (HDR + super::wire::BLOCK) as u64;
        let room = cfg
            .max_held_bytes_per_peer
            .saturating_sub(p.held_bytes)
            .min(cfg.max_held_bytes.saturating_sub(held_total));
        need <= p.allowance.saturating_add(room)
    }

    /// Makes room for a new pending address by giving up the oldest, if it is old enough.
    fn evict_oldest(&mut self, now: u64, stats: &mut ServerStats) -> bool {
        while let Some(&(t, a)) = self.order.front() {
            match self.pending.get(&a) {
                Some(p) if p.created == t => {
                    if now.saturating_sub(t) < self.cfg.min_pending_age_ns {
                        return false;
                    }
                    self.order.pop_front();
                    let p = self.pending.remove(&a).expect("looked up above");
                    self.held_total -= p.held_bytes;
                    stats.evicted_peers += 1;
                    stats.dropped_unvalidated += p.held.len() as u64;
                    stats.dropped_unvalidated_bytes += p.held_bytes;
                    return true;
                }
                _ => {
                    self.order.pop_front();
                }
            }
        }
        false
    }

    /// Sends `p`'s challenge, if the allowance covers it (it always does right after a
    /// request's credit: three times at least a header).
    fn challenge(peer: u64, p: &mut Pending, req: &Header, out: &mut VecDeque<Transmit>, stats: &mut ServerStats) {
        if p.allowance < HDR as u64 {
            return;
        }
        p.allowance -= HDR as u64;
        let mut h = Header::new(Op::Challenge);
        h.path = req.path;
        h.rpc = p.nonce;
        h.ts = req.ts;
        let mut header = [0u8; HDR];
        h.encode(&mut header);
        stats.challenges_sent += 1;
        out.push_back(Transmit {
            path: h.path,
            port: 0,
            peer,
            header,
            block: None,
        });
    }

    /// Sends the answers waiting at the head of `p`'s queue that its allowance now covers.
    fn release(p: &mut Pending, held_total: &mut u64, out: &mut VecDeque<Transmit>) {
        while let Some(t) = p.held.front() {
            let n = wire_len(t);
            if n > p.allowance {
                return;
            }
            p.allowance -= n;
            p.held_bytes -= n;
            *held_total -= n;
            out.push_back(p.held.pop_front().expect("looked at above"));
        }
    }

    /// A CHALLENGE_REPLY from `peer` carrying `nonce`: validates the address if it is the
    /// nonce sent there, and sends everything that waited.
    pub(super) fn on_reply(
        &mut self,
        now: u64,
        peer: u64,
        nonce: u64,
        out: &mut VecDeque<Transmit>,
        stats: &mut ServerStats,
    ) {
        match self.pending.get(&peer) {
            Some(p) if p.nonce == nonce => {}
            // a duplicate echo of an address already validated changes nothing
            None if self.validated.contains_key(&peer) => return,
            _ => {
                stats.bad_challenge_replies += 1;
                return;
            }
        }
        let p = self.pending.remove(&peer).expect("looked up above");
        self.held_total -= p.held_bytes;
        out.extend(p.held);
        if self.validated.len() >= self.cfg.max_validated {
            self.forget_least_recent();
        }
        self.validated.insert(peer, now);
        stats.peers_validated += 1;
        tracing::debug!(
            "solar: address {peer:#x} validated ({} us after its first challenge)",
            now.saturating_sub(p.created) / 1000
        );
    }

    /// Forgets the validated addresses heard from least recently, about an eighth of the table
    /// (so a full table costs a scan per eighth of its size in new addresses).
    fn forget_least_recent(&mut self) {
        let mut seen: Vec<u64> = self.validated.values().copied().collect();
        let k = (seen.len() / 8).max(1).min(seen.len()) - 1;
        let (_, &mut cut, _) = seen.select_nth_unstable(k);
        let mut left = k + 1;
        // ties at the cut are forgotten only as far as the eighth goes
        self.validated.retain(|_, &mut t| {
            if t < cut || (t == cut && left > 0) {
                left = left.saturating_sub(1);
                return false;
            }
            true
        });
    }

    /// An answer to `t.peer`: sent if the address is validated or its allowance covers it
    /// (and nothing of it waits already); else it waits, within the bounds, or is dropped.
    pub(super) fn send(&mut self, t: Transmit, out: &mut VecDeque<Transmit>, stats: &mut ServerStats) {
        if self.validated.contains_key(&t.peer) {
            out.push_back(t);
            return;
        }
        let n = wire_len(&t);
        let Some(p) = self.pending.get_mut(&t.peer) else {
            // its address was given up (or forgotten) while the request was served
            stats.dropped_unvalidated += 1;
            stats.dropped_unvalidated_bytes += n;
            return;
        };
        if p.held.is_empty() && p.allowance >= n {
            p.allowance -= n;
            out.push_back(t);
            return;
        }
        if p.held_bytes + n > self.cfg.max_held_bytes_per_peer || self.held_total + n > self.cfg.max_held_bytes {
            stats.dropped_unvalidated += 1;
            stats.dropped_unvalidated_bytes += n;
            return;
        }
        p.held_bytes += n;
        self.held_total += n;
        p.held.push_back(t);
        stats.held_packets += 1;
        stats.held_bytes += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::solar::client::{ClientConfig, ClientEvent, SolarClient};
    use crate::transport::solar::server::{Request, SolarServer};
    use crate::transport::solar::wire::{block_crc, BLOCK};
    use std::sync::Arc;

    const VICTIM: u64 = 0x7f00_0001_1234;

    /// A validating server whose nonces are 1000, 1001, ...
    fn server(cfg: ValidationConfig) -> SolarServer {
        let mut s = SolarServer::new();
        let mut n = 1000u64;
        s.require_validation(
            cfg,
            Box::new(move || {
                n += 1;
                n - 1
            }),
        )
        .unwrap();
        s
    }

    fn read_req(path: u16, lba: u64, blocks: u16) -> Vec<u8> {
        let mut h = Header::new(Op::ReadReq);
        h.path = path;
        h.volume = 1;
        h.rpc = 1 << 63 | lba;
        h.lba = lba;
        h.blk_cnt = blocks;
        h.packet(&[])
    }

    fn reply(path: u16, nonce: u64) -> Vec<u8> {
        let mut h = Header::new(Op::ChallengeReply);
        h.path = path;
        h.rpc = nonce;
        h.packet(&[])
    }

    /// Hands `pkt` from `peer` to the server and answers a read with `blocks` of data.
    fn feed(s: &mut SolarServer, now: u64, peer: u64, pkt: &[u8]) {
        if let Some(Request::Read { token, count, .. }) = s.on_packet_at(now, peer, pkt, false).unwrap() {
            let data: Arc<[u8]> = Arc::from(vec![0x5a; BLOCK]);
            for k in 0..count {
                s.read_block(token, k, data.clone(), 0, block_crc(&data));
            }
            s.read_finished(token);
        }
    }

    /// What the server sends now: (ops, bytes) per destination `peer`.
    fn drain(s: &mut SolarServer, peer: u64) -> (Vec<Op>, u64) {
        let mut ops = Vec::new();
        let mut bytes = 0;
        while let Some(t) = s.poll_transmit() {
            assert_eq!(t.peer, peer, "an answer to another address");
            bytes += t.to_vec().len() as u64;
            ops.push(Header::decode(&t.to_vec()).unwrap().0.op);
        }
        (ops, bytes)
    }

    fn nonce_of(s: &mut SolarServer) -> u64 {
        let t = s.poll_transmit().expect("a challenge");
        let (h, _) = Header::decode(&t.to_vec()).unwrap();
        assert_eq!(h.op, Op::Challenge);
        h.rpc
    }

    #[test]
    fn a_forged_source_gets_at_most_three_times_what_it_sent_and_the_echo_releases_the_rest() {
        let mut s = server(ValidationConfig::default());
        // one READ_REQ of 64 blocks "from" the victim: 256 KiB of answers wait, the victim
        // gets the challenge and nothing more
        let mut sent = 0u64;
        let req = read_req(2, 0, 64);
        sent += req.len() as u64;
        feed(&mut s, 1_000, VICTIM, &req);
        let (ops, got) = drain(&mut s, VICTIM);
        assert_eq!(ops, vec![Op::Challenge]);
        assert!(got <= AMPLIFICATION * sent, "{got} bytes for {sent}");
        // more forged requests in a row: the challenge is not sent again within 200 us, and
        // what fits the allowance (a block per 22 requests) is all that goes
        for i in 0..200u64 {
            let req = read_req(2, 64 + i, 1);
            sent += req.len() as u64;
            feed(&mut s, 2_000 + i, VICTIM, &req);
        }
        let (ops, more) = drain(&mut s, VICTIM);
        assert!(!ops.contains(&Op::Challenge), "{ops:?}");
        let total = got + more;
        assert!(total <= AMPLIFICATION * sent, "{total} bytes reflected for {sent}");
        assert!(total > 2 * sent, "the allowance is used: {total} for {sent}");
        let st = s.stats();
        assert_eq!((st.challenges_sent, st.peers_validated), (1, 0));
        assert!(st.held_packets >= 64, "{st:?}");
        assert_eq!(s.validation_sizes(), (0, 1));
        // a wrong nonce (a guess) validates nothing and releases nothing
        feed(&mut s, 3_000, VICTIM, &reply(2, 999));
        assert_eq!(drain(&mut s, VICTIM).0, Vec::<Op>::new());
        assert_eq!(s.stats().bad_challenge_replies, 1);
        // after 200 us a request draws the challenge again, with the same nonce
        feed(&mut s, 300_000, VICTIM, &read_req(2, 500, 1));
        assert_eq!(nonce_of(&mut s), 1000);
        // the right nonce from the address: everything that waited goes, in order, and the
        // address is served in full from then on
        let held = s.held_bytes();
        assert!(held > 0);
        feed(&mut s, 301_000, VICTIM, &reply(2, 1000));
        let (ops, bytes) = drain(&mut s, VICTIM);
        assert_eq!(bytes, held);
        assert!(ops.iter().all(|&o| o == Op::ReadData));
        assert_eq!((s.stats().peers_validated, s.held_bytes()), (1, 0));
        feed(&mut s, 302_000, VICTIM, &read_req(2, 0, 64));
        let (ops, bytes) = drain(&mut s, VICTIM);
        assert_eq!((ops.len(), bytes), (64, 64 * (HDR + BLOCK) as u64));
        // a duplicate echo later is no bad reply
        feed(&mut s, 303_000, VICTIM, &reply(2, 1000));
        assert_eq!(s.stats().bad_challenge_replies, 1);
    }

    #[test]
    fn what_waits_is_bounded_per_address_and_in_all() {
        let cfg = ValidationConfig {
            max_held_bytes_per_peer: 8 * (HDR + BLOCK) as u64,
            max_held_bytes: 12 * (HDR + BLOCK) as u64,
            ..ValidationConfig::default()
        };
        let mut s = server(cfg);
        // a read whose blocks cannot all go or wait is not served at all: the storage is not
        // read for answers that would be dropped (one small request may ask for 65,535 blocks)
        feed(&mut s, 0, 1, &read_req(0, 0, 100));
        let st = s.stats();
        assert_eq!((st.reads, st.unserved_reads, st.held_packets), (0, 1, 0), "{st:?}");
        // one that fits the address's share waits whole
        feed(&mut s, 1, 1, &read_req(0, 0, 8));
        let st = s.stats();
        assert_eq!((st.held_packets, st.dropped_unvalidated), (8, 0), "{st:?}");
        assert_eq!(s.held_bytes(), 8 * (HDR + BLOCK) as u64);
        // more from the address while its queue is full are not served
        feed(&mut s, 2, 1, &read_req(0, 0, 2));
        assert_eq!(s.stats().unserved_reads, 2);
        // a second address gets what is left of the total: 4 blocks, not 5
        feed(&mut s, 0, 2, &read_req(0, 0, 5));
        assert_eq!(s.stats().unserved_reads, 3);
        feed(&mut s, 1, 2, &read_req(0, 0, 4));
        assert_eq!(s.stats().held_packets, 12);
        assert_eq!(s.held_bytes(), 12 * (HDR + BLOCK) as u64);
        while s.poll_transmit().is_some() {}
        // an echo frees its address's share
        feed(&mut s, 10, 1, &reply(0, 1000));
        assert_eq!(drain(&mut s, 1).0.len(), 8);
        assert_eq!(s.held_bytes(), 4 * (HDR + BLOCK) as u64);
    }

    #[test]
    fn a_flood_of_sources_is_bounded_refused_then_given_up_oldest_first() {
        let cfg = ValidationConfig {
            max_pending: 4,
            min_pending_age_ns: 1_000_000,
            ..ValidationConfig::default()
        };
        let mut s = server(cfg);
        for peer in 0..10u64 {
            feed(&mut s, peer, 100 + peer, &read_req(0, 0, 1));
        }
        // four wait; six were refused: not read, no challenge
        assert_eq!(s.validation_sizes(), (0, 4));
        let st = s.stats();
        assert_eq!((st.refused_peers, st.challenges_sent, st.reads), (6, 4, 4));
        while s.poll_transmit().is_some() {}
        // once the oldest are older than min_pending_age_ns, newcomers take their places
        for peer in 10..13u64 {
            feed(&mut s, 2_000_000, 100 + peer, &read_req(0, 0, 1));
        }
        let st = s.stats();
        assert_eq!((st.evicted_peers, st.refused_peers), (3, 6));
        assert_eq!(s.validation_sizes(), (0, 4));
        // a given-up address's echo is a bad reply; a kept one validates
        feed(&mut s, 2_000_001, 100, &reply(0, 1000));
        assert_eq!(s.stats().bad_challenge_replies, 1);
        feed(&mut s, 2_000_002, 103, &reply(0, 1003));
        assert_eq!(s.validation_sizes(), (1, 3));
        // the order queue stays bounded however many come and go
        for i in 0..1000u64 {
            feed(&mut s, 10_000_000 + i * 2_000_000, 1000 + i, &read_req(0, 0, 1));
        }
        assert_eq!(s.validation_sizes(), (1, 4));
    }

    #[test]
    fn validated_addresses_are_bounded_and_expire_when_idle() {
        let cfg = ValidationConfig {
            max_validated: 8,
            idle_ns: 1_000_000_000,
            ..ValidationConfig::default()
        };
        let mut s = server(cfg);
        let mut nonce = 1000;
        for peer in 0..8u64 {
            feed(&mut s, peer * 10, peer, &read_req(0, 0, 1));
            feed(&mut s, peer * 10 + 1, peer, &reply(0, nonce));
            nonce += 1;
        }
        assert_eq!(s.validation_sizes(), (8, 0));
        // peer 0 is heard from again: peer 1 is now the least recent
        feed(&mut s, 1_000, 0, &read_req(0, 0, 1));
        feed(&mut s, 2_000, 8, &read_req(0, 0, 1));
        feed(&mut s, 2_001, 8, &reply(0, nonce));
        assert_eq!(s.validation_sizes(), (8, 0));
        while s.poll_transmit().is_some() {}
        let challenges = s.stats().challenges_sent;
        feed(&mut s, 3_000, 0, &read_req(0, 0, 1));
        assert_eq!(s.stats().challenges_sent, challenges, "peer 0 is still validated");
        feed(&mut s, 3_000, 1, &read_req(0, 0, 1));
        assert_eq!(s.stats().challenges_sent, challenges + 1, "peer 1 was forgotten");
        // peer 0 idle past idle_ns validates again
        feed(&mut s, 2_000_000_000, 0, &read_req(0, 0, 1));
        assert_eq!(s.stats().challenges_sent, challenges + 2);
    }

    #[test]
    fn a_zero_bound_is_refused_by_name() {
        let mut s = SolarServer::new();
        let cfg = ValidationConfig {
            max_pending: 0,
            ..ValidationConfig::default()
        };
        let e = s.require_validation(cfg, Box::new(|| 7)).unwrap_err();
        assert!(e.contains("max_pending"), "{e}");
        assert!(!s.validating());
    }

    #[test]
    fn a_real_client_is_validated_within_one_round_trip_of_its_first_read() {
        let mut s = server(ValidationConfig::default());
        let mut c = SolarClient::new(
            ClientConfig {
                paths: 2,
                ..ClientConfig::default()
            },
            None,
            0,
        );
        let io = c.read(0, 1, 0, 64).unwrap();
        // one round trip: the requests go, the challenges come back with what the allowance
        // covers; the client echoes; the rest comes
        let mut now = 1_000;
        let mut trips = 0;
        let mut done = false;
        while !done {
            trips += 1;
            assert!(trips <= 3, "not done within two round trips");
            let mut to_server = Vec::new();
            while let Some(t) = c.poll_transmit(now) {
                to_server.push((t.port as u64, t.to_vec()));
            }
            now += 10_000;
            for (port, p) in &to_server {
                feed(&mut s, now, *port, p);
            }
            let mut to_client = Vec::new();
            while let Some(t) = s.poll_transmit() {
                to_client.push(t.to_vec());
            }
            now += 10_000;
            for p in &to_client {
                c.on_packet(now, p).unwrap();
            }
            while let Some(ClientEvent::Done { io: id, result }) = c.poll_event() {
                assert_eq!(id, io);
                result.unwrap();
                done = true;
            }
        }
        // first trip: requests out, challenges back; second: echoes and answers
        assert_eq!(trips, 2);
        let st = s.stats();
        assert_eq!(st.peers_validated, st.challenges_sent);
        assert_eq!(c.stats().challenges_answered, st.challenges_sent);
        assert_eq!((st.dropped_unvalidated, st.bad_challenge_replies), (0, 0));
    }
}
