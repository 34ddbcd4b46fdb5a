//! The connection manager's door over real gRPC on 127.0.0.1: a batch over `max_batch` is
//! refused whole, a caller past `max_qps_per_caller` is refused by name, and phantom QPs (which
//! never receive a packet) are reaped after `unused_timeout`, counted, and free the caller's
//! slots, while a QP that carried data is kept.

use netstack::cm::{self, Accepted, Acceptor, Connector, DoorLimits, DoorStats};
use netstack::verbs::*;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Keeps its connected QPs by number, as the door's hooks need.
struct MapAcceptor {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    mr: Mr,
    qps: Mutex<HashMap<u32, Qp>>,
}

impl Acceptor for MapAcceptor {
    fn accept(&self, _remote: &Endpoint, _pd: &[u8]) -> Result<Accepted, String> {
        let qp = self
            .ctx
            .create_qp(&self.pd, &self.cq, &self.cq, QpInitAttr::default())
            .map_err(|e| e.to_string())?;
        let mut reply = self.mr.addr().to_le_bytes().to_vec();
        reply.extend_from_slice(&self.mr.rkey().to_le_bytes());
        Ok(Accepted {
            qp,
            private_data: reply,
        })
    }

    fn connected(&self, qp: Qp) {
        self.qps.lock().insert(qp.qp_num(), qp);
    }

    fn rx_packets(&self, qpn: u32) -> Option<u64> {
        self.qps.lock().get(&qpn).map(|q| q.stats().rx_packets)
    }

    fn reap(&self, qpn: u32) {
        self.qps.lock().remove(&qpn);
    }
}

const CAP: usize = 300;
/// Long enough that the flood (about 0.1 s here) and the refused request fit in it on a loaded
/// machine.
const TIMEOUT: Duration = Duration::from_secs(2);

struct Server {
    acc: Arc<MapAcceptor>,
    stats: DoorStats,
    addr: std::net::SocketAddr,
    _rt: tokio::runtime::Runtime,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn server() -> Server {
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1 << 12).unwrap();
    let mr = pd.reg_mr(1 << 16, Access::ALL).unwrap();
    let acc = Arc::new(MapAcceptor {
        ctx,
        pd,
        cq,
        mr,
        qps: Mutex::new(HashMap::new()),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let limits = DoorLimits {
        max_batch: cm::CHUNK,
        max_qps_per_caller: CAP,
        unused_timeout: TIMEOUT,
    };
    let (svc, stats) = cm::service_with(acc.clone(), limits);
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(cm::incoming(listener), async {
                let _ = rx.await;
            }),
    );
    Server {
        acc,
        stats,
        addr,
        _rt: rt,
        _stop: tx,
    }
}

fn local() -> std::net::IpAddr {
    "127.0.0.1".parse().unwrap()
}

#[test]
fn a_batch_over_max_batch_is_refused_whole() {
    let s = server();
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let (pd, cq) = (ctx.alloc_pd(), ctx.create_cq(16).unwrap());
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let one = cm::pb::ConnectRequest {
        endpoint: Some(qp.local_endpoint().into()),
        private_data: Vec::new(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt
        .block_on(async {
            let mut raw =
                cm::pb::connection_manager_client::ConnectionManagerClient::connect(format!("http://{}", s.addr))
                    .await
                    .unwrap();
            raw.connect_qps(cm::pb::ConnectBatch {
                requests: vec![one; cm::CHUNK + 1],
            })
            .await
        })
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("max_batch"), "{}", err.message());
    assert!(s.acc.qps.lock().is_empty(), "nothing of the batch was accepted");
}

#[test]
fn phantoms_past_the_cap_are_refused_then_reaped_and_a_real_client_gets_in() {
    let s = server();
    let ctx = Context::open(ContextConfig::default()).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1 << 12).unwrap();
    let mr = pd.reg_mr(1 << 12, Access::ALL).unwrap();
    let qp = || ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut conn = rt.block_on(Connector::new(s.addr)).unwrap();

    // the flood: CAP phantoms (connected, never used) fill this caller's share
    let phantoms: Vec<Qp> = (0..CAP).map(|_| qp()).collect();
    let reqs: Vec<(&Qp, Vec<u8>)> = phantoms.iter().map(|q| (q, Vec::new())).collect();
    let t = Instant::now();
    let replies = rt.block_on(conn.connect_many(&reqs)).unwrap();
    assert!(replies.iter().all(|r| r.is_ok()), "the first {CAP} are admitted");
    assert_eq!(s.stats.held_by(local()), CAP);
    // one more is refused, naming the limit
    let extra = qp();
    let r = rt.block_on(conn.connect(&extra, Vec::new()));
    assert!(t.elapsed() < TIMEOUT, "the flood took {:?}", t.elapsed());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("max_qps_per_caller is 300"), "{e}");
    assert_eq!(s.acc.qps.lock().len(), CAP, "the refused request made no QP");

    // the phantoms never send: after the timeout they are reaped, counted, and their slots free
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.stats.reaped() < CAP as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        // a connect attempt sweeps too; the periodic sweeper is serve_with's
        let _ = rt.block_on(conn.connect(&qp(), Vec::new()));
    }
    assert!(s.stats.reaped() >= CAP as u64, "reaped {}", s.stats.reaped());

    // a real client is admitted and moves data
    let real = qp();
    let reply = rt.block_on(conn.connect(&real, Vec::new())).unwrap();
    let raddr = u64::from_le_bytes(reply[..8].try_into().unwrap());
    let rkey = u32::from_le_bytes(reply[8..12].try_into().unwrap());
    let data: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
    mr.write(0, &data);
    real.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 64))
            .remote(raddr + 128, rkey),
    )
    .unwrap();
    let wc = cq.next(Duration::from_secs(10)).expect("a completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    let mut back = vec![0u8; 64];
    s.acc.mr.read(128, &mut back);
    assert_eq!(back, data);

    // a QP that carried data outlives the timeout: only never-used QPs are reaped
    let reaped = s.stats.reaped();
    let used_at = Instant::now();
    while used_at.elapsed() < TIMEOUT * 2 {
        std::thread::sleep(Duration::from_millis(50));
        let _ = rt.block_on(conn.connect(&qp(), Vec::new()));
    }
    assert_eq!(real.state(), QpState::Rts);
    let held = s.acc.qps.lock().len();
    assert!(held >= 1, "the used QP is still held");
    assert!(
        s.stats.reaped() > reaped,
        "the probes' unused QPs were reaped meanwhile"
    );
    real.post_send(
        SendWr::new(2, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 64))
            .remote(raddr + 256, rkey),
    )
    .unwrap();
    let wc = cq.next(Duration::from_secs(10)).expect("a completion");
    assert_eq!(wc.status, WcStatus::Success, "the used QP still works: {wc:?}");
}
