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
    // a restarted partition re-registers: the map follows it
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
    assert_eq!(addrs[0], s0.cm_addr());
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
