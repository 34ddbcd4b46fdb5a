//! Segment metadata in a real etcd (Debian's etcd-server, started here): engines find each
//! other under one key prefix and not under another (tenants); a stale descriptor (an engine
//! instance that is no longer the live one) is detected and never used; an engine that stops
//! withdraws its descriptor and one that restarts under the same name re-publishes; engines
//! with the segment open follow both through their watch.

use kvcache_engine::*;
use std::time::Duration;

fn engine(name: &str, etcd: &str, prefix: &str) -> TransferEngine {
    let mut c = EngineConfig::new(name, TransportKind::Flexns);
    c.metadata = MetadataConfig::parse(etcd, Some(prefix)).unwrap();
    c.advertise_ip = Some(std::net::Ipv4Addr::LOCALHOST);
    c.transfer_timeout = Duration::from_secs(10);
    TransferEngine::new(c).unwrap()
}

#[test]
fn engines_meet_in_etcd_and_stale_descriptors_are_refused() {
    if !etcd_lite::local::installed() {
        test_support::skip(
            "kvcache-engine etcd",
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server as root)",
        );
        return;
    }
    let etcd = etcd_lite::local::LocalEtcd::start("kvc-test").expect("starting etcd");
    let d = engine("decode", &etcd.url, "tenant-a/");
    let pool = d.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let p = engine("prefill", &etcd.url, "tenant-a/");
    let src = p.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    src.write(0, b"kv blocks through etcd metadata");
    let seg = p.open_segment("decode").unwrap();
    p.transfer_sync_write(seg, src.addr(), pool.addr(), 64).unwrap();
    let mut got = [0u8; 31];
    pool.read(0, &mut got);
    assert_eq!(&got, b"kv blocks through etcd metadata");

    // another tenant's prefix does not see it
    let other = engine("prefill", &etcd.url, "tenant-b/");
    let e = other.open_segment("decode").unwrap_err().to_string();
    assert!(e.contains("tenant-b/") && e.contains("decode"), "{e}");

    // a stale descriptor: the live engine's address under an old instance number
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut kv = rt.block_on(etcd_lite::EtcdClient::connect(&etcd.url)).unwrap();
    let mut stale = d.local_descriptor();
    stale.instance ^= 0x5a5a;
    rt.block_on(kv.put("tenant-a/segments/decode", stale.to_json()))
        .unwrap();
    let p2 = engine("prefill-2", &etcd.url, "tenant-a/");
    match p2.open_segment("decode") {
        Err(TransferError::StaleDescriptor {
            segment,
            published,
            live,
        }) => {
            assert_eq!(segment, "decode");
            assert_eq!(published, stale.instance);
            assert_eq!(live, d.local_descriptor().instance);
        }
        other => panic!("expected a stale descriptor error, got {:?}", other.map(|_| ())),
    }

    // the engine stops: its descriptor goes (ours again first, as a live engine would have it)
    rt.block_on(kv.put("tenant-a/segments/decode", d.local_descriptor().to_json()))
        .unwrap();
    drop(d);
    assert_eq!(rt.block_on(kv.get("tenant-a/segments/decode")).unwrap(), None);
    // a running engine with the segment open sees it go through its watch: a transfer to it
    // fails at once (not after the transfer timeout) and says why
    let t = std::time::Instant::now();
    let e = loop {
        match p.transfer_sync_write(seg, src.addr(), pool.addr(), 64) {
            Err(e) if e.to_string().contains("left etcd") => break e.to_string(),
            r => assert!(
                t.elapsed() < Duration::from_secs(2),
                "still sending to a gone engine: {r:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!(
        "transfers to the stopped engine refused {:?} after it stopped: {e}",
        t.elapsed()
    );
    let t = std::time::Instant::now();
    let _ = p.transfer_sync_write(seg, src.addr(), pool.addr(), 64);
    assert!(t.elapsed() < Duration::from_millis(100), "refused at once");
    // ... and a restarted one under the same name re-publishes: found, new instance, usable
    let d2 = engine("decode", &etcd.url, "tenant-a/");
    let pool2 = d2.allocate_memory(1 << 20, Location::Cpu(0)).unwrap();
    let seg2 = p2.open_segment("decode").unwrap();
    p2.register_local_memory(src.clone(), Location::Cpu(0)).unwrap(); // one buffer, two engines
    assert_eq!(
        p2.segment_descriptor(seg2).unwrap().instance,
        d2.local_descriptor().instance
    );
    p2.transfer_sync_write(seg2, src.addr(), pool2.addr(), 64).unwrap();
    pool2.read(0, &mut got);
    assert_eq!(&got, b"kv blocks through etcd metadata");
    // the first prefill engine, which opened the dead instance, follows the new one through
    // its watch (no refresh asked for) and can write to its new buffers
    let t = std::time::Instant::now();
    while p.segment_descriptor(seg).map(|d| d.instance).ok() != Some(d2.local_descriptor().instance) {
        assert!(t.elapsed() < Duration::from_secs(2), "the new instance is not seen");
        std::thread::sleep(Duration::from_millis(5));
    }
    src.write(0, b"kv blocks to the restarted peer");
    p.transfer_sync_write(seg, src.addr(), pool2.addr(), 64).unwrap();
    pool2.read(0, &mut got);
    assert_eq!(&got, b"kv blocks to the restarted peer");
    let fresh = p.refresh_segment(seg).unwrap();
    assert_eq!(fresh.instance, d2.local_descriptor().instance);
}

/// A decode engine process publishes under a 3 s lease: while it runs its descriptor stays
/// (renewed), and once it is killed (no chance to withdraw) etcd deletes it within the lease.
#[test]
fn a_killed_engines_descriptor_disappears_within_its_lease() {
    if !etcd_lite::local::installed() {
        test_support::skip(
            "kvcache-engine etcd lease",
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server as root)",
        );
        return;
    }
    use std::io::BufRead;
    let etcd = etcd_lite::local::LocalEtcd::start("kvc-lease").expect("starting etcd");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvcache-engine"))
        .args([
            "serve",
            "--name",
            "decode-lease",
            "--transport",
            "tcp",
            "--pool",
            "1MiB",
        ])
        .args([
            "--metadata",
            &etcd.url,
            "--etcd-prefix",
            "lease-test/",
            "--advertise",
            "127.0.0.1",
        ])
        .args(["--lease-ttl", "3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    assert!(banner.contains("segment=decode-lease"), "{banner}");
    let gone = etcd_lite::local::check_lease_expiry(
        &etcd.url,
        "lease-test/segments/decode-lease",
        Duration::from_secs(3),
        || {
            child.kill().unwrap(); // SIGKILL: the engine cannot withdraw its descriptor
            child.wait().unwrap();
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("descriptor gone {gone:?} after the kill (lease 3 s)");
}
