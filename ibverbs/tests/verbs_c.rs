//! Verbs exercised directly: `tests/c/verbs_check.c`, compiled against the real
//! `<infiniband/verbs.h>` and linked against flexns's `libibverbs.so.1`
//! (`scripts/build-ibverbs.sh`). `local`: `ibv_reg_mr`'s refusals (wrapping, unmapped and
//! read-only ranges, remote write without local write), `EBUSY` of a PD and a CQ in use, posts
//! to a QP in ERR flushed, `ibv_query_qp`'s state, a destroyed CQ's queued channel event not
//! handed out, `ibv_destroy_cq` waiting for `ibv_ack_cq_events`. `pair`: two processes move a
//! random pattern by SEND, INLINE SEND (from unregistered memory), RDMA WRITE and RDMA READ,
//! every byte checked, and one deregisters and unmaps a region while a 48 MiB READ of it is
//! being answered (the engine must not touch the memory after `ibv_dereg_mr` returns).

mod common;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Kills the child on drop (a failed assertion leaves no process behind).
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Builds the libraries and the C program; `None` (skip reported) without the header.
fn program(test: &str) -> Option<(PathBuf, PathBuf)> {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        test_support::skip(
            test,
            test_support::Missing::Tool,
            "no /usr/include/infiniband/verbs.h (libibverbs-dev; scripts/install-test-deps.sh installs it)",
        );
        return None;
    }
    // built once per test process (two builds at once race on the output files)
    static BUILT: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    Some(BUILT.get_or_init(build).clone())
}

fn build() -> (PathBuf, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let lib = common::libdir().to_path_buf();
    let dir = std::env::temp_dir().join(format!("flexns-verbs-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("verbs_check");
    let out = Command::new("cc")
        .arg("-O1")
        .arg("-pthread")
        .arg("-o")
        .arg(&bin)
        .arg(root.join("ibverbs/tests/c/verbs_check.c"))
        .arg(format!("-L{}", lib.display()))
        .arg("-l:libibverbs.so.1")
        .output()
        .expect("cc runs");
    assert!(
        out.status.success(),
        "compiling verbs_check.c: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (bin, lib)
}

/// Runs `bin mode` within `limit`; its output.
fn run(bin: &Path, lib: &Path, mode: &str, limit: Duration) -> Output {
    let child = Command::new(bin)
        .arg(mode)
        .env("LD_LIBRARY_PATH", lib)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("verbs_check starts");
    let mut g = Guard(Some(child));
    let deadline = Instant::now() + limit;
    loop {
        let c = g.0.as_mut().unwrap();
        if c.try_wait().expect("try_wait").is_some() {
            return g.0.take().unwrap().wait_with_output().expect("output");
        }
        assert!(Instant::now() < deadline, "verbs_check {mode} ran past {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check(o: &Output, mode: &str) {
    assert!(
        o.status.success(),
        "verbs_check {mode}: {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn verbs_refusals_states_and_events() {
    let Some((bin, lib)) = program("verbs_refusals_states_and_events") else {
        return;
    };
    let o = run(&bin, &lib, "local", Duration::from_secs(60));
    check(&o, "local");
}

#[test]
fn data_moves_intact_and_dereg_waits_for_in_flight_reads() {
    let Some((bin, lib)) = program("data_moves_intact_and_dereg_waits_for_in_flight_reads") else {
        return;
    };
    let o = run(&bin, &lib, "pair", Duration::from_secs(120));
    check(&o, "pair");
}
