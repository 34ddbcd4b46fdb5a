//! kv-server's connection-manager door against a phantom flood, over real processes: a
//! `kv-server` child (started as `flexns kv-server`), an attacker that sends unauthenticated
//! `ConnectQps` batches of phantom QPs (endpoints that never answer) from 127.0.0.2, and real
//! kv clients on 127.0.0.1. The attacker is refused past its per-caller cap and past the batch
//! cap, real clients are admitted meanwhile and do verified puts and gets, the phantoms are
//! reaped after the configured timeout (counted in `flexns_cm_qps_reaped_total`) and free the
//! attacker's slots, a real client idle for several timeouts is not reaped, and the server's
//! RSS stays bounded.

#[path = "common/prom.rs"]
#[allow(dead_code)] // this test asks /metrics only
mod prom;

use clients::bench::ChildServer;
use kv_store::client::{ClientConfig, GetPath, KvClient};
use kv_store::proto::Hello;
use netstack::cm::pb;
use netstack::verbs::{Context, ContextConfig};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// The attacker's cap (`--max-connections-per-caller`), below `--max-connections` (64).
const CAP: usize = 12;
/// `--unused-connection-timeout`.
const TIMEOUT: Duration = Duration::from_secs(1);
/// Message memory of one connection of depth 64 (3 × 64 slots of 66 KiB, see
/// `ServerConfig::max_connections`).
const CONN_BYTES: u64 = 3 * 64 * 66 * 1024;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Server {
    child: ChildServer,
    cm: SocketAddr,
    metrics: String,
    _config: tempfile_path::TempPath,
}

/// A path removed when dropped (no tempfile crate here).
mod tempfile_path {
    pub struct TempPath(pub std::path::PathBuf);
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn server() -> Server {
    // The server's probe of a connection never heard from goes out at half the timeout; with a
    // 67 ms ACK timeout its retries to a phantom's silent endpoint last 67 ms × (1 + 2 + 4 + 8 +
    // 16 × 4) = 5.3 s, so it is the door's reaper (at 1 s, sweeping every 0.25 s) that ends
    // the phantoms here, not the probe's failure.
    let config = tempfile_path::TempPath(std::env::temp_dir().join(format!("kv-cm-door-{}.toml", std::process::id())));
    std::fs::write(&config.0, "[qp]\ntimeout_ns = 67108864\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let args: Vec<String> = [
        "kv-server",
        "--capacity",
        "4096",
        "--data-size",
        "16MiB",
        "--resp",
        "off",
        "--max-connections",
        "64",
        "--max-connections-per-caller",
        &CAP.to_string(),
        "--unused-connection-timeout",
        &TIMEOUT.as_secs_f64().to_string(),
        "--metrics-addr",
        &metrics,
        "--config",
        config.0.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let child = ChildServer::start(env!("CARGO_BIN_EXE_flexns").as_ref(), &args).expect("kv-server starts");
    let cm = child.field("cm").unwrap().parse().unwrap();
    Server {
        child,
        cm,
        metrics,
        _config: config,
    }
}

fn rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib << 10
}

/// `flexns_cm_qps_reaped_total` from the server's `/metrics` (0 before the first reap).
fn reaped(metrics: &str) -> u64 {
    let (status, body) = prom::http_get(metrics, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix("flexns_cm_qps_reaped_total "))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

type Raw = pb::connection_manager_client::ConnectionManagerClient<tonic::transport::Channel>;

/// A raw gRPC client of the connection manager, connecting from `from`.
fn raw(rt: &tokio::runtime::Runtime, cm: SocketAddr, from: IpAddr) -> Raw {
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{cm}"))
            .unwrap()
            .local_address(Some(from))
            .connect()
            .await
            .expect("connecting to the connection manager");
        Raw::new(ch)
    })
}

/// `n` phantom requests: kv connections of depth 64 whose endpoint is `sink`, which never
/// answers.
fn phantoms(n: usize, sink: SocketAddr) -> pb::ConnectBatch {
    pb::ConnectBatch {
        requests: (0..n)
            .map(|i| pb::ConnectRequest {
                endpoint: Some(pb::QpEndpoint {
                    qpn: 0x1000 + i as u32,
                    psn: 7,
                    addr: sink.to_string(),
                    mtu: 4096,
                    recovery: "go-back-n".into(),
                    ..Default::default()
                }),
                private_data: serde_json::to_vec(&Hello::Kv { depth: 64 }).unwrap(),
            })
            .collect(),
    }
}

fn accepted(r: &pb::ConnectBatchReply) -> usize {
    r.results
        .iter()
        .filter(|r| matches!(r.result, Some(pb::connect_result::Result::Reply(_))))
        .count()
}

fn real_client(ctx: &Context, cm: SocketAddr) -> Result<KvClient, kv_store::KvError> {
    KvClient::connect(
        ctx,
        ClientConfig {
            servers: vec![cm],
            get_path: GetPath::Rpc,
            depth: 64,
            ..Default::default()
        },
    )
}

fn value(k: u32, round: u32) -> Vec<u8> {
    (0..100u32)
        .map(|i| (i ^ k.wrapping_mul(31) ^ round.wrapping_mul(7)) as u8)
        .collect()
}

fn verify(c: &mut KvClient, round: u32) {
    for k in 0..50u32 {
        c.put(&k.to_le_bytes(), &value(k, round)).expect("put");
    }
    for k in 0..50u32 {
        assert_eq!(c.get(&k.to_le_bytes()).expect("get"), Some(value(k, round)), "key {k}");
    }
}

#[test]
fn a_phantom_flood_is_capped_and_reaped_while_real_clients_get_in() {
    let s = server();
    let pid = s.child.pid().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let sink_addr = sink.local_addr().unwrap();
    let ctx = Context::open(ContextConfig::default()).unwrap();

    // a real client connected before the flood
    let mut before = real_client(&ctx, s.cm).expect("a client before the flood");
    verify(&mut before, 0);
    let rss0 = rss_bytes(pid);

    // the flood, from 127.0.0.2: a batch over the per-batch cap is refused whole ...
    let attacker: IpAddr = "127.0.0.2".parse().unwrap();
    let mut a = raw(&rt, s.cm, attacker);
    let e = rt
        .block_on(a.connect_qps(phantoms(netstack::cm::CHUNK + 1, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("a batch over max_batch");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max_batch"), "{}", e.message());
    // ... the cap's worth is admitted, and more is refused naming the limit
    let flood_at = Instant::now();
    let r = rt
        .block_on(a.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&r), CAP, "{r:?}");
    let e = rt
        .block_on(a.connect_qps(phantoms(CAP, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("phantoms past the caller's cap are refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains(&format!("max_qps_per_caller is {CAP}")),
        "{}",
        e.message()
    );
    let e = rt
        .block_on(a.connect_qps(phantoms(1, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("even one more");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");

    // while the attacker is at its cap, a new real client is admitted and verifies
    let mut during = real_client(&ctx, s.cm).expect("a real client admitted during the flood");
    // and one that sends nothing until the end: the server's probe finds it alive
    let mut idle = real_client(&ctx, s.cm).expect("an idle client admitted during the flood");
    assert!(
        flood_at.elapsed() < TIMEOUT,
        "the phantoms were still held: {:?}",
        flood_at.elapsed()
    );
    verify(&mut during, 1);
    verify(&mut before, 2);
    let rss_flood = rss_bytes(pid);
    // the flood holds at most the cap's connections' message memory (and the two clients')
    let bound = rss0 + (CAP as u64 + 2) * CONN_BYTES + (64 << 20);
    assert!(
        rss_flood <= bound,
        "RSS {} MiB during the flood, bound {} MiB",
        rss_flood >> 20,
        bound >> 20
    );

    // the phantoms never answer: after the timeout they are reaped and counted, and free the
    // attacker's slots; the idle real clients are not reaped
    let until = flood_at + TIMEOUT + Duration::from_secs(15);
    while reaped(&s.metrics) < CAP as u64 {
        assert!(Instant::now() < until, "reaped {} of {CAP}", reaped(&s.metrics));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        flood_at.elapsed() >= TIMEOUT,
        "reaped before the timeout: {:?}",
        flood_at.elapsed()
    );
    let r = rt
        .block_on(a.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&r), CAP, "the reaped phantoms' slots are free again: {r:?}");
    // the real clients stay idle for three timeouts: the second wave is reaped, they are not
    let wave2 = Instant::now();
    while reaped(&s.metrics) < 2 * CAP as u64 || wave2.elapsed() < 3 * TIMEOUT {
        assert!(
            wave2.elapsed() < TIMEOUT + Duration::from_secs(15),
            "second wave not reaped"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    verify(&mut before, 3);
    verify(&mut during, 4);
    verify(&mut idle, 5);
    assert_eq!(reaped(&s.metrics), 2 * CAP as u64, "only the phantoms were reaped");
    let rss_end = rss_bytes(pid);
    assert!(
        rss_end <= bound,
        "RSS {} MiB after two waves, bound {} MiB",
        rss_end >> 20,
        bound >> 20
    );
    eprintln!(
        "kv-server RSS: {} MiB before, {} MiB during the flood, {} MiB after two waves",
        rss0 >> 20,
        rss_flood >> 20,
        rss_end >> 20
    );
}
