//! Snapshots across replicas, in process: with the volume's writes held off
//! ([`Volume::quiesced`]) while each storage node takes its snapshot, every replica's snapshot
//! holds exactly the same writes even with many writes in flight; a volume with a replica down
//! refuses to be snapshotted; a grown volume stays the same volume for its open users.

use block_agent::agent::{Agent, AgentConfig, ReplicaAt};
use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{Volume, VolumeConfig};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const VOLUME: u32 = 5;
const BLOCKS: u64 = 1024;

fn block(lba: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![(seq as u8) ^ (lba as u8); BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b
}

fn nodes(tag: &str, n: usize) -> (std::path::PathBuf, Vec<StorageNode>) {
    let base = std::env::temp_dir().join(format!("snap-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let nodes: Vec<StorageNode> = (0..n)
        .map(|i| StorageNode::start(NodeConfig::new(base.join(format!("node{i}")))).unwrap())
        .collect();
    for node in &nodes {
        node.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
    }
    (base, nodes)
}

fn volume(rt: &tokio::runtime::Runtime, nodes: &[StorageNode], cfg: VolumeConfig) -> Arc<Volume> {
    let _g = rt.enter();
    let links = nodes
        .iter()
        .map(|n| Arc::new(Link::start(LinkConfig::new(n.addr(), Carrier::Udp { paths: 2 })).unwrap()))
        .collect();
    Volume::new(VOLUME, BLOCKS * BLOCK as u64, links, cfg)
}

#[test]
fn replicas_snapshot_the_same_writes_while_writes_are_in_flight() {
    let (base, nodes) = nodes("same", 2);
    let rt = test_support::runtime();
    let vol = volume(&rt, &nodes, VolumeConfig::default());
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    // 16 writers, each its own blocks, as fast as they go
    let writers: Vec<_> = (0..16u64)
        .map(|t| {
            let (vol, stop, count) = (vol.clone(), stop.clone(), count.clone());
            rt.spawn(async move {
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let lba = ((seq * 7919 + t * 131) % (BLOCKS / 16)) * 16 + t;
                    vol.write(lba * BLOCK as u64, &block(lba, seq), false).await.unwrap();
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut pauses = Vec::new();
    for snap in 1..=3u32 {
        std::thread::sleep(Duration::from_millis(300));
        let before = count.load(Ordering::Relaxed);
        let t = std::time::Instant::now();
        rt.block_on(vol.quiesced(async {
            for n in &nodes {
                n.snapshot(VOLUME, snap).unwrap();
            }
        }))
        .unwrap();
        pauses.push(t.elapsed());
        assert!(before > 0, "writes were flowing");
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        rt.block_on(w).unwrap();
    }
    let (a, b) = (nodes[0].store(VOLUME).unwrap(), nodes[1].store(VOLUME).unwrap());
    let mut differ = 0;
    for snap in 1..=3u32 {
        for lba in 0..BLOCKS {
            if a.read_snapshot(snap, lba).unwrap() != b.read_snapshot(snap, lba).unwrap() {
                differ += 1;
            }
        }
    }
    eprintln!(
        "{} writes; writes held off {pauses:?} for the three snapshots",
        count.load(Ordering::Relaxed)
    );
    assert_eq!(differ, 0, "blocks whose snapshots differ between the replicas");
    drop(vol);
    drop(nodes);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_volume_with_a_replica_down_refuses_a_snapshot() {
    let (base, mut nodes) = nodes("down", 3);
    let rt = test_support::runtime();
    let cfg = VolumeConfig {
        write_quorum: Some(2),
        replica_timeout: Duration::from_millis(200),
        ..VolumeConfig::default()
    };
    let vol = volume(&rt, &nodes, cfg);
    drop(nodes.pop());
    rt.block_on(async {
        for seq in 1..50u64 {
            vol.write(seq * BLOCK as u64, &block(seq, seq), false).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    });
    let e = rt.block_on(vol.quiesced(async {})).unwrap_err();
    assert!(e.contains("replica 2") && e.contains("retry"), "{e}");
    drop(vol);
    drop(nodes);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_grown_volume_stays_the_same_volume_for_its_open_users() {
    let (base, nodes) = nodes("grow", 1);
    let rt = test_support::runtime();
    let _g = rt.enter();
    let agent = Agent::new(AgentConfig::new(Carrier::Tcp));
    let at = [ReplicaAt {
        node: "sn-0000000000000001".into(),
        addr: nodes[0].addr().to_string(),
        admin: String::new(),
    }];
    let v1 = agent.attach("v", VOLUME, BLOCKS * BLOCK as u64, &at, 0, 0).unwrap();
    nodes[0].resize_volume(VOLUME, 2 * BLOCKS * BLOCK as u64).unwrap();
    let v2 = agent.attach("v", VOLUME, 2 * BLOCKS * BLOCK as u64, &at, 0, 0).unwrap();
    assert!(Arc::ptr_eq(&v1, &v2), "growing replaced the volume");
    assert_eq!(v1.size(), 2 * BLOCKS * BLOCK as u64);
    let last = (2 * BLOCKS - 1) * BLOCK as u64;
    rt.block_on(v1.write(last, &block(7, 7), false)).unwrap();
    assert_eq!(rt.block_on(v2.read(last, BLOCK as u64)).unwrap(), block(7, 7));
    drop((v1, v2, agent));
    drop(nodes);
    let _ = std::fs::remove_dir_all(&base);
}
