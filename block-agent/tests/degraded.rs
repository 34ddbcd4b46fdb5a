//! Degraded writes with a 2-of-3 write quorum: a storage node stops in the middle of a
//! workload; every write goes on being acknowledged (by the two others) with no error and no
//! stall of the replica timeout; reads return the latest acknowledged data; the node comes
//! back on its address, the volume catches it up from a good copy while writes continue, and
//! afterwards every replica holds every acknowledged write (read straight from the stores).

use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{ReplicaState, Volume, VolumeConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const VOLUME: u32 = 3;
/// 8 MiB: 8 dirty-tracking regions of 1 MiB.
const BLOCKS: u64 = 2048;

fn block(lba: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![(seq as u8) ^ (lba as u8); BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b
}

/// Writes `count` single blocks (spread over the volume) with sequence numbers from `seq`;
/// records each acknowledged one; returns the slowest write.
async fn writes(vol: &Arc<Volume>, seq: &mut u64, count: u64, acked: &mut HashMap<u64, u64>) -> Duration {
    let mut slowest = Duration::ZERO;
    for _ in 0..count {
        *seq += 1;
        let lba = (*seq * 7919) % BLOCKS;
        let t = Instant::now();
        vol.write(lba * BLOCK as u64, &block(lba, *seq), false)
            .await
            .unwrap_or_else(|e| panic!("write {seq} at block {lba}: {e}"));
        slowest = slowest.max(t.elapsed());
        acked.insert(lba, *seq);
    }
    slowest
}

async fn read_back(vol: &Arc<Volume>, acked: &HashMap<u64, u64>) {
    for (&lba, &seq) in acked {
        let got = vol.read(lba * BLOCK as u64, BLOCK as u64).await.unwrap();
        assert!(got == block(lba, seq), "block {lba}: not write {seq}");
    }
}

#[test]
fn a_stopped_replica_costs_no_write_and_is_caught_up_when_it_returns() {
    let base = std::env::temp_dir().join(format!("degraded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let cfg = |i: usize, listen: Option<std::net::SocketAddr>| {
        let mut c = NodeConfig::new(base.join(format!("node{i}")));
        if let Some(a) = listen {
            c.listen = a;
        }
        c
    };
    let mut nodes: Vec<Option<StorageNode>> = (0..3)
        .map(|i| Some(StorageNode::start(cfg(i, None)).unwrap()))
        .collect();
    let addrs: Vec<_> = nodes.iter().map(|n| n.as_ref().unwrap().addr()).collect();
    for n in nodes.iter().flatten() {
        n.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let vcfg = VolumeConfig {
        write_quorum: Some(2),
        replica_timeout: Duration::from_millis(300),
        resync_interval: Duration::from_millis(100),
        ..VolumeConfig::default()
    };
    let vol = {
        let _g = rt.enter();
        let links = addrs
            .iter()
            .map(|&a| Arc::new(Link::start(LinkConfig::new(a, Carrier::Udp { paths: 2 })).unwrap()))
            .collect();
        Volume::new(VOLUME, BLOCKS * BLOCK as u64, links, vcfg)
    };
    assert_eq!(vol.write_quorum(), 2);
    let (mut seq, mut acked) = (0u64, HashMap::new());
    rt.block_on(writes(&vol, &mut seq, 300, &mut acked));

    // node 2 stops: writes go on, answered by the other two
    nodes[2] = None;
    let slowest = rt.block_on(writes(&vol, &mut seq, 600, &mut acked));
    // its copies in flight are given up on one replica timeout after their quorum
    std::thread::sleep(Duration::from_millis(600));
    let states = vol.replica_states();
    assert_eq!(states[2].0, ReplicaState::Down, "{states:?}");
    assert!(states[2].1 > 0, "it missed regions: {states:?}");
    assert!(
        slowest < Duration::from_millis(250),
        "no write waited for the stopped replica: {slowest:?}"
    );
    let c = vol.counters();
    let degraded = c.degraded_writes.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(c.replica_downs.load(std::sync::atomic::Ordering::Relaxed), 1);
    // reads come from the replicas in sync
    rt.block_on(read_back(&vol, &acked));

    // node 2 returns on its address with its old data: caught up while writes continue
    nodes[2] = Some(StorageNode::start(cfg(2, Some(addrs[2]))).unwrap());
    let t = Instant::now();
    loop {
        rt.block_on(writes(&vol, &mut seq, 20, &mut acked));
        if vol.replica_states().iter().all(|s| s.0 == ReplicaState::InSync) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not in sync after 20 s: {:?}",
            vol.replica_states()
        );
    }
    let resynced = c.resynced_regions.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{} writes, {degraded} degraded, slowest {slowest:?} while node 2 was down; caught up in {:?} ({resynced} regions)",
        seq,
        t.elapsed()
    );
    assert!(resynced >= 1);
    rt.block_on(read_back(&vol, &acked));
    // every replica holds every acknowledged write
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(300)).await });
    for (i, n) in nodes.iter().enumerate() {
        let store = n.as_ref().unwrap().store(VOLUME).unwrap();
        for (&lba, &s) in &acked {
            let (data, _, _) = store.read(lba).unwrap();
            assert!(data == block(lba, s), "replica {i} block {lba}: not write {s}");
        }
    }
    drop(vol);
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(nodes);
    let _ = std::fs::remove_dir_all(&base);
}
