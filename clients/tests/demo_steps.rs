//! `flexns demo`'s steps that run other programs, each through the real binary
//! (`flexns demo --only STEP --json`): the stack as a daemon (`flexnsd`, with `flexnsd-bench`),
//! unmodified perftest on flexns's `libibverbs.so.1`, and the served vLLM pair (`--no-llm`
//! leaves it out; the pair itself is `#[ignore]`d in `cargo test --workspace`, which runs
//! before the test command installs the flexns Python package: scripts/test.sh runs it after
//! that, see docs/TESTING.md).

use serde_json::Value;
use std::process::{Command, Stdio};

/// Runs `flexns demo ARGS --json`; its exit success, its JSON lines, its stderr and its pid.
fn demo_pid(args: &[&str]) -> (bool, Vec<Value>, String, u32) {
    demo_env(args, &[])
}

/// [`demo_pid`] with `envs` added to the demo's environment.
fn demo_env(args: &[&str], envs: &[(&str, &std::path::Path)]) -> (bool, Vec<Value>, String, u32) {
    let child = Command::new(env!("CARGO_BIN_EXE_flexns"))
        .arg("demo")
        .args(args)
        .arg("--json")
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("flexns demo starts");
    let pid = child.id();
    let o = child.wait_with_output().expect("flexns demo runs");
    let out = String::from_utf8_lossy(&o.stdout);
    let lines = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    (
        o.status.success(),
        lines,
        String::from_utf8_lossy(&o.stderr).into_owned(),
        pid,
    )
}

/// [`demo_pid`] without the pid.
fn demo(args: &[&str]) -> (bool, Vec<Value>, String) {
    let (ok, lines, err, _) = demo_pid(args);
    (ok, lines, err)
}

/// The lines of `bench`.
fn of<'a>(lines: &'a [Value], bench: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["bench"] == bench).collect()
}

/// Processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            if c.contains(needle) {
                found.push(format!("{}: {c}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

/// The flexnsd step moves WRITE 1 MiB and SEND 64 B through a flexnsd daemon and through an
/// in-process engine, every WRITE byte checked at the target, runs a KV-cache engine on the
/// daemon, and stops the daemon.
#[test]
fn flexnsd_step_moves_verified_data_through_the_daemon_and_stops_it() {
    let (ok, lines, err, pid) = demo_pid(&["--only", "flexnsd", "--duration", "0.5"]);
    assert!(ok, "flexns demo --only flexnsd failed:\n{err}");
    let rows = of(&lines, "demo-flexnsd");
    assert_eq!(rows.len(), 4, "one line per op and system: {rows:?}");
    for system in ["flexnsd", "in-process"] {
        let w = rows
            .iter()
            .find(|r| r["system"] == system && r["op"] == "write")
            .unwrap_or_else(|| panic!("no {system} WRITE line: {rows:?}"));
        assert_eq!(w["verified"], true, "{w}");
        assert_eq!(w["msg_bytes"], 1 << 20, "{w}");
        assert!(w["gbps"].as_f64().is_some_and(|g| g > 0.0), "{w}");
        let s = rows
            .iter()
            .find(|r| r["system"] == system && r["op"] == "send")
            .unwrap_or_else(|| panic!("no {system} SEND line: {rows:?}"));
        assert!(s["p50_us"].as_f64().is_some_and(|p| p > 0.0), "{s}");
    }
    // a KV-cache engine with its stack in the daemon wrote checked bytes to an in-process one
    let kv = of(&lines, "demo-flexnsd-kvcache");
    assert_eq!(kv.len(), 1, "one KV-cache line: {kv:?}");
    assert_eq!(kv[0]["verified"], true, "{}", kv[0]);
    assert!(kv[0]["bytes"].as_u64().is_some_and(|b| b >= 16 << 20), "{}", kv[0]);
    // the daemon was the demo's child, on a socket in a folder named by the demo's pid:
    // neither is left
    let dir = std::env::temp_dir().join(format!("flexns-demo-flexnsd-{pid}"));
    let left = processes_with(&dir.to_string_lossy());
    assert!(left.is_empty(), "the demo's flexnsd outlived it: {left:?}");
    assert!(!dir.exists(), "{} is left", dir.display());
}

/// The ibverbs step runs unmodified `ib_write_bw` and `ib_send_lat` (server and client
/// processes) on flexns's libibverbs.so.1, prints their figures and says that perftest
/// checks no data.
#[test]
fn ibverbs_step_runs_unmodified_perftest_and_says_it_checks_no_data() {
    for p in ["ib_write_bw", "ib_send_lat"] {
        let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).any(|d| d.join(p).is_file());
        if !found {
            test_support::skip(
                "ibverbs_step_runs_unmodified_perftest_and_says_it_checks_no_data",
                test_support::Missing::Tool,
                &format!("{p} is not installed (Debian package perftest; scripts/install-test-deps.sh)"),
            );
            return;
        }
    }
    let (ok, lines, err) = demo(&["--only", "ibverbs", "--duration", "0.5"]);
    assert!(ok, "flexns demo --only ibverbs failed:\n{err}");
    let rows = of(&lines, "demo-ibverbs");
    assert_eq!(rows.len(), 2, "{lines:?}");
    let bw = rows
        .iter()
        .find(|r| r["program"] == "ib_write_bw")
        .expect("an ib_write_bw line");
    assert!(bw["gbps"].as_f64().is_some_and(|g| g > 0.0), "{bw}");
    let lat = rows
        .iter()
        .find(|r| r["program"] == "ib_send_lat")
        .expect("an ib_send_lat line");
    assert!(lat["p50_us"].as_f64().is_some_and(|p| p > 0.0), "{lat}");
    for r in rows {
        assert_eq!(
            r["verified"], false,
            "perftest checks no data; the line must not say otherwise: {r}"
        );
        assert_eq!(r["system"], "perftest-flexns", "{r}");
    }
}

/// `--no-llm` really leaves the LLM step out: no vLLM process starts, no line of it; and when
/// that leaves no step at all (`--only llm --no-llm`) the demo fails saying so, instead of
/// running nothing and reporting success.
#[test]
fn no_llm_leaves_the_llm_step_out() {
    let (ok, lines, err) = demo(&["--only", "llm", "--no-llm"]);
    assert!(!ok, "a demo with no step to run succeeded: {lines:?}\n{err}");
    assert!(err.contains("leaves no step to run"), "{err}");
    assert!(lines.iter().all(|l| l["bench"] != "demo-llm"), "{lines:?}");
    assert!(!err.contains("vllm_pair"), "{err}");
}

/// The LLM step kills the script's whole process group once the script returns, whatever it
/// returned: a process the script started in its group and left running (as vLLM's engine core
/// and workers could be) does not outlive the step. The script is a stand-in run as `$PYTHON`
/// (it passes the `import vllm, flexns` probe, starts a `sleep` in the background, prints a
/// did-not-run result and exits), so this needs no vLLM.
#[test]
fn llm_step_kills_what_the_script_left_in_its_process_group() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("flexns-demo-fakepy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (fake, pidfile) = (dir.join("python3"), dir.join("left.pid"));
    std::fs::write(
        &fake,
        "#!/bin/sh\n\
         [ \"$1\" = -c ] && exit 0\n\
         sleep 600 </dev/null >/dev/null 2>&1 &\n\
         echo $! > \"$FLEXNS_TEST_LEFT_PID\"\n\
         echo '{\"ran\": false, \"verified\": false, \"error\": \"stand-in script\"}'\n\
         exit 2\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (ok, _, err, _) = demo_env(
        &["--only", "llm"],
        &[("PYTHON", &fake), ("FLEXNS_TEST_LEFT_PID", &pidfile)],
    );
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap_or_else(|e| panic!("the stand-in wrote no pid ({e}); demo: {err}"))
        .trim()
        .parse()
        .unwrap();
    // alive: /proc/PID is there, not a zombie, and still our sleep
    let alive = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let state = stat.rsplit(") ").next().and_then(|r| r.chars().next());
        state.is_some_and(|c| c != 'Z') && String::from_utf8_lossy(&cmd).starts_with("sleep\u{0}600")
    };
    // SIGKILL was sent before the demo exited; give the kernel a moment to finish the kill
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while alive() && std::time::Instant::now() < end {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let left = alive();
    if left {
        // SAFETY: kill(2) with a pid and a signal number touches no memory of this process.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "a step whose script did not run succeeded: {err}");
    assert!(err.contains("did not run: stand-in script"), "{err}");
    assert!(
        !left,
        "the sleep the script left in its process group outlived the LLM step"
    );
}

/// The LLM step: two vLLM engines, the prefill's KV blocks moved to decode over flexns by
/// vLLM's NixlConnector; the prompt's whole blocks are in decode's cache byte for byte,
/// decode's tokens equal a non-disaggregated run and decode's flexns
/// engine moved at least the blocks' bytes. About 40 s on an idle 2-core host (100 s beside
/// builds). It needs the flexns Python package, which scripts/test.sh installs after `cargo
/// test --workspace`, and then runs this (`cargo test --workspace --test demo_steps --
/// --ignored llm_step`).
#[test]
#[ignore = "needs the flexns Python package installed (scripts/test.sh runs it after scripts/python.sh)"]
fn llm_step_serves_a_disaggregated_pair_over_flexns() {
    let (ok, lines, err) = demo(&["--only", "llm"]);
    let skipped = lines
        .iter()
        .find(|l| l["bench"] == "demo-llm" && l["skipped"].is_string());
    if let Some(s) = skipped {
        test_support::skip(
            "llm_step_serves_a_disaggregated_pair_over_flexns",
            test_support::Missing::Tool,
            s["skipped"].as_str().unwrap_or("?"),
        );
        return;
    }
    assert!(ok, "flexns demo --only llm failed:\n{err}");
    let r = of(&lines, "demo-llm");
    let r = r.first().expect("a demo-llm line");
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["checks"]["whole_blocks_equal_at_decode"], true, "{r}");
    assert!(r["whole_blocks_compared"].as_u64().is_some_and(|n| n > 0), "{r}");
    assert_eq!(r["checks"]["whole_blocks_loaded_not_computed"], true, "{r}");
    let whole = r["whole_blocks_compared"].as_u64().unwrap_or(0);
    assert!(
        r["num_cached_tokens"].as_u64().is_some_and(|n| n >= whole * 32),
        "decode did not take the whole blocks' tokens from the remote KV: {r}"
    );
    assert_eq!(r["tokens"], r["reference"], "{r}");
    assert_eq!(r["tokens"].as_array().map(Vec::len), Some(8), "{r}");
    let moved: u64 = ["same_host_copy_bytes", "same_host_cma_bytes", "rx_bytes"]
        .iter()
        .map(|k| r["moved"][k].as_u64().unwrap_or(0))
        .sum();
    assert!(
        r["kv_bytes"].as_u64().is_some_and(|b| b > 0 && moved >= b),
        "decode's flexns engine moved {moved} B for {} B of KV: {r}",
        r["kv_bytes"]
    );
}
