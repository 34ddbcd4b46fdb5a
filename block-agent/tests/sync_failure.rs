//! Fail-stop durability: a storage node whose disk fails a sync stops acknowledging.
//!
//! After a failed `fdatasync` the kernel may drop the dirty pages (PostgreSQL's "fsyncgate"):
//! the log past its last durable record holds what the disk had before, replay stops there,
//! and a write appended and acknowledged after it is lost at the next crash. The power-cut
//! disk (`test_support::powercut`) fails a sync so, dropping the pages. A store it happens to
//! poisons itself ([`StoreError::Poisoned`]): it refuses every later write and read, and a
//! restart replays only what was durable. With three replicas the volume goes on on the two
//! others with no error, the failed replica acknowledges nothing more, and once its node
//! restarts on a healthy disk the resync brings it back: every acknowledged write then reads
//! back from every replica. A store that goes on appending after a failed sync fails here.

use block_agent::control::pb::{self, storage_node_admin_server::StorageNodeAdmin};
use block_agent::control::NodeAdmin;
use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::{StoreError, VolumeStore, BLOCK};
use block_agent::volume::{ReplicaState, Volume, VolumeConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_support::powercut::{Disk, Fault};

fn block(lba: u64, seq: u64) -> Vec<u8> {
    let mut b = vec![(seq as u8) ^ (lba as u8) ^ 0x5A; BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&seq.to_le_bytes());
    b
}

/// Whether the power-cut disk can be mounted; reports the skip when not.
fn can_mount(test: &str) -> bool {
    if !test_support::is_root() {
        test_support::skip(
            test,
            test_support::Missing::Root,
            "mounting the power-cut disk needs root",
        );
        return false;
    }
    if let Err(why) = Disk::available() {
        test_support::skip(test, test_support::Missing::Mount, &why);
        return false;
    }
    true
}

fn poisoned<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) {
    assert!(matches!(r, Err(StoreError::Poisoned { .. })), "{what}: {r:?}");
}

#[test]
fn a_failed_log_sync_poisons_the_store_and_a_restart_replays_only_what_was_durable() {
    const NAME: &str = "a_failed_log_sync_poisons_the_store_and_a_restart_replays_only_what_was_durable";
    if !can_mount(NAME) {
        return;
    }
    let at = std::env::temp_dir().join(format!("sync-failure-store-{}", std::process::id()));
    let mut disk = Disk::mount(&at).unwrap();
    let dir = disk.path().to_path_buf();
    let write = |s: &VolumeStore, lba: u64, seq: u64| {
        let b = block(lba, seq);
        s.write(lba, &b, crc32c::crc32c(&b), seq)
    };
    let s = VolumeStore::create(&dir, 1, 256, 1 << 30).unwrap();
    for lba in 0..10 {
        write(&s, lba, 100 + lba).unwrap();
    }
    // the next sync of the log fails, and drops the pages written since the last one
    disk.inject(Fault::sync(Some("vol-1.log"), 1));
    poisoned(write(&s, 10, 110), "the write whose sync failed");
    assert_eq!(disk.stats().failed_syncs, 1, "{:?}", disk.stats());
    // the sync of the next commit would "succeed" over the hole: none is attempted
    let writes = disk.stats().writes;
    poisoned(write(&s, 11, 111), "a write after the failure");
    let (tx, rx) = std::sync::mpsc::channel();
    let b = block(12, 112);
    let kick = s.submit_blocks(
        12,
        &[(&b, crc32c::crc32c(&b))],
        112,
        Box::new(move |r| tx.send(r).unwrap()),
    );
    assert!(!kick, "a failed store needs no leader: the write is answered at once");
    poisoned(rx.try_recv().unwrap(), "a queued write after the failure");
    poisoned(s.read(3), "a read after the failure");
    poisoned(s.block_versions(0, 16), "the block versions after the failure");
    poisoned(s.checkpoint(), "a checkpoint after the failure");
    assert_eq!(disk.stats().writes, writes, "nothing more reached the disk");
    let cause = s.poisoned().expect("the store says it failed");
    assert!(cause.contains("syncing the log"), "{cause}");
    assert_eq!(s.stats().writes, 10, "acknowledged writes");
    drop(s);

    // the power goes; the disk works again: the store replays what was durable
    disk.power_cut();
    disk.heal();
    disk.power_on().unwrap();
    let s = VolumeStore::open(&dir, 1, 1 << 30).unwrap();
    assert_eq!(s.poisoned(), None);
    assert_eq!(s.stats().replayed, 10);
    for lba in 0..10 {
        assert!(s.read(lba).unwrap() == (block(lba, 100 + lba), crc32c::crc32c(&block(lba, 100 + lba)), 100 + lba));
    }
    for lba in 10..13 {
        assert_eq!(s.read(lba).unwrap().2, 0, "block {lba} was never acknowledged");
    }
    write(&s, 11, 211).unwrap();
    assert_eq!(s.read(11).unwrap().0, block(11, 211));

    // a failed sync of the data file in a checkpoint poisons the store too
    disk.inject(Fault::sync(Some("vol-1.data"), 1));
    assert!(s.checkpoint().is_err());
    poisoned(write(&s, 20, 220), "a write after a failed checkpoint");
    poisoned(s.read(11), "a read after a failed checkpoint");
    assert!(s.poisoned().unwrap().contains("checkpoint"), "{:?}", s.poisoned());
    drop(s);
    disk.power_cut();
    disk.heal();
    disk.power_on().unwrap();
    let s = VolumeStore::open(&dir, 1, 1 << 30).unwrap();
    assert_eq!(
        s.read(11).unwrap().0,
        block(11, 211),
        "the log kept what the checkpoint lost"
    );
    assert_eq!(s.read(20).unwrap().2, 0);
    drop(s);
    drop(disk);
    let _ = std::fs::remove_dir(&at);
}

const VOLUME: u32 = 3;
/// 8 MiB: 8 dirty-tracking regions of 1 MiB.
const BLOCKS: u64 = 2048;

/// Writes `count` single blocks (spread over the volume) with sequence numbers from `seq`,
/// each acknowledged with no error; records each.
async fn writes(vol: &Arc<Volume>, seq: &mut u64, count: u64, acked: &mut HashMap<u64, u64>) {
    for _ in 0..count {
        *seq += 1;
        let lba = (*seq * 7919) % BLOCKS;
        vol.write(lba * BLOCK as u64, &block(lba, *seq), false)
            .await
            .unwrap_or_else(|e| panic!("write {seq} at block {lba}: {e}"));
        acked.insert(lba, *seq);
    }
}

async fn read_back(vol: &Arc<Volume>, acked: &HashMap<u64, u64>) {
    for (&lba, &seq) in acked {
        let got = vol.read(lba * BLOCK as u64, BLOCK as u64).await.unwrap();
        assert!(got == block(lba, seq), "block {lba}: not write {seq}");
    }
}

#[test]
fn a_replica_whose_disk_fails_a_sync_acknowledges_nothing_more_and_is_resynced_after_a_restart() {
    const NAME: &str = "a_replica_whose_disk_fails_a_sync_acknowledges_nothing_more_and_is_resynced_after_a_restart";
    if !can_mount(NAME) {
        return;
    }
    let base = std::env::temp_dir().join(format!("sync-failure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    // node 2 keeps its volumes on the disk that fails
    let mut disk = Disk::mount(base.join("disk2")).unwrap();
    let dirs = [base.join("node0"), base.join("node1"), disk.path().to_path_buf()];
    let cfg = |i: usize, listen: Option<std::net::SocketAddr>| {
        let mut c = NodeConfig::new(&dirs[i]);
        if let Some(a) = listen {
            c.listen = a;
        }
        c
    };
    let mut nodes: Vec<Option<Arc<StorageNode>>> = (0..3)
        .map(|i| Some(Arc::new(StorageNode::start(cfg(i, None)).unwrap())))
        .collect();
    let addrs: Vec<_> = nodes.iter().map(|n| n.as_ref().unwrap().addr()).collect();
    for n in nodes.iter().flatten() {
        n.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
    }
    let rt = test_support::runtime();
    // why volume VOLUME's store on node `i` failed, as the node's admin service lists it
    let failed = |nodes: &[Option<Arc<StorageNode>>], i: usize| {
        let admin = NodeAdmin(nodes[i].clone().unwrap());
        let r = rt.block_on(admin.list_volumes(tonic::Request::new(pb::ListVolumesRequest {})));
        let v = r.unwrap().into_inner().volumes;
        assert_eq!(v.len(), 1, "{v:?}");
        v[0].failed.clone()
    };
    let vcfg = VolumeConfig {
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
    assert_eq!(vol.write_quorum(), 2, "a majority of 3");
    let (mut seq, mut acked) = (0u64, HashMap::new());
    rt.block_on(writes(&vol, &mut seq, 200, &mut acked));
    let failing = nodes[2].as_ref().unwrap().store(VOLUME).unwrap();
    assert!(failing.stats().writes > 0, "replica 2 takes writes");

    // the next sync of node 2's log fails, mid-workload: (b) every write goes on with no error
    disk.inject(Fault::sync(Some(&format!("vol-{VOLUME}.log")), 1));
    let t = Instant::now();
    while disk.stats().failed_syncs == 0 {
        rt.block_on(writes(&vol, &mut seq, 20, &mut acked));
        assert!(t.elapsed() < Duration::from_secs(20), "replica 2 synced no log in 20 s");
    }
    rt.block_on(writes(&vol, &mut seq, 20, &mut acked));
    assert_eq!(disk.stats().failed_syncs, 1, "{:?}", disk.stats());
    let at_failure = failing.stats().writes;
    rt.block_on(writes(&vol, &mut seq, 300, &mut acked));
    rt.block_on(read_back(&vol, &acked));
    // the resync tries the replica every 100 ms meanwhile: give it time to (wrongly) land
    std::thread::sleep(Duration::from_millis(800));
    // (a) no write was acknowledged from replica 2 after its failure, the resync's neither,
    // and its store refuses: the agent counts it down, and the node says why
    assert_eq!(
        failing.stats().writes,
        at_failure,
        "replica 2 acknowledged writes after its log sync failed"
    );
    let b = block(0, 1);
    poisoned(failing.write(0, &b, crc32c::crc32c(&b), 1), "a write to replica 2");
    assert!(failing.poisoned().is_some());
    assert!(failed(&nodes, 2).contains("syncing the log"), "{}", failed(&nodes, 2));
    assert_eq!(failed(&nodes, 0), "");
    let states = vol.replica_states();
    assert_eq!(states[2].0, ReplicaState::Down, "{states:?}");
    let c = vol.counters();
    assert!(c.replica_downs.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    drop(failing);

    // (c) node 2 restarts on its healthy disk (what the failure dropped stays lost), replays
    // its log, and the resync brings it back while writes go on
    nodes[2] = None;
    disk.power_cut();
    disk.heal();
    disk.power_on().unwrap();
    nodes[2] = Some(Arc::new(StorageNode::start(cfg(2, Some(addrs[2]))).unwrap()));
    assert_eq!(failed(&nodes, 2), "", "a restarted store starts healthy");
    let t = Instant::now();
    loop {
        rt.block_on(writes(&vol, &mut seq, 20, &mut acked));
        if vol.replica_states().iter().all(|s| s.0 == ReplicaState::InSync) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "not in sync after 30 s: {:?}",
            vol.replica_states()
        );
    }
    let resynced = c.resynced_regions.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{seq} writes; replica 2 acknowledged {at_failure} before its sync failed; back in sync {:?} after its \
         restart ({resynced} regions resynced)",
        t.elapsed()
    );
    assert!(resynced >= 1);
    rt.block_on(read_back(&vol, &acked));
    // every replica holds every acknowledged write
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(400)).await });
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
    drop(disk);
    let _ = std::fs::remove_dir_all(&base);
}
