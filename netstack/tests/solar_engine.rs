//! Solar endpoints on the engine's data cores, over real UDP sockets: an agent's client and a
//! storage server on two contexts, beside the RC QPs. Writes become durable through a handler
//! that finishes them from another thread; reads come back checked; a malformed packet is
//! counted and dropped and the server goes on serving; a client toward an address nobody
//! serves times out instead of hanging.

use netstack::transport::solar::client::ClientConfig;
use netstack::transport::solar::server::SolarServer;
use netstack::transport::solar::wire::{self, Status, BLOCK};
use netstack::verbs::solar::{ReadAnswer, ReadBlocks, SolarError, StorageHandler, WriteBlock, WriteDone};
use netstack::verbs::{Context, ContextConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A stored block and its CRC, by (volume, lba).
type Blocks = HashMap<(u32, u64), (Arc<[u8]>, u32)>;

/// A write waiting for the store's thread.
struct Job {
    volume: u32,
    lba: u64,
    data: Vec<u8>,
    crc: u32,
    done: WriteDone,
}

/// Blocks in memory; writes are made "durable" by a thread of their own, as a storage node's
/// writer pool would.
struct MemStore {
    blocks: Mutex<Blocks>,
    writes: Mutex<mpsc::Sender<Job>>,
}

impl MemStore {
    fn start() -> Arc<MemStore> {
        let (tx, rx) = mpsc::channel::<Job>();
        let s = Arc::new(MemStore {
            blocks: Mutex::new(HashMap::new()),
            writes: Mutex::new(tx),
        });
        let weak = Arc::downgrade(&s);
        std::thread::spawn(move || {
            for j in rx {
                let Some(s) = weak.upgrade() else { return };
                s.blocks.lock().insert((j.volume, j.lba), (Arc::from(j.data), j.crc));
                j.done.finish(Status::Ok);
            }
        });
        s
    }
}

impl StorageHandler for MemStore {
    fn write(&self, b: WriteBlock<'_>, done: WriteDone) {
        let job = Job {
            volume: b.volume,
            lba: b.lba,
            data: b.data.to_vec(),
            crc: b.crc,
            done,
        };
        let _ = self.writes.lock().send(job);
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

fn ctx(path_ports: u8) -> Context {
    Context::open(ContextConfig {
        path_ports,
        ..ContextConfig::default()
    })
    .unwrap()
}

/// Data no earlier run wrote: a clock-seeded xorshift stream.
fn fresh(len: usize, seed: u64) -> Vec<u8> {
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

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[test]
fn solar_runs_on_the_engine_cores() {
    let store = MemStore::start();
    let sctx = ctx(1);
    let service = sctx.solar_server(SolarServer::new(), store.clone()).unwrap();
    assert!(
        sctx.solar_server(SolarServer::new(), store.clone()).is_err(),
        "one server per context"
    );
    let actx = ctx(4);
    let cfg = ClientConfig {
        paths: 4,
        ..ClientConfig::default()
    };
    let agent = actx.solar_client(service.local_addr(), cfg.clone(), None).unwrap();
    assert!(
        actx.solar_client(service.local_addr(), cfg.clone(), None).is_err(),
        "one client per server address"
    );
    let too_many = ClientConfig {
        paths: 5,
        ..cfg.clone()
    };
    let e = actx
        .solar_client("127.0.0.1:9".parse().unwrap(), too_many, None)
        .err()
        .unwrap();
    assert!(e.to_string().contains("paths"), "{e}");

    // 16 requests of 8 blocks in flight at once, then read back in other shapes
    let data = fresh(128 * BLOCK, seed());
    let writes: Vec<_> = (0..16)
        .map(|i| {
            let part: Arc<[u8]> = Arc::from(&data[i * 8 * BLOCK..(i + 1) * 8 * BLOCK]);
            agent.write(3, 100 + 8 * i as u64, part, i % 2 == 0)
        })
        .collect();
    for w in writes {
        w.blocking_recv().unwrap().unwrap();
    }
    let whole = agent.read(3, 100, 128).blocking_recv().unwrap().unwrap();
    assert!(whole == data, "the blocks read back are the blocks written");
    let some = agent.read(3, 137, 5).blocking_recv().unwrap().unwrap();
    assert_eq!(some, data[37 * BLOCK..42 * BLOCK]);
    let e = agent.read(3, 5000, 1).blocking_recv().unwrap().unwrap_err();
    assert!(matches!(e, SolarError::Io(_)), "{e:?}");

    // a malformed packet is counted and dropped; the server goes on serving
    let before = service.stats().malformed;
    let mut bad = wire::Header::new(wire::Op::ReadReq).packet(&[]);
    bad[20] ^= 0xff; // the header CRC no longer matches
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.send_to(&bad, service.local_addr()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while service.stats().malformed == before {
        assert!(Instant::now() < deadline, "the malformed packet was not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let again = agent.read(3, 100, 2).blocking_recv().unwrap().unwrap();
    assert_eq!(again, data[..2 * BLOCK]);

    // the status the core publishes: every path used and up, nothing outstanding
    std::thread::sleep(Duration::from_millis(20));
    let st = agent.status();
    assert_eq!((st.paths, st.paths_up, st.outstanding), (4, 4, 0), "{st:?}");
    assert!(st.stats.blocks_sent >= 128, "{st:?}");
    assert!(service.stats().writes >= 128, "{:?}", service.stats());
    let es = actx.stats();
    assert!(es.tx_packets > 0 && es.rx_datagrams > 0, "{es:?}");
}

#[test]
fn a_request_to_nobody_times_out_and_a_closed_client_fails_its_requests() {
    // a port with no server: nothing answers
    let nobody = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = match nobody.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    let actx = ctx(2);
    let cfg = ClientConfig {
        paths: 2,
        io_timeout_ns: 300_000_000,
        ..ClientConfig::default()
    };
    let agent = actx.solar_client(addr, cfg.clone(), None).unwrap();
    let t = Instant::now();
    let e = agent.read(1, 0, 1).blocking_recv().unwrap().unwrap_err();
    assert!(matches!(e, SolarError::Io(_)), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let pending = agent.write(1, 0, Arc::from(vec![1u8; BLOCK]), false);
    drop(agent);
    assert_eq!(pending.blocking_recv().unwrap(), Err(SolarError::Stopped));
    // the address is free again for a new client
    let _again = actx.solar_client(addr, cfg, None).unwrap();
}

/// A client context driven by a task on the application's runtime (`Drive::Runtime`): requests
/// at depth and alone come back right, the passes are the task's (counted as application
/// passes), and a context opened outside a runtime is refused with the reason.
#[test]
fn a_runtime_task_drives_a_client_context() {
    let outside = Context::open(ContextConfig {
        drive: netstack::verbs::Drive::Runtime,
        ..ContextConfig::default()
    });
    let e = outside.err().expect("no runtime, no runtime drive");
    assert!(e.to_string().contains("tokio runtime"), "{e}");

    let store = MemStore::start();
    let sctx = ctx(1);
    let service = sctx.solar_server(SolarServer::new(), store.clone()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let actx = rt.block_on(async {
        Context::open(ContextConfig {
            path_ports: 4,
            drive: netstack::verbs::Drive::Runtime,
            ..ContextConfig::default()
        })
        .unwrap()
    });
    let cfg = ClientConfig {
        paths: 4,
        ..ClientConfig::default()
    };
    let agent = actx.solar_client(service.local_addr(), cfg, None).unwrap();
    let data = fresh(64 * BLOCK, seed());
    rt.block_on(async {
        // 32 single-block writes at once, then reads alone and at depth
        let writes: Vec<_> = (0..32)
            .map(|i| {
                agent.write(
                    7,
                    2 * i as u64,
                    Arc::from(&data[2 * i * BLOCK..(2 * i + 2) * BLOCK]),
                    false,
                )
            })
            .collect();
        for w in writes {
            w.await.unwrap().unwrap();
        }
        for i in 0..8u64 {
            let one = agent.read(7, 5 * i, 1).await.unwrap().unwrap();
            assert_eq!(one, data[5 * i as usize * BLOCK..(5 * i as usize + 1) * BLOCK]);
        }
        let reads: Vec<_> = (0..16).map(|i| agent.read(7, 4 * i, 4)).collect();
        for (i, r) in reads.into_iter().enumerate() {
            let got = r.await.unwrap().unwrap();
            assert!(got == data[4 * i * BLOCK..(4 * i + 4) * BLOCK], "read {i}");
        }
    });
    let es = actx.stats();
    assert!(es.task_passes > 0, "the runtime's task received the answers: {es:?}");
    assert!(es.rx_datagrams >= 32 + 8 + 16, "{es:?}");
    drop(agent);
    drop(actx);
    drop(rt);
}
