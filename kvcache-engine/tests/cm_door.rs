//! A kvcache engine's connection-manager door against a phantom flood, over real processes: a
//! decode engine (a `kvcache-engine serve` child, flexns, P2P metadata), an attacker that sends
//! unauthenticated `ConnectQps` batches of phantom QPs (endpoints that never answer) from
//! 127.0.0.2, and prefill engines in this process on 127.0.0.1. The attacker is refused past
//! the batch cap and past its per-caller cap; a prefill engine that connects while the
//! attacker holds its cap is admitted and moves verified bytes; the phantoms are reaped after
//! the configured timeout (counted in `flexns_cm_qps_reaped_total`) and free the attacker's
//! slots; an engine that connected and sent nothing for several timeouts is not reaped (the
//! decode engine's probe finds it alive); the QPs of an engine that left are dropped; the
//! decode process's RSS stays bounded.

use kvcache_engine::*;
use netstack::cm::pb;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The attacker's cap (`--max-qps-per-caller`); the prefill engines (2 QPs each, all from
/// 127.0.0.1) stay under it.
const CAP: usize = 12;
/// `--unused-qp-timeout`: long enough for two engines to connect while the phantoms are held
/// on a loaded machine.
const TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes of one verified transfer.
const LEN: usize = 1 << 20;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Decode {
    child: Child,
    segment: String,
    rpc: SocketAddr,
    pool_addr: u64,
    metrics: String,
    config: std::path::PathBuf,
}

impl Drop for Decode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

fn decode() -> Decode {
    // The decode engine probes a QP quiet for half the timeout; with a 67 ms ACK timeout the
    // probe's retries to a phantom's silent endpoint last 67 ms × (1 + 2 + 4 + 8 + 16 × 4) =
    // 5.3 s, so it is the door's reaper (at 2 s, sweeping every 0.5 s) that ends the phantoms
    // here, not the probe's failure; a departed engine's QPs fail the probe.
    let config = std::env::temp_dir().join(format!("kvcache-cm-door-{}.toml", std::process::id()));
    std::fs::write(&config, "[qp]\ntimeout_ns = 67108864\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvcache-engine"))
        .args(["serve", "--transport", "flexns", "--metadata", "P2PHANDSHAKE"])
        .args(["--bind", "127.0.0.1", "--advertise", "127.0.0.1", "--pool", "16MiB"])
        .args(["--max-qps-per-caller", &CAP.to_string()])
        .args(["--unused-qp-timeout", &TIMEOUT.as_secs_f64().to_string()])
        .args(["--metrics-addr", &metrics])
        .arg("--stack-config")
        .arg(&config)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting kvcache-engine");
    let out = child.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let banner = lines
        .recv_timeout(Duration::from_secs(30))
        .expect("the decode engine's banner");
    let field = |k: &str| {
        banner
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")).map(str::to_string))
            .unwrap_or_else(|| panic!("{k} in {banner}"))
    };
    Decode {
        segment: field("segment"),
        rpc: field("rpc").parse().unwrap(),
        pool_addr: u64::from_str_radix(field("pool_addr").trim_start_matches("0x"), 16).unwrap(),
        metrics,
        config,
        child,
    }
}

/// `name` in the decode process's `/metrics` (0 before it is first set).
fn metric(d: &Decode, name: &str) -> u64 {
    let mut s = std::net::TcpStream::connect(&d.metrics).expect("connecting to /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        d.metrics
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).expect("reading /metrics");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let prefix = format!("{name} ");
    r.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

fn reaped(d: &Decode) -> u64 {
    metric(d, "flexns_cm_qps_reaped_total")
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

/// `n` phantom requests: an engine's connection request (a well-formed hello) whose endpoint is
/// `sink`, which never answers.
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
                private_data: br#"{"from":"phantom","expect":0}"#.to_vec(),
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

/// A prefill engine of this process on 127.0.0.1, with a source and a read-back buffer.
struct Prefill {
    engine: TransferEngine,
    src: Arc<netstack::mem::Region>,
    back: Arc<netstack::mem::Region>,
}

fn prefill(name: &str) -> Prefill {
    let mut c = EngineConfig::new(name, TransportKind::Flexns);
    c.metadata = MetadataConfig::P2p;
    c.bind_ip = Some(std::net::Ipv4Addr::LOCALHOST);
    c.advertise_ip = Some(std::net::Ipv4Addr::LOCALHOST);
    c.transfer_timeout = Duration::from_secs(20);
    // one attempt: a QP of this engine the decode engine dropped would fail the transfer
    // (a retry would reconnect and hide it)
    c.slice_attempts = 1;
    let engine = TransferEngine::new(c).unwrap();
    let src = engine.allocate_memory(LEN, Location::Cpu(0)).unwrap();
    let back = engine.allocate_memory(LEN, Location::Cpu(0)).unwrap();
    Prefill { engine, src, back }
}

/// Writes a pattern of `round` into the decode pool at `slot` and reads it back: every byte.
fn verify(p: &Prefill, d: &Decode, seg: SegmentHandle, slot: u64, round: u8) {
    let data: Vec<u8> = (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31) ^ round ^ (i >> 12) as u8)
        .collect();
    p.src.write(0, &data);
    p.back.fill(0, LEN, 0);
    let at = d.pool_addr + slot * LEN as u64;
    p.engine
        .transfer_sync_write(seg, p.src.addr(), at, LEN as u64)
        .unwrap_or_else(|e| panic!("round {round}: write: {e}"));
    p.engine
        .transfer_sync_read(seg, p.back.addr(), at, LEN as u64)
        .unwrap_or_else(|e| panic!("round {round}: read: {e}"));
    assert!(p.back.equals(0, &data), "round {round}: the bytes read back differ");
}

#[test]
fn a_phantom_flood_is_capped_and_reaped_while_real_engines_transfer() {
    let d = decode();
    let pid = d.child.id();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let sink_addr = sink.local_addr().unwrap();

    // a prefill engine connected before the flood; two more made (not connected) now
    let a = prefill("prefill-a");
    let seg_a = a.engine.open_segment(&d.segment).unwrap();
    verify(&a, &d, seg_a, 0, 0);
    let b = prefill("prefill-b");
    let c = prefill("prefill-c");
    let rss0 = rss_bytes(pid);

    // the flood, from 127.0.0.2: a batch over the per-call cap (one peer's QPs, 64) is
    // refused whole ...
    let attacker: IpAddr = "127.0.0.2".parse().unwrap();
    let mut x = raw(&rt, d.rpc, attacker);
    let e = rt
        .block_on(x.connect_qps(phantoms(config::MAX_QPS_PER_PEER + 1, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("a batch over max_batch");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("max_batch"), "{}", e.message());
    // ... the cap's worth is admitted, and more is refused naming the limit
    let flood_at = Instant::now();
    let r = rt
        .block_on(x.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&r), CAP, "{r:?}");
    let e = rt
        .block_on(x.connect_qps(phantoms(CAP, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("phantoms past the caller's cap are refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains(&format!("max_qps_per_caller is {CAP}")),
        "{}",
        e.message()
    );
    let e = rt
        .block_on(x.connect_qps(phantoms(1, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("even one more");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");

    // while the attacker holds its cap (none of its phantoms reaped yet), another engine is
    // admitted, and one that then sends nothing until the end
    let seg_b = b
        .engine
        .open_segment(&d.segment)
        .expect("an engine admitted during the flood");
    let seg_c = c
        .engine
        .open_segment(&d.segment)
        .expect("an idle engine admitted during the flood");
    assert_eq!(
        reaped(&d),
        0,
        "the phantoms were no longer held ({:?})",
        flood_at.elapsed()
    );
    verify(&b, &d, seg_b, 1, 1);
    verify(&a, &d, seg_a, 0, 2);
    let rss_flood = rss_bytes(pid);
    // the flood holds at most its cap of QPs with their receive buffers (64 KiB each)
    let bound = rss0 + (64 << 20);
    assert!(
        rss_flood <= bound,
        "RSS {} MiB during the flood, bound {} MiB",
        rss_flood >> 20,
        bound >> 20
    );

    // the phantoms never answer: after the timeout they are reaped and counted, and free the
    // attacker's slots; the real engines' QPs are not reaped
    let until = flood_at + TIMEOUT + Duration::from_secs(15);
    while reaped(&d) < CAP as u64 {
        assert!(Instant::now() < until, "reaped {} of {CAP}", reaped(&d));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        flood_at.elapsed() >= TIMEOUT,
        "reaped before the timeout: {:?}",
        flood_at.elapsed()
    );
    let r = rt
        .block_on(x.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&r), CAP, "the reaped phantoms' slots are free again: {r:?}");
    // the engines stay idle for three timeouts (c has sent nothing at all): the second wave
    // is reaped, they are not
    let wave2 = Instant::now();
    while reaped(&d) < 2 * CAP as u64 || wave2.elapsed() < 3 * TIMEOUT {
        assert!(
            wave2.elapsed() < TIMEOUT + Duration::from_secs(15),
            "second wave not reaped: {}",
            reaped(&d)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    verify(&c, &d, seg_c, 2, 3);
    verify(&a, &d, seg_a, 0, 4);
    verify(&b, &d, seg_b, 1, 5);
    assert_eq!(reaped(&d), 2 * CAP as u64, "only the phantoms were reaped");
    // three engines' two QPs each, no phantom left (the gauge is set every eighth of the
    // timeout)
    let t = Instant::now();
    while metric(&d, "flexns_kvcache_accepted_qps") != 6 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "accepted QPs: {}",
            metric(&d, "flexns_kvcache_accepted_qps")
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // an engine that leaves: the decode engine's probe of its quiet QPs fails, and they are
    // dropped (not counted as reaped: they were used)
    drop(b);
    let left = Instant::now();
    while metric(&d, "flexns_kvcache_accepted_qps") > 4 {
        assert!(
            left.elapsed() < Duration::from_secs(30),
            "the QPs of an engine that left are still held: {}",
            metric(&d, "flexns_kvcache_accepted_qps")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let dropped_after = left.elapsed();
    verify(&a, &d, seg_a, 0, 6);
    verify(&c, &d, seg_c, 2, 7);
    assert_eq!(reaped(&d), 2 * CAP as u64);
    let rss_end = rss_bytes(pid);
    assert!(
        rss_end <= bound,
        "RSS {} MiB after two waves, bound {} MiB",
        rss_end >> 20,
        bound >> 20
    );
    eprintln!(
        "decode engine RSS: {} MiB before, {} MiB during the flood, {} MiB after two waves; \
         a departed engine's QPs dropped after {dropped_after:?}",
        rss0 >> 20,
        rss_flood >> 20,
        rss_end >> 20
    );
}
