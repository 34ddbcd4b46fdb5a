//! What the workspace's tests share.
//!
//! A test that cannot run here calls [`skip`] and returns. libtest captures the output of
//! passing tests, so a skip would read as a pass; [`skip`] therefore also appends a line to
//! the file `FLEXNS_SKIP_LOG` names (the project's test command sets it and lists every skip
//! when it ends). Under CI (`FLEXNS_CI=1`, set by `.ci/run`) a skip for something CI provides
//! (a tool the install script installs, root) fails the test instead.

#![warn(unreachable_pub, missing_docs)]

use std::io::Write;

pub mod powercut;
pub mod rawudp;
pub mod units;

/// A tokio runtime of two worker threads with timers and I/O, as the in-process tests drive
/// volumes and agents on it (the CI machine has two cores).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Why a test cannot run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// A tool or package `scripts/install-test-deps.sh` installs (CI has it).
    Tool,
    /// Root (CI runs as root).
    Root,
    /// Something CI does not provide either (a GPU, an RDMA NIC).
    Hardware,
    /// A kernel device these tests mount (a FUSE file system, a loop device). CI provides them
    /// where `/dev/fuse` exists: there a skip for one fails under CI, since a test that skipped
    /// on a machine able to run it would read as a pass.
    Mount,
}

/// Whether CI provides what `missing` names on this machine.
fn ci_provides(missing: Missing) -> bool {
    match missing {
        Missing::Tool | Missing::Root => true,
        Missing::Hardware => false,
        Missing::Mount => std::path::Path::new("/dev/fuse").exists(),
    }
}

/// Reports that `test` skips because `why`; panics under CI when CI provides what is missing
/// (see [`Missing`]).
pub fn skip(test: &str, missing: Missing, why: &str) {
    let line = format!("{test}: {why}");
    eprintln!("SKIPPED {line}");
    if let Some(p) = std::env::var_os("FLEXNS_SKIP_LOG") {
        // one short O_APPEND write per line: lines of concurrent tests do not interleave
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p) {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
    let ci = std::env::var_os("FLEXNS_CI").is_some_and(|v| v == "1");
    if ci && ci_provides(missing) {
        panic!("CI provides what this test needs, yet it would skip: {line}");
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("Uid:")
                    .and_then(|r| r.split_whitespace().nth(1))
                    .map(|u| u == "0")
            })
        })
        .unwrap_or(false)
}

/// Whether `tool` runs (`tool ARG` can be started).
pub fn have(tool: &str, arg: &str) -> bool {
    std::process::Command::new(tool)
        .arg(arg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}
