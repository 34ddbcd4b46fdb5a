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
