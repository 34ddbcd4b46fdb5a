//! A real Prometheus server (Debian's `prometheus`) scrapes a running block cluster (the
//! controller, three storage nodes and the agent, each with `--metrics-addr`) and a KV-cache
//! decode engine while a workload runs; the test then asks Prometheus's HTTP API for what the
//! workload must have produced: every target up, exactly the NBD writes the test made, at least
//! three stored blocks per block written, a non-zero rate of flexns bytes into the decode engine.

mod common;

use block_agent::nbd::client::NbdClient;
use clients::blk::{ClusterSpec, LocalCluster};
use common::prom::{http_get, query, urlencode};
use common::{host_port, spawner, tmp};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NAME: &str = "prometheus_scrapes_every_daemon_and_sees_the_workload";

/// `n` consecutive free ports on 127.0.0.1 (checked by binding each).
fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let base = 20_000 + (rand_u16() % 30_000);
        let ok = (0..n).all(|k| std::net::TcpListener::bind(("127.0.0.1", base + k)).is_ok());
        if ok {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (t.subsec_nanos() ^ std::process::id().wrapping_mul(2654435761)) as u16
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prometheus_scrapes_every_daemon_and_sees_the_workload() {
    if !common::have("prometheus") {
        test_support::skip(
            NAME,
            test_support::Missing::Tool,
            "prometheus is not installed (scripts/install-test-deps.sh installs Debian's prometheus)",
        );
        return;
    }
    let dir = tmp("prometheus");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 64 << 20;
    spec.metrics_base = Some(free_ports(6));
    let targets: Vec<String> = spec.metrics_addrs().into_iter().map(|(_, a)| a).collect();
    let c = LocalCluster::start(&spawner(), spec).unwrap();

    // a KV-cache decode engine with its own endpoint
    let kv_metrics = format!("127.0.0.1:{}", common::free_port());
    let mut decode = Command::new(env!("CARGO_BIN_EXE_kvcache-bench"))
        .args([
            "serve",
            "--transport",
            "flexns",
            "--metadata",
            "P2PHANDSHAKE",
            "--advertise",
            "127.0.0.1",
        ])
        .args(["--pool", "16MiB", "--metrics-addr", &kv_metrics])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let banner = {
        let mut l = String::new();
        BufReader::new(decode.stdout.take().unwrap()).read_line(&mut l).unwrap();
        l
    };
    let decode = Kill(decode);
    let segment = banner
        .split_whitespace()
        .find_map(|w| w.strip_prefix("segment="))
        .expect("decode banner")
        .to_string();

    // Prometheus, scraping every second
    let prom = format!("127.0.0.1:{}", common::free_port());
    let quoted = |v: &[String]| v.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ");
    let cfg = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: block\n    static_configs:\n      - targets: [{}]\n  - job_name: kvcache\n    static_configs:\n      - targets: [{}]\n",
        quoted(&targets),
        quoted(std::slice::from_ref(&kv_metrics))
    );
    std::fs::write(dir.join("prometheus.yml"), cfg).unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let _prom = Kill(
        Command::new("prometheus")
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );

    let ready = Instant::now() + Duration::from_secs(60);
    while !http_get(&prom, "/-/ready").is_ok_and(|(st, _)| st == 200) {
        assert!(Instant::now() < ready, "Prometheus did not become ready");
        std::thread::sleep(Duration::from_millis(200));
    }

    // the workload: 4 KiB and 64 KiB writes through NBD, each read back
    let (hp, name) = host_port(&c.uri);
    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
    let (mut writes, mut blocks) = (0u64, 0u64);
    let until = Instant::now() + Duration::from_secs(3);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while Instant::now() < until {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = if x >> 63 == 0 { 4096 } else { 65536 };
        let off = (x >> 20) % ((64 << 20) / 65536) * 65536;
        let data: Vec<u8> = (0..len).map(|i| (i as u64 ^ x) as u8).collect();
        cl.write(off, &data, false).unwrap();
        let mut back = vec![0u8; len];
        cl.read(off, &mut back).unwrap();
        assert_eq!(back, data);
        writes += 1;
        blocks += len as u64 / 4096;
    }
    // Prometheus has scraped the decode engine before the benchmark starts, so the scrapes
    // during it see its bytes rise (a rate needs two samples that differ)
    let scraped_once = Instant::now() + Duration::from_secs(30);
    while query(&prom, "up{job=\"kvcache\"} == 1").is_empty() {
        assert!(
            Instant::now() < scraped_once,
            "Prometheus never scraped the decode engine"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // the benchmark serves its own (prefill) metrics while it runs
    let bench_metrics = format!("127.0.0.1:{}", common::free_port());
    let bench = Command::new(env!("CARGO_BIN_EXE_kvcache-bench"))
        .args([
            "--server",
            &segment,
            "--size",
            "1MiB",
            "--duration",
            "2",
            "--pairs",
            "1",
            "--json",
        ])
        .args(["--metrics-addr", &bench_metrics])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut scraped = String::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) && !scraped.contains("flexns_kvcache_requests_total") {
        std::thread::sleep(Duration::from_millis(300));
        scraped = http_get(&bench_metrics, "/metrics").map(|(_, b)| b).unwrap_or_default();
    }
    assert!(
        scraped.contains("flexns_kvcache_requests_total{result=\"completed\"}"),
        "kvcache-bench --metrics-addr served: {scraped}"
    );
    let bench = bench.wait_with_output().unwrap();
    assert!(bench.status.success(), "{}", String::from_utf8_lossy(&bench.stderr));
    let sent: u64 = String::from_utf8_lossy(&bench.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["bench"] == "kvcache_write")
        .and_then(|v| v["bytes"].as_u64())
        .expect("the benchmark's result line");

    // wait for scrapes after the workload (the collectors copy counters once a second)
    let deadline = Instant::now() + Duration::from_secs(30);
    let want = format!("sum(flexns_nbd_requests_total{{op=\"write\"}}) == {writes}");
    // the decode daemon received the bytes: as packets (rx bytes), or, from a same-host prefill
    // on the shm link (the engine's default), copied into its memory by the peer (its export
    // counts them)
    let received = format!(
        "(sum(flexns_rx_bytes_total{{job=\"kvcache\"}}) or vector(0)) + \
         (sum(flexns_same_host_peer_bytes_total{{job=\"kvcache\",direction=\"in\"}}) or vector(0)) >= {sent}"
    );
    loop {
        let up = query(&prom, "up");
        let all_up = up.len() == targets.len() + 1 && up.iter().all(|(_, v)| *v == 1.0);
        if all_up && !query(&prom, &want).is_empty() && !query(&prom, &received).is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus never saw {writes} writes with every target up: up = {up:?}, writes = {:?}; its log: {}",
            query(&prom, "sum(flexns_nbd_requests_total{op=\"write\"})"),
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // every block is stored on three replicas
    let stored = query(&prom, "sum(flexns_store_writes_total)");
    assert!(
        stored[0].1 >= (3 * blocks) as f64,
        "stored {stored:?}, {blocks} blocks written"
    );
    // the decode engine received the benchmark's bytes (the loop above waited for them), at a
    // rate Prometheus can see
    let rate = query(&prom, "sum(rate(flexns_rx_bytes_total{job=\"kvcache\"}[1m]))");
    assert!(rate.first().is_some_and(|(_, v)| *v > 0.0), "rx rate {rate:?}");
    // latency histograms per volume and operation (cumulative: the whole run's p99)
    let p99 = query(
        &prom,
        "histogram_quantile(0.99, sum by (le, op) (flexns_nbd_request_duration_seconds_bucket))",
    );
    assert!(p99.iter().any(|(m, v)| m["op"] == "write" && *v > 0.0), "p99 {p99:?}");
    // each storage node timed its log syncs (the writes above reached all three)
    let syncs = query(&prom, "sum by (node) (flexns_store_log_sync_duration_seconds_count)");
    assert!(
        syncs.len() == 3 && syncs.iter().all(|(_, v)| *v >= 1.0),
        "log syncs timed per node: {syncs:?}"
    );
    let nodes_up = query(&prom, "flexns_control_storage_nodes{state=\"up\"}");
    assert_eq!(nodes_up.first().map(|(_, v)| *v), Some(3.0), "{nodes_up:?}");
    eprintln!(
        "{writes} NBD writes ({blocks} blocks), {sent} B by kvcache-bench; Prometheus: `{want}` and `{received}` \
         hold, sum(flexns_store_writes_total) = {}, kvcache rx rate {:.0} B/s, write p99 {:?}",
        stored[0].1, rate[0].1, p99
    );
    // every panel of the Grafana dashboard is a query this Prometheus accepts
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/flexns.json")).unwrap(),
    )
    .unwrap();
    for p in dash["panels"].as_array().unwrap() {
        let expr = p["targets"][0]["expr"].as_str().unwrap();
        let (status, body) = http_get(&prom, &format!("/api/v1/query?query={}", urlencode(expr))).unwrap();
        assert_eq!(status, 200, "dashboard panel {}: {expr}: {body}", p["title"]);
    }
    let (_, sample) = http_get(&targets[targets.len() - 1], "/metrics").unwrap();
    eprintln!(
        "one scrape of the agent (NBD lines):\n{}",
        sample
            .lines()
            .filter(|l| l.starts_with("flexns_nbd_requests_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(decode);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}
