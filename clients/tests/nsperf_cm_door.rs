//! `nsperf server`'s connection-manager door against a phantom flood, over real processes: an
//! `nsperf server` child, an attacker that sends unauthenticated `ConnectQps` batches of
//! phantom QPs (endpoints that never answer) from 127.0.0.2, and a real `nsperf client` run on
//! 127.0.0.1 with idle QPs of its own. The attacker is refused past its cap (the server had
//! none: it took every QP offered), the real run verifies meanwhile, the phantoms are reaped
//! after the timeout and free the attacker's slots, the run's idle QPs (quiet for more than the
//! timeout) are not reaped, and the server's RSS stays bounded.

#[path = "common/prom.rs"]
#[allow(dead_code)] // this test asks /metrics only
mod prom;

use clients::bench::ChildServer;
use clients::perf::{Hello, Op};
use netstack::cm::pb;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

/// The attacker's cap (`--max-qps-per-caller`).
const CAP: usize = 200;
/// `--unused-qp-timeout`.
const TIMEOUT: Duration = Duration::from_secs(1);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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

fn phantoms(n: usize, sink: SocketAddr) -> pb::ConnectBatch {
    let hello = Hello {
        op: Op::Write,
        size: 64,
        depth: 1,
        echo: false,
        low_latency: false,
        signaled: false,
        resp_addr: 0,
        resp_rkey: 0,
        need: 0,
        session: 1,
    };
    pb::ConnectBatch {
        requests: (0..n)
            .map(|i| pb::ConnectRequest {
                endpoint: Some(pb::QpEndpoint {
                    qpn: 0x2000 + i as u32,
                    psn: 9,
                    addr: sink.to_string(),
                    mtu: 4096,
                    recovery: "go-back-n".into(),
                    ..Default::default()
                }),
                private_data: serde_json::to_vec(&hello).unwrap(),
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

#[test]
fn a_phantom_flood_is_capped_and_reaped_while_a_real_run_verifies() {
    // with a 67 ms ACK timeout the server's probe of a silent phantom (at half the timeout)
    // retries for 67 ms × (1 + 2 + 4 + 8 + 16 × 4) = 5.3 s: the door's reaper ends it first
    let config = std::env::temp_dir().join(format!("nsperf-cm-door-{}.toml", std::process::id()));
    std::fs::write(&config, "[qp]\ntimeout_ns = 67108864\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let args: Vec<String> = [
        "server",
        "--mr-size",
        "4MiB",
        "--max-qps-per-caller",
        &CAP.to_string(),
        "--unused-qp-timeout",
        &TIMEOUT.as_secs_f64().to_string(),
        "--metrics-addr",
        &metrics,
        "--config",
        config.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let srv = ChildServer::start(env!("CARGO_BIN_EXE_nsperf").as_ref(), &args).expect("nsperf server starts");
    let _ = std::fs::remove_file(&config);
    let cm: SocketAddr = srv.field("cm").unwrap().parse().unwrap();
    let pid = srv.pid().unwrap();
    let rss0 = rss_bytes(pid);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let sink_addr = sink.local_addr().unwrap();

    // the flood from 127.0.0.2: the cap's worth is admitted, more is refused naming the limit
    let attacker: IpAddr = "127.0.0.2".parse().unwrap();
    let mut a = rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{cm}"))
            .unwrap()
            .local_address(Some(attacker))
            .connect()
            .await
            .unwrap();
        Raw::new(ch)
    });
    let flood_at = Instant::now();
    let first = rt
        .block_on(a.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&first), CAP);
    for n in [CAP, 1] {
        let e = rt
            .block_on(a.connect_qps(phantoms(n, sink_addr)))
            .map(|r| accepted(r.get_ref()))
            .expect_err("phantoms past the caller's cap are refused");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(
            e.message().contains(&format!("max_qps_per_caller is {CAP}")),
            "{}",
            e.message()
        );
    }
    let e = rt
        .block_on(a.connect_qps(phantoms(netstack::cm::CHUNK + 1, sink_addr)))
        .map(|r| accepted(r.get_ref()))
        .expect_err("a batch over max_batch");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let rss_flood = rss_bytes(pid);

    // a real run during the flood (its QPs are admitted: another caller) verifies; its idle
    // QPs stay quiet for more than the timeout
    let o = Command::new(env!("CARGO_BIN_EXE_nsperf"))
        .args([
            "client",
            "--server",
            &cm.to_string(),
            "--json",
            "--size",
            "4KiB",
            "--depth",
            "8",
        ])
        .args(["--qps", "4", "--idle-qps", "16", "--duration", "3"])
        .output()
        .expect("nsperf client runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "nsperf client failed: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let line: serde_json::Value = out
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("a result line");
    assert_eq!(line["verified"], true, "{line}");
    assert!(line["ops"].as_u64().unwrap() > 0, "{line}");

    // the phantoms were reaped after the timeout; the run's QPs (idle ones included) were not
    let until = Instant::now() + Duration::from_secs(15);
    while reaped(&metrics) < CAP as u64 {
        assert!(Instant::now() < until, "reaped {} of {CAP}", reaped(&metrics));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(flood_at.elapsed() >= TIMEOUT);
    assert_eq!(reaped(&metrics), CAP as u64, "only the phantoms were reaped");
    // their slots are free again
    let again = rt
        .block_on(a.connect_qps(phantoms(CAP, sink_addr)))
        .unwrap()
        .into_inner();
    assert_eq!(accepted(&again), CAP, "the reaped phantoms' slots are free");
    let rss_end = rss_bytes(pid);
    let bound = rss0 + (64 << 20);
    assert!(
        rss_flood.max(rss_end) <= bound,
        "RSS {} / {} MiB, bound {} MiB",
        rss_flood >> 20,
        rss_end >> 20,
        bound >> 20
    );
    eprintln!(
        "nsperf server RSS: {} MiB before, {} MiB during the flood, {} MiB after the run and a second wave",
        rss0 >> 20,
        rss_flood >> 20,
        rss_end >> 20
    );
}
