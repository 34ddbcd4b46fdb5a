//! A server as a reflector (issue 43 item 1): whoever sets up a QP names its peer's address,
//! and nothing there proves the caller owns it. An attacker connects a server's QP naming a
//! victim's socket as the peer and its own socket as one of the peer's sources, then sends
//! READ requests for the server's whole region from its own socket, no spoofing needed. The
//! server must send the victim at most three times the bytes the attacker sent (it validates
//! the peer with a challenge the victim never answers), while a real client beside it, which
//! does answer, runs verified WRITEs and READs at full size.

use netstack::verbs::*;
use netstack::wire::{encode_into, Bth, HeaderBuf, Opcode, Reth};
use std::net::{SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);
/// The server's region, all of it asked for by each forged READ.
const SERVER_MEM: usize = 4 << 20;
/// Bytes each WRITE and READ of the real client moves.
const OP: usize = 256 << 10;

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 ^ seed).wrapping_mul(2654435761).to_le_bytes()[1])
        .collect()
}

fn read_request(dest_qp: u32, psn: u32, reth: Reth) -> HeaderBuf {
    let mut bth = Bth::new(Opcode::ReadRequest as u8, dest_qp, psn);
    bth.ack_req = true;
    let mut h = HeaderBuf::with_bth(&bth);
    h.push_reth(&reth);
    h
}

fn v4(s: &UdpSocket) -> SocketAddrV4 {
    match s.local_addr().expect("a bound socket") {
        std::net::SocketAddr::V4(a) => a,
        a => panic!("{a} is not IPv4"),
    }
}

#[test]
fn a_qp_pointed_at_a_victim_sends_it_at_most_three_times_what_the_attacker_sent() {
    let server = Context::open(ContextConfig::default()).unwrap();
    let pd = server.alloc_pd();
    let cq = server.create_cq(1024).unwrap();
    let mr = pd.reg_mr(SERVER_MEM, Access::ALL).unwrap();
    mr.write(0, &pattern(SERVER_MEM, 0x5eed));

    // the victim counts what reaches it
    let victim = UdpSocket::bind("127.0.0.1:0").unwrap();
    victim.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let victim_addr = v4(&victim);
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let counter = {
        let (stop, received) = (stop.clone(), received.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok(n) = victim.recv(&mut buf) {
                    received.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        })
    };

    // the attacker's QP on the server: peer "addr" is the victim, its own socket a "source"
    let attacker = UdpSocket::bind("127.0.0.1:0").unwrap();
    let attacker_addr = v4(&attacker);
    let target = server.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let te = target.local_endpoint();
    let forged = Endpoint {
        qpn: 0x4242,
        psn: 0,
        addr: victim_addr,
        sources: vec![attacker_addr],
        ..te.clone()
    };
    target.connect(&forged).unwrap();

    // a real client on another QP of the same server, working all along
    let client = Context::open(ContextConfig::default()).unwrap();
    let cpd = client.alloc_pd();
    let ccq = client.create_cq(1024).unwrap();
    let cqp = client.create_qp(&cpd, &ccq, &ccq, QpInitAttr::default()).unwrap();
    let cmr = cpd.reg_mr(2 * OP, Access::ALL).unwrap();
    let sqp = server.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    cqp.connect(&sqp.local_endpoint()).unwrap();
    sqp.connect(&cqp.local_endpoint()).unwrap();

    // the attacker's READs, each for the whole region at the PSN the last one left the
    // responder expecting (a 4 MiB READ takes 1024 PSNs)
    let whole = Reth {
        va: mr.addr(),
        rkey: mr.rkey(),
        dma_len: SERVER_MEM as u32,
    };
    let mut sent = 0u64;
    let mut out = Vec::new();
    for (i, round) in (0..40u32).enumerate() {
        for k in 0..4 {
            out.clear();
            encode_into(
                &mut out,
                &read_request(te.qpn, ((round * 4 + k) << 10) & 0xFF_FFFF, whole),
                &[],
                attacker_addr,
                te.addr,
            );
            attacker.send_to(&out, te.addr).unwrap();
            sent += out.len() as u64;
        }
        // meanwhile the real client WRITEs and READs back fresh bytes at the region's end
        let data = pattern(OP, i as u32);
        cmr.write(0, &data);
        cqp.post_send(
            SendWr::new(2 * i as u64, WrOpcode::RdmaWrite)
                .sge(cmr.sge(0, OP))
                .remote(mr.addr() + (SERVER_MEM - OP) as u64, mr.rkey()),
        )
        .unwrap();
        let wc = ccq.next(T).expect("WRITE completion");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        cqp.post_send(
            SendWr::new(2 * i as u64 + 1, WrOpcode::RdmaRead)
                .sge(cmr.sge(OP, OP))
                .remote(mr.addr() + (SERVER_MEM - OP) as u64, mr.rkey()),
        )
        .unwrap();
        let wc = ccq.next(T).expect("READ completion");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let mut got = vec![0u8; OP];
        cmr.read(OP, &mut got);
        assert!(
            got == data,
            "round {i}: the READ returned other bytes than the WRITE wrote"
        );
    }
    // whatever the server would send has left well before this
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    counter.join().unwrap();
    let reflected = received.load(Ordering::Relaxed);
    let s = target.stats();
    eprintln!("attacker sent {sent} bytes; the victim received {reflected}; {s:?}");
    assert!(
        reflected <= 3 * sent,
        "the server sent the victim {reflected} bytes for {sent} from the attacker: {s:?}"
    );
    assert!(s.challenges_sent > 0 && s.routes_validated == 0, "{s:?}");
    assert!(s.gated_packets > 0, "nothing was held back: {s:?}");
    let real = sqp.stats();
    assert!(
        real.routes_validated >= 1,
        "the real client was never validated: {real:?}"
    );
    assert_eq!(real.timeouts, 0, "{real:?}");
}
