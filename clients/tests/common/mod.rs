//! Helpers shared by the block service's process tests.
#![allow(dead_code)] // each test file uses its own subset

use block_agent::nbd::client::NbdClient;
use block_agent::store::VolumeStore;
use clients::blk::Spawner;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const BLKCTL: &str = env!("CARGO_BIN_EXE_blkctl");

/// How the tests start the block daemons: `blkctl daemon ROLE ...`.
pub fn spawner() -> Spawner {
    Spawner {
        exe: BLKCTL.into(),
        prefix: vec!["daemon".into()],
    }
}

/// A fresh directory for one test.
pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("blk-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

/// Runs `blkctl --dir DIR ARGS`: (success, stdout, stderr).
pub fn blkctl(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(BLKCTL)
        .arg("--dir")
        .arg(dir)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// `nbd://HOST:PORT/NAME` -> (HOST:PORT, NAME).
pub fn host_port(uri: &str) -> (String, String) {
    let rest = uri.strip_prefix("nbd://").unwrap();
    let (hp, name) = rest.split_once('/').unwrap();
    (hp.to_string(), name.to_string())
}

/// A 4 KiB block unique to (lba, version), never repeating within the block.
pub fn pattern(lba: u64, version: u64) -> Vec<u8> {
    let mut x = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xD6E8_FEB8_6659_FD93) | 1;
    let mut v = vec![0u8; 4096];
    for c in v.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// A free TCP port on 127.0.0.1 (for an address that must stay the same across restarts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A local etcd-server for one test and its `host:port`, or None (saying why the test skips)
/// when etcd is not installed.
pub fn local_etcd(tag: &str) -> Option<(etcd_lite::local::LocalEtcd, String)> {
    if !etcd_lite::local::installed() {
        test_support::skip(
            &format!("block service with etcd ({tag})"),
            test_support::Missing::Tool,
            "etcd is not installed (scripts/install-test-deps.sh installs etcd-server)",
        );
        return None;
    }
    let etcd = etcd_lite::local::LocalEtcd::start(tag).unwrap();
    let ep = etcd.url.trim_start_matches("http://").to_string();
    Some((etcd, ep))
}
pub mod prom;

/// Writers that keep writing blocks they own and record every acknowledged write.
pub struct Writers {
    acked: Arc<Mutex<HashMap<u64, u64>>>,
    errors: Arc<Mutex<Vec<String>>>,
    count: Arc<AtomicU64>,
    /// The slowest write since the last [`Writers::take_slowest`], in microseconds.
    slowest_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Writers {
    /// `n` writer threads over NBD at `uri`, on a volume of `blocks` blocks.
    pub fn start(uri: &str, blocks: u64, n: u64) -> Writers {
        let (hp, name) = host_port(uri);
        let w = Writers {
            acked: Arc::default(),
            errors: Arc::default(),
            count: Arc::default(),
            slowest_us: Arc::default(),
            stop: Arc::default(),
            threads: Vec::new(),
        };
        let threads = (0..n)
            .map(|t| {
                let (acked, errors, count, stop) = (w.acked.clone(), w.errors.clone(), w.count.clone(), w.stop.clone());
                let slowest = w.slowest_us.clone();
                let (hp, name) = (hp.clone(), name.clone());
                std::thread::spawn(move || {
                    let mut cl = NbdClient::connect(hp.as_str(), &name).unwrap();
                    cl.set_timeout(Some(Duration::from_secs(60))).unwrap();
                    let mut x = t * 7919 + 1;
                    let mut version = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        // writer t owns the blocks = t (mod n): its acknowledged order is the order
                        let lba = ((x >> 33) % (blocks / n)) * n + t;
                        version += 1;
                        let v = (t << 48) | version;
                        let at = std::time::Instant::now();
                        match cl.write(lba * 4096, &pattern(lba, v), false) {
                            Ok(()) => {
                                slowest.fetch_max(at.elapsed().as_micros() as u64, Ordering::Relaxed);
                                acked.lock().unwrap().insert(lba, v);
                                count.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                errors.lock().unwrap().push(format!("block {lba}: {e}"));
                                return;
                            }
                        }
                    }
                })
            })
            .collect();
        Writers { threads, ..w }
    }

    /// Writes acknowledged so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The slowest write since the last call (or the start).
    pub fn take_slowest(&self) -> Duration {
        Duration::from_micros(self.slowest_us.swap(0, Ordering::Relaxed))
    }

    /// Stops the writers; returns the acknowledged writes, failing on any I/O error.
    pub fn finish(self) -> HashMap<u64, u64> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        let errors = self.errors.lock().unwrap().clone();
        assert!(errors.is_empty(), "I/O errors: {errors:?}");
        self.acked.lock().unwrap().clone()
    }
}

/// Every acknowledged write is on every replica (read straight from the stores).
pub fn check_stores(dir: &Path, acked: &HashMap<u64, u64>) {
    check_stores_on(dir, &[0, 1, 2], acked)
}

/// Every acknowledged write is on storage nodes `nodes` (node0, ...: read straight from
/// their stores).
pub fn check_stores_on(dir: &Path, nodes: &[usize], acked: &HashMap<u64, u64>) {
    for &i in nodes {
        let s = VolumeStore::open(&dir.join(format!("node{i}")), 1, 1 << 30).unwrap();
        for (&lba, &v) in acked {
            let (data, _, _) = s.read(lba).unwrap();
            assert!(
                data == pattern(lba, v),
                "node{i} block {lba}: not the acknowledged write {v:#x}"
            );
        }
    }
}
