//! Helpers shared by the block service's process tests.
#![allow(dead_code)] // each test file uses its own subset

use clients::blk::Spawner;
use std::path::{Path, PathBuf};
use std::process::Command;

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
