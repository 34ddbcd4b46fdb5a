//! Sans-IO tests of the RC transport against hostile peers: forged packets with correct ICRCs
//! (a QPN and PSNs learnt from one captured packet) must neither turn a responder into a
//! reflector nor end a live connection.

use super::*;
use crate::memory::{Access, AccessError, KeyTable, SharedRegion};
use crate::wire::{encode_into, Aeth, AtomicEth, NakCode, Reth, Syndrome};
use crate::work::{Sge, WcStatus, WrOpcode};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicU8, Ordering};

/// Registered memory for the tests: bytes a peer may access through shared references (the
/// crate takes no locks; the tests run on one thread, so an atomic needs no more than this).
#[derive(Debug)]
struct Mem(Vec<AtomicU8>);

impl Mem {
    fn new(data: &[u8]) -> Mem {
        Mem(data.iter().map(|&b| AtomicU8::new(b)).collect())
    }
    fn bytes(&self, off: usize, n: usize) -> Vec<u8> {
        self.0[off..off + n].iter().map(|b| b.load(Ordering::Relaxed)).collect()
    }
    fn word(&self, off: usize) -> Option<u64> {
        if !off.is_multiple_of(8) || off + 8 > self.0.len() {
            return None;
        }
        Some(u64::from_le_bytes(self.bytes(off, 8).try_into().unwrap_or_default()))
    }
}

impl SharedRegion for Mem {
    fn from_bytes(data: &[u8]) -> Mem {
        Mem::new(data)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        dst.copy_from_slice(&self.bytes(off, dst.len()));
    }
    fn write(&self, off: usize, src: &[u8]) {
        for (d, &s) in self.0[off..off + src.len()].iter().zip(src) {
            d.store(s, Ordering::Relaxed);
        }
    }
    fn append_to(&self, off: usize, n: usize, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.bytes(off, n));
    }
    fn compare_swap(&self, off: usize, compare: u64, swap: u64) -> Option<u64> {
        let old = self.word(off)?;
        if old == compare {
            self.write(off, &swap.to_le_bytes());
        }
        Some(old)
    }
    fn fetch_add(&self, off: usize, add: u64) -> Option<u64> {
        let old = self.word(off)?;
        self.write(off, &old.wrapping_add(add).to_le_bytes());
        Some(old)
    }
}

/// One region per side, at `BASE`, under key `KEY`, in protection domain 1.
struct Keys(Arc<Mem>);

const BASE: u64 = 0x10_0000;
const KEY: u32 = 0x77;
const MEM: usize = 256 << 10;
const MTU: u32 = 1024;

impl KeyTable for Keys {
    type Region = Mem;
    fn check(&self, key: u32, pd: u32, va: u64, len: u64, _need: Access) -> Result<(Arc<Mem>, usize), AccessError> {
        if key != KEY {
            return Err(AccessError::BadKey(key));
        }
        if pd != 1 {
            return Err(AccessError::WrongPd(key));
        }
        let end = va.checked_add(len).ok_or(AccessError::OutOfBounds { va, len })?;
        if va < BASE || end > BASE + MEM as u64 {
            return Err(AccessError::OutOfBounds { va, len });
        }
        Ok((self.0.clone(), (va - BASE) as usize))
    }
}

const A: &str = "10.0.0.1:4791";
const B: &str = "10.0.0.2:4791";

/// A connected pair: the client (QPN 1, first PSN `client_psn`) and the server (QPN 2).
struct Pair {
    client: RcQp<Mem>,
    server: RcQp<Mem>,
    cmem: Keys,
    smem: Keys,
    now: u64,
}

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().expect("an address")
}

impl Pair {
    fn new(client_psn: u32) -> Pair {
        let cfg = RcConfig {
            mtu: MTU,
            ..RcConfig::default()
        };
        let mut client = RcQp::new(1, 1, cfg);
        let mut server = RcQp::new(2, 1, cfg);
        let server_psn = 5000;
        client.modify_to_init().unwrap();
        server.modify_to_init().unwrap();
        client.modify_to_rtr(2, server_psn, cfg).unwrap();
        server.modify_to_rtr(1, client_psn, cfg).unwrap();
        client.modify_to_rts(client_psn).unwrap();
        server.modify_to_rts(server_psn).unwrap();
        let pattern: Vec<u8> = (0..MEM)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1])
            .collect();
        Pair {
            client,
            server,
            cmem: Keys(Arc::new(Mem::new(&[0; MEM]))),
            smem: Keys(Arc::new(Mem::new(&pattern))),
            now: 1_000_000,
        }
    }

    /// Moves packets both ways (running the delayed-ACK timers) until neither side has any;
    /// returns the packets and payload bytes the server sent.
    fn pump(&mut self) -> (u32, usize) {
        let (mut pkts, mut bytes) = (0, 0);
        loop {
            let mut moved = false;
            while let Some(p) = self.client.poll_transmit(self.now) {
                let d = encode(&p, A, B);
                let v = PacketView::parse(&d).expect("a packet the client sent parses");
                self.server.handle_packet(self.now, &v, &self.smem);
                moved = true;
            }
            while let Some(p) = self.server.poll_transmit(self.now) {
                pkts += 1;
                bytes += p.payload_len();
                let d = encode(&p, B, A);
                let v = PacketView::parse(&d).expect("a packet the server sent parses");
                self.client.handle_packet(self.now, &v, &self.cmem);
                moved = true;
            }
            self.now += 50_000; // past the delayed ACK, well before any retransmission timeout
            self.client.handle_timeout(self.now);
            self.server.handle_timeout(self.now);
            if !moved && !self.client.wants_transmit(self.now) && !self.server.wants_transmit(self.now) {
                return (pkts, bytes);
            }
        }
    }

    /// Hands the server a forged request and returns the packets and payload bytes it sends.
    fn forge_to_server(&mut self, hdr: &HeaderBuf) -> (u32, usize) {
        let d = forge(hdr, A, B);
        let v = PacketView::parse(&d).expect("a forged packet parses");
        self.server.handle_packet(self.now, &v, &self.smem);
        let (mut pkts, mut bytes) = (0, 0);
        while let Some(p) = self.server.poll_transmit(self.now) {
            pkts += 1;
            bytes += p.payload_len();
        }
        (pkts, bytes)
    }

    fn read(&mut self, wr_id: u64, local_off: u64, remote_off: u64, len: u32) {
        let wr = SendWr::new(wr_id, WrOpcode::RdmaRead)
            .sge(Sge {
                addr: BASE + local_off,
                length: len,
                lkey: KEY,
            })
            .remote(BASE + remote_off, KEY);
        self.client.post_send(wr, &self.cmem).expect("READ posted");
    }

    fn completion(&mut self) -> Wc {
        self.client.poll_completion().expect("a completion")
    }
}

fn encode(p: &crate::transport::TxPacket<Mem>, src: &str, dst: &str) -> Vec<u8> {
    let mut out = Vec::new();
    p.encode(addr(src), addr(dst), &mut out);
    out
}

/// A datagram with a correct ICRC, as a hostile peer that spoofs `src` builds it.
fn forge(hdr: &HeaderBuf, src: &str, dst: &str) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(&mut out, hdr, &[], addr(src), addr(dst));
    out
}

fn read_request(dest_qp: u32, psn: u32, va: u64, len: u32) -> HeaderBuf {
    let mut bth = Bth::new(Opcode::ReadRequest as u8, dest_qp, psn);
    bth.ack_req = true;
    let mut h = HeaderBuf::with_bth(&bth);
    h.push_reth(&Reth {
        va,
        rkey: KEY,
        dma_len: len,
    });
    h
}

fn ack(dest_qp: u32, psn: u32, syndrome: Syndrome) -> HeaderBuf {
    let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::Acknowledge as u8, dest_qp, psn));
    h.push_aeth(&Aeth { syndrome, msn: 0 });
    h
}

const FATAL: Syndrome = Syndrome::Nak(NakCode::RemoteAccessError);

#[test]
fn a_duplicate_read_is_answered_only_within_a_read_the_responder_accepted() {
    let psn = 100;
    let mut t = Pair::new(psn);
    // a genuine 3000-byte READ: PSNs 100..103 (three 1 KiB response packets)
    t.read(1, 0, 4096, 3000);
    t.pump();
    let wc = t.completion();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert_eq!(t.cmem.0.bytes(0, 3000), t.smem.0.bytes(4096, 3000));

    // forged: the captured PSN with another RETH (the whole region) is not executed
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn, BASE, MEM as u32));
    assert_eq!((pkts, bytes), (0, 0), "a forged READ sends nothing");
    // nor one that starts in the READ at a PSN whose data does not start there
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn + 1, BASE + 4096, 1000));
    assert_eq!((pkts, bytes), (0, 0), "a re-request at the wrong offset sends nothing");
    // nor one asking beyond the READ's end
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn, BASE + 4096, 3001));
    assert_eq!((pkts, bytes), (0, 0), "a longer READ sends nothing");
    let s = t.server.stats();
    assert_eq!((s.duplicate_requests_refused, s.duplicate_requests), (3, 0), "{s:?}");

    // the genuine retransmission (same PSN and RETH) is answered in full
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn, BASE + 4096, 3000));
    assert_eq!((pkts, bytes), (3, 3000));
    // and so is a requester's re-request of the tail from its first missing response PSN
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn + 1, BASE + 4096 + MTU as u64, 3000 - MTU));
    assert_eq!((pkts, bytes), (2, 3000 - MTU as usize));
    let s = t.server.stats();
    assert_eq!((s.duplicate_requests_refused, s.duplicate_requests), (3, 2), "{s:?}");
    assert_eq!(t.server.state(), QpState::Rts);

    // once RESPONDER_RD_ATOMIC later READs were accepted, the first one is forgotten
    for i in 0..RESPONDER_RD_ATOMIC as u64 {
        t.read(10 + i, 8192, 0, 64);
        t.pump();
        assert_eq!(t.completion().status, WcStatus::Success);
    }
    let (pkts, bytes) = t.forge_to_server(&read_request(2, psn, BASE + 4096, 3000));
    assert_eq!(
        (pkts, bytes),
        (0, 0),
        "a READ older than the responder's depth is not answered"
    );
    assert_eq!(t.server.stats().duplicate_requests_refused, 4);
}

/// A key table whose region was deregistered: every key is refused.
struct NoKeys;

impl KeyTable for NoKeys {
    type Region = Mem;
    fn check(&self, key: u32, _pd: u32, _va: u64, _len: u64, _need: Access) -> Result<(Arc<Mem>, usize), AccessError> {
        Err(AccessError::BadKey(key))
    }
}

#[test]
fn a_duplicate_read_of_a_region_gone_since_gets_the_access_error_not_silence() {
    let psn = 300;
    let mut t = Pair::new(psn);
    t.read(1, 0, 4096, 3000);
    t.pump();
    assert_eq!(t.completion().status, WcStatus::Success);
    // the requester lost the responses and asks again; the region was deregistered meanwhile
    let d = forge(&read_request(2, psn, BASE + 4096, 3000), A, B);
    let v = PacketView::parse(&d).expect("a packet parses");
    t.server.handle_packet(t.now, &v, &NoKeys);
    let mut sent = Vec::new();
    while let Some(p) = t.server.poll_transmit(t.now) {
        sent.push(encode(&p, B, A));
    }
    assert_eq!(
        sent.len(),
        1,
        "one answer: the NAK (silence would run the peer's retries out)"
    );
    let v = PacketView::parse(&sent[0]).expect("the answer parses");
    assert_eq!(v.opcode, Opcode::Acknowledge);
    assert_eq!(v.bth.psn, psn);
    assert_eq!(v.aeth.map(|a| a.syndrome), Some(FATAL), "{:?}", v.aeth);
    assert_eq!(v.payload.len(), 0, "no memory sent");
}

#[test]
fn a_duplicate_atomic_replays_only_the_same_request() {
    let psn = 7;
    let mut t = Pair::new(psn);
    let wr = SendWr {
        compare_add: 5,
        ..SendWr::new(1, WrOpcode::AtomicFetchAndAdd)
            .sge(Sge {
                addr: BASE,
                length: 8,
                lkey: KEY,
            })
            .remote(BASE + 64, KEY)
    };
    t.client.post_send(wr, &t.cmem).unwrap();
    t.pump();
    assert_eq!(t.completion().status, WcStatus::Success);
    let after = t.smem.0.bytes(64, 8);
    let atomic = |va: u64| {
        let mut bth = Bth::new(Opcode::FetchAdd as u8, 2, psn);
        bth.ack_req = true;
        let mut h = HeaderBuf::with_bth(&bth);
        h.push_atomic(&AtomicEth {
            va,
            rkey: KEY,
            swap_add: 5,
            compare: 0,
        });
        h
    };
    assert_eq!(t.forge_to_server(&atomic(BASE + 128)).0, 0, "another address: refused");
    assert_eq!(t.forge_to_server(&atomic(BASE + 64)).0, 1, "the same request: replayed");
    assert_eq!(t.smem.0.bytes(64, 8), after, "never executed twice");
    let s = t.server.stats();
    assert_eq!((s.duplicate_requests_refused, s.duplicate_requests), (1, 1), "{s:?}");
}

#[test]
fn ghost_naks_and_acks_are_dropped_and_a_nak_of_an_outstanding_request_is_fatal() {
    // the client's PSNs wrap: its WRITE takes PSNs 0xFFFFFF and 0 (2^24 unwrapped)
    let mut t = Pair::new(0xFF_FFFF);
    // the server has nothing outstanding: every NAK to it is a ghost
    for psn in [0, 4 << 20, 8 << 20, 12 << 20] {
        t.forge_to_server(&ack(2, psn, FATAL));
    }
    assert_eq!(t.server.state(), QpState::Rts, "ghost NAKs end no connection");
    assert_eq!(t.server.stats().ghost_naks, 4);
    assert!(t.server.poll_completion().is_none());

    let wr = SendWr::new(9, WrOpcode::RdmaWrite)
        .sge(Sge {
            addr: BASE,
            length: 2 * MTU,
            lkey: KEY,
        })
        .remote(BASE, KEY);
    t.client.post_send(wr, &t.cmem).unwrap();
    let mut sent = 0;
    while t.client.poll_transmit(t.now).is_some() {
        sent += 1; // lost on the way: both PSNs stay outstanding
    }
    assert_eq!(sent, 2);
    let to_client = |t: &mut Pair, h: HeaderBuf| {
        let d = forge(&h, B, A);
        let v = PacketView::parse(&d).unwrap();
        t.client.handle_packet(t.now, &v, &t.cmem);
    };
    // behind una (across the wrap), and beyond what was sent: ghosts of every kind
    to_client(&mut t, ack(1, 0xFF_FFFE, FATAL));
    to_client(&mut t, ack(1, 1, FATAL));
    to_client(&mut t, ack(1, 0xFF_FFF0, Syndrome::Rnr { timer: 1 }));
    to_client(&mut t, ack(1, 0x40_0000, Syndrome::Nak(NakCode::PsnSequenceError)));
    to_client(&mut t, ack(1, 5, Syndrome::Ack { credits: 0x1F }));
    let mut resp = HeaderBuf::with_bth(&Bth::new(Opcode::ReadResponseOnly as u8, 1, 3));
    resp.push_aeth(&Aeth {
        syndrome: Syndrome::Ack { credits: 0x1F },
        msn: 0,
    });
    to_client(&mut t, resp);
    let s = t.client.stats();
    assert_eq!((s.ghost_naks, s.ghost_acks, s.ghost_responses), (4, 1, 1), "{s:?}");
    assert_eq!(t.client.state(), QpState::Rts, "ghosts end no connection");
    assert!(t.client.poll_completion().is_none(), "and complete nothing");
    assert_eq!(s.qp_errors, [0; QpErrorCause::COUNT]);

    // a NAK naming an outstanding PSN (the WRITE's second, 0 after the wrap) still ends it
    to_client(&mut t, ack(1, 0, FATAL));
    assert_eq!(t.client.state(), QpState::Err);
    let wc = t.completion();
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::RemAccessErr));
    assert_eq!(t.client.error_cause(), Some(QpErrorCause::RemoteAccess));
    assert_eq!(t.client.stats().qp_errors[QpErrorCause::RemoteAccess as usize], 1);
}

/// The host delay the driver told a QP stays when its paths are set anew (a connect that
/// adopts the peer's paths) or it is reset: the driver says it again only when it changes.
#[test]
fn the_host_delay_survives_new_paths_and_a_reset() {
    let cfg = RcConfig {
        recovery: Recovery::SelectiveRepeat,
        ..RcConfig::default()
    };
    let mut qp: RcQp<Mem> = RcQp::new(1, 1, cfg);
    qp.set_host_delay(4_000_000);
    qp.set_paths(
        4,
        crate::path::SprayPolicy::RoundRobin,
        crate::path::PathParams::default(),
    )
    .unwrap();
    assert_eq!(qp.paths().host_delay(), 4_000_000);
    qp.modify_to_reset();
    assert_eq!(qp.paths().host_delay(), 4_000_000);
}

/// Hands `side` a datagram as its driver does: the bytes are credited to the peer's allowance.
fn deliver(qp: &mut RcQp<Mem>, now: u64, d: &[u8], mem: &Keys) {
    let v = PacketView::parse(d).expect("a packet parses");
    qp.credit_received(now, d.len());
    qp.handle_packet(now, &v, mem);
}

#[test]
fn a_peer_that_never_answers_the_challenge_gets_at_most_three_times_what_it_sent() {
    // the caller named a victim as the server's peer and sends READs from its own socket:
    // whatever the server sends goes to the victim, who never echoes the challenge
    let mut p = Pair::new(100);
    p.server
        .require_validation(&[0x1234_5678_9abc_def0], validation::Chooser::Remote);
    let (mut sent, mut reflected) = (0usize, 0usize);
    for i in 0..64u32 {
        let d = forge(&read_request(2, 100 + i, BASE, 64 << 10), A, B);
        sent += d.len();
        deliver(&mut p.server, p.now, &d, &p.smem);
        while let Some(pkt) = p.server.poll_transmit(p.now) {
            reflected += encode(&pkt, B, A).len();
        }
        p.now += 1_000_000;
        p.server.handle_timeout(p.now);
    }
    assert!(reflected > 0, "the server sent nothing, not even a challenge");
    // challenges are answered at most one per packet received, each no larger than it
    assert!(
        reflected <= 3 * sent,
        "{reflected} bytes sent to an unvalidated peer that sent {sent}"
    );
    let s = p.server.stats();
    assert!(s.gated_packets > 0 && s.challenges_sent > 0, "{s:?}");
    assert!(!p.server.peer_validated());
}

#[test]
fn a_peer_that_echoes_the_challenge_is_served_in_full_and_a_wrong_nonce_validates_nothing() {
    let mut p = Pair::new(100);
    p.server
        .require_validation(&[0x0bad_cafe_f00d_0001], validation::Chooser::Remote);
    // a forged reply with a guessed nonce is dropped and counted
    let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::ProbeReply as u8, 2, validation::CHALLENGE));
    h.push_u32(0xdead_beef).push_u32(0x0000_0001);
    deliver(&mut p.server, p.now, &forge(&h, A, B), &p.smem);
    assert!(!p.server.peer_validated());
    assert_eq!(p.server.stats().bad_challenge_replies, 1);
    // the real client echoes the challenge: a 64 KiB READ completes and is intact
    p.read(7, 0, 4096, 64 << 10);
    for _ in 0..1000 {
        let mut moved = false;
        while let Some(pkt) = p.client.poll_transmit(p.now) {
            deliver(&mut p.server, p.now, &encode(&pkt, A, B), &p.smem);
            moved = true;
        }
        while let Some(pkt) = p.server.poll_transmit(p.now) {
            deliver(&mut p.client, p.now, &encode(&pkt, B, A), &p.cmem);
            moved = true;
        }
        p.now += 50_000;
        p.client.handle_timeout(p.now);
        p.server.handle_timeout(p.now);
        if !moved && p.client.has_completions() {
            break;
        }
    }
    assert!(p.server.peer_validated());
    let wc = p.completion();
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::Success));
    assert_eq!(p.cmem.0.bytes(0, 64 << 10), p.smem.0.bytes(4096, 64 << 10));
    let s = p.server.stats();
    assert_eq!(s.routes_validated, 1, "{s:?}");
    assert_eq!(s.timeouts, 0, "validation must not cost a retransmission: {s:?}");
}

#[test]
fn a_qp_whose_peer_named_its_address_challenges_it_once_unpaid() {
    // a connection request named a victim and nothing ever comes from there: one challenge
    // goes out, however long the QP lives
    let mut p = Pair::new(100);
    p.server.require_validation(&[7], validation::Chooser::Remote);
    let mut sent = 0;
    for _ in 0..10_000 {
        while p.server.poll_transmit(p.now).is_some() {
            sent += 1;
        }
        p.now += 1_000_000;
        p.server.handle_timeout(p.now);
    }
    assert_eq!(sent, 1, "{:?}", p.server.stats());
}

#[test]
fn two_sides_that_both_hold_a_packet_still_validate_each_other() {
    // both post a 64 KiB WRITE right after connecting: each holds its first packet until the
    // other answers its challenge, and each answers the other's ahead of what it holds
    let mut p = Pair::new(100);
    p.client.require_validation(&[11], validation::Chooser::Local);
    p.server.require_validation(&[22], validation::Chooser::Remote);
    let wr = |id, lkey| {
        SendWr::new(id, WrOpcode::RdmaWrite)
            .sge(Sge {
                addr: BASE,
                length: 64 << 10,
                lkey,
            })
            .remote(BASE + (128 << 10), KEY)
    };
    p.client.post_send(wr(1, KEY), &p.cmem).expect("client WRITE posted");
    p.server.post_send(wr(2, KEY), &p.smem).expect("server WRITE posted");
    // both build what they can before anything arrives: a challenge each, the WRITEs held
    let first: Vec<_> = std::iter::from_fn(|| p.client.poll_transmit(p.now)).collect();
    let answer: Vec<_> = std::iter::from_fn(|| p.server.poll_transmit(p.now)).collect();
    assert_eq!((first.len(), answer.len()), (1, 1), "only the challenges leave");
    assert!(p.client.stats().gated_packets == 1 && p.server.stats().gated_packets == 1);
    for pkt in &first {
        deliver(&mut p.server, p.now, &encode(pkt, A, B), &p.smem);
    }
    for pkt in &answer {
        deliver(&mut p.client, p.now, &encode(pkt, B, A), &p.cmem);
    }
    for _ in 0..2000 {
        let mut moved = false;
        while let Some(pkt) = p.client.poll_transmit(p.now) {
            deliver(&mut p.server, p.now, &encode(&pkt, A, B), &p.smem);
            moved = true;
        }
        while let Some(pkt) = p.server.poll_transmit(p.now) {
            deliver(&mut p.client, p.now, &encode(&pkt, B, A), &p.cmem);
            moved = true;
        }
        p.now += 50_000;
        p.client.handle_timeout(p.now);
        p.server.handle_timeout(p.now);
        if !moved && p.client.has_completions() && p.server.has_completions() {
            break;
        }
    }
    let (c, s) = (p.client.poll_completion(), p.server.poll_completion());
    assert_eq!(c.map(|w| w.status), Some(WcStatus::Success), "{:?}", p.client.stats());
    assert_eq!(s.map(|w| w.status), Some(WcStatus::Success), "{:?}", p.server.stats());
    assert!(p.client.peer_validated() && p.server.peer_validated());
    assert_eq!(p.client.stats().timeouts + p.server.stats().timeouts, 0);
}

/// Parameters a peer or an application could pick to overflow a deadline or claim unbounded
/// queue memory are refused, naming the field; the largest allowed timeout with the largest
/// backoff still fits a deadline.
#[test]
fn rc_config_bounds_what_could_overflow_a_deadline_or_claim_unbounded_memory() {
    let ok = RcConfig::default();
    for (bad, field) in [
        (
            RcConfig {
                timeout_ns: u64::MAX,
                ..ok
            },
            "timeout_ns",
        ),
        (
            RcConfig {
                max_backoff_shift: 63,
                ..ok
            },
            "max_backoff_shift",
        ),
        (
            RcConfig {
                ack_delay_ns: u64::MAX,
                ..ok
            },
            "ack_delay_ns",
        ),
        (
            RcConfig {
                max_send_wr: u32::MAX,
                ..ok
            },
            "max_send_wr",
        ),
        (
            RcConfig {
                max_recv_wr: 1 << 30,
                ..ok
            },
            "max_recv_wr",
        ),
    ] {
        let e = bad.validate().expect_err(field);
        assert!(e.starts_with(field), "{field}: {e}");
    }
    let edge = RcConfig {
        timeout_ns: MAX_TIMEOUT_NS,
        max_backoff_shift: 16,
        ..ok
    };
    edge.validate().unwrap();
    assert!(edge.retry_bound_ns() < u64::MAX / 4);
}
