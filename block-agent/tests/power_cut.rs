//! A power cut, not a process kill: three storage nodes keep their volumes on disks that forget
//! every write not yet made durable (`test_support::powercut`), a 3-replica volume takes writes
//! of 1 to 8 blocks from eight writers, and the power of all three disks is cut mid-workload,
//! three times. After each restart every write acknowledged before the cut reads back from
//! every replica (its version or the one write to that block that was in flight at the cut),
//! and the restarted nodes serve it through a new volume. A store that acknowledged before its
//! log's fdatasync, or whose files' directory entries were never synced, fails here. Rounds 1
//! and 2 acknowledge a write on all three replicas, so each store is checked as the cut left
//! it; round 3 runs the default majority quorum, and the new volume reconciles the replicas
//! (as an agent attaching it does) before the stores are checked.

use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{LocalStores, Volume, VolumeConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use test_support::powercut::Disk;

const VOLUME: u32 = 7;
const BLOCKS: u64 = 4096;
const WRITERS: u64 = 8;
const NAME: &str = "every_acknowledged_write_survives_a_power_cut_on_every_replica";

/// Block `lba` as written by the write numbered `seq`: both in its first 16 bytes, then noise.
fn block(lba: u64, seq: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(BLOCK);
    b.extend_from_slice(&lba.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    let mut x = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    while b.len() < BLOCK {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.extend_from_slice(&x.to_le_bytes());
    }
    b
}

/// What the writers know of each block: the last acknowledged write, and the writes issued
/// since that were never acknowledged (in flight at a cut: any replica may hold one of them).
#[derive(Default, Clone)]
struct Known {
    acked: u64,
    unacked: Vec<u64>,
}

impl Known {
    fn allows(&self, seq: u64) -> bool {
        seq == self.acked || self.unacked.contains(&seq)
    }
}

fn node_config(dir: &std::path::Path) -> NodeConfig {
    let mut c = NodeConfig::new(dir);
    c.log_limit = 1 << 20; // frequent checkpoints: the data files' syncs matter too
    c
}

fn volume(rt: &tokio::runtime::Runtime, nodes: &[StorageNode], quorum: Option<usize>) -> Arc<Volume> {
    let _g = rt.enter();
    let links = nodes
        .iter()
        .map(|n| Arc::new(Link::start(LinkConfig::new(n.addr(), Carrier::Udp { paths: 2 })).unwrap()))
        .collect();
    let cfg = VolumeConfig {
        write_quorum: quorum,
        ..VolumeConfig::default()
    };
    Volume::new(VOLUME, BLOCKS * BLOCK as u64, links, cfg)
}

#[test]
fn every_acknowledged_write_survives_a_power_cut_on_every_replica() {
    if !test_support::is_root() {
        test_support::skip(
            NAME,
            test_support::Missing::Root,
            "mounting the power-cut disks needs root",
        );
        return;
    }
    if let Err(why) = Disk::available() {
        test_support::skip(NAME, test_support::Missing::Mount, &why);
        return;
    }
    let base = std::env::temp_dir().join(format!("power-cut-{}", std::process::id()));
    let mut disks: Vec<Disk> = (0..3)
        .map(|i| Disk::mount(base.join(format!("disk{i}"))).unwrap())
        .collect();
    let mut nodes: Vec<StorageNode> = disks
        .iter()
        .map(|d| StorageNode::start(node_config(d.path())).unwrap())
        .collect();
    for n in &nodes {
        n.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
    }
    let known: Arc<Mutex<HashMap<u64, Known>>> = Arc::default();
    let mut seq_base = 0u64;
    for round in 1..=3u64 {
        // rounds 1 and 2: every replica acknowledges; round 3: a majority
        let quorum = (round < 3).then_some(3);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let vol = volume(&rt, &nodes, quorum);
        let acked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        for w in 0..WRITERS {
            let (vol, known, acked) = (vol.clone(), known.clone(), acked.clone());
            rt.spawn(async move {
                // each writer owns a stripe of the volume, so one write per block is in flight
                let span = BLOCKS / WRITERS;
                let mut x = w * 7919 + round * 104_729 + 1;
                for i in 1u64.. {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let n = 1 + (x >> 60) % 8;
                    let lba = w * span + (x >> 33) % (span - n);
                    let seq = seq_base + (i << 4) + w;
                    let mut data = Vec::with_capacity((n as usize) * BLOCK);
                    {
                        let mut k = known.lock().unwrap();
                        for l in lba..lba + n {
                            data.extend_from_slice(&block(l, seq));
                            k.entry(l).or_default().unacked.push(seq);
                        }
                    }
                    if vol.write(lba * BLOCK as u64, &data, false).await.is_err() {
                        return; // the power is off
                    }
                    let mut k = known.lock().unwrap();
                    for l in lba..lba + n {
                        let kn = k.get_mut(&l).unwrap();
                        kn.acked = seq;
                        kn.unacked.clear();
                    }
                    acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        // cut at a different instant each round, once writes are flowing
        let until = std::time::Instant::now() + Duration::from_millis(700 + 600 * round);
        while std::time::Instant::now() < until || acked.load(std::sync::atomic::Ordering::Relaxed) < 100 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut lost = test_support::powercut::CutReport::default();
        for d in &mut disks {
            let r = d.power_cut();
            lost.files_reverted += r.files_reverted;
            lost.pages_lost += r.pages_lost;
            lost.entries_lost += r.entries_lost;
        }
        let writes = acked.load(std::sync::atomic::Ordering::Relaxed);
        rt.shutdown_timeout(Duration::from_secs(2));
        drop(vol);
        nodes.clear();
        let syncs: u64 = disks.iter().map(|d| d.stats().file_syncs).sum();
        eprintln!("round {round}: {writes} acknowledged writes, {syncs} file syncs, the cut lost {lost:?}");
        assert!(
            lost.pages_lost > 0,
            "the cut lost nothing: the test would not tell a store that never syncs"
        );

        for d in &mut disks {
            d.power_on().unwrap();
        }
        nodes = disks
            .iter()
            .map(|d| StorageNode::start(node_config(d.path())).unwrap())
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let vol = volume(&rt, &nodes, quorum);
        if quorum.is_none() {
            // a replica may lack a write a majority acknowledged: compare and copy first
            let stores = Arc::new(LocalStores::default());
            for (i, n) in nodes.iter().enumerate() {
                stores.set(&i.to_string(), n.store(VOLUME).unwrap());
            }
            vol.set_admins((0..3).map(|i| i.to_string()).collect(), stores);
            let _g = rt.enter();
            vol.start_reconcile();
            rt.block_on(vol.read(0, BLOCK as u64)).unwrap();
            let copied = vol
                .counters()
                .reconciled_blocks
                .load(std::sync::atomic::Ordering::Relaxed);
            eprintln!("round {round}: the new volume copied {copied} blocks to replicas that lacked them");
        }
        let k = known.lock().unwrap();
        let mut checked = 0;
        for (i, n) in nodes.iter().enumerate() {
            let store = n
                .store(VOLUME)
                .unwrap_or_else(|| panic!("round {round}: replica {i} lost volume {VOLUME}"));
            for (&lba, kn) in k.iter() {
                let (data, _crc, _v) = store
                    .read(lba)
                    .unwrap_or_else(|e| panic!("round {round}: replica {i} block {lba}: {e}"));
                let seq = u64::from_le_bytes(data[8..16].try_into().unwrap());
                assert!(
                    kn.allows(seq),
                    "round {round}: replica {i} block {lba} holds write {seq}, acknowledged {} (unacknowledged {:?})",
                    kn.acked,
                    kn.unacked
                );
                let expect = if seq == 0 { vec![0u8; BLOCK] } else { block(lba, seq) };
                assert!(data == expect, "round {round}: replica {i} block {lba} is torn");
                checked += 1;
            }
        }
        drop(k);
        let sample: Vec<(u64, Known)> = known
            .lock()
            .unwrap()
            .iter()
            .take(256)
            .map(|(l, k)| (*l, k.clone()))
            .collect();
        for (lba, kn) in sample {
            let got = rt.block_on(vol.read(lba * BLOCK as u64, BLOCK as u64)).unwrap();
            let seq = u64::from_le_bytes(got[8..16].try_into().unwrap());
            assert!(
                kn.allows(seq) && got == block(lba, seq) || seq == 0 && kn.acked == 0,
                "round {round}: block {lba} served"
            );
        }
        eprintln!("round {round}: {checked} block reads on 3 replicas after the restart");
        drop(vol);
        drop(rt);
        seq_base = round << 48;
    }
    nodes.clear();
    drop(disks);
    let _ = std::fs::remove_dir_all(&base);
}
