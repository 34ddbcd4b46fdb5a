//! Block volumes survive restarts, as processes: storage nodes keep their identity in their
//! data directories and register under it wherever they listen, so
//! - `blkctl cluster down` then `cluster up` serves the same volume with its data;
//! - a storage node killed and started again on another port serves its replicas again while
//!   a client keeps writing, with no I/O error;
//! - a controller killed and started again loses nothing and follows a node that moves;
//! - an agent killed and started again serves the same NBD URI with the same data;
//! - a controller state of version 1 (replicas by address) upgrades in place;
//! - a second process serving a copy of a node's directory is refused, and the first one
//!   left serving keeps the volume consistent;
//! - with etcd, a killed node leaves etcd within its lease and the controller marks it down.

mod common;

use block_agent::nbd::client::NbdClient;
use clients::blk::{ClusterSpec, LocalCluster};
use common::{blkctl, check_stores, free_port, have, host_port, local_etcd, pattern, spawner, tmp, Writers};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// An 8 MiB image that never repeats (different every run).
fn random_image(path: &Path) -> Vec<u8> {
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut v = vec![0u8; 8 << 20];
    for c in v.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, &v).unwrap();
    v
}

/// Writes `img` at offset 0 of the volume at `uri`: with nbdcopy (a real NBD client) where
/// installed, else with the project's client.
fn write_image(uri: &str, file: &Path, img: &[u8]) {
    if have("nbdcopy") {
        let o = Command::new("nbdcopy").arg(file).arg(uri).output().unwrap();
        assert!(o.status.success(), "nbdcopy in: {}", String::from_utf8_lossy(&o.stderr));
    } else {
        test_support::skip(
            "block restart data through nbdcopy",
            test_support::Missing::Tool,
            "nbdcopy is not installed (scripts/install-test-deps.sh installs libnbd-bin): the project's NBD client moves the image",
        );
        let (hp, name) = host_port(uri);
        let mut c = NbdClient::connect(hp.as_str(), &name).unwrap();
        c.write(0, img, true).unwrap();
        c.disconnect();
    }
}

/// Reads `len` bytes at offset 0 of the volume at `uri` (nbdcopy where installed).
fn read_image(uri: &str, dir: &Path, len: usize) -> Vec<u8> {
    if have("nbdcopy") {
        let out = dir.join("back.img");
        let o = Command::new("nbdcopy").arg(uri).arg(&out).output().unwrap();
        assert!(
            o.status.success(),
            "nbdcopy out: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let mut v = std::fs::read(&out).unwrap();
        v.truncate(len);
        v
    } else {
        let (hp, name) = host_port(uri);
        let mut c = NbdClient::connect(hp.as_str(), &name).unwrap();
        let mut v = vec![0u8; len];
        c.read(0, &mut v).unwrap();
        c.disconnect();
        v
    }
}

fn down_up_round(dir: &Path, extra: &[&str]) {
    let nbd = format!("127.0.0.1:{}", free_port());
    let mut up = vec!["cluster", "up", "--size", "64MiB", "--nbd", nbd.as_str()];
    up.extend_from_slice(extra);
    let (ok, out, err) = blkctl(dir, &up);
    assert!(ok, "cluster up: {err}");
    let uri = out.trim().to_string();
    std::fs::create_dir_all(dir.join("io")).unwrap();
    let img_file = dir.join("io/image");
    let img = random_image(&img_file);
    write_image(&uri, &img_file, &img);
    let (ok, _, err) = blkctl(dir, &["cluster", "down"]);
    assert!(ok && err.contains("data kept"), "cluster down: {err}");
    // the same command again: the kept volume, with its data
    let (ok, out, err) = blkctl(dir, &up);
    assert!(ok, "second cluster up: {err}");
    assert!(
        err.contains("is the one kept"),
        "the kept volume is said to be served again: {err}"
    );
    assert_eq!(out.trim(), uri, "the same NBD URI");
    let back = read_image(&uri, &dir.join("io"), img.len());
    if back != img {
        let bad: Vec<usize> = (0..img.len() / 4096)
            .filter(|&b| back[b * 4096..(b + 1) * 4096] != img[b * 4096..(b + 1) * 4096])
            .collect();
        let zeros = bad
            .iter()
            .filter(|&&b| back[b * 4096..(b + 1) * 4096].iter().all(|&x| x == 0))
            .count();
        let log = std::fs::read_to_string(dir.join("agent0.log")).unwrap_or_default();
        panic!(
            "the image read back after cluster down/up differs in {} blocks ({zeros} read as zeros), first {:?}; \
             agent log:\n{log}",
            bad.len(),
            &bad[..bad.len().min(8)]
        );
    }
    let (ok, out, _) = blkctl(dir, &["cluster", "status"]);
    assert!(ok, "{out}");
    assert_eq!(out.matches(" up ").count(), 3, "three storage nodes up:\n{out}");
    assert!(!out.contains("NOT RUNNING") && !out.contains("down"), "{out}");
    let (ok, out, _) = blkctl(dir, &["describe", "vol0"]);
    assert!(ok && out.matches("\"state\": \"up\"").count() == 3, "{out}");
    let (ok, _, err) = blkctl(dir, &["cluster", "down", "--purge"]);
    assert!(ok, "{err}");
}

#[test]
fn cluster_down_then_up_serves_the_same_data() {
    down_up_round(&tmp("downup"), &[]);
}

#[test]
fn cluster_down_then_up_with_metadata_in_etcd() {
    let Some((_etcd, ep)) = local_etcd("blkdu") else { return };
    down_up_round(&tmp("downup-etcd"), &["--etcd", &ep]);
}

fn fast_spec(dir: &Path) -> ClusterSpec {
    let mut spec = ClusterSpec::new(dir.to_path_buf());
    spec.size = 32 << 20;
    spec.heartbeat_ms = 200;
    spec.node_timeout_ms = 1000;
    spec
}

fn describe(c: &LocalCluster) -> String {
    let (ok, out, err) = blkctl(&c.spec.dir, &["--control", &c.control_addr, "describe", "vol0"]);
    assert!(ok, "{err}");
    out
}

/// Waits until `describe vol0` shows `want` (the controller's view settles within heartbeats).
fn wait_describe(c: &LocalCluster, want: impl Fn(&str) -> bool, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let d = describe(c);
        if want(&d) {
            return d;
        }
        assert!(Instant::now() < deadline, "{what}: {d}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_storage_node_restarted_on_a_new_port_serves_again_under_io() {
    let dir = tmp("newport");
    let mut c = LocalCluster::start(&spawner(), fast_spec(&dir)).unwrap();
    let old = c.nodes[1].field("data").unwrap();
    let w = Writers::start(&c.uri, (32 << 20) / 4096, 4);
    std::thread::sleep(Duration::from_millis(1000));
    let before = w.count();
    c.nodes[1].kill9();
    wait_describe(&c, |d| d.contains("\"state\": \"down\""), "the killed node shows down");
    let while_down = w.count();
    c.restart_node(1, false).unwrap();
    let new = c.nodes[1].field("data").unwrap();
    assert_ne!(old, new, "the node listens on another port now");
    let d = wait_describe(
        &c,
        |d| d.contains(&new) && d.matches("\"state\": \"up\"").count() == 3,
        "the controller follows the node to its new address",
    );
    assert!(!d.contains(&old), "{d}");
    let back = w.count();
    std::thread::sleep(Duration::from_millis(2000));
    let after = w.count();
    eprintln!(
        "writes acknowledged: {before} before the kill, {} while the node was down, {} in 2 s after its restart on {new} (was {old})",
        while_down - before,
        after - back
    );
    assert!(before > 50, "writes flowed before the kill");
    assert!(after > back + 50, "writes flow again after the restart on a new port");
    let acked = w.finish();
    drop(c);
    check_stores(&dir, &acked);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restarted_controller_loses_nothing_and_follows_a_moved_node() {
    let dir = tmp("ctlrestart");
    let mut c = LocalCluster::start(&spawner(), fast_spec(&dir)).unwrap();
    let w = Writers::start(&c.uri, (32 << 20) / 4096, 2);
    std::thread::sleep(Duration::from_millis(500));
    c.control.kill9();
    // the data path does not go through the controller
    let t = w.count();
    std::thread::sleep(Duration::from_millis(500));
    assert!(w.count() > t + 20, "writes go on while the controller is down");
    c.restart_control().unwrap();
    wait_describe(
        &c,
        |d| d.matches("\"state\": \"up\"").count() == 3,
        "the nodes' heartbeats reach the new controller",
    );
    // the new controller follows a node that moves
    c.nodes[2].kill9();
    c.restart_node(2, false).unwrap();
    let new = c.nodes[2].field("data").unwrap();
    wait_describe(
        &c,
        |d| d.contains(&new) && d.matches("\"state\": \"up\"").count() == 3,
        "the restarted controller follows the moved node",
    );
    let t = w.count();
    std::thread::sleep(Duration::from_millis(1000));
    assert!(w.count() > t + 20, "writes flow after the move");
    let acked = w.finish();
    drop(c);
    check_stores(&dir, &acked);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restarted_agent_serves_the_same_uri_and_data() {
    let dir = tmp("agentrestart");
    let mut spec = fast_spec(&dir);
    spec.nbd = format!("127.0.0.1:{}", free_port());
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let uri = c.uri.clone();
    let (hp, name) = host_port(&uri);
    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
    let blocks: Vec<u64> = (0..64).map(|i| i * 97).collect();
    for &b in &blocks {
        cl.write(b * 4096, &pattern(b, 7), false).unwrap();
    }
    cl.disconnect();
    c.agent.kill9();
    c.restart_agent().unwrap();
    // the controller's answer to its registration brings the export back
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut cl = loop {
        match NbdClient::connect(hp.as_str(), &name) {
            Ok(cl) => break cl,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the restarted agent does not export {name}: {e}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let mut buf = vec![0u8; 4096];
    for &b in &blocks {
        cl.read(b * 4096, &mut buf).unwrap();
        assert!(buf == pattern(b, 7), "block {b} after the agent restart");
    }
    cl.disconnect();
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rewrites a cluster's state as version 1 wrote it (nodes and replicas by data address) and
/// removes the node ids, as a cluster made before node ids looks.
fn downgrade_to_version_one(dir: &Path) {
    let p = dir.join("control.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let nodes = v["nodes"].as_object().unwrap();
    let addr = |id: &str| nodes[id]["data"].as_str().unwrap().to_string();
    let mut volumes = v["volumes"].clone();
    for (_, vol) in volumes.as_object_mut().unwrap() {
        let r: Vec<String> = vol["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| addr(x.as_str().unwrap()))
            .collect();
        vol["replicas"] = serde_json::json!(r);
    }
    let old_nodes: serde_json::Map<String, serde_json::Value> = nodes
        .values()
        .map(|n| (n["data"].as_str().unwrap().to_string(), n["admin"].clone()))
        .collect();
    let v1 =
        serde_json::json!({"next_id": v["next_id"], "volumes": volumes, "nodes": old_nodes, "agents": v["agents"]});
    std::fs::write(&p, serde_json::to_vec_pretty(&v1).unwrap()).unwrap();
    for i in 0..3 {
        std::fs::remove_file(dir.join(format!("node{i}/node-id"))).unwrap();
    }
}

#[test]
fn a_version_one_state_upgrades_in_place() {
    let dir = tmp("upgrade");
    let nbd = format!("127.0.0.1:{}", free_port());
    let up = ["cluster", "up", "--size", "16MiB", "--nbd", nbd.as_str()];
    let (ok, out, err) = blkctl(&dir, &up);
    assert!(ok, "{err}");
    let uri = out.trim().to_string();
    let (hp, name) = host_port(&uri);
    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
    cl.write(4096 * 100, &pattern(100, 3), true).unwrap();
    cl.disconnect();
    let (ok, _, err) = blkctl(&dir, &["cluster", "down"]);
    assert!(ok, "{err}");
    downgrade_to_version_one(&dir);
    let (ok, out, err) = blkctl(&dir, &up);
    assert!(ok, "cluster up over a version-1 state: {err}");
    assert_eq!(out.trim(), uri);
    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
    let mut buf = vec![0u8; 4096];
    cl.read(4096 * 100, &mut buf).unwrap();
    assert!(buf == pattern(100, 3), "the block written before the upgrade");
    cl.disconnect();
    let (ok, out, _) = blkctl(&dir, &["describe", "vol0"]);
    assert!(
        ok && out.matches("\"node\": \"sn-").count() == 3,
        "replicas claimed by node ids: {out}"
    );
    let (ok, _, err) = blkctl(&dir, &["cluster", "down", "--purge"]);
    assert!(ok, "{err}");
}

#[test]
fn a_second_process_with_a_copied_node_directory_is_refused() {
    let dir = tmp("dupid");
    let mut c = LocalCluster::start(&spawner(), fast_spec(&dir)).unwrap();
    // a copy of node0's directory (its node id with it) started as a fourth process
    let copy = dir.join("node0-copy");
    std::fs::create_dir_all(&copy).unwrap();
    for e in std::fs::read_dir(dir.join("node0")).unwrap().flatten() {
        if e.file_name() != "LOCK" {
            // a live directory: a temporary file (a fence being replaced) may be gone by now
            match std::fs::copy(e.path(), copy.join(e.file_name())) {
                Err(x) if x.kind() == std::io::ErrorKind::NotFound => {}
                r => {
                    r.unwrap();
                }
            }
        }
    }
    let args = vec![
        "--dir".to_string(),
        copy.display().to_string(),
        "--control".into(),
        c.control_addr.clone(),
        "--heartbeat-ms".into(),
        "200".into(),
    ];
    let mut dup = clients::blk::Daemon::start(&spawner(), &dir, "dup", "node", &args, false).unwrap();
    // the newer start serves the id now; the first process's next heartbeat is refused and it
    // stops, naming why
    let deadline = Instant::now() + Duration::from_secs(10);
    while clients::blk::proc_start_time(c.nodes[0].pid).is_some() {
        assert!(Instant::now() < deadline, "the superseded node process still runs");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    assert!(log.contains("superseded"), "{log}");
    // and the same directory cannot be served by two processes at once
    let again = clients::blk::Daemon::start(&spawner(), &dir, "dup2", "node", &args, false);
    let e = format!(
        "{:#}",
        again.err().expect("a second process on one directory is refused")
    );
    assert!(e.contains("in use by another storage node process"), "{e}");
    dup.stop();
    c.nodes[0].stop();
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With the metadata in etcd, storage nodes and the agent register themselves under leases
/// (`PREFIX/block/live/...`), and the controller follows those keys with a watch: a killed
/// node leaves etcd within its 2 s lease and is down then, long before the controller's
/// heartbeat timeout (60 s here) would say so; restarted, it is up again; stopped cleanly,
/// every process leaves etcd at once.
#[test]
fn with_etcd_a_killed_node_leaves_etcd_and_is_down_within_its_lease() {
    let Some((_etcd, ep)) = local_etcd("blk-live") else {
        return;
    };
    let dir = tmp("live");
    let mut spec = fast_spec(&dir);
    spec.etcd = Some(ep.clone());
    spec.node_timeout_ms = 60_000;
    spec.etcd_lease_ttl_s = 2;
    let prefix = clients::blk::etcd_prefix(&dir);
    let mut c = LocalCluster::start(&spawner(), spec).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut kv = rt.block_on(etcd_lite::EtcdClient::connect(&ep)).unwrap();
    let mut live = |kind: &str| {
        rt.block_on(kv.get_prefix(format!("{prefix}/block/live/{kind}/").as_bytes()))
            .unwrap()
            .into_iter()
            .map(|(k, v)| (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap()))
            .collect::<Vec<_>>()
    };
    let nodes = live("nodes");
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    let victim = c.nodes[1].field("node").unwrap();
    assert!(
        nodes
            .iter()
            .any(|(k, v)| k.ends_with(&victim) && v.contains("\"data\"")),
        "{nodes:?}"
    );
    assert_eq!(live("agents").len(), 1);
    wait_describe(&c, |d| d.matches("\"state\": \"up\"").count() == 3, "three nodes up");

    c.nodes[1].kill9();
    let t = Instant::now();
    wait_describe(&c, |d| d.contains("\"state\": \"down\""), "the killed node shows down");
    let down = t.elapsed();
    eprintln!("killed storage node down after {down:?} (lease 2 s, heartbeat timeout 60 s)");
    assert!(down < Duration::from_secs(10), "{down:?}");
    assert_eq!(live("nodes").len(), 2);

    c.restart_node(1, false).unwrap();
    wait_describe(
        &c,
        |d| d.matches("\"state\": \"up\"").count() == 3,
        "the restarted node is up",
    );
    assert_eq!(live("nodes").len(), 3);

    // a clean stop leaves etcd at once (no lease to wait out)
    for n in c.nodes.iter_mut() {
        n.stop();
    }
    c.agent.stop();
    assert!(
        live("nodes").is_empty() && live("agents").is_empty(),
        "{:?}",
        live("nodes")
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pid `blkctl cluster up` recorded for daemon `name` in `dir/cluster.json`.
fn recorded_pid(dir: &Path, name: &str) -> u32 {
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("cluster.json")).unwrap()).unwrap();
    state["pids"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p[0] == name)
        .and_then(|p| p[1].as_u64())
        .unwrap_or_else(|| panic!("{name}'s pid in {state}")) as u32
}

/// SIGKILL to `pid`, and waits until it is gone (or a zombie).
fn kill9_and_wait(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    let t = Instant::now();
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z"))
        && t.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `blkctl cluster status` shows the controller answering with `up` storage nodes
/// up; returns the output.
fn wait_status_up(dir: &Path, up: usize, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (ok, out, err) = blkctl(dir, &["cluster", "status"]);
        assert!(ok, "cluster status: {err}");
        let n = out
            .lines()
            .filter(|l| l.contains(" admin ") && l.contains("  up "))
            .count();
        if !out.contains("does not answer") && n == up {
            return out;
        }
        assert!(Instant::now() < deadline, "{what}: {out}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `blkctl cluster restart control` brings a killed controller back on the address the nodes,
/// the agent and the saved state know (it was started with `--listen 127.0.0.1:0`): `status`
/// and `describe` answer, every node shows up, and a restarted node registers with it.
#[test]
fn cluster_restart_control_comes_back_on_its_address() {
    /// Stops the detached cluster however the test ends.
    struct Down(std::path::PathBuf);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = blkctl(&self.0, &["cluster", "down", "--purge"]);
        }
    }
    let dir = tmp("clictl");
    let (ok, _, err) = blkctl(&dir, &["cluster", "up", "--size", "16MiB", "--nbd", "127.0.0.1:0"]);
    let _down = Down(dir.clone());
    assert!(ok, "cluster up: {err}");
    wait_status_up(&dir, 3, "the nodes are up");
    kill9_and_wait(recorded_pid(&dir, "control"));
    let (ok, _, err) = blkctl(&dir, &["cluster", "restart", "control"]);
    assert!(ok, "cluster restart control: {err}");
    wait_status_up(&dir, 3, "the nodes' heartbeats reach the restarted controller");
    let (ok, out, err) = blkctl(&dir, &["describe", "vol0"]);
    assert!(
        ok && out.contains("vol0"),
        "describe after the controller's restart: {err}"
    );
    // a node started again registers with the restarted controller
    kill9_and_wait(recorded_pid(&dir, "node2"));
    let (ok, _, err) = blkctl(&dir, &["cluster", "restart", "node2"]);
    assert!(ok, "cluster restart node2: {err}");
    wait_status_up(&dir, 3, "the restarted node registers with the restarted controller");
    let (ok, _, err) = blkctl(&dir, &["cluster", "down", "--purge"]);
    assert!(ok, "{err}");
}
