//! Fencing, in process, over both carriers (Solar and the plain TCP protocol): once the storage
//! nodes fence a volume at a new attachment epoch, the volume of the earlier attachment can
//! neither write nor read it (`VolumeError::Fenced`, at once, nothing stored), the new one is
//! served, and the fence survives a node restart. `clients/tests/blk_cluster.rs` runs the
//! same through the controller and real agents (detach --force, attach elsewhere).

use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{Volume, VolumeConfig, VolumeError};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const VOLUME: u32 = 5;
const BLOCKS: u64 = 256;

fn block(lba: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag ^ lba as u8; BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8] = tag;
    b
}

fn volume(rt: &tokio::runtime::Runtime, addrs: &[SocketAddr], carrier: Carrier, epoch: u32) -> Arc<Volume> {
    let _g = rt.enter();
    let links = addrs
        .iter()
        .map(|&a| {
            let mut c = LinkConfig::new(a, carrier);
            c.client.io_timeout_ns = 3_000_000_000;
            Arc::new(Link::start(c).unwrap())
        })
        .collect();
    let cfg = VolumeConfig {
        replica_timeout: Duration::from_millis(500),
        ..VolumeConfig::default()
    };
    Volume::attached(VOLUME, BLOCKS * BLOCK as u64, links, cfg, epoch)
}

fn fenced<T: std::fmt::Debug>(r: Result<T, VolumeError>) -> bool {
    matches!(r, Err(VolumeError::Fenced { .. }))
}

fn round(carrier: Carrier, tag: &str) {
    let base = std::env::temp_dir().join(format!("fence-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let mut nodes: Vec<StorageNode> = (0..3)
        .map(|i| {
            let n = StorageNode::start(NodeConfig::new(base.join(format!("node{i}")))).unwrap();
            n.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
            n
        })
        .collect();
    let addrs: Vec<SocketAddr> = nodes.iter().map(|n| n.addr()).collect();
    let rt = test_support::runtime();
    let old = volume(&rt, &addrs, carrier, 1);
    rt.block_on(async {
        for lba in 0..16 {
            old.write(lba * BLOCK as u64, &block(lba, 1), false).await.unwrap();
        }
    });
    // the volume is attached again: the new attachment's nodes fence it at epoch 2
    for n in &nodes {
        assert_eq!(rt.block_on(n.fence(VOLUME, 2)).unwrap(), 2);
        assert_eq!(rt.block_on(n.fence(VOLUME, 1)).unwrap(), 2, "a fence only rises");
    }
    let new = volume(&rt, &addrs, carrier, 2);
    rt.block_on(async {
        for lba in 0..16 {
            new.write(lba * BLOCK as u64, &block(lba, 2), false).await.unwrap();
        }
        let t = std::time::Instant::now();
        assert!(fenced(old.write(0, &block(0, 3), false).await), "{tag}: the old write");
        assert!(t.elapsed() < Duration::from_secs(2), "refused at once, not timed out");
        assert!(old.is_fenced());
        assert!(
            fenced(old.read(BLOCK as u64, BLOCK as u64).await),
            "{tag}: the old read"
        );
        assert!(
            fenced(old.write_zeroes(0, 16 * BLOCK as u64, true).await),
            "{tag}: the old TRIM"
        );
        for lba in 0..16 {
            let got = new.read(lba * BLOCK as u64, BLOCK as u64).await.unwrap();
            assert!(got == block(lba, 2), "{tag}: block {lba} is the new attachment's");
        }
    });
    // copies still in flight to the third replica (2 of 3 acknowledge a write) land first
    rt.block_on(new.quiesced(async {})).unwrap();
    for n in &nodes {
        let s = n.store(VOLUME).unwrap();
        for lba in 0..16 {
            assert!(s.read(lba).unwrap().0 == block(lba, 2), "{tag}: stored block {lba}");
        }
    }
    // the fence is kept: after a restart an attachment of epoch 1 is still refused
    let addr0 = nodes[0].addr();
    drop(nodes.remove(0));
    let mut cfg = NodeConfig::new(base.join("node0"));
    cfg.listen = addr0;
    let n0 = StorageNode::start(cfg).unwrap();
    assert_eq!(n0.store(VOLUME).unwrap().fenced_at(), 2);
    let stale = volume(&rt, &addrs[..1], carrier, 1);
    assert!(
        fenced(rt.block_on(stale.write(0, &block(0, 4), false))),
        "{tag}: refused after the restart"
    );
    assert!(n0.store(VOLUME).unwrap().read(0).unwrap().0 == block(0, 2));
    drop((old, new, stale));
    drop(n0);
    drop(nodes);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn an_earlier_attachment_is_fenced_out_over_solar() {
    round(Carrier::Udp { paths: 2 }, "solar");
}

#[test]
fn an_earlier_attachment_is_fenced_out_over_tcp() {
    round(Carrier::Tcp, "tcp");
}

/// Two volumes attached at the same epoch through the same links (an agent's links are shared
/// by its volumes) draw the same version numbers: Solar tells their writes apart by volume,
/// so concurrent writes of both complete and each reads back its own data.
#[test]
fn two_volumes_on_shared_links_may_use_the_same_versions() {
    let base = std::env::temp_dir().join(format!("fence-shared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let nodes: Vec<StorageNode> = (0..2)
        .map(|i| {
            let n = StorageNode::start(NodeConfig::new(base.join(format!("node{i}")))).unwrap();
            for v in [VOLUME, VOLUME + 1] {
                n.create_volume(v, BLOCKS * BLOCK as u64).unwrap();
            }
            n
        })
        .collect();
    let rt = test_support::runtime();
    let _g = rt.enter();
    let links: Vec<Arc<Link>> = nodes
        .iter()
        .map(|n| Arc::new(Link::start(LinkConfig::new(n.addr(), Carrier::Udp { paths: 2 })).unwrap()))
        .collect();
    let vols: Vec<Arc<Volume>> = [VOLUME, VOLUME + 1]
        .into_iter()
        .map(|id| Volume::attached(id, BLOCKS * BLOCK as u64, links.clone(), VolumeConfig::default(), 3))
        .collect();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for (k, v) in vols.iter().enumerate() {
            let v = v.clone();
            tasks.push(tokio::spawn(async move {
                for lba in 0..64 {
                    v.write(lba * BLOCK as u64, &block(lba, 10 + k as u8), false)
                        .await
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for (k, v) in vols.iter().enumerate() {
            for lba in 0..64 {
                let got = v.read(lba * BLOCK as u64, BLOCK as u64).await.unwrap();
                assert!(got == block(lba, 10 + k as u8), "volume {k} block {lba}");
            }
        }
    });
    drop((vols, links, nodes));
    let _ = std::fs::remove_dir_all(&base);
}

/// What the controller no longer attaches here (it moved the volume while this agent could not
/// be told) stops being exported at the agent's next heartbeat: an export attached before the
/// controller was asked and missing from its answer goes; one it names stays, and so does one
/// attached after the question (the answer predates it).
#[test]
fn an_agent_drops_the_exports_its_controller_moved_elsewhere() {
    use block_agent::agent::{Agent, AgentConfig, ReplicaAt};
    let base = std::env::temp_dir().join(format!("fence-keep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let node = StorageNode::start(NodeConfig::new(base.join("node0"))).unwrap();
    for v in [1, 2, 3] {
        node.create_volume(v, BLOCKS * BLOCK as u64).unwrap();
    }
    let rt = test_support::runtime();
    let _g = rt.enter();
    let agent = Agent::new(AgentConfig::new(Carrier::Tcp));
    let at = [ReplicaAt {
        node: "sn-0000000000000001".into(),
        addr: node.addr().to_string(),
        admin: String::new(),
    }];
    agent.attach("kept", 1, BLOCKS * BLOCK as u64, &at, 0, 1).unwrap();
    agent.attach("moved", 2, BLOCKS * BLOCK as u64, &at, 0, 1).unwrap();
    let asked = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(5));
    agent.attach("newer", 3, BLOCKS * BLOCK as u64, &at, 0, 1).unwrap();
    assert_eq!(agent.keep_only(&["kept"], asked), vec!["moved".to_string()]);
    let mut left = agent.exports().names();
    left.sort();
    assert_eq!(left, ["kept", "newer"]);
    drop(agent);
    drop(node);
    let _ = std::fs::remove_dir_all(&base);
}
