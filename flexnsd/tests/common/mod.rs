//! What the flexnsd tests share: a real `flexnsd` process on a socket of its own.

#![allow(dead_code)]

use flexnsd::client::Attachment;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// How long a test waits for the daemon to listen.
pub const START: Duration = Duration::from_secs(10);

/// A `flexnsd` process on a socket of its own; killed with SIGKILL on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: PathBuf,
}

impl Daemon {
    pub fn start(tag: &str) -> Daemon {
        Daemon::start_with(tag, "")
    }

    /// A daemon whose engine context has `context` (TOML lines) besides its address.
    pub fn start_with(tag: &str, context: &str) -> Daemon {
        Daemon::start_cfg(tag, "", context)
    }

    /// A daemon with `top` (TOML lines) at the top of its config and `context` in [context].
    pub fn start_cfg(tag: &str, top: &str, context: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("flexnsd-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("flexnsd.sock");
        let config = dir.join("flexnsd.toml");
        std::fs::write(
            &config,
            format!("spin_us = 50\n{top}\n[context]\nbind = \"127.0.0.1:0\"\n{context}\n"),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_flexnsd"))
            .arg("--socket")
            .arg(&socket)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("start flexnsd");
        let d = Daemon { child, socket, dir };
        let deadline = Instant::now() + START;
        while Attachment::connect(&d.socket, "probe").is_err() {
            assert!(Instant::now() < deadline, "flexnsd did not listen within {START:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
