//! The block service as processes: `blkctl cluster up/down` and the volume commands (with the
//! controller's metadata in a file and in a real etcd), kill -9 of a storage node during a
//! write-heavy run with every acknowledged write checked on every replica afterwards (with
//! the default majority quorum writes go on and the replica is caught up after its restart),
//! an agent restarted while a replica is behind (it reconciles the replicas), snapshots and
//! clones under fio, TRIM and BLOCK_STATUS through qemu-io, nbdinfo and qemu-img, QoS, and a
//! real kernel file system (ext4 through nbdfuse and a loop device) on a flexns volume.

mod common;

use block_agent::nbd::client::NbdClient;
use clients::blk::{ClusterSpec, LocalCluster};
use common::{blkctl, check_stores, check_stores_on, have, host_port, local_etcd, pattern, spawner, tmp, Writers};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// SIGKILL to `pid`, and waits until it is gone.
fn kill9_pid(pid: i32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    let t = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
        && t.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn cli_round(dir: &Path, extra: &[&str]) {
    let mut up = vec!["cluster", "up", "--size", "16MiB", "--nbd", "127.0.0.1:0"];
    up.extend_from_slice(extra);
    let (ok, out, err) = blkctl(dir, &up);
    assert!(ok, "cluster up: {err}");
    let uri = out.trim().to_string();
    assert!(uri.starts_with("nbd://127.0.0.1:"), "{uri}");
    let (ok, _, err) = blkctl(dir, &["cluster", "up"]);
    assert!(
        !ok && err.contains("already up"),
        "a second cluster up is refused: {err}"
    );
    let (ok, out, _) = blkctl(dir, &["create", "data1", "--size", "8MiB", "--replicas", "2"]);
    assert!(ok && out.contains("data1"), "{out}");
    let (ok, _, err) = blkctl(dir, &["create", "data1", "--size", "8MiB"]);
    assert!(!ok && err.contains("exists"), "{err}");
    let (ok, _, err) = blkctl(dir, &["create", "big", "--size", "8MiB", "--replicas", "5"]);
    assert!(!ok && err.contains("5 storage nodes"), "{err}");
    let (ok, _, err) = blkctl(dir, &["create", "odd", "--size", "1000"]);
    assert!(!ok && err.contains("multiple of 4096"), "{err}");
    let (ok, out, _) = blkctl(dir, &["resize", "data1", "--size", "12MiB"]);
    assert!(ok && out.contains("12582912"), "{out}");
    let (ok, _, err) = blkctl(dir, &["resize", "data1", "--size", "4MiB"]);
    assert!(!ok && err.contains("only grow"), "{err}");
    let (ok, out, err) = blkctl(dir, &["attach", "data1"]);
    assert!(ok, "{err}");
    let data_uri = out.trim().to_string();
    let (ok, out, _) = blkctl(dir, &["describe", "data1"]);
    assert!(ok && out.contains("\"agent\": \"agent0\""), "{out}");
    let (ok, out, _) = blkctl(dir, &["list"]);
    assert!(
        ok && out.contains("vol0") && out.contains("data1") && out.contains("agents: agent0"),
        "{out}"
    );
    // data through the agent, on both volumes
    let (hp, name) = host_port(&data_uri);
    let mut c = NbdClient::connect(hp.as_str(), &name).unwrap();
    assert_eq!(c.size(), 12 << 20);
    let block: Vec<u8> = (0..65536u32).map(|i| (i % 241) as u8).collect();
    c.write(12 << 20 >> 1, &block, true).unwrap();
    let mut back = vec![0u8; block.len()];
    c.read(12 << 20 >> 1, &mut back).unwrap();
    assert!(back == block);
    c.disconnect();
    if !have("qemu-io") {
        test_support::skip(
            "blkctl volumes through qemu-io",
            test_support::Missing::Tool,
            "qemu-io is not installed (scripts/install-test-deps.sh installs qemu-utils)",
        );
    } else {
        let sock = dir.join("nbd.sock");
        let unix = format!("nbd+unix:///vol0?socket={}", sock.display());
        let o = Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                &unix,
                "-c",
                "write -P 0x5a 0 1M",
                "-c",
                "read -P 0x5a 0 1M",
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "qemu-io over the unix socket: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // a killed storage node comes back with `cluster restart`
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("cluster.json")).unwrap()).unwrap();
    let pid = state["pids"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p[0] == "node0")
        .and_then(|p| p[1].as_u64())
        .expect("node0's pid");
    let (ok, _, err) = blkctl(dir, &["cluster", "restart", "node0"]);
    assert!(!ok && err.contains("is running"), "{err}");
    kill9_pid(pid as i32);
    let (ok, _, err) = blkctl(dir, &["cluster", "restart", "node0"]);
    assert!(ok, "cluster restart: {err}");
    let (ok, out, _) = blkctl(dir, &["cluster", "status"]);
    assert!(ok && !out.contains("NOT RUNNING"), "{out}");
    let (ok, _, _) = blkctl(dir, &["delete", "data1"]);
    assert!(ok);
    assert!(
        NbdClient::connect(hp.as_str(), &name).is_err(),
        "a deleted volume is no longer exported"
    );
    let (ok, _, err) = blkctl(dir, &["cluster", "down", "--purge"]);
    assert!(ok, "{err}");
    assert!(!dir.exists());
}

#[test]
fn blkctl_cluster_and_volume_commands() {
    cli_round(&tmp("cli"), &[]);
}

#[test]
fn blkctl_cluster_with_metadata_in_etcd() {
    let Some((_etcd, ep)) = local_etcd("blk") else { return };
    cli_round(&tmp("etcd"), &["--etcd", &ep]);
}

/// An agent restarted while a replica is behind (with the default majority quorum it missed
/// the writes made while its node was down, and the agent that knew is gone) compares the
/// replicas when it attaches the volume again and copies the newest copy of each block to the
/// stale one before serving: every acknowledged write ends up on every replica, and a read
/// after the restart returns the latest data.
#[test]
fn a_restarted_agent_reconciles_a_replica_it_no_longer_knows_is_behind() {
    let dir = tmp("reconcile");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 32 << 20;
    spec.replicas = 3;
    spec.nodes = 3;
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let control = c.control_addr.clone();
    let w = Writers::start(&c.uri, (32u64 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1000));
    c.nodes[1].kill9();
    let before = w.count();
    std::thread::sleep(Duration::from_millis(1500));
    let while_down = w.count() - before;
    let acked = w.finish();
    assert!(while_down > 50, "writes went on without node1: {while_down}");
    // the agent that knew node1 is behind dies; node1 and a new agent start
    c.agent.kill9();
    c.restart_node(1, true).unwrap();
    let t = Instant::now();
    c.restart_agent().unwrap();
    let d = describe_until(&dir, &control, Duration::from_secs(30), |d| {
        d["io"]["reconciled_blocks"].as_u64().unwrap_or(0) > 0
    });
    let (hp, name) = host_port(&c.uri);
    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
    for (&lba, &v) in acked.iter().take(200) {
        let mut got = vec![0u8; 4096];
        cl.read(lba * 4096, &mut got).unwrap();
        assert!(got == pattern(lba, v), "block {lba}: not the acknowledged write {v:#x}");
    }
    cl.disconnect();
    let view = describe(&dir, &control, "vol0");
    assert_eq!(view["epoch"], 2, "the restarted agent is a new attachment: {view}");
    eprintln!(
        "{while_down} writes while node1 was down; after the agent's restart the replicas were reconciled \
         within {d:?} of it ({:?} since the restart): {}",
        t.elapsed(),
        view["io"]
    );
    drop(c);
    check_stores(&dir, &acked);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 4-node cluster whose 3-replica volume `vol0` has a replica replaced 2 s after its node
/// falls silent (1 s without a heartbeat): a node holding one of its replicas (the victim to
/// kill) and the node holding none (the spare that takes it over).
struct ReplaceCluster {
    c: LocalCluster,
    dir: std::path::PathBuf,
    control: String,
    ids: Vec<String>,
    victim: usize,
    spare: usize,
}

fn replace_cluster(tag: &str, size: u64) -> ReplaceCluster {
    let dir = tmp(tag);
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = size;
    spec.replicas = 3;
    spec.nodes = 4;
    spec.node_timeout_ms = 1000;
    spec.replace_after_ms = 2000;
    let c = LocalCluster::start(&spawner(), spec).unwrap();
    let control = c.control_addr.clone();
    let ids: Vec<String> = c.nodes.iter().map(|n| n.field("node").unwrap()).collect();
    let d = describe(&dir, &control, "vol0");
    let victim = (0..4).find(|&i| holds(&d, &ids[i])).unwrap();
    let spare = (0..4).find(|&i| !holds(&d, &ids[i])).unwrap();
    ReplaceCluster {
        c,
        dir,
        control,
        ids,
        victim,
        spare,
    }
}

/// Whether a volume `describe` names storage node `id` among its 3 replicas.
fn holds(d: &serde_json::Value, id: &str) -> bool {
    (0..3).any(|k| d["replicas"][k]["node"] == id)
}

/// A replica whose storage node stays down past the controller's `--replace-after-ms` is
/// replaced by a new one on a spare node, which the agent rebuilds from the others while
/// writes go on: no write fails, `describe` shows the new node `in-sync`, and it holds every
/// acknowledged write.
#[test]
fn a_replica_down_past_the_replace_timeout_is_rebuilt_on_another_node() {
    let ReplaceCluster {
        mut c,
        dir,
        control,
        ids,
        victim,
        spare,
    } = replace_cluster("replace", 32 << 20);
    let w = Writers::start(&c.uri, (32u64 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1000));
    c.nodes[victim].kill9();
    let t = Instant::now();
    let replaced = describe_until(&dir, &control, Duration::from_secs(20), |d| holds(d, &ids[spare]));
    let rebuilt = describe_until(&dir, &control, Duration::from_secs(30), |d| {
        (0..3).all(|k| d["replicas"][k]["sync"] == "in-sync")
    });
    let slowest = w.take_slowest();
    let acked = w.finish();
    std::thread::sleep(Duration::from_millis(500));
    let d = describe(&dir, &control, "vol0");
    eprintln!(
        "node{victim} killed; node{spare} took its replica {replaced:?} later and was in sync {rebuilt:?} after that \
         ({:?} in all); slowest write {slowest:?}; {}",
        t.elapsed(),
        d["io"]
    );
    assert!(!holds(&d, &ids[victim]) && holds(&d, &ids[spare]), "{d:#}");
    // the old node comes back: its stale copy is deleted, never served
    c.restart_node(victim, true).unwrap();
    let stale = dir.join(format!("node{victim}/vol-1.data"));
    let t = Instant::now();
    while stale.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "node{victim} kept its stale copy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(c);
    let now: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    check_stores_on(&dir, &now, &acked);
    if std::env::var_os("BLOCK_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The controller makes a new replica without holding its state: while the snapshot copy onto
/// the spare node hangs (the spare is stopped, SIGSTOP, in the middle of it), `blkctl list`
/// and `describe` are answered at once, and the move completes when the spare wakes.
#[test]
fn control_calls_are_answered_while_a_new_replicas_snapshot_copy_hangs() {
    let r = replace_cluster("copy-hang", 64 << 20);
    let (mut c, dir, control, ids, victim, spare) = (r.c, r.dir, r.control, r.ids, r.victim, r.spare);
    // a snapshot of many written blocks: a copy that takes a while
    let w = Writers::start(&c.uri, (64u64 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1500));
    let written = w.finish().len();
    let (ok, _, err) = blkctl(&dir, &["--control", control.as_str(), "snapshot", "create", "vol0@s1"]);
    assert!(ok, "snapshot create: {err}");
    let spare_log = dir.join(format!("node{spare}.log"));
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    c.nodes[victim].kill9();
    let t = Instant::now();
    while !read(&spare_log).contains("copying snapshots") {
        assert!(t.elapsed() < Duration::from_secs(30), "no copy started on node{spare}");
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(c.nodes[spare].pid, "STOP");
    // well within the 1 s after which the stopped spare would count as down
    let t = Instant::now();
    let (listed, out, err) = blkctl(&dir, &["--control", control.as_str(), "list"]);
    let list_took = t.elapsed();
    let t = Instant::now();
    let d = describe(&dir, &control, "vol0");
    let describe_took = t.elapsed();
    let copy_done = read(&spare_log).contains("copied its snapshots");
    let moved = read(&dir.join("control.log")).contains(&format!("replaced by a new one on {}", ids[spare]));
    signal(c.nodes[spare].pid, "CONT");
    assert!(
        !copy_done && !moved,
        "the copy of {written} blocks was over before the spare stopped: nothing was held up"
    );
    assert!(listed && out.contains("vol0"), "list: {out} {err}");
    assert!(
        !holds(&d, &ids[spare]),
        "the move is not recorded before it is made: {d:#}"
    );
    assert!(
        list_took < Duration::from_millis(500) && describe_took < Duration::from_millis(500),
        "control calls during the copy: list {list_took:?}, describe {describe_took:?}"
    );
    let rebuilt = describe_until(&dir, &control, Duration::from_secs(40), |d| {
        holds(d, &ids[spare]) && (0..3).all(|k| d["replicas"][k]["sync"] == "in-sync")
    });
    eprintln!(
        "{written} blocks in the snapshot; during its copy list took {list_took:?}, describe {describe_took:?}; \
         the new replica was in sync {rebuilt:?} after the spare woke"
    );
    drop(c);
    if std::env::var_os("BLOCK_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A volume with a snapshot, and a clone of it with a snapshot of its own, lose a replica for
/// good: the controller makes a new one on the spare node with the snapshot copied from a
/// surviving replica (not only the live blocks), then the clone's there (a clone of the copied
/// snapshot, with the clone's snapshot copied into it), and the agent rebuilds the live blocks
/// of both. Read straight from the stores afterwards: the new replica's snapshot holds what
/// the volume held when it was taken (holes where it had none), its live blocks what was
/// written after, the clone its own writes over the snapshot, and the clone's snapshot the
/// clone's writes before it.
#[test]
fn a_replica_of_a_volume_with_snapshots_is_rebuilt_with_them() {
    let ReplaceCluster {
        mut c,
        dir,
        control,
        ids,
        victim,
        spare,
    } = replace_cluster("replace-snap", 16 << 20);
    let blocks = (16u64 << 20) / 4096;
    let w = Writers::start(&c.uri, blocks, 4);
    std::thread::sleep(Duration::from_millis(800));
    let at_snapshot = w.finish();
    let (ok, out, err) = blkctl(&dir, &["--control", control.as_str(), "snapshot", "create", "vol0@s1"]);
    assert!(ok, "snapshot create: {err}");
    assert!(out.contains("vol0@s1"), "{out}");
    // after the snapshot: some of its blocks overwritten, some blocks it lacks written
    let (hp, name) = host_port(&c.uri);
    let mut nbd = NbdClient::connect(hp.as_str(), &name).unwrap();
    let mut live = at_snapshot.clone();
    let overwritten: Vec<u64> = at_snapshot.keys().copied().take(200).collect();
    let fresh: Vec<u64> = (0..blocks).filter(|l| !at_snapshot.contains_key(l)).take(50).collect();
    assert!(
        overwritten.len() > 20 && fresh.len() == 50,
        "writes before the snapshot: {}",
        at_snapshot.len()
    );
    for &lba in overwritten.iter().chain(&fresh) {
        let v = (1 << 62) | lba;
        nbd.write(lba * 4096, &pattern(lba, v), false).unwrap();
        live.insert(lba, v);
    }
    nbd.flush().unwrap();
    drop(nbd);
    // a clone of the snapshot, with writes of its own
    let ok = |args: &[&str]| {
        let mut a = vec!["--control", control.as_str()];
        a.extend_from_slice(args);
        let (ok, out, err) = blkctl(&dir, &a);
        assert!(ok, "blkctl {args:?}: {err}");
        out
    };
    ok(&["clone", "vol0@s1", "c1"]);
    let c1_uri = ok(&["attach", "c1"]).trim().to_string();
    let (hp1, n1) = host_port(&c1_uri);
    let mut cl = NbdClient::connect(hp1.as_str(), &n1).unwrap();
    let mut clone_writes = HashMap::new();
    for &lba in overwritten.iter().take(20).chain(fresh.iter().take(20)) {
        let v = (1 << 61) | lba;
        cl.write(lba * 4096, &pattern(lba, v), false).unwrap();
        clone_writes.insert(lba, v);
    }
    cl.flush().unwrap();
    // a snapshot of the clone, then writes over 10 of its blocks and 10 it never wrote
    ok(&["snapshot", "create", "c1@cs1"]);
    let at_clone_snapshot = clone_writes.clone();
    let later: Vec<u64> = overwritten
        .iter()
        .take(10)
        .chain(overwritten.iter().skip(20).take(10))
        .copied()
        .collect();
    for &lba in &later {
        let v = (1 << 60) | lba;
        cl.write(lba * 4096, &pattern(lba, v), false).unwrap();
        clone_writes.insert(lba, v);
    }
    cl.flush().unwrap();
    cl.disconnect();
    c.nodes[victim].kill9();
    let t = Instant::now();
    let replaced = describe_until(&dir, &control, Duration::from_secs(30), |d| holds(d, &ids[spare]));
    let rebuilt = describe_until(&dir, &control, Duration::from_secs(30), |d| {
        (0..3).all(|k| d["replicas"][k]["sync"] == "in-sync")
    });
    // the clone follows its parent's replica to the spare node
    let clone_rebuilt = loop {
        let d = describe(&dir, &control, "c1");
        if holds(&d, &ids[spare]) && (0..3).all(|k| d["replicas"][k]["sync"] == "in-sync") {
            break t.elapsed();
        }
        assert!(t.elapsed() < Duration::from_secs(40), "c1 was not moved: {d:#}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let c1_id = describe(&dir, &control, "c1")["id"].as_u64().unwrap() as u32;
    eprintln!(
        "node{victim} killed; node{spare} took its replica with the snapshot {replaced:?} later, in sync {rebuilt:?} \
         after that ({:?} in all), its clone c1 in sync {clone_rebuilt:?} after the kill; {} blocks in the \
         snapshot, {} written after",
        t.elapsed(),
        at_snapshot.len(),
        overwritten.len() + fresh.len()
    );
    drop(c);
    let now: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    check_stores_on(&dir, &now, &live);
    for i in now {
        let s = block_agent::store::VolumeStore::open(&dir.join(format!("node{i}")), 1, 1 << 30).unwrap();
        let snaps = s.snapshots();
        assert_eq!(snaps.len(), 1, "node{i}'s snapshots: {snaps:?}");
        for (&lba, &v) in &at_snapshot {
            assert!(
                s.read_snapshot(snaps[0], lba).unwrap() == pattern(lba, v),
                "node{i} snapshot block {lba}: not the write {v:#x} it held"
            );
        }
        for &lba in &fresh {
            assert!(
                s.read_snapshot(snaps[0], lba).unwrap() == vec![0u8; 4096],
                "node{i} snapshot block {lba}: written after the snapshot, yet in it"
            );
        }
        // the clone: its own writes, the rest as the snapshot had it
        let node_dir = dir.join(format!("node{i}"));
        let base = block_agent::store::Base {
            store: std::sync::Arc::new(s),
            snapshot: snaps[0],
        };
        let clone = block_agent::store::VolumeStore::open_with(&node_dir, c1_id, 1 << 30, Some(base)).unwrap();
        for (&lba, &v) in at_snapshot.iter().chain(&clone_writes) {
            let want = clone_writes.get(&lba).copied().unwrap_or(v);
            assert!(
                clone.read(lba).unwrap().0 == pattern(lba, want),
                "node{i} clone block {lba}: not {want:#x}"
            );
        }
        // the clone's own snapshot: its writes before it, the parent's snapshot elsewhere
        let cs = clone.snapshots();
        assert_eq!(cs.len(), 1, "node{i}: the clone's snapshots {cs:?}");
        for (&lba, &v) in at_snapshot.iter().chain(&at_clone_snapshot) {
            let want = at_clone_snapshot.get(&lba).copied().unwrap_or(v);
            assert!(
                clone.read_snapshot(cs[0], lba).unwrap() == pattern(lba, want),
                "node{i} clone snapshot block {lba}: not {want:#x}"
            );
        }
        for &lba in fresh.iter().skip(20) {
            assert!(
                clone.read_snapshot(cs[0], lba).unwrap() == vec![0u8; 4096],
                "node{i} clone snapshot block {lba}: neither the parent's snapshot nor the clone wrote it"
            );
        }
    }
    if std::env::var_os("BLOCK_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn kill_dash_nine_of_a_storage_node_loses_no_acknowledged_write() {
    let dir = tmp("kill9");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 32 << 20;
    spec.replicas = 3;
    spec.nodes = 3;
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let w = Writers::start(&c.uri, (32u64 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1500));
    let before_kill = w.count();
    c.nodes[1].kill9();
    std::thread::sleep(Duration::from_millis(1000));
    let while_down = w.count();
    c.restart_node(1, true).unwrap();
    let restarted = Instant::now();
    std::thread::sleep(Duration::from_millis(3000));
    let total = w.count();
    let acked = w.finish();
    // with the default majority quorum the last writes' third copies may still be in flight,
    // and node1 may still be catching up: every replica holds every write once it is in sync
    let control = c.control_addr.clone();
    describe_until(&dir, &control, Duration::from_secs(20), |d| {
        (0..3).all(|i| d["replicas"][i]["sync"] == "in-sync")
    });
    std::thread::sleep(Duration::from_millis(500));
    eprintln!(
        "writes acknowledged: {before_kill} before the kill, {} while node1 was down, {} after its restart ({:?})",
        while_down - before_kill,
        total - while_down,
        restarted.elapsed()
    );
    assert!(before_kill > 50, "writes flowed before the kill");
    assert!(total > while_down + 50, "writes flowed again after the restart");
    // every acknowledged write is on every replica, read straight from the stores
    drop(c);
    check_stores(&dir, &acked);
    eprintln!("{} blocks checked on 3 replicas", acked.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `blkctl describe` of `volume` against the cluster's controller, as JSON.
fn describe(dir: &Path, control: &str, volume: &str) -> serde_json::Value {
    let (ok, out, err) = blkctl(dir, &["--control", control, "describe", volume]);
    assert!(ok, "describe: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("describe printed {out:?}: {e}"))
}

/// Polls `describe` until `want` holds of it, or panics after `within`.
fn describe_until(dir: &Path, control: &str, within: Duration, want: impl Fn(&serde_json::Value) -> bool) -> Duration {
    let t = Instant::now();
    loop {
        let d = describe(dir, control, "vol0");
        if want(&d) {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "describe after {within:?}: {d:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// With a 2-of-3 write quorum (`blkctl cluster up --write-quorum 2`), kill -9 of a storage
/// node costs no write: writes go on (none waits for the dead replica, none fails), describe
/// shows the replica down; restarted, it is caught up from a good copy while writes continue,
/// and then every replica holds every acknowledged write.
#[test]
fn with_a_write_quorum_a_dead_replica_stalls_no_write_and_is_caught_up() {
    let dir = tmp("quorum");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 32 << 20;
    spec.replicas = 3;
    spec.nodes = 3;
    spec.write_quorum = 2;
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let control = c.control_addr.clone();
    let w = Writers::start(&c.uri, (32u64 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1500));
    let d = describe(&dir, &control, "vol0");
    assert_eq!(d["write_quorum"], 2, "{d:#}");
    // node1's place among the volume's replicas
    let id = c.nodes[1].field("node").expect("node id in the banner");
    let r = (0..3)
        .find(|&i| d["replicas"][i]["node"] == id.as_str())
        .expect("node1 holds a replica");
    let before_kill = w.count();
    c.nodes[1].kill9();
    w.take_slowest();
    let down_after = describe_until(&dir, &control, Duration::from_secs(10), |d| {
        d["replicas"][r]["sync"] == "down"
    });
    std::thread::sleep(Duration::from_millis(1500));
    let while_down = w.count() - before_kill;
    let slowest_down = w.take_slowest();
    c.restart_node(1, true).unwrap();
    let caught_up = describe_until(&dir, &control, Duration::from_secs(30), |d| {
        (0..3).all(|i| d["replicas"][i]["sync"] == "in-sync")
    });
    let d = describe(&dir, &control, "vol0");
    std::thread::sleep(Duration::from_millis(500));
    let acked = w.finish(); // fails on any I/O error
                            // the last writes' third copies may still be in flight (a quorum answered them): every
                            // replica holds every write once they land, which an in-sync describe then shows
    describe_until(&dir, &control, Duration::from_secs(20), |d| {
        (0..3).all(|i| d["replicas"][i]["sync"] == "in-sync")
    });
    std::thread::sleep(Duration::from_millis(500));
    eprintln!(
        "{before_kill} writes before the kill; node1 down in describe after {down_after:?}; {while_down} writes \
         while it was down (slowest {slowest_down:?}); caught up {caught_up:?} after its restart: {}",
        d["io"]
    );
    assert!(before_kill > 50, "writes flowed before the kill");
    assert!(while_down > 50, "writes flowed while node1 was down");
    assert!(
        slowest_down < Duration::from_secs(1),
        "a write waited {slowest_down:?} for the dead replica"
    );
    assert!(d["io"]["resynced_regions"].as_u64().unwrap() >= 1, "{d:#}");
    drop(c);
    check_stores(&dir, &acked);
    eprintln!("{} blocks checked on 3 replicas", acked.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// 4 KiB writes from each connection, one write at a time on each, for `secs`: the
/// connections back, and every write's completion time, in order.
fn write_for(conns: Vec<NbdClient>, secs: f64) -> (Vec<NbdClient>, Vec<Instant>) {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let n = conns.len() as u64;
    let threads: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, mut cl)| {
            std::thread::spawn(move || {
                let c = c as u64;
                let block = vec![0x5Au8 ^ c as u8; 4096];
                let mut done = Vec::new();
                let mut i = 0u64;
                while Instant::now() < end {
                    cl.write(((i * n + c) % 2048) * 4096, &block, false).unwrap();
                    done.push(Instant::now());
                    i += 1;
                }
                (cl, done)
            })
        })
        .collect();
    let (mut conns, mut all) = (Vec::new(), Vec::new());
    for t in threads {
        let (cl, done) = t.join().unwrap();
        conns.push(cl);
        all.extend(done);
    }
    all.sort();
    (conns, all)
}

/// Completions per second from the `skip`-th completion to the last.
fn rate_after(done: &[Instant], skip: usize) -> (f64, Duration) {
    assert!(done.len() > skip + 100, "only {} writes completed", done.len());
    let span = done[done.len() - 1] - done[skip];
    ((done.len() - 1 - skip) as f64 / span.as_secs_f64(), span)
}

/// Provisioned IOPS: a volume created with `--iops 200 --burst-ms 100` gets 200 writes per
/// second ±10 % from 16 connections that want far more (measured over 3 s, past the 20-write
/// burst), `describe` shows the limit and that nearly every write waited, and `blkctl qos`
/// lifts the limit online for the connections already open: at least twice the limit then,
/// and no write waits.
#[test]
fn provisioned_iops_hold_and_change_online() {
    let dir = tmp("qos");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 8 << 20;
    spec.replicas = 1;
    spec.nodes = 1;
    let c = LocalCluster::start(&spawner(), spec).unwrap();
    let ctl = c.control_addr.as_str();
    let run = |args: &[&str]| {
        let mut a = vec!["--control", ctl];
        a.extend_from_slice(args);
        let (ok, out, err) = blkctl(&dir, &a);
        assert!(ok, "blkctl {args:?}: {err}");
        out
    };
    run(&[
        "create",
        "q",
        "--size",
        "8MiB",
        "--replicas",
        "1",
        "--iops",
        "200",
        "--burst-ms",
        "100",
    ]);
    let uri = run(&["attach", "q"]).trim().to_string();
    let (hp, name) = host_port(&uri);
    // 16 connections keep 16 writes waiting: demand far above 200 per second
    let conns = (0..16)
        .map(|_| NbdClient::connect(hp.as_str(), &name).unwrap())
        .collect();
    let (conns, limited) = write_for(conns, 3.0);
    // past the burst (20 writes) and the first queue of 16
    let (rate, span) = rate_after(&limited, 40);
    let d = describe(&dir, ctl, "q");
    assert_eq!(d["qos"]["iops"], 200, "{d:#}");
    let throttled = d["qos"]["throttled"].as_u64().unwrap();
    assert!(
        (180.0..=220.0).contains(&rate),
        "{rate:.1} writes/s over {span:?} at a 200 IOPS limit ({} writes in all)",
        limited.len()
    );
    // with writes always waiting, each one past the burst is held back
    assert!(
        throttled as f64 >= 0.9 * (limited.len() - 20) as f64,
        "{throttled} of {} writes throttled: {d:#}",
        limited.len()
    );
    assert!(d["qos"]["throttled_ms"].as_f64().unwrap() > 0.0, "{d:#}");
    run(&["qos", "q", "--iops", "0"]);
    // the same 16 connections, still open: writes after the change see it at once
    let (_, lifted) = write_for(conns, 2.0);
    let (free, free_span) = rate_after(&lifted, 40);
    eprintln!(
        "200 IOPS limit: {rate:.1} writes/s over {span:?} ({} writes, {throttled} throttled); lifted online: \
         {free:.1} writes/s over {free_span:?}",
        limited.len()
    );
    let after = describe(&dir, ctl, "q");
    assert_eq!(after["qos"]["iops"], 0, "{after:#}");
    assert_eq!(
        after["qos"]["throttled"], d["qos"]["throttled"],
        "a write waited after the limit was lifted: {after:#}"
    );
    assert!(
        free >= 400.0,
        "{free:.1} writes/s with the limit lifted (limit was 200)"
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ext4_on_a_flexns_volume_through_nbdfuse() {
    if !test_support::is_root() {
        test_support::skip(
            "ext4 through nbdfuse",
            test_support::Missing::Root,
            "losetup and mount need root",
        );
        return;
    }
    for t in ["nbdfuse", "mkfs.ext4", "losetup", "fsck.ext4"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            test_support::skip(
                "ext4 through nbdfuse",
                test_support::Missing::Tool,
                &format!("{t} is not installed (scripts/install-test-deps.sh installs libnbd-bin, fuse3, e2fsprogs)"),
            );
            return;
        }
    }
    if !Path::new("/dev/fuse").exists() {
        test_support::skip(
            "ext4 through nbdfuse",
            test_support::Missing::Mount,
            "/dev/fuse does not exist here",
        );
        return;
    }
    let dir = tmp("ext4");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 64 << 20;
    let c = LocalCluster::start(&spawner(), spec).unwrap();
    let (fuse, fs) = (dir.join("fuse"), dir.join("fs"));
    std::fs::create_dir_all(&fuse).unwrap();
    std::fs::create_dir_all(&fs).unwrap();
    let sh = |cmd: &str| {
        let o = Command::new("sh").args(["-c", cmd]).output().unwrap();
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    };
    let mut nbdfuse = Command::new("nbdfuse").arg(&fuse).arg(&c.uri).spawn().unwrap();
    let dev = fuse.join("nbd");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dev.exists() {
        assert!(Instant::now() < deadline, "nbdfuse did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ok, loopdev) = sh(&format!("losetup -f --show {}", dev.display()));
    let cleanup = |loopdev: &str| {
        let _ = sh(&format!(
            "umount {} 2>/dev/null; losetup -d {loopdev} 2>/dev/null; umount {} 2>/dev/null",
            fs.display(),
            fuse.display()
        ));
    };
    if !ok {
        let _ = nbdfuse.kill();
        let _ = nbdfuse.wait();
        cleanup("");
        test_support::skip(
            "ext4 through nbdfuse",
            test_support::Missing::Mount,
            &format!("no loop device available here: {loopdev}"),
        );
        return;
    }
    let l = loopdev.trim().to_string();
    let steps = [
        format!("mkfs.ext4 -q -F {l}"),
        format!("mount {l} {}", fs.display()),
        format!(
            "head -c 8M /dev/urandom > {0}/a.bin && cp {0}/a.bin {0}/b.bin && sync",
            fs.display()
        ),
        format!("cmp {0}/a.bin {0}/b.bin", fs.display()),
        format!("umount {}", fs.display()),
        format!("fsck.ext4 -f -n {l}"),
        format!("mount {l} {0} && cmp {0}/a.bin {0}/b.bin && umount {0}", fs.display()),
    ];
    for s in &steps {
        let (ok, out) = sh(s);
        if !ok {
            cleanup(&l);
            let _ = nbdfuse.kill();
            let _ = nbdfuse.wait();
            panic!("{s}: {out}");
        }
    }
    cleanup(&l);
    let _ = nbdfuse.wait();
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_demo_block_step_writes_and_verifies_a_volume() {
    let r = clients::blk::demo_step(&spawner(), 0.5).unwrap();
    assert_eq!(r.len(), 1);
    assert!(r[0].verified, "{:?}", r[0]);
    assert!(r[0].ops > 10, "{:?}", r[0]);
}

/// fio through the NBD engine on `uri`; its JSON report. Panics (with fio's words) when fio
/// fails, a verify failure included.
fn fio(uri: &str, args: &[&str]) -> serde_json::Value {
    let o = Command::new("fio")
        .args(["--name=snap", "--ioengine=nbd", &format!("--uri={uri}"), "--bs=4k"])
        .args(["--output-format=json", "--verify=crc32c", "--verify_fatal=1"])
        .args(args)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "fio {args:?}: {}\n{out}",
        String::from_utf8_lossy(&o.stderr)
    );
    let json = &out[out.find('{').expect("fio's JSON")..];
    serde_json::from_str(json).unwrap()
}

/// Snapshots and clones as a user meets them: snapshots taken while fio overwrites the volume
/// at random (verify headers on every block) restore to a state fio's verify accepts, through
/// a clone attached at once; they are points in time (a block written just before the
/// snapshot is in it, one written just after is not); they survive a kill -9 of a storage
/// node; a snapshot with a clone cannot be deleted, and the volume with clones cannot either.
#[test]
fn snapshots_under_a_running_fio_verify_workload_restore_to_a_state_fio_accepts() {
    if !have("fio") {
        test_support::skip(
            "snapshots under fio",
            test_support::Missing::Tool,
            "fio is not installed (scripts/install-test-deps.sh installs it)",
        );
        return;
    }
    let dir = tmp("snap");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 24 << 20;
    spec.replicas = 2;
    spec.nodes = 2;
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let ctl = c.control_addr.clone();
    let run = |args: &[&str]| {
        let mut a = vec!["--control", ctl.as_str()];
        a.extend_from_slice(args);
        blkctl(&dir, &a)
    };
    let ok = |args: &[&str]| {
        let (ok, out, err) = run(args);
        assert!(ok, "blkctl {args:?}: {err}");
        out
    };
    // fio owns the first 16 MiB (every block a fio block); markers live past it
    fio(&c.uri, &["--rw=write", "--size=16m", "--do_verify=0"]);
    let (hp, name) = host_port(&c.uri);
    let mut nbd = NbdClient::connect(hp.as_str(), &name).unwrap();
    let marker = 20u64 << 20;
    let uri = c.uri.clone();
    let load = std::thread::spawn(move || {
        fio(
            &uri,
            &[
                "--rw=randwrite",
                "--size=16m",
                "--iodepth=16",
                "--do_verify=0",
                "--time_based",
                "--runtime=5",
                "--randrepeat=0",
            ],
        )
    });
    std::thread::sleep(Duration::from_millis(1500));
    nbd.write(marker, &pattern(marker / 4096, 1), true).unwrap();
    let t = Instant::now();
    let out = ok(&["snapshot", "create", "vol0@s1"]);
    let took = t.elapsed();
    assert!(out.contains("vol0@s1"), "{out}");
    nbd.write(marker, &pattern(marker / 4096, 2), true).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    ok(&["snapshot", "create", "vol0@s2"]);
    let (ok2, _, err) = run(&["snapshot", "create", "vol0@s2"]);
    assert!(!ok2 && err.contains("has a snapshot"), "a name is taken once: {err}");
    let report = load.join().unwrap();
    let w = &report["jobs"][0]["write"];
    let max_ms = w["clat_ns"]["max"].as_f64().unwrap() / 1e6;
    eprintln!(
        "fio randwrite during two snapshots: {:.0} IOPS, slowest write {max_ms:.1} ms; blkctl snapshot create took {took:?}",
        w["iops"].as_f64().unwrap()
    );
    // the snapshots outlive a kill -9 of a storage node
    c.nodes[1].kill9();
    c.restart_node(1, true).unwrap();
    let out = ok(&["clone", "vol0@s1", "c1"]);
    assert!(out.contains("clone of vol0@s1"), "{out}");
    let c1 = ok(&["attach", "c1"]).trim().to_string();
    let report = fio(&c1, &["--rw=read", "--size=16m"]);
    assert_eq!(
        report["jobs"][0]["read"]["io_bytes"],
        16 << 20,
        "the whole 16 MiB verified"
    );
    let (hp1, n1) = host_port(&c1);
    let mut cl = NbdClient::connect(hp1.as_str(), &n1).unwrap();
    let mut got = vec![0u8; 4096];
    cl.read(marker, &mut got).unwrap();
    assert!(
        got == pattern(marker / 4096, 1),
        "the block written just before s1 is in it"
    );
    nbd.read(marker, &mut got).unwrap();
    assert!(got == pattern(marker / 4096, 2), "the volume keeps its own write");
    // a clone is a volume of its own: its writes stay in it
    cl.write(marker, &pattern(marker / 4096, 3), true).unwrap();
    ok(&["clone", "vol0@s2", "c2"]);
    let c2 = ok(&["attach", "c2"]).trim().to_string();
    fio(&c2, &["--rw=read", "--size=16m"]);
    let (hp2, n2) = host_port(&c2);
    let mut cl2 = NbdClient::connect(hp2.as_str(), &n2).unwrap();
    cl2.read(marker, &mut got).unwrap();
    assert!(got == pattern(marker / 4096, 2), "s2 was taken after the second marker");
    cl2.disconnect();
    cl.disconnect();
    nbd.disconnect();
    let out = ok(&["snapshot", "list", "vol0"]);
    assert!(out.contains("vol0@s1") && out.contains("clones c1"), "{out}");
    let (no, _, err) = run(&["snapshot", "delete", "vol0@s1"]);
    assert!(!no && err.contains("clones (c1)"), "{err}");
    let (no, _, err) = run(&["delete", "vol0"]);
    assert!(!no && err.contains("clones"), "{err}");
    ok(&["delete", "c1"]);
    ok(&["snapshot", "delete", "vol0@s1"]);
    let out = ok(&["snapshot", "list"]);
    assert!(!out.contains("vol0@s1") && out.contains("vol0@s2"), "{out}");
    // c2 still reads s2 whole
    fio(&c2, &["--rw=read", "--size=16m"]);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The extents `nbdinfo --map --json` reports: (offset, length, hole).
fn nbd_map(uri: &str) -> Vec<(u64, u64, bool)> {
    let o = Command::new("nbdinfo").args(["--map", "--json", uri]).output().unwrap();
    assert!(o.status.success(), "nbdinfo: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v.as_array()
        .expect("extents")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["type"].as_u64().unwrap() & 1 != 0,
            )
        })
        .collect()
}

/// Bytes the storage nodes' data files occupy on disk.
fn data_file_bytes(dir: &Path, nodes: usize) -> u64 {
    use std::os::unix::fs::MetadataExt;
    (0..nodes)
        .map(|i| {
            std::fs::metadata(dir.join(format!("node{i}/vol-1.data")))
                .unwrap()
                .blocks()
                * 512
        })
        .sum()
}

/// TRIM and WRITE_ZEROES give space back: through real clients (qemu-io), the zeroed ranges
/// read as zeros, `nbdinfo --map` and `qemu-img map` show them as holes, the storage nodes'
/// data files shrink on disk, and WRITE_ZEROES with NO_HOLE keeps its blocks allocated.
#[test]
fn trim_deallocates_and_block_status_shows_the_sparse_layout() {
    trim_round("solar");
    trim_round("tcp");
}

fn trim_round(transport: &str) {
    for t in ["qemu-io", "nbdinfo", "qemu-img"] {
        if !have(t) {
            test_support::skip(
                "TRIM and BLOCK_STATUS",
                test_support::Missing::Tool,
                &format!("{t} is not installed (scripts/install-test-deps.sh installs it)"),
            );
            return;
        }
    }
    let dir = tmp(&format!("trim-{transport}"));
    let mut spec = ClusterSpec::new(dir.clone());
    spec.transport = transport.into();
    spec.size = 64 << 20;
    spec.replicas = 2;
    spec.nodes = 2;
    let c = LocalCluster::start(&spawner(), spec).unwrap();
    let io = |cmds: &[&str]| {
        let mut a = vec!["-f", "raw", c.uri.as_str()];
        for x in cmds {
            a.extend(["-c", x]);
        }
        let o = Command::new("qemu-io").args(&a).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success() && !out.contains("Pattern verification failed") && !out.contains("failed"),
            "qemu-io {cmds:?}: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    assert_eq!(nbd_map(&c.uri), vec![(0, 64 << 20, true)], "a new volume is one hole");
    io(&["write -P 0x5a 0 16M"]);
    let written = data_file_bytes(&dir, 2);
    io(&[
        "discard 4M 8M",      // TRIM
        "write -z -u 12M 2M", // WRITE_ZEROES, may deallocate
        "write -z 14M 1M",    // WRITE_ZEROES with NO_HOLE
        "read -P 0 4M 11M",
        "read -P 0x5a 0 4M",
        "read -P 0x5a 15M 1M",
    ]);
    let mib = 1u64 << 20;
    assert_eq!(
        nbd_map(&c.uri),
        vec![
            (0, 4 * mib, false),
            (4 * mib, 10 * mib, true),
            (14 * mib, 2 * mib, false),
            (16 * mib, 48 * mib, true)
        ]
    );
    let o = Command::new("qemu-img")
        .args(["map", "--output=json", "-f", "raw", &c.uri])
        .output()
        .unwrap();
    let map: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let hole = map
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["start"] == 4 * mib)
        .expect("an extent at 4 MiB");
    assert_eq!(
        (hole["length"].as_u64(), hole["data"].as_bool()),
        (Some(10 * mib), Some(false)),
        "{map}"
    );
    let after = data_file_bytes(&dir, 2);
    eprintln!("{transport}: data files on disk: {written} bytes after writing 16 MiB on 2 replicas, {after} after zeroing 10 MiB");
    assert!(
        after + 2 * 9 * mib <= written,
        "the zeroed 10 MiB were given back on both replicas: {written} -> {after} bytes"
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends `sig` (STOP, CONT) to `pid`.
fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

/// A volume moved off an agent that hangs (SIGSTOP: cut off, not dead, its NBD connection
/// still open). Detaching it needs `--force` since the agent cannot answer; attaching it to
/// another agent raises its epoch and that agent fences every replica before its first I/O.
/// When the old agent wakes, the writes and reads its client still sends fail (EIO) instead of
/// writing over the new agent's data, and every write acknowledged through the new agent is on
/// every replica.
#[test]
fn a_volume_moved_off_a_hung_agent_fences_that_agent_out() {
    let dir = tmp("fence");
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 16 << 20;
    spec.replicas = 3;
    spec.nodes = 3;
    let c = LocalCluster::start(&spawner(), spec).unwrap();
    let control = c.control_addr.clone();
    let ctl = |args: &[&str]| {
        let mut a = vec!["--control", control.as_str()];
        a.extend_from_slice(args);
        blkctl(&dir, &a)
    };
    let (hp, name) = host_port(&c.uri);
    let mut old = NbdClient::connect(hp.as_str(), &name).unwrap();
    old.set_timeout(Some(Duration::from_secs(30))).unwrap();
    const BLOCKS: u64 = 64;
    for lba in 0..BLOCKS {
        old.write(lba * 4096, &pattern(lba, 1), false).unwrap();
    }
    assert_eq!(describe(&dir, &control, "vol0")["epoch"], 1);
    let agent1 = c.start_agent("agent1").unwrap();
    signal(c.agent.pid, "STOP");
    let (ok, _, err) = ctl(&["detach", "vol0"]);
    assert!(
        !ok && err.contains("--force"),
        "a detach the agent cannot answer is refused: {err}"
    );
    let (ok, _, err) = ctl(&["detach", "vol0", "--force"]);
    assert!(ok, "detach --force: {err}");
    let (ok, out, err) = ctl(&["attach", "vol0", "--agent", "agent1"]);
    assert!(ok, "attach to agent1: {err}");
    let (hp1, name1) = host_port(out.trim());
    let mut new = NbdClient::connect(hp1.as_str(), &name1).unwrap();
    for lba in 0..BLOCKS {
        new.write(lba * 4096, &pattern(lba, 2), false).unwrap();
    }
    let view = describe(&dir, &control, "vol0");
    assert_eq!(
        (view["epoch"].as_u64(), view["agent"].as_str()),
        (Some(2), Some("agent1")),
        "{view}"
    );
    // the old agent wakes up with its client's requests waiting
    signal(c.agent.pid, "CONT");
    let t = Instant::now();
    let w = old.write(0, &pattern(0, 3), false);
    assert!(w.is_err(), "the fenced agent's write was refused");
    let mut got = vec![0u8; 4096];
    assert!(old.read(4096, &mut got).is_err(), "the fenced agent's read was refused");
    eprintln!("the old agent's write failed {:?} after it woke: {w:?}", t.elapsed());
    let log = std::fs::read_to_string(&c.agent.log).unwrap_or_default();
    assert!(log.contains("fenced"), "the old agent says it is fenced");
    for lba in 0..BLOCKS {
        new.read(lba * 4096, &mut got).unwrap();
        assert!(got == pattern(lba, 2), "block {lba}: the new agent's write");
    }
    new.disconnect();
    drop(agent1);
    drop(c);
    check_stores(&dir, &(0..BLOCKS).map(|lba| (lba, 2)).collect());
    let _ = std::fs::remove_dir_all(&dir);
}
