//! A hostile peer on the network (issue 43): it forges RoCEv2 packets with correct ICRCs from
//! the legitimate client's address (raw IP, so root), knowing the server's QPN and PSNs. Two
//! contexts over real UDP sockets on 127.0.0.1: the client runs a verified WRITE/READ loop while
//! spoofed ghost NAKs hit the server's QP, then forged READs ask it for memory nobody asked
//! for. The connection lives on and the server sends nothing for the forgeries.

use netstack::verbs::*;
use netstack::wire::{encode_into, Aeth, Bth, HeaderBuf, NakCode, Opcode, Reth, Syndrome};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_support::rawudp::RawUdp;

const T: Duration = Duration::from_secs(10);
/// Bytes each WRITE and READ of the client's loop moves (16 packets of 4 KiB).
const OP: usize = 64 << 10;
/// The server's region: what a forged READ would reflect.
const SERVER_MEM: usize = 4 << 20;

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn side(mr_len: usize) -> Side {
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let mr = pd.reg_mr(mr_len, Access::ALL).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 ^ seed).wrapping_mul(2654435761).to_le_bytes()[1])
        .collect()
}

/// A RoCEv2 datagram with a correct ICRC, as sent from `src` to `dst`.
fn forge(hdr: &HeaderBuf, src: SocketAddrV4, dst: SocketAddrV4) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(&mut out, hdr, &[], src, dst);
    out
}

fn nak(dest_qp: u32, psn: u32) -> HeaderBuf {
    let mut h = HeaderBuf::with_bth(&Bth::new(Opcode::Acknowledge as u8, dest_qp, psn));
    h.push_aeth(&Aeth {
        syndrome: Syndrome::Nak(NakCode::RemoteAccessError), // 0x62
        msn: 0,
    });
    h
}

fn read_request(dest_qp: u32, psn: u32, reth: Reth) -> HeaderBuf {
    let mut bth = Bth::new(Opcode::ReadRequest as u8, dest_qp, psn);
    bth.ack_req = true;
    let mut h = HeaderBuf::with_bth(&bth);
    h.push_reth(&reth);
    h
}

/// One WRITE of a fresh pattern to the server and a READ of it back, both verified.
fn round(client: &Side, server: &Side, i: u32) {
    let data = pattern(OP, i);
    client.mr.write(0, &data);
    client
        .qp
        .post_send(
            SendWr::new(2 * i as u64, WrOpcode::RdmaWrite)
                .sge(client.mr.sge(0, OP))
                .remote(server.mr.addr(), server.mr.rkey()),
        )
        .unwrap();
    let wc = client.cq.next(T).expect("WRITE completion");
    assert_eq!(wc.status, WcStatus::Success, "round {i}: {wc:?}");
    client
        .qp
        .post_send(
            SendWr::new(2 * i as u64 + 1, WrOpcode::RdmaRead)
                .sge(client.mr.sge(OP, OP))
                .remote(server.mr.addr(), server.mr.rkey()),
        )
        .unwrap();
    let wc = client.cq.next(T).expect("READ completion");
    assert_eq!(wc.status, WcStatus::Success, "round {i}: {wc:?}");
    let mut got = vec![0u8; OP];
    client.mr.read(OP, &mut got);
    assert!(
        got == data,
        "round {i}: the READ returned other bytes than the WRITE wrote"
    );
}

/// Waits until `f` holds (a counter the server's core updates asynchronously).
fn wait_for(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn spoofed_naks_and_forged_reads_neither_end_nor_reflect_a_live_connection() {
    if !test_support::is_root() {
        test_support::skip(
            "hostile::spoofed_naks_and_forged_reads",
            test_support::Missing::Root,
            "forging a peer's source address needs a raw socket (root)",
        );
        return;
    }
    let raw = RawUdp::open().expect("a raw socket (root)");
    let client = side(2 * OP);
    let server = side(SERVER_MEM);
    server.mr.write(0, &pattern(SERVER_MEM, 0xdead));
    let (ce, se) = (client.qp.local_endpoint(), server.qp.local_endpoint());
    client.qp.connect(&se).unwrap();
    server.qp.connect(&ce).unwrap();
    assert_eq!(ce.mtu, 4096);
    let pkts = (OP / 4096) as u32;

    // (i) the forger sprays ghost NAKs (syndrome 0x62) at the server's QP, from the client's
    // address, while the client works: the server has nothing outstanding, so none names a
    // request of its
    let stop = Arc::new(AtomicBool::new(false));
    let forger = {
        let stop = stop.clone();
        let raw = RawUdp::open().expect("a raw socket (root)");
        let (src, dst, qpn) = (ce.addr, se.addr, se.qpn);
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) || sent < 400 {
                for psn in [0, 4 << 20, 8 << 20, 12 << 20] {
                    raw.send(src, dst, &forge(&nak(qpn, psn), src, dst))
                        .expect("a forged datagram sent");
                    sent += 1;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            sent
        })
    };
    let mut i = 0;
    let started = Instant::now();
    while i < 20 || started.elapsed() < Duration::from_millis(300) {
        round(&client, &server, i);
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let sent = forger.join().unwrap();
    wait_for("the server to count every ghost NAK", || {
        server.qp.stats().ghost_naks >= sent
    });
    let s = server.qp.stats();
    assert_eq!(s.ghost_naks, sent, "{s:?}");
    assert_eq!(server.qp.state(), QpState::Rts, "spoofed NAKs end no connection");
    assert_eq!(client.qp.state(), QpState::Rts);
    assert_eq!(s.qp_errors, client.qp.stats().qp_errors);
    assert!(s.qp_errors.iter().all(|&n| n == 0), "{s:?}");
    round(&client, &server, i);
    i += 1;

    // (ii) forged READs. The client's requests so far took PSNs ce.psn.. in rounds of a
    // 16-packet WRITE and a 16-packet READ; the client pauses so that whatever the server
    // sends from now on answers the forger
    let read_psn = |round: u32| (ce.psn + (2 * round + 1) * pkts) & 0xFF_FFFF;
    let last_read = read_psn(i - 1);
    let whole = Reth {
        va: server.mr.addr(),
        rkey: server.mr.rkey(),
        dma_len: SERVER_MEM as u32,
    };
    let first = Reth {
        va: server.mr.addr(),
        rkey: server.mr.rkey(),
        dma_len: OP as u32,
    };
    std::thread::sleep(Duration::from_millis(50)); // delayed ACKs out
    let before = (server.ctx.stats().tx_bytes, server.qp.stats());
    // the latest READ's PSN with a RETH for the whole region (a modified capture)
    raw.send(
        ce.addr,
        se.addr,
        &forge(&read_request(se.qpn, last_read, whole), ce.addr, se.addr),
    )
    .expect("a forged datagram sent");
    // the first READ replayed exactly (long retired: dozens of READs were accepted since)
    raw.send(
        ce.addr,
        se.addr,
        &forge(&read_request(se.qpn, read_psn(0), first), ce.addr, se.addr),
    )
    .expect("a forged datagram sent");
    let dups = |s: &RcStats| s.duplicate_requests + s.duplicate_requests_refused;
    wait_for("the server to take both forged READs", || {
        dups(&server.qp.stats()) >= dups(&before.1) + 2
    });
    std::thread::sleep(Duration::from_millis(100)); // anything it were to send would be out
    let after = (server.ctx.stats().tx_bytes, server.qp.stats());
    assert_eq!(
        after.0 - before.0,
        0,
        "the server sent bytes for forged READs: {:?}",
        after.1
    );
    assert_eq!(after.1.tx_packets, before.1.tx_packets);
    assert_eq!(
        after.1.duplicate_requests_refused - before.1.duplicate_requests_refused,
        2
    );
    assert_eq!(server.qp.state(), QpState::Rts);

    // the client goes on as before
    for _ in 0..5 {
        round(&client, &server, i);
        i += 1;
    }
    assert_eq!((client.qp.state(), server.qp.state()), (QpState::Rts, QpState::Rts));
}

/// Every opcode the stack knows, and some it does not.
const OPCODES: &[u8] = &[
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10, 0x11, 0x12,
    0x13, 0x14, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x1f, 0x40, 0x64, 0xff,
];

#[test]
fn random_packets_with_valid_bths_from_the_client_address_end_no_connection() {
    if !test_support::is_root() {
        test_support::skip(
            "hostile::random_packets_with_valid_bths",
            test_support::Missing::Root,
            "forging a peer's source address needs a raw socket (root)",
        );
        return;
    }
    use rand::{Rng, SeedableRng};
    let raw = RawUdp::open().expect("a raw socket (root)");
    let client = side(2 * OP);
    let server = side(SERVER_MEM);
    let (ce, se) = (client.qp.local_endpoint(), server.qp.local_endpoint());
    client.qp.connect(&se).unwrap();
    server.qp.connect(&ce).unwrap();
    round(&client, &server, 0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x0ddba11);
    let before = server.ctx.stats();
    let mut forged = 0u64;
    for i in 1..=20u32 {
        // a burst of forgeries: a known or unknown opcode, the server's QPN, any PSN, random
        // header and payload bytes of any length, a correct ICRC, from the client's address
        for _ in 0..100 {
            let op = OPCODES[rng.random_range(0..OPCODES.len())];
            let mut bth = Bth::new(op, se.qpn, rng.random_range(0..1 << 24));
            bth.ack_req = rng.random();
            let mut h = HeaderBuf::with_bth(&bth);
            let tail: Vec<u8> = (0..rng.random_range(0..96)).map(|_| rng.random()).collect();
            h.set_pad_for(tail.len());
            let mut out = Vec::new();
            encode_into(&mut out, &h, &[&tail], ce.addr, se.addr);
            raw.send(ce.addr, se.addr, &out).expect("a forged datagram sent");
            forged += 1;
        }
        // the client goes on verifying between the bursts
        round(&client, &server, i);
    }
    wait_for("the server to take in every forged packet", || {
        server.ctx.stats().rx_datagrams - before.rx_datagrams >= forged
    });
    let s = server.qp.stats();
    assert_eq!(
        (client.qp.state(), server.qp.state()),
        (QpState::Rts, QpState::Rts),
        "{s:?}"
    );
    assert!(s.qp_errors.iter().all(|&n| n == 0), "{s:?}");
    assert!(client.qp.stats().qp_errors.iter().all(|&n| n == 0));
    round(&client, &server, 21);
}
