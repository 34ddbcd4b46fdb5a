//! A Solar storage server is no reflector (issue 43 item 1): forged READ_REQs naming a victim's
//! UDP address as their source (raw IP, so root) make the server send the victim no more than
//! three times the bytes the forger sent, while a real agent beside it, on two contexts over
//! real UDP sockets on 127.0.0.1, keeps writing and reading back verified blocks.

use netstack::transport::solar::client::ClientConfig;
use netstack::transport::solar::server::SolarServer;
use netstack::transport::solar::wire::{Header, Op, Status, BLOCK, HDR};
use netstack::verbs::solar::{ReadAnswer, ReadBlocks, StorageHandler, WriteBlock, WriteDone};
use netstack::verbs::{Context, ContextConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_support::rawudp::RawUdp;

/// Blocks the forged READ_REQs ask for each (256 KiB of answers per 64-byte packet).
const BLOCKS: u16 = 64;
/// Forged packets.
const FORGED: usize = 400;
const VOLUME: u32 = 1;

/// A stored block and its CRC, by (volume, lba).
type Blocks = HashMap<(u32, u64), (Arc<[u8]>, u32)>;

/// Blocks in memory; writes are durable on arrival.
#[derive(Default)]
struct MemStore {
    blocks: Mutex<Blocks>,
}

impl StorageHandler for MemStore {
    fn write(&self, b: WriteBlock<'_>, done: WriteDone) {
        self.blocks
            .lock()
            .insert((b.volume, b.lba), (Arc::from(b.data.to_vec()), b.crc));
        done.finish(Status::Ok);
    }
    fn read(&self, r: ReadBlocks, answer: &mut ReadAnswer<'_>) {
        let blocks = self.blocks.lock();
        for k in 0..r.count {
            match blocks.get(&(r.volume, r.lba + k as u64)) {
                Some((d, crc)) => answer.block(k, d.clone(), 0, *crc),
                None => answer.failed(k, Status::OutOfRange),
            }
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A forged READ_REQ for `BLOCKS` blocks from `lba`.
fn read_req(i: u64, lba: u64) -> Vec<u8> {
    let mut h = Header::new(Op::ReadReq);
    h.volume = VOLUME;
    h.rpc = 1 << 63 | (1 << 40) | i;
    h.lba = lba;
    h.blk_cnt = BLOCKS;
    h.psn = i as u32;
    h.path = (i % 4) as u16;
    h.packet(&[])
}

#[test]
fn forged_read_requests_reflect_at_most_three_times_their_bytes_while_an_agent_verifies() {
    if !test_support::is_root() {
        test_support::skip(
            "solar_reflection::forged_read_requests",
            test_support::Missing::Root,
            "forging a victim's source address needs a raw socket (root)",
        );
        return;
    }
    let raw = RawUdp::open().expect("a raw socket (root)");
    let store = Arc::new(MemStore::default());
    let sctx = Context::open(ContextConfig {
        path_ports: 1,
        ..ContextConfig::default()
    })
    .unwrap();
    let service = sctx.solar_server(SolarServer::new(), store.clone()).unwrap();
    let actx = Context::open(ContextConfig {
        path_ports: 4,
        ..ContextConfig::default()
    })
    .unwrap();
    let cfg = ClientConfig {
        paths: 4,
        ..ClientConfig::default()
    };
    let agent = Arc::new(actx.solar_client(service.local_addr(), cfg, None).unwrap());

    // the agent's blocks, which the forger will ask for
    let base = pattern(BLOCKS as usize * BLOCK, 0x5eed);
    agent
        .write(VOLUME, 0, Arc::from(base.clone()), true)
        .blocking_recv()
        .unwrap()
        .unwrap();
    let back = agent.read(VOLUME, 0, BLOCKS).blocking_recv().unwrap().unwrap();
    assert!(back == base, "the blocks read back are the blocks written");

    // the victim: a UDP socket that only counts what reaches it
    let victim = UdpSocket::bind("127.0.0.1:0").unwrap();
    victim.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let victim_addr = match victim.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        a => panic!("{a}"),
    };
    let received = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let counter = {
        let (received, stop) = (received.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok(n) = victim.recv(&mut buf) {
                    received.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        })
    };

    // the agent goes on writing fresh blocks and reading them back while the forger sends
    let rounds = Arc::new(AtomicU64::new(0));
    let worker = {
        let (agent, stop, rounds) = (agent.clone(), stop.clone(), rounds.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let lba = 1000 + (i % 8) * 16;
                let data = pattern(16 * BLOCK, i);
                agent
                    .write(VOLUME, lba, Arc::from(data.clone()), false)
                    .blocking_recv()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("round {i}: write: {e}"));
                let got = agent
                    .read(VOLUME, lba, 16)
                    .blocking_recv()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("round {i}: read: {e}"));
                assert!(
                    got == data,
                    "round {i}: the read returned other bytes than the write wrote"
                );
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let server = service.local_addr();
    let rounds_before = rounds.load(Ordering::Relaxed);
    let mut sent = 0u64;
    let t = Instant::now();
    for i in 0..FORGED as u64 {
        let p = read_req(i, 0);
        raw.send(victim_addr, server, &p).expect("a forged datagram sent");
        sent += p.len() as u64;
        if i % 16 == 15 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let attack = t.elapsed();
    // let whatever the server would send arrive, while the agent goes on
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("the agent verified every round");
    counter.join().unwrap();
    let reflected = received.load(Ordering::Relaxed);
    let st = service.stats();
    eprintln!(
        "forged {FORGED} READ_REQs ({sent} bytes in {attack:?}); the victim received {reflected} bytes \
         ({:.2}x); agent rounds {}; server {st:?}",
        reflected as f64 / sent as f64,
        rounds.load(Ordering::Relaxed)
    );
    assert!(
        reflected <= 3 * sent,
        "the victim received {reflected} bytes for {sent} forged ({:.1}x)",
        reflected as f64 / sent as f64
    );
    assert!(
        reflected >= HDR as u64,
        "the victim got at least the challenge (the server saw the forgeries)"
    );
    assert!(
        rounds.load(Ordering::Relaxed) >= rounds_before + 5,
        "the agent kept verifying through the attack"
    );
    // the agent's path addresses were validated (one per path it used); the victim's never
    assert!((1..=4).contains(&st.peers_validated), "{st:?}");
    assert!(st.challenges_sent > st.peers_validated, "{st:?}");
    assert!(st.held_packets + st.dropped_unvalidated > 0, "{st:?}");
    eprintln!("agent: {:?}", agent.status().stats);
}
