//! The multi-host cluster (`deploy/cluster/cluster.sh`, root): ten hosts in network namespaces
//! behind a switch namespace, etcd, the block service, two kv shards, two decode engines and
//! Prometheus. The test drives a workload on each service from this machine (the operator's
//! port on the switch), checks Prometheus sees every daemon and the workload, then kills one
//! host after another and checks each service reacts as its design says:
//! - a storage node host: the controller marks it down when its lease leaves etcd; reads keep
//!   being served from the other replicas; started again, it is up and writes go on;
//! - a kv shard host: a running client fails that shard's requests at once (the other shard
//!   serves on); started again, the client reconnects by itself;
//! - a decode engine host: transfers to it are refused at once, the other engine still serves;
//! - Prometheus marks the dead host's target down.
//!
//! `cluster.sh down` removes everything, and runs even when the test fails.

mod common;

use block_agent::nbd::client::NbdClient;
use common::prom::{http_get, query};
use kv_store::client::{ClientConfig, KvClient};
use kv_store::KvError;
use kvcache_engine::{EngineConfig, Location, MetadataConfig, TransferEngine, TransportKind};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const NAME: &str = "multi-host cluster in network namespaces";

fn script() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/cluster/cluster.sh").to_string()
}

/// A cluster that `cluster.sh down` removes when dropped.
struct Cluster {
    dir: PathBuf,
    net: u8,
}

impl Cluster {
    fn ip(&self, octet: u8) -> String {
        format!("10.77.{}.{octet}", self.net)
    }

    fn sh(&self, args: &[&str]) -> String {
        let o = Command::new(script())
            .args(args)
            .args(["--dir", self.dir.to_str().unwrap()])
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "cluster.sh {args:?}: {out}{err}");
        format!("{out}{err}")
    }

    fn describe(&self) -> String {
        let o = Command::new(env!("CARGO_BIN_EXE_blkctl"))
            .args(["--control", &format!("{}:7420", self.ip(11)), "describe", "vol0"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["down", "--dir", self.dir.to_str().unwrap()])
            .status();
    }
}

/// Waits up to `within` for `ok`; how long it took.
fn wait_for(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

/// Block `lba`'s contents in write round `round` of this run (differs every run).
fn block(seed: u64, round: u64, lba: u64) -> Vec<u8> {
    common::pattern(lba, seed ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

#[test]
fn a_multi_host_cluster_serves_every_service_and_rides_out_host_losses() {
    if !test_support::is_root() {
        test_support::skip(NAME, test_support::Missing::Root, "needs root (network namespaces)");
        return;
    }
    for tool in ["etcd", "prometheus"] {
        if !common::have(tool) {
            test_support::skip(
                NAME,
                test_support::Missing::Tool,
                &format!("{tool} is not installed (scripts/install-test-deps.sh installs it)"),
            );
            return;
        }
    }
    let pid = std::process::id();
    let c = Cluster {
        dir: std::env::temp_dir().join(format!("flexns-cluster-test-{pid}")),
        net: 100 + (pid % 150) as u8,
    };
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_flexns"))
        .parent()
        .unwrap()
        .to_path_buf();
    let t = Instant::now();
    let up = c.sh(&[
        "up",
        "--net",
        &c.net.to_string(),
        "--prefix",
        &format!("t{}", pid % 100_000),
        "--bin",
        bin.to_str().unwrap(),
    ]);
    eprintln!("cluster up in {:?}:\n{up}", t.elapsed());
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;

    // ---- block: vol0 through the agent's NBD export, 3 replicas on 3 hosts
    let nbd_at = format!("{}:10809", c.ip(15));
    let mut nbd = NbdClient::connect(nbd_at.as_str(), "vol0").unwrap();
    let blocks = 256u64;
    for lba in 0..blocks {
        nbd.write(lba * 4096, &block(seed, 0, lba), lba % 64 == 63).unwrap();
    }
    nbd.flush().unwrap();
    let verify = |nbd: &mut NbdClient, round: u64, range: std::ops::Range<u64>| {
        let mut b = vec![0u8; 4096];
        for lba in range {
            nbd.read(lba * 4096, &mut b).unwrap();
            assert!(
                b == block(seed, round, lba),
                "vol0 block {lba}: not write round {round}"
            );
        }
    };
    verify(&mut nbd, 0, 0..blocks);

    // ---- kv: a client on this machine, finding both shards through etcd
    let ctx = netstack::verbs::Context::open(netstack::config::ContextConfig {
        bind: format!("{}:0", c.ip(1)).parse().unwrap(),
        ..Default::default()
    })
    .unwrap();
    let etcd = format!("http://{}:2379", c.ip(11));
    let mut kv = KvClient::connect(
        &ctx,
        ClientConfig {
            etcd: Some(kv_store::shardmap::EtcdMap::new(&etcd, "/flexns/kv/")),
            timeout: Duration::from_secs(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(kv.shards(), 2);
    let key = |i: u32| format!("user{i:05}").into_bytes();
    let value = |i: u32| format!("{seed:x}-{i}").into_bytes();
    let ops = (0..200).map(|i| kv_store::client::Op::Put(key(i), value(i))).collect();
    assert!(kv.execute(ops).iter().all(|r| r.is_ok()));
    for i in 0..200 {
        assert_eq!(kv.get(&key(i)).unwrap(), Some(value(i)));
    }
    let on_shard = |s: u32| (0..200).find(|&i| kv_store::proto::shard_of(&key(i), 2) == s).unwrap();
    let (k0, k1) = (on_shard(0), on_shard(1));

    // ---- kvcache: a prefill engine on this machine writes into both decode engines
    let mut cfg = EngineConfig::new("prefill-test", TransportKind::Flexns);
    cfg.metadata = MetadataConfig::parse(&format!("etcd://{}:2379", c.ip(11)), Some("/flexns/kvcache/")).unwrap();
    cfg.bind_ip = Some(c.ip(1).parse().unwrap());
    cfg.advertise_ip = cfg.bind_ip;
    cfg.transfer_timeout = Duration::from_secs(5);
    let prefill = TransferEngine::new(cfg).unwrap();
    let src = prefill.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let back = prefill.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let kv_blocks: Vec<u8> = (0..1u64 << 20)
        .map(|i| (i as u8) ^ (seed as u8) ^ (i >> 12) as u8)
        .collect();
    src.write(0, &kv_blocks);
    let decode: Vec<_> = ["decode-0", "decode-1"]
        .iter()
        .map(|n| {
            let h = prefill.open_segment(n).unwrap();
            let at = prefill.segment_descriptor(h).unwrap().buffers[0].addr;
            (h, at)
        })
        .collect();
    let round_trip = |(h, at): (kvcache_engine::SegmentHandle, u64)| -> Result<(), String> {
        prefill
            .transfer_sync_write(h, src.addr(), at, 1 << 20)
            .map_err(|e| e.to_string())?;
        back.write(0, &vec![0u8; 1 << 20]);
        prefill
            .transfer_sync_read(h, back.addr(), at, 1 << 20)
            .map_err(|e| e.to_string())?;
        let mut got = vec![0u8; 1 << 20];
        back.read(0, &mut got);
        assert!(got == kv_blocks, "KV blocks read back differ");
        Ok(())
    };
    for &d in &decode {
        round_trip(d).unwrap();
    }

    // ---- Prometheus scrapes all nine daemons and saw the block writes
    let prom = format!("{}:9090", c.ip(11));
    wait_for("every target up in Prometheus", Duration::from_secs(20), || {
        let up = query(&prom, "up");
        up.len() == 9 && up.iter().all(|(_, v)| *v == 1.0)
    });
    let writes = "sum(flexns_nbd_requests_total{op=\"write\"})";
    wait_for("the NBD writes in Prometheus", Duration::from_secs(20), || {
        query(&prom, writes).first().is_some_and(|(_, v)| *v >= blocks as f64)
    });
    // every replica stored every block written
    let stored = "sum by (job) (flexns_store_writes_total)";
    wait_for(
        "every replica's stored writes in Prometheus",
        Duration::from_secs(20),
        || {
            let r = query(&prom, stored);
            r.len() == 3 && r.iter().all(|(_, v)| *v >= blocks as f64)
        },
    );
    // the kv gets were offloaded: the shards' handlers timed them
    let handled = "sum(flexns_offload_handler_duration_seconds_count)";
    wait_for(
        "offload handler latencies in Prometheus",
        Duration::from_secs(20),
        || query(&prom, handled).first().is_some_and(|(_, v)| *v >= 1.0),
    );
    assert!(!query(&prom, "flexns_cq_capacity_completions").is_empty());
    eprintln!("PromQL {handled} = {:?}", query(&prom, handled)[0].1);
    eprintln!("PromQL {writes} = {:?}", query(&prom, writes)[0].1);
    eprintln!("PromQL {stored} = {:?}", query(&prom, stored));
    let (status, scrape) = http_get(&format!("{}:9101", c.ip(15)), "/metrics").unwrap();
    assert_eq!(status, 200);
    let nbd_lines: Vec<&str> = scrape
        .lines()
        .filter(|l| l.starts_with("flexns_nbd_requests_total"))
        .collect();
    eprintln!("agent scrape (flexns_nbd_requests_total):\n{}", nbd_lines.join("\n"));
    assert!(!nbd_lines.is_empty());

    eprintln!("[{:?}] workloads verified", t.elapsed());
    // ---- host loss 1: a storage node
    c.sh(&["kill", "sn1"]);
    let down = wait_for(
        "the controller marks the dead node down",
        Duration::from_secs(10),
        || c.describe().contains("\"state\": \"down\""),
    );
    eprintln!("storage node host killed: down in the controller after {down:?} (lease 3 s)");
    let t1 = Instant::now();
    verify(&mut nbd, 0, 0..blocks); // served by the other replicas
    let took = t1.elapsed();
    eprintln!(
        "[{:?}] {blocks} reads served with a replica down in {took:?}",
        t.elapsed()
    );
    assert!(
        took < Duration::from_secs(15),
        "a down replica is tried last, not by every third read"
    );
    c.sh(&["start", "sn1"]);
    wait_for("the restarted node is up", Duration::from_secs(15), || {
        c.describe().matches("\"state\": \"up\"").count() == 3
    });
    for lba in 0..64 {
        nbd.write(lba * 4096, &block(seed, 1, lba), false).unwrap();
    }
    nbd.flush().unwrap();
    verify(&mut nbd, 1, 0..64);
    verify(&mut nbd, 0, 64..blocks);
    eprintln!("[{:?}] writes after the node's restart verified", t.elapsed());

    // ---- host loss 2: a kv shard
    c.sh(&["kill", "kv1"]);
    let t1 = Instant::now();
    wait_for(
        "shard 1 fails fast once its lease expires",
        Duration::from_secs(10),
        || matches!(kv.get(&key(k1)), Err(KvError::Unavailable(_))),
    );
    eprintln!(
        "kv shard host killed: its requests fail at once after {:?} (lease 3 s)",
        t1.elapsed()
    );
    assert_eq!(kv.get(&key(k0)).unwrap(), Some(value(k0)), "shard 0 serves on");
    c.sh(&["start", "kv1"]);
    wait_for(
        "the client reconnects to the restarted shard",
        Duration::from_secs(10),
        || kv.put(&key(k1), b"after the restart").is_ok(),
    );
    assert_eq!(kv.get(&key(k1)).unwrap(), Some(b"after the restart".to_vec()));
    assert!(kv.stats().shard_moves >= 1);
    eprintln!("[{:?}] kv client back on the restarted shard", t.elapsed());

    // ---- host loss 3: a decode engine
    c.sh(&["kill", "kvc1"]);
    let t1 = Instant::now();
    let why = loop {
        match round_trip(decode[1]) {
            Err(e) if e.contains("left etcd") => break e,
            _ => assert!(
                t1.elapsed() < Duration::from_secs(15),
                "transfers to the dead engine still tried"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("decode engine host killed: refused after {:?}: {why}", t1.elapsed());
    round_trip(decode[0]).unwrap();

    // ---- Prometheus sees the dead host
    wait_for(
        "Prometheus marks the dead host's target down",
        Duration::from_secs(20),
        || query(&prom, "up{job=\"kvc1\"}").first().is_some_and(|(_, v)| *v == 0.0),
    );

    // ---- and down removes everything
    drop(prefill);
    drop(kv);
    let prefix = format!("t{}_", pid % 100_000);
    drop(c);
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&ns.stdout).contains(&prefix),
        "namespaces left behind"
    );
}
