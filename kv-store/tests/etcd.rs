//! The shard map in a real etcd (Debian's etcd-server, started here): two partitions register,
//! a client given only etcd finds both and spreads keys over them; another prefix (tenant) sees
//! nothing of them.

use kv_store::client::{ClientConfig, GetPath, KvClient, Op};
use kv_store::server::{KvServer, ServerConfig};
use kv_store::shardmap::EtcdMap;
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_etcd() -> Option<etcd_lite::local::LocalEtcd> {
    if !etcd_lite::local::installed() {
        test_support::skip(
            "kv-store etcd",
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server as root)",
        );
        return None;
    }
    Some(etcd_lite::local::LocalEtcd::start("kv-test").expect("starting etcd"))
}

#[test]
fn clients_find_the_shards_through_etcd() {
    let Some(etcd) = start_etcd() else { return };
    let map = EtcdMap::new(&etcd.url, "/test/tenant-a/");
    let servers: Vec<KvServer> = (0..2)
        .map(|i| {
            KvServer::start(ServerConfig {
                capacity: 4096,
                data_bytes: 1 << 20,
                shard: i,
                shards: 2,
                etcd: Some(map.clone()),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    let ctx = netstack::verbs::Context::open(Default::default()).unwrap();
    let mut c = KvClient::connect(
        &ctx,
        ClientConfig {
            etcd: Some(map.clone()),
            get_path: GetPath::A1,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(c.shards(), 2);
    let ops = (0..400u32)
        .map(|k| Op::Put(k.to_le_bytes().to_vec(), vec![k as u8; 32]))
        .collect();
    assert!(c.execute(ops).into_iter().all(|r| r.is_ok()));
    for k in 0..400u32 {
        assert_eq!(c.get(&k.to_le_bytes()).unwrap(), Some(vec![k as u8; 32]));
    }
    let keys: Vec<u64> = servers.iter().map(|s| s.stats().store.keys).collect();
    assert_eq!(keys.iter().sum::<u64>(), 400);
    assert!(keys.iter().all(|&k| k > 100), "both shards hold keys: {keys:?}");
    // a key sent to the wrong partition is refused with the owner named
    let k1 = (0..400u32)
        .map(|k| k.to_le_bytes())
        .find(|k| kv_store::proto::shard_of(k, 2) == 1)
        .unwrap();
    let e = servers[0].put(&k1, b"x").unwrap_err().to_string();
    assert!(e.contains("belongs to shard 1"), "{e}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addrs = rt.block_on(map.fetch(Duration::from_secs(1))).unwrap();
    assert_eq!(addrs, vec![servers[0].cm_addr(), servers[1].cm_addr()]);
    // another tenant's prefix holds no map
    let other = EtcdMap::new(&etcd.url, "/test/tenant-b/");
    let e = rt.block_on(other.fetch(Duration::from_millis(200))).unwrap_err();
    assert!(e.to_string().contains("incomplete"), "{e}");
    // a restarted partition re-registers: the map follows it (a partition that stops leaves it)
    let mut servers = servers;
    let s1 = servers.pop().unwrap();
    drop(servers);
    let s0 = KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 1 << 20,
        shard: 0,
        shards: 2,
        etcd: Some(map.clone()),
        ..Default::default()
    })
    .unwrap();
    let addrs = rt.block_on(map.fetch(Duration::from_secs(1))).unwrap();
    assert_eq!(addrs, vec![s0.cm_addr(), s1.cm_addr()]);
    drop(s1);
    let e = rt.block_on(map.fetch(Duration::from_millis(100))).unwrap_err();
    assert!(
        e.to_string().contains("shards [0]"),
        "a stopped partition leaves the map: {e}"
    );
    // an unreachable etcd is a clear error
    let dead = EtcdMap::new(&format!("http://127.0.0.1:{}", free_port()), "/x/");
    let e = rt.block_on(dead.fetch(Duration::from_millis(100))).unwrap_err();
    assert!(e.to_string().contains("etcd at http://127.0.0.1:"), "{e}");
}

/// A kv-server process registers its shard under a 3 s lease: while it runs the entry stays
/// (renewed); killed (no chance to clean up), it drops out of the map within the lease, so
/// clients stop being sent to a dead shard. The shard count stays.
#[test]
fn a_killed_servers_shard_entry_expires_with_its_lease() {
    let Some(etcd) = start_etcd() else { return };
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kv-server"))
        .args([
            "--capacity",
            "1024",
            "--data-size",
            "1MiB",
            "--shard",
            "0",
            "--shards",
            "1",
        ])
        .args([
            "--etcd",
            &etcd.url,
            "--etcd-prefix",
            "lease-test/",
            "--etcd-lease-ttl",
            "3",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    assert!(banner.starts_with("kv-server cm="), "{banner}");
    let gone =
        etcd_lite::local::check_lease_expiry(&etcd.url, "lease-test/shards/00000", Duration::from_secs(3), || {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut kv = rt.block_on(etcd_lite::EtcdClient::connect(&etcd.url)).unwrap();
    assert!(
        rt.block_on(kv.get("lease-test/shards/count")).unwrap().is_some(),
        "the count is configuration"
    );
    eprintln!("shard entry gone {gone:?} after the kill (lease 3 s)");
}

fn shard_server(map: &EtcdMap, shard: u32) -> KvServer {
    KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 1 << 20,
        shard,
        shards: 2,
        etcd: Some(map.clone()),
        ..Default::default()
    })
    .unwrap()
}

/// Waits up to 3 s for `ok`; how long it took.
fn within_3s(mut ok: impl FnMut() -> bool) -> Duration {
    let t = std::time::Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(3), "not seen within 3 s");
        std::thread::sleep(Duration::from_millis(2));
    }
    t.elapsed()
}

/// A running client follows etcd's shard map through a watch: a shard another server takes
/// over is reconnected before the client's next request; a shard whose registration leaves the
/// map fails its requests at once (the other shard keeps serving) until a server registers it
/// again.
#[test]
fn a_running_client_follows_a_shard_moved_in_etcd() {
    let Some(etcd) = start_etcd() else { return };
    let map = EtcdMap::new(&etcd.url, "/test/moves/");
    let a0 = shard_server(&map, 0);
    let a1 = shard_server(&map, 1);
    let ctx = netstack::verbs::Context::open(Default::default()).unwrap();
    let mut c = KvClient::connect(
        &ctx,
        ClientConfig {
            etcd: Some(map.clone()),
            get_path: GetPath::Offload,
            timeout: Duration::from_secs(1),
            ..Default::default()
        },
    )
    .unwrap();
    let key_on = |s: u32, n: u32| {
        (0u32..)
            .map(|k| k.to_le_bytes().to_vec())
            .filter(|k| kv_store::proto::shard_of(k, 2) == s)
            .nth(n as usize)
            .unwrap()
    };
    let (k0, k1, k1b) = (key_on(0, 0), key_on(1, 0), key_on(1, 1));
    c.put(&k0, b"zero").unwrap();
    c.put(&k1, b"on a1").unwrap();
    assert_eq!(a1.get(&k1).unwrap(), Some(b"on a1".to_vec()));

    // another server takes shard 1 over: it holds k1b; the running client reads it from there
    let b1 = shard_server(&map, 1);
    b1.put(&k1b, b"on b1").unwrap();
    let moved = within_3s(|| c.get(&k1b).ok().flatten().as_deref() == Some(&b"on b1"[..]));
    eprintln!("client read from the shard's new server {moved:?} after it registered");
    assert_eq!(c.stats().shard_moves, 1);
    assert_eq!(c.get(&k1).unwrap(), None, "shard 1 is b1's now, which never held k1");
    assert_eq!(c.get(&k0).unwrap(), Some(b"zero".to_vec()), "shard 0 is untouched");
    c.put(&k1, b"on b1 too").unwrap();
    assert_eq!(b1.get(&k1).unwrap(), Some(b"on b1 too".to_vec()));
    assert_eq!(
        a1.get(&k1).unwrap(),
        Some(b"on a1".to_vec()),
        "the old server is not written"
    );

    // b1 leaves (its registration is revoked): shard 1 fails fast, shard 0 serves on
    drop(b1);
    let down = within_3s(|| matches!(c.get(&k1), Err(kv_store::KvError::Unavailable(_))));
    let t = std::time::Instant::now();
    let e = c.get(&k1).unwrap_err().to_string();
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "fails at once, not after the timeout"
    );
    assert!(e.contains("shard 1") && e.contains("etcd"), "{e}");
    assert_eq!(c.get(&k0).unwrap(), Some(b"zero".to_vec()));
    eprintln!("shard 1 unavailable {down:?} after its server left: {e}");

    // a new server registers shard 1: the client is back on it
    let c1 = shard_server(&map, 1);
    within_3s(|| c.put(&k1b, b"on c1").is_ok());
    assert_eq!(c1.get(&k1b).unwrap(), Some(b"on c1".to_vec()));
    assert_eq!(c.stats().shard_moves, 2);
    drop(a0);
}
