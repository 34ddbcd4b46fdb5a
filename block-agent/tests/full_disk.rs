//! End to end, as processes: a replica whose disk fills up. Two `block-server`s (node 1 keeps
//! its volumes on a 4 MiB tmpfs), a `block-agent` exporting two 2-replica volumes over NBD,
//! and a raw NBD client.
//!
//! - Volume `full` has the default quorum, a majority of 2: both replicas. Once node 1's file
//!   system is full every write fails, and the NBD client gets `ENOSPC` (not `EIO`); the
//!   failed replica is shown down, not in sync, with the regions of those writes behind (each
//!   landed on replica 0); the agent logs a handful of lines for the whole episode, not one
//!   per write, and counts every failure (`flexns_volume_replica_write_failures_total`).
//! - Volume `degraded` has a write quorum of 1: its writes go on degraded on replica 0.
//! - Then the tmpfs grows and node 1 restarts (its store is fail-stop once a write failed):
//!   the resync brings both volumes' replica 1 back in sync, writes succeed again, and every
//!   block of both replicas' stores compares equal.

use block_agent::control::pb;
use block_agent::nbd::proto::*;
use block_agent::store::VolumeStore;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TEST: &str = "full_disk::a_replica_whose_disk_fills_is_shown_behind_logged_once_and_resynced";
/// Volume ids on the storage nodes.
const FULL: u32 = 5;
const DEGRADED: u32 = 6;
/// 16 MiB each: far more than node 1's 4 MiB tmpfs holds (a block takes its log record and
/// its place in the data file).
const SIZE: u64 = 16 << 20;
/// Bytes of each write (a 64 KiB write is 16 blocks).
const W: u64 = 64 << 10;
const BLOCK: usize = 4096;
/// Writes sent after the first that failed.
const PAST_FULL: u64 = 20;

/// A process stopped (SIGTERM, then SIGKILL) when dropped.
struct Proc(Child);

impl Proc {
    /// Starts `bin` with `args`, its stderr into `log`; returns it and its banner.
    fn start(bin: &str, args: &[&str], log: &Path) -> (Proc, String) {
        let mut child = Command::new(bin)
            .args(args)
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin} starts: {e}"));
        let mut banner = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut banner)
            .unwrap();
        let p = Proc(child);
        assert!(
            !banner.is_empty(),
            "{bin} printed no banner: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        (p, banner)
    }

    /// SIGTERM, and waits (SIGKILL after 10 s).
    fn stop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let t = Instant::now();
        while self.0.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(10) {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            self.stop();
        }
    }
}

/// `key=value` of a banner.
fn field(banner: &str, key: &str) -> String {
    banner
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in the banner {banner:?}"))
        .to_string()
}

/// A tmpfs mounted at a directory, unmounted (and the directory removed) when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .unwrap();
        assert!(st.success(), "mount -t tmpfs on {}", at.display());
        Tmpfs(at.to_path_buf())
    }

    fn grow(&self, size: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(st.success(), "remount {} to {size}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A minimal NBD client (fixed newstyle, OPT_GO, simple replies).
struct Nbd {
    s: TcpStream,
    handle: u64,
}

impl Nbd {
    fn connect(addr: &str, export: &str) -> Nbd {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(u64::from_be_bytes(hello[0..8].try_into().unwrap()), NBDMAGIC);
        s.write_all(&u32::from(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())
            .unwrap();
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
        s.write_all(&OPT_GO.to_be_bytes()).unwrap();
        s.write_all(&(d.len() as u32).to_be_bytes()).unwrap();
        s.write_all(&d).unwrap();
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h).unwrap();
            assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), REPLY_MAGIC);
            let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
            s.read_exact(&mut data).unwrap();
            match typ {
                REP_INFO => {}
                REP_ACK => return Nbd { s, handle: 0 },
                e => panic!("GO {export:?} refused: {e:#x} {}", String::from_utf8_lossy(&data)),
            }
        }
    }

    /// One request; its error (0: none) and the data a read returned.
    fn request(&mut self, typ: u16, offset: u64, length: u32, data: &[u8]) -> (u32, Vec<u8>) {
        self.handle += 1;
        let r = Request {
            flags: 0,
            typ,
            handle: self.handle,
            offset,
            length,
        };
        self.s.write_all(&r.encode()).unwrap();
        self.s.write_all(data).unwrap();
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
        assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), self.handle);
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let mut d = Vec::new();
        if err == 0 && typ == CMD_READ {
            d = vec![0u8; length as usize];
            self.s.read_exact(&mut d).unwrap();
        }
        (err, d)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.request(CMD_WRITE, offset, data.len() as u32, data).0
    }

    fn read(&mut self, offset: u64, len: u64) -> Vec<u8> {
        let (err, d) = self.request(CMD_READ, offset, len as u32, &[]);
        assert_eq!(err, 0, "read of {len} bytes at {offset}");
        d
    }
}

/// Write `k`'s 64 KiB: each block names its volume, write and block.
fn pattern(volume: u32, k: u64) -> Vec<u8> {
    let mut d = vec![(k as u8) ^ (volume as u8) ^ 0x5A; W as usize];
    for (b, blk) in d.chunks_mut(BLOCK).enumerate() {
        blk[..4].copy_from_slice(&volume.to_le_bytes());
        blk[4..12].copy_from_slice(&k.to_le_bytes());
        blk[12..20].copy_from_slice(&(b as u64).to_le_bytes());
    }
    d
}

/// The agent's exports by name: (replica states, regions behind).
fn exports(rt: &tokio::runtime::Runtime, admin: &str) -> Vec<(String, Vec<String>, Vec<u32>)> {
    rt.block_on(async {
        let mut c = pb::agent_admin_client::AgentAdminClient::connect(format!("http://{admin}"))
            .await
            .unwrap();
        let r = c.list_exports(pb::ListExportsRequest {}).await.unwrap().into_inner();
        r.exports
            .into_iter()
            .map(|e| (e.export_name, e.replica_states, e.regions_behind))
            .collect()
    })
}

fn states_of(rt: &tokio::runtime::Runtime, admin: &str, name: &str) -> (Vec<String>, Vec<u32>) {
    exports(rt, admin)
        .into_iter()
        .find(|e| e.0 == name)
        .map(|e| (e.1, e.2))
        .unwrap_or_else(|| panic!("no export {name}"))
}

/// `metric{...labels...}`'s value in the agent's Prometheus text.
fn metric(addr: &str, name: &str, labels: &[&str]) -> Option<u64> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
}

/// The agent's log lines at WARN or ERROR that name volume export `volume` (ANSI colours
/// stripped).
fn loud_lines(log: &Path, volume: u32) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap();
    let mut plain = String::with_capacity(text.len());
    let mut esc = false;
    for ch in text.chars() {
        match (esc, ch) {
            (false, '\u{1b}') => esc = true,
            (true, c) if c.is_ascii_alphabetic() => esc = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    plain
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .filter(|l| l.contains(&format!("volume {volume}:")))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_replica_whose_disk_fills_is_shown_behind_logged_once_and_resynced() {
    if !test_support::is_root() {
        test_support::skip(TEST, test_support::Missing::Root, "mounting a tmpfs needs root");
        return;
    }
    let t0 = Instant::now();
    let base = std::env::temp_dir().join(format!("full-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let dirs = [base.join("node0"), base.join("node1")];
    std::fs::create_dir_all(&dirs[0]).unwrap();
    let tmpfs = Tmpfs::mount(&dirs[1], "4m");
    let rt = test_support::runtime();

    // two storage nodes, both volumes on each
    let server = env!("CARGO_BIN_EXE_block-server");
    let mut nodes = Vec::new();
    let mut at = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let d = d.to_str().unwrap();
        let (p, banner) = Proc::start(
            server,
            &["--dir", d, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"],
            &base.join(format!("node{i}.log")),
        );
        let (id, data, admin) = (field(&banner, "node"), field(&banner, "data"), field(&banner, "admin"));
        rt.block_on(async {
            let mut c = pb::storage_node_admin_client::StorageNodeAdminClient::connect(format!("http://{admin}"))
                .await
                .unwrap();
            for v in [FULL, DEGRADED] {
                c.create_volume(pb::CreateVolumeRequest { id: v, size: SIZE })
                    .await
                    .unwrap();
            }
        });
        nodes.push(p);
        at.push((id, data, admin));
    }

    // the agent, exporting both (`degraded` with a write quorum of 1)
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let agent_log = base.join("agent.log");
    let (mut agent, banner) = Proc::start(
        env!("CARGO_BIN_EXE_block-agent"),
        &[
            "--nbd",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--metrics-addr",
            &metrics,
        ],
        &agent_log,
    );
    let (nbd, admin) = (field(&banner, "nbd"), field(&banner, "admin"));
    let replicas: Vec<pb::Replica> = at
        .iter()
        .map(|(id, data, admin)| pb::Replica {
            node: id.clone(),
            addr: data.clone(),
            state: "up".into(),
            admin: admin.clone(),
        })
        .collect();
    rt.block_on(async {
        let mut c = pb::agent_admin_client::AgentAdminClient::connect(format!("http://{admin}"))
            .await
            .unwrap();
        for (id, name, quorum) in [(FULL, "full", 0), (DEGRADED, "degraded", 1)] {
            let volume = pb::VolumeSpec {
                id,
                name: name.into(),
                size: SIZE,
                replicas: replicas.clone(),
                write_quorum: quorum,
                ..Default::default()
            };
            c.attach(pb::AttachRequest { volume: Some(volume) }).await.unwrap();
        }
    });
    let mut full = Nbd::connect(&nbd, "full");
    let mut degraded = Nbd::connect(&nbd, "degraded");

    // (a) fill node 1's disk: the write that finds it full, and every later one, answer
    // ENOSPC (the quorum is both replicas)
    let mut k = 0u64;
    let full_at = loop {
        assert!(k * W < SIZE, "16 MiB written to a 4 MiB tmpfs without an error");
        match full.write(k * W, &pattern(FULL, k)) {
            0 => k += 1,
            e => {
                assert_eq!(e, ENOSPC, "write {k} failed with errno {e}, not ENOSPC");
                break k;
            }
        }
    };
    assert!(full_at > 0, "no write fit on the 4 MiB tmpfs");
    for k in full_at + 1..=full_at + PAST_FULL {
        assert_eq!(
            full.write(k * W, &pattern(FULL, k)),
            ENOSPC,
            "write {k} past the full point"
        );
    }
    let failed = PAST_FULL + 1;
    // after the space is freed: new writes beyond the failed ones
    let after = full_at + PAST_FULL + 1..full_at + PAST_FULL + 5;
    let end = after.end * W;
    // the degraded volume's writes go on, on replica 0 alone
    for k in 0..4 {
        assert_eq!(degraded.write(k * W, &pattern(DEGRADED, k)), 0, "degraded write {k}");
    }
    let t_full = t0.elapsed();

    // (b) the resync looks every 500 ms: a replica that failed writes stays down and behind
    std::thread::sleep(Duration::from_millis(1500));
    let (states, behind) = states_of(&rt, &admin, "full");
    assert_eq!(states, ["in-sync", "down"], "volume full (behind: {behind:?})");
    assert!(
        behind[1] >= 1,
        "the failed writes' regions are behind on replica 1: {behind:?}"
    );
    let (states, behind) = states_of(&rt, &admin, "degraded");
    assert_eq!(states, ["in-sync", "down"], "volume degraded (behind: {behind:?})");
    assert!(behind[1] >= 1, "{behind:?}");

    // (d) a handful of lines for the episode, and every failure counted
    let loud = loud_lines(&agent_log, FULL);
    assert!(
        loud.len() <= 3,
        "{} WARN/ERROR lines for {failed} failed writes:\n{}",
        loud.len(),
        loud.join("\n")
    );
    let labels = ["volume=\"full\"", "replica=\"1\""];
    let t = Instant::now();
    let counted = loop {
        // copied into the registry once a second
        match metric(&metrics, "flexns_volume_replica_write_failures_total", &labels) {
            Some(n) if n >= failed => break n,
            other => assert!(t.elapsed() < Duration::from_secs(5), "the counter reads {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(counted, failed, "each failed write counted once");
    let replica0 = ["volume=\"full\"", "replica=\"0\""];
    assert_eq!(
        metric(&metrics, "flexns_volume_replica_write_failures_total", &replica0),
        Some(0)
    );

    // (c) space is freed (the tmpfs grows) and node 1 restarts (its store stopped at the
    // failure): the resync brings replica 1 back, and writes succeed again
    tmpfs.grow("256m");
    nodes[1].stop();
    let (id1, data1, admin1) = at[1].clone();
    let d1 = dirs[1].to_str().unwrap();
    let (p, banner) = Proc::start(
        server,
        &["--dir", d1, "--listen", &data1, "--admin", &admin1],
        &base.join("node1-restarted.log"),
    );
    assert_eq!(field(&banner, "node"), id1, "the same node");
    nodes[1] = p;
    let t_restart = Instant::now();
    loop {
        let all = exports(&rt, &admin);
        if all.iter().all(|e| e.1.iter().all(|s| s == "in-sync")) {
            break;
        }
        assert!(
            t_restart.elapsed() < Duration::from_secs(30),
            "not in sync 30 s after node 1 restarted: {all:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let resynced_in = t_restart.elapsed();
    for k in after.clone() {
        assert_eq!(
            full.write(k * W, &pattern(FULL, k)),
            0,
            "write {k} after the space was freed"
        );
    }
    assert_eq!(degraded.write(4 * W, &pattern(DEGRADED, 4)), 0);
    // what was acknowledged reads back (the failed writes' ranges are the replicas' to agree
    // on: compared below, never rewritten here)
    for k in (0..full_at).chain(after.clone()) {
        assert!(full.read(k * W, W) == pattern(FULL, k), "full: write {k} reads back");
    }
    for k in 0..5 {
        assert!(
            degraded.read(k * W, W) == pattern(DEGRADED, k),
            "degraded: write {k} reads back"
        );
    }
    // the episode ended with one more line
    let loud = loud_lines(&agent_log, FULL);
    assert!(loud.len() <= 4, "{}", loud.join("\n"));
    assert!(
        loud.iter().any(|l| l.contains("takes writes again")),
        "the episode's end is logged:\n{}",
        loud.join("\n")
    );

    // both replicas' stores hold the same blocks, over the failed writes' ranges too
    drop(full);
    drop(degraded);
    agent.stop();
    for n in &mut nodes {
        n.stop();
    }
    for (v, blocks) in [(FULL, end / BLOCK as u64), (DEGRADED, SIZE / BLOCK as u64)] {
        let s0 = VolumeStore::open(&dirs[0], v, 256 << 20).unwrap();
        let s1 = VolumeStore::open(&dirs[1], v, 256 << 20).unwrap();
        let mut differ = Vec::new();
        for lba in 0..blocks {
            if s0.read(lba).unwrap().0 != s1.read(lba).unwrap().0 {
                differ.push(lba);
            }
        }
        assert!(
            differ.is_empty(),
            "volume {v}: {} blocks differ between the replicas, the first {:?}",
            differ.len(),
            &differ[..differ.len().min(8)]
        );
    }
    eprintln!(
        "node 1 full after {full_at} writes of 64 KiB ({t_full:?} in); {failed} writes answered ENOSPC, {} \
         WARN/ERROR lines; back in sync {resynced_in:?} after its restart; {:?} in all\n{}",
        loud.len(),
        t0.elapsed(),
        loud.join("\n")
    );
    drop(tmpfs);
    let _ = std::fs::remove_dir_all(&base);
}
