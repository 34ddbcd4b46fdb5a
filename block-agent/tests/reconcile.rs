//! Reconciling replicas when a volume is attached anew, in process, with the volume asking the
//! nodes' stores directly ([`LocalStores`]; the agent asks their admin services;
//! `clients/tests/blk_cluster.rs` runs that as processes). With the default 2-of-3 quorum: a
//! replica that missed writes a dropped volume knew of is compared and copied by the new
//! volume before it serves; a replica that does not answer is never read until it answers and
//! is compared (then caught up); with fewer than `replicas - quorum + 1` answering, I/O waits.

use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{LocalStores, ReplicaState, Volume, VolumeConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const VOLUME: u32 = 9;
const BLOCKS: u64 = 2048;

fn block(lba: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![(seq as u8) ^ (lba as u8) ^ 0x5A; BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b
}

struct Cluster {
    base: std::path::PathBuf,
    nodes: Vec<Option<StorageNode>>,
    addrs: Vec<SocketAddr>,
    stores: Arc<LocalStores>,
}

impl Cluster {
    fn start(tag: &str) -> Cluster {
        let base = std::env::temp_dir().join(format!("reconcile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let mut c = Cluster {
            base,
            nodes: Vec::new(),
            addrs: Vec::new(),
            stores: Arc::default(),
        };
        for i in 0..3 {
            let n = StorageNode::start(NodeConfig::new(c.base.join(format!("node{i}")))).unwrap();
            n.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
            c.addrs.push(n.addr());
            c.stores.set(&i.to_string(), n.store(VOLUME).unwrap());
            c.nodes.push(Some(n));
        }
        c
    }

    fn stop(&mut self, i: usize) {
        self.stores.remove(&i.to_string());
        self.nodes[i] = None;
    }

    fn restart(&mut self, i: usize) {
        let mut cfg = NodeConfig::new(self.base.join(format!("node{i}")));
        cfg.listen = self.addrs[i];
        let n = StorageNode::start(cfg).unwrap();
        self.stores.set(&i.to_string(), n.store(VOLUME).unwrap());
        self.nodes[i] = Some(n);
    }

    /// A volume as an agent attaching it anew makes it (reconciling first when `reconcile`).
    fn volume(&self, rt: &tokio::runtime::Runtime, reconcile: bool) -> Arc<Volume> {
        let _g = rt.enter();
        let links = self
            .addrs
            .iter()
            .map(|&a| Arc::new(Link::start(LinkConfig::new(a, Carrier::Udp { paths: 2 })).unwrap()))
            .collect();
        let cfg = VolumeConfig {
            replica_timeout: Duration::from_millis(300),
            resync_interval: Duration::from_millis(100),
            ..VolumeConfig::default()
        };
        let v = Volume::new(VOLUME, BLOCKS * BLOCK as u64, links, cfg);
        v.set_admins((0..3).map(|i| i.to_string()).collect(), self.stores.clone());
        if reconcile {
            v.start_reconcile();
        }
        v
    }

    /// Every replica holds every acknowledged write.
    fn check(&self, acked: &HashMap<u64, u64>) {
        for (i, n) in self.nodes.iter().enumerate() {
            let s = n.as_ref().unwrap().store(VOLUME).unwrap();
            for (&lba, &seq) in acked {
                assert!(
                    s.read(lba).unwrap().0 == block(lba, seq),
                    "replica {i} block {lba}: not write {seq}"
                );
            }
        }
    }
}

async fn writes(vol: &Arc<Volume>, seq: &mut u64, n: u64, acked: &mut HashMap<u64, u64>) {
    for _ in 0..n {
        *seq += 1;
        let lba = (*seq * 7919) % BLOCKS;
        vol.write(lba * BLOCK as u64, &block(lba, *seq), false).await.unwrap();
        acked.insert(lba, *seq);
    }
}

/// Drops `vol` as an agent restart does: its background tasks (a resync round holds the
/// volume while it runs) end before anything else happens. Otherwise the old volume's resync
/// may catch a restarted replica up before the new volume compares it, and the new one finds
/// nothing to copy (seen once in a loaded run).
fn gone(vol: Arc<Volume>) {
    let old = Arc::downgrade(&vol);
    drop(vol);
    let t = Instant::now();
    while old.upgrade().is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the dropped volume still runs after 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_replica_down_at_attach_is_never_read_until_it_is_compared_and_caught_up() {
    let mut c = Cluster::start("down");
    let rt = test_support::runtime();
    let (mut seq, mut acked) = (0u64, HashMap::new());
    // replica 1 misses writes; the volume that knew it is dropped (an agent restart)
    let vol = c.volume(&rt, false);
    assert_eq!(vol.write_quorum(), 2, "a majority by default");
    rt.block_on(writes(&vol, &mut seq, 200, &mut acked));
    c.stop(1);
    rt.block_on(writes(&vol, &mut seq, 400, &mut acked));
    gone(vol);
    // node 1 back, node 2 down: the new volume compares replicas 0 and 1 and copies what
    // 1 lacks; 2 is down and unverified
    c.restart(1);
    c.stop(2);
    let vol = c.volume(&rt, true);
    let t = Instant::now();
    rt.block_on(writes(&vol, &mut seq, 100, &mut acked));
    let reconciled = vol
        .counters()
        .reconciled_blocks
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(reconciled > 0, "blocks copied to replica 1: {reconciled}");
    assert_eq!(vol.replica_states()[2].0, ReplicaState::Down);
    for (&lba, &s) in acked.iter() {
        let got = rt.block_on(vol.read(lba * BLOCK as u64, BLOCK as u64)).unwrap();
        assert!(got == block(lba, s), "block {lba}: not write {s}");
    }
    // node 2 returns: compared with a clean replica, caught up while writes go on
    c.restart(2);
    loop {
        rt.block_on(writes(&vol, &mut seq, 20, &mut acked));
        if vol.replica_states().iter().all(|s| s.0 == ReplicaState::InSync) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", vol.replica_states());
    }
    eprintln!(
        "{reconciled} blocks reconciled at attach; node 2 caught up {:?} after the attach ({} regions)",
        t.elapsed(),
        vol.counters()
            .resynced_regions
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(400)).await });
    c.check(&acked);
    drop(vol);
    let _ = std::fs::remove_dir_all(&c.base);
}

#[test]
fn with_too_few_replicas_answering_io_waits_for_one_more() {
    let mut c = Cluster::start("wait");
    let rt = test_support::runtime();
    let (mut seq, mut acked) = (0u64, HashMap::new());
    let vol = c.volume(&rt, false);
    rt.block_on(writes(&vol, &mut seq, 100, &mut acked));
    drop(vol);
    // a block written by a host whose clock ran far ahead: new versions must exceed it
    let ahead = 1u64 << 62;
    let b = block(7, 7);
    let store = c.nodes[0].as_ref().unwrap().store(VOLUME).unwrap();
    store.write(7, &b, crc32c::crc32c(&b), ahead).unwrap();
    c.stop(1);
    c.stop(2);
    let vol = c.volume(&rt, true);
    let read = rt.spawn({
        let vol = vol.clone();
        async move { vol.read(0, BLOCK as u64).await }
    });
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        !read.is_finished(),
        "a read went ahead with one replica of three compared"
    );
    c.restart(2);
    let t = Instant::now();
    rt.block_on(read).unwrap().unwrap();
    assert!(
        vol.next_versions(1) > ahead,
        "the versions were raised above the highest a replica holds"
    );
    eprintln!(
        "the read waited, and went on {:?} after a second replica answered",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(vol);
    let _ = std::fs::remove_dir_all(&c.base);
}

/// Holes travel as holes. A replica that missed a TRIM (its node was down) is caught up by the
/// resync, and one a new volume finds behind is reconciled, with zero runs where the good copy
/// has holes: the trimmed blocks are holes on every replica afterwards (no space held), not
/// zeros written as data, and the blocks around them are data.
#[test]
fn a_replica_catching_up_gets_the_good_copys_holes_as_holes() {
    use block_agent::store::{ALLOC_DATA, ALLOC_HOLE};
    let mut c = Cluster::start("holes");
    let rt = test_support::runtime();
    let vol = c.volume(&rt, false);
    let all: Vec<u8> = (0..256).flat_map(|lba| block(lba, 1)).collect();
    rt.block_on(vol.write(0, &all, false)).unwrap();
    let layout = |c: &Cluster, i: usize| {
        c.nodes[i]
            .as_ref()
            .unwrap()
            .store(VOLUME)
            .unwrap()
            .allocation(0, 256)
            .unwrap()
    };
    let expect = |holes: std::ops::Range<usize>| -> Vec<u8> {
        (0..256)
            .map(|k| if holes.contains(&k) { ALLOC_HOLE } else { ALLOC_DATA })
            .collect()
    };
    // the resync: node 2 is down while half of region 0 is trimmed
    c.stop(2);
    rt.block_on(vol.write_zeroes(0, 128 * BLOCK as u64, true)).unwrap();
    c.restart(2);
    let t = Instant::now();
    while vol.replica_states()[2] != (ReplicaState::InSync, 0) {
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", vol.replica_states());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(layout(&c, 2), expect(0..128), "the resync copied the holes as holes");
    // the reconciliation: node 1 is down while blocks 128..192 are trimmed, and the volume
    // that knew it goes away
    c.stop(1);
    rt.block_on(vol.write_zeroes(128 * BLOCK as u64, 64 * BLOCK as u64, true))
        .unwrap();
    drop(vol);
    c.restart(1);
    let vol = c.volume(&rt, true);
    let head = rt.block_on(vol.read(0, 256 * BLOCK as u64)).unwrap();
    assert!(head[..192 * BLOCK].iter().all(|&b| b == 0));
    assert!(head[192 * BLOCK..] == all[192 * BLOCK..]);
    assert!(
        vol.counters()
            .reconciled_blocks
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 64
    );
    for i in 0..3 {
        assert_eq!(layout(&c, i), expect(0..192), "replica {i}");
    }
    drop(vol);
    let _ = std::fs::remove_dir_all(&c.base);
}
