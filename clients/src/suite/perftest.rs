//! The `perftest-*` comparisons of `flexns bench`: the unmodified Debian perftest programs
//! (`ib_write_bw`, `ib_send_lat`) over flexns's `libibverbs.so.1` (`ibverbs/`, built by
//! `scripts/build-ibverbs.sh --release`), interleaved with `nsperf` runs at the same size and
//! depth: an nsperf run, then a perftest server and client pair, `--pairs` times. The ratio is
//! perftest's figure over nsperf's (how much of the engine's own benchmark a stock verbs program
//! gets). Skipped, with the reason, when perftest or the library is not there.

use super::Comparison;
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// A perftest program and its arguments (the TCP port and, for the client, the server's
/// address are added per run).
pub(crate) struct Perftest {
    /// `ib_write_bw` or `ib_send_lat`.
    pub(crate) program: &'static str,
    /// Its arguments.
    pub(crate) args: Vec<String>,
}

/// The folder of flexns's `libibverbs.so.1`: `$FLEXNS_IBVERBS_DIR`, else
/// `target/ibverbs/<profile>` beside this build's `target/<profile>/flexns`.
pub(crate) fn library_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("FLEXNS_IBVERBS_DIR") {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe.parent().context("the executable has no folder")?;
    let profile = profile_dir.file_name().context("the executable's folder has no name")?;
    let target = profile_dir.parent().context("the executable's folder has no parent")?;
    Ok(target.join("ibverbs").join(profile))
}

/// The program `name` on `$PATH`.
fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Why the comparison cannot run here (perftest not installed, the library not built); None
/// when it can.
pub(super) fn unavailable(p: &Perftest) -> Option<String> {
    if which(p.program).is_none() {
        return Some(format!(
            "{} is not installed (Debian package perftest; scripts/install-test-deps.sh)",
            p.program
        ));
    }
    let lib = match library_dir() {
        Ok(d) => d.join("libibverbs.so.1"),
        Err(e) => return Some(format!("no folder for flexns's libibverbs: {e:#}")),
    };
    (!lib.is_file()).then(|| {
        format!(
            "{} not found: build it with scripts/build-ibverbs.sh --release (or set FLEXNS_IBVERBS_DIR)",
            lib.display()
        )
    })
}

/// Whether a TCP socket listens on `port` (read from /proc, so that perftest's server, which
/// accepts one connection, is not connected to).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

/// A TCP port free now, for perftest's exchange.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits for `child` up to `limit`, killing it past that; its stdout and stderr.
fn finish(mut child: Child, limit: Duration, what: &str) -> Result<String> {
    let start = Instant::now();
    let pid = child.id();
    while child.try_wait()?.is_none() {
        if start.elapsed() > limit || crate::procs::stopping() {
            stop(child);
            bail!("{what} did not finish within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output();
    crate::procs::reaped(pid);
    let o = o?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if !o.status.success() {
        bail!("{what} failed ({}): {}", o.status, text.lines().last().unwrap_or(""));
    }
    Ok(text)
}

/// Kills and reaps `child`.
fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
    crate::procs::reaped(child.id());
}

/// One perftest server and client pair over the library in `lib`; the client's output.
pub(crate) fn pair(p: &Perftest, lib: &Path, limit: Duration) -> Result<String> {
    let port = free_port()?.to_string();
    let cmd = |extra: &[&str]| {
        let mut c = crate::procs::command(p.program);
        c.args(&p.args)
            .args(["-p", &port])
            .args(extra)
            .env("LD_LIBRARY_PATH", lib)
            .env("FLEXNS_IBV_QUIET", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c
    };
    let mut server = crate::procs::spawn(&mut cmd(&[])).with_context(|| format!("starting {}", p.program))?;
    let start = Instant::now();
    while !listening(port.parse()?) {
        if start.elapsed() > Duration::from_secs(20) || server.try_wait()?.is_some() {
            stop(server);
            bail!("{} server never listened on {port}", p.program);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = crate::procs::spawn(&mut cmd(&["127.0.0.1"])).with_context(|| format!("starting {}", p.program))?;
    let c = finish(client, limit, &format!("{} client", p.program));
    let s = finish(server, limit, &format!("{} server", p.program));
    let c = c?;
    s?;
    Ok(c)
}

/// The figure of a perftest result table: for a bandwidth test the BW average (Gbit/s with
/// `--report_gbits`, 4th column), for a latency test t_typical (µs, 5th column), of the row
/// of `size` bytes.
pub(crate) fn figure(out: &str, size: f64, latency: bool) -> Result<f64> {
    let col = if latency { 4 } else { 3 };
    let v = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map_while(|w| w.parse::<f64>().ok())
                .collect::<Vec<f64>>()
        })
        .find(|v| v.len() > col && v[0] == size)
        .with_context(|| format!("no result row for {size} bytes in:\n{out}"))?;
    if !v[col].is_finite() || v[col] <= 0.0 {
        bail!(
            "perftest printed {} (it could not calibrate its cycle counter?)",
            v[col]
        );
    }
    Ok(v[col])
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The value of `--size` among perftest's arguments.
fn size_of(p: &Perftest) -> Result<f64> {
    let s = super::flag(&p.args, "-s").context("a perftest comparison names its size with -s")?;
    s.parse().with_context(|| format!("-s {s}: not a number of bytes"))
}

/// Runs `pairs` interleaved pairs (an nsperf run with `c.args`, then a perftest pair), writing
/// each line into `out`; the lines, the ratio line last.
pub(super) fn run(c: &Comparison, p: &Perftest, pairs: u32, out: &mut std::fs::File) -> Result<Vec<Value>> {
    let nsperf = super::sibling(c.program)?;
    let lib = library_dir()?;
    let size = size_of(p)?;
    let metric = if c.latency { "p50_us" } else { "gbps" };
    let mut lines = Vec::new();
    let mut emit = |mut v: Value, lines: &mut Vec<Value>| -> Result<()> {
        v["comparison"] = c.name.into();
        writeln!(out, "{v}")?;
        lines.push(v);
        Ok(())
    };
    let mut ratios = Vec::new();
    let (mut ns_figs, mut pt_figs) = (Vec::new(), Vec::new());
    for _ in 0..pairs {
        if crate::procs::stopping() {
            break;
        }
        let o = crate::procs::output(
            crate::procs::command(&nsperf)
                .args(&c.args)
                .arg("--json")
                .env("RUST_BACKTRACE", "0"),
            libc::SIGINT,
        )
        .with_context(|| format!("running {}", nsperf.display()))?;
        if !o.status.success() {
            bail!(
                "nsperf {}: {}",
                c.args.join(" "),
                String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed")
            );
        }
        let text = String::from_utf8_lossy(&o.stdout);
        let ns = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["system"] == "flexns" && v[metric].is_number())
            .with_context(|| format!("nsperf printed no {metric} line:\n{text}"))?;
        let ns_fig = ns[metric].as_f64().unwrap_or(0.0);
        emit(ns, &mut lines)?;
        let text = pair(p, &lib, Duration::from_secs(300))?;
        let fig = figure(&text, size, c.latency)?;
        emit(
            json!({
                "bench": p.program,
                "system": "perftest-flexns",
                "program": p.program,
                "args": p.args.join(" "),
                "msg_bytes": size,
                metric: fig,
                // an unmodified perftest does not check the bytes it moves: the row says so
                // (its nsperf runs, which do, are verified as ever)
                "verified": false,
                "how": "perftest does not check the data it moves",
            }),
            &mut lines,
        )?;
        if ns_fig > 0.0 {
            ratios.push(fig / ns_fig);
        }
        ns_figs.push(ns_fig);
        pt_figs.push(fig);
    }
    if ratios.is_empty() {
        bail!("no whole pair");
    }
    let ratio = median(ratios.clone());
    let mut r = json!({
        "bench": "ratio",
        "metric": metric,
        "system": "perftest-flexns",
        "reference": "nsperf",
        "ratio": ratio,
        "ratios": ratios,
        "system_values": pt_figs,
        "reference_values": ns_figs,
    });
    if c.latency {
        r["p50_ratio"] = ratio.into();
    }
    emit(r, &mut lines)?;
    Ok(lines)
}
