//! Snapshots across replicas, in process: with the volume's writes held off
//! ([`Volume::quiesced`]) while each storage node takes its snapshot, every replica's snapshot
//! holds exactly the same writes even with many writes in flight; a volume with a replica down
//! refuses to be snapshotted; a grown volume stays the same volume for its open users. A
//! snapshot holds exactly the writes acknowledged before it: none missing, none issued after.

use block_agent::agent::{Agent, AgentConfig, ReplicaAt};
use block_agent::link::{Carrier, Link, LinkConfig};
use block_agent::storage_node::{NodeConfig, StorageNode};
use block_agent::store::BLOCK;
use block_agent::volume::{Volume, VolumeConfig};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// One write of the point-in-time test: its version, when it was issued and when it was
/// acknowledged.
struct Write {
    lba: u64,
    seq: u64,
    issued: Instant,
    acked: Instant,
}

/// A snapshot holds exactly the writes acknowledged before it was asked for, and none issued
/// after it was acknowledged: 16 writers, each alone on its blocks and one write at a time,
/// write a new version of one block after another (every version of a block distinct) while
/// three snapshots are taken. For every block of every snapshot, on every replica, the block
/// is whole (one version, byte for byte), not older than the last version acknowledged before
/// `snapshot` was called, and issued before `snapshot` returned; a version in flight across
/// the call may be either. A snapshot taken late (after later writes landed) fails the last
/// check on the blocks written meanwhile, one taken early (writes acknowledged before it
/// missing) the second.
#[test]
fn a_snapshot_holds_exactly_the_writes_acknowledged_before_it() {
    let (base, nodes) = nodes("pit", 2);
    let rt = test_support::runtime();
    let vol = volume(&rt, &nodes, VolumeConfig::default());
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..16u64)
        .map(|t| {
            let (vol, stop) = (vol.clone(), stop.clone());
            rt.spawn(async move {
                let mut log = Vec::new();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    // writer t owns the blocks t, t + 16, ...: 64 blocks, visited in turn
                    let lba = ((seq * 47) % (BLOCKS / 16)) * 16 + t;
                    let issued = Instant::now();
                    vol.write(lba * BLOCK as u64, &block(lba, seq), false).await.unwrap();
                    log.push(Write {
                        lba,
                        seq,
                        issued,
                        acked: Instant::now(),
                    });
                }
                log
            })
        })
        .collect();
    // (asked, returned) of each snapshot
    let mut taken = Vec::new();
    for snap in 1..=3u32 {
        std::thread::sleep(Duration::from_millis(300));
        let asked = Instant::now();
        rt.block_on(vol.quiesced(async {
            for n in &nodes {
                n.snapshot(VOLUME, snap).unwrap();
            }
        }))
        .unwrap();
        taken.push((snap, asked, Instant::now()));
    }
    // writes after the last snapshot, so that every snapshot has later versions to refuse
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let mut by_lba: Vec<Vec<Write>> = (0..BLOCKS).map(|_| Vec::new()).collect();
    for w in writers {
        for x in rt.block_on(w).unwrap() {
            by_lba[x.lba as usize].push(x);
        }
    }
    let stores = [nodes[0].store(VOLUME).unwrap(), nodes[1].store(VOLUME).unwrap()];
    let (mut exact, mut in_flight, mut later) = (0u64, 0u64, 0u64);
    for &(snap, asked, returned) in &taken {
        for (lba, writes) in by_lba.iter().enumerate() {
            let lba = lba as u64;
            // the newest version acknowledged before the snapshot was asked for (0: none)
            let floor = writes
                .iter()
                .filter(|w| w.acked < asked)
                .map(|w| w.seq)
                .max()
                .unwrap_or(0);
            later += writes.iter().filter(|w| w.issued > returned).count() as u64;
            for (r, store) in stores.iter().enumerate() {
                let got = store.read_snapshot(snap, lba).unwrap();
                let seq = if got.iter().all(|&b| b == 0) {
                    0
                } else {
                    u64::from_le_bytes(got[8..16].try_into().unwrap())
                };
                let what = format!("snapshot {snap}, replica {r}, block {lba}");
                if seq == 0 {
                    assert_eq!(
                        floor, 0,
                        "{what}: empty, but version {floor} was acknowledged before it"
                    );
                    continue;
                }
                assert!(
                    got == block(lba, seq),
                    "{what}: not one whole version (header says {seq})"
                );
                assert!(
                    seq >= floor,
                    "{what}: version {seq}, older than version {floor} acknowledged before the snapshot"
                );
                let w = writes
                    .iter()
                    .find(|w| w.seq == seq)
                    .expect("a version some writer wrote");
                assert!(
                    w.issued <= returned,
                    "{what}: version {seq}, issued {:?} after the snapshot was acknowledged",
                    w.issued - returned
                );
                if seq == floor {
                    exact += 1;
                } else {
                    in_flight += 1;
                }
            }
        }
    }
    eprintln!(
        "{exact} snapshot blocks at the last version acknowledged before the snapshot, {in_flight} at a version in \
         flight across it; {later} writes issued after the snapshots"
    );
    // the test saw what it checks: blocks written before, and many writes after, each snapshot
    assert!(exact > BLOCKS, "{exact} blocks held an acknowledged version");
    assert!(later > BLOCKS, "only {later} writes came after the snapshots");
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

/// The storage node's admin calls that move snapshots between nodes (the controller's
/// re-replication of a volume with snapshots): a node copies a volume's snapshots from another
/// node's admin service, each as it was taken (sizes too: the volume grew between them), and
/// its live blocks read as zeros; bad requests get errors naming what is wrong, and a copy that
/// fails leaves nothing behind.
#[test]
fn a_node_copies_a_volumes_snapshots_from_another() {
    use block_agent::control::pb;
    use block_agent::control::pb::storage_node_admin_server::{StorageNodeAdmin, StorageNodeAdminServer};
    use block_agent::control::NodeAdmin;
    use tonic::{Code, Request};
    let base = std::env::temp_dir().join(format!("snap-copy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let src = Arc::new(StorageNode::start(NodeConfig::new(base.join("src"))).unwrap());
    let dst = Arc::new(StorageNode::start(NodeConfig::new(base.join("dst"))).unwrap());
    src.create_volume(VOLUME, BLOCKS * BLOCK as u64).unwrap();
    let s = src.store(VOLUME).unwrap();
    let put = |lba: u64, seq: u64| {
        let b = block(lba, seq);
        s.write(lba, &b, crc32c::crc32c(&b), seq).unwrap();
    };
    // snapshot 1: even blocks of the first half; snapshot 7: grown, some overwritten, some
    // zeroed, some new past the old end; then live writes neither has
    for lba in (0..BLOCKS / 2).step_by(2) {
        put(lba, 1);
    }
    src.snapshot(VOLUME, 1).unwrap();
    src.resize_volume(VOLUME, 2 * BLOCKS * BLOCK as u64).unwrap();
    for lba in (0..BLOCKS / 2).step_by(6) {
        put(lba, 2);
    }
    s.write_zeroes(4, 8, 3).unwrap();
    for lba in BLOCKS..BLOCKS + 40 {
        put(lba, 4);
    }
    src.snapshot(VOLUME, 7).unwrap();
    for lba in 0..64 {
        put(lba, 5);
    }
    let expect = |snap: u32, lba: u64| s.read_snapshot(snap, lba).unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(StorageNodeAdminServer::new(NodeAdmin(src.clone())))
            .serve(addr),
    );
    let admin = NodeAdmin(dst.clone());
    let copy = |source: String, snapshots: Vec<u32>, size: u64| {
        rt.block_on(admin.copy_snapshots(Request::new(pb::CopySnapshotsRequest {
            volume: VOLUME,
            source,
            snapshots,
            size,
            ..Default::default()
        })))
    };
    // bad requests, and a source that is not there: errors, nothing made
    let size = 3 * BLOCKS * BLOCK as u64;
    assert_eq!(
        copy(addr.to_string(), vec![], size).unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        copy(addr.to_string(), vec![1], 1000).unwrap_err().code(),
        Code::InvalidArgument
    );
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    assert!(copy(gone, vec![1, 7], size).is_err());
    assert!(dst.store(VOLUME).is_none(), "a failed copy left a volume");
    let ask_since = |volume, snapshot, lba, blocks, since| {
        rt.block_on(
            NodeAdmin(src.clone()).read_snapshot(Request::new(pb::ReadSnapshotRequest {
                volume,
                snapshot,
                lba,
                blocks,
                since,
                own: false,
            })),
        )
    };
    let ask = |volume, snapshot, blocks| ask_since(volume, snapshot, 0, blocks, 0);
    assert_eq!(ask(VOLUME, 1, 257).unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(ask(VOLUME, 2, 1).unwrap_err().code(), Code::NotFound);
    assert_eq!(ask(VOLUME + 1, 1, 1).unwrap_err().code(), Code::NotFound);
    assert_eq!(
        ask_since(VOLUME, 7, 0, 1, 2).unwrap_err().code(),
        Code::NotFound,
        "no snapshot 2"
    );
    assert_eq!(
        ask_since(VOLUME, 7, 0, 1, 7).unwrap_err().code(),
        Code::NotFound,
        "itself"
    );
    // snapshot 7 since snapshot 1: a block no write touched in between comes without data;
    // one written, zeroed or grown in between comes as a full read would give it
    let mut unchanged = 0;
    for from in (0..2 * BLOCKS).step_by(256) {
        let rep = ask_since(VOLUME, 7, from, 256, 1).unwrap().into_inner();
        let mut data = rep.data.chunks_exact(BLOCK);
        for (k, &state) in rep.states.iter().enumerate() {
            let lba = from + k as u64;
            let same = lba < BLOCKS
                && s.read_snapshot(1, lba).unwrap() == s.read_snapshot(7, lba).unwrap()
                && s.snapshot_allocation(1, lba).unwrap() == s.snapshot_allocation(7, lba).unwrap();
            if state == block_agent::control::SNAPSHOT_UNCHANGED {
                assert!(same, "block {lba} changed between the snapshots but came as unchanged");
                unchanged += 1;
                continue;
            }
            // what the writes between the snapshots touched (a zeroed hole is a new write too)
            let touched = lba >= BLOCKS || (lba < BLOCKS / 2 && lba.is_multiple_of(6)) || (4..12).contains(&lba);
            assert!(touched, "block {lba}, untouched between the snapshots, came whole");
            assert_eq!(state, s.snapshot_allocation(7, lba).unwrap(), "block {lba}'s state");
            if state == block_agent::store::ALLOC_DATA {
                assert!(
                    data.next().unwrap() == &s.read_snapshot(7, lba).unwrap()[..],
                    "block {lba}"
                );
            }
        }
        assert!(data.next().is_none(), "data beyond the data blocks");
    }
    assert!(unchanged > BLOCKS / 4, "only {unchanged} blocks came as unchanged");
    // the copy (the source's server may still be starting: a few tries)
    let mut tries = 0;
    while let Err(e) = copy(addr.to_string(), vec![1, 7], size) {
        tries += 1;
        assert!(tries < 50 && e.code() == Code::Unavailable, "{e}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let d = dst.store(VOLUME).unwrap();
    assert_eq!(d.snapshots(), vec![1, 7]);
    assert_eq!(
        (d.snapshot_blocks(1), d.snapshot_blocks(7)),
        (Some(BLOCKS), Some(2 * BLOCKS))
    );
    assert_eq!(d.blocks(), 3 * BLOCKS);
    for (snap, end) in [(1, BLOCKS), (7, 2 * BLOCKS)] {
        for lba in 0..end {
            assert!(
                d.read_snapshot(snap, lba).unwrap() == expect(snap, lba),
                "snapshot {snap} block {lba}"
            );
            assert_eq!(
                d.snapshot_allocation(snap, lba).unwrap(),
                s.snapshot_allocation(snap, lba).unwrap(),
                "snapshot {snap} block {lba}'s allocation"
            );
        }
    }
    for lba in [0, 1, 63, BLOCKS, 3 * BLOCKS - 1] {
        assert!(d.read(lba).unwrap().0 == vec![0u8; BLOCK], "live block {lba} is zeros");
    }
    // a second copy of the same volume is refused
    assert_eq!(
        copy(addr.to_string(), vec![1], size).unwrap_err().code(),
        Code::AlreadyExists
    );
    drop(rt);
    let _ = std::fs::remove_dir_all(&base);
}
