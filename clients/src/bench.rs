//! Benchmark plumbing per `docs/BENCHMARKS.md`: result lines, sizes with suffixes, latency histograms,
//! CPU and memory accounting, child servers, interleaved side-by-side comparison.

use anyhow::{bail, Context as _, Result};
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::Duration;

/// What every command-line program of the project does first: default SIGPIPE handling and
/// `tracing` logs on stderr, filtered by `RUST_LOG` (stdout stays for results).
pub fn init_cli() {
    restore_sigpipe();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
}

/// What a long-running server mode of the project's programs does first instead of
/// [`init_cli`]: SIGPIPE stays ignored (a peer that closes its connection while the server
/// writes an answer is an error on that connection, not the end of the server), and `tracing`
/// logs on stderr at `info` unless `RUST_LOG` says otherwise.
pub fn init_daemon() {
    // SAFETY: setting a signal's disposition to ignored has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    block_agent::daemon::init_logging();
}

/// How every program of the crate ends: status 0, or its error's chain on one line
/// (`program: outer: cause: root cause`) on stderr and status 1. A backtrace of the error
/// follows only when asked for with `RUST_LIB_BACKTRACE=1` (RUST_BACKTRACE alone is for panics).
pub fn exit(program: &str, r: Result<()>) -> std::process::ExitCode {
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e:#}");
            if std::env::var_os("RUST_LIB_BACKTRACE").is_some_and(|v| v == "1") {
                eprintln!("{e:?}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// Restores the default SIGPIPE action, so a command whose output is piped into `head` ends
/// quietly when the reader goes away instead of panicking on a failed print.
pub fn restore_sigpipe() {
    // SAFETY: setting a signal's disposition to the default has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

pub use netstack::config::parse_size;

/// One result line (fields that do not apply are left out of the JSON).
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchResult {
    /// The benchmark (`write`, `read`, `send`, `get`, ...).
    pub bench: String,
    /// The system measured (`flexns`, `tcp`, `redis`, ...).
    pub system: String,
    /// The transport under the system, where it has a choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// Bytes per message or operation.
    pub msg_bytes: u64,
    /// Queue pairs or connections.
    pub qps: u32,
    /// Operations in flight per queue pair or connection.
    pub depth: u32,
    /// Bytes moved.
    pub bytes: u64,
    /// Operations completed.
    pub ops: u64,
    /// Measured time in seconds.
    pub secs: f64,
    /// Throughput in Gbit/s.
    pub gbps: f64,
    /// Operations per second, in millions.
    pub mops: f64,
    /// Median latency in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_us: Option<f64>,
    /// 99th-percentile latency in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    /// 99.9th-percentile latency in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p999_us: Option<f64>,
    /// Whether the data moved was checked at its destination.
    pub verified: bool,
    /// The run was cut short by SIGINT/SIGTERM: its figures cover only part of it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub incomplete: bool,
    /// CPU seconds the client used (user and system).
    pub cpu_secs: f64,
    /// The client's peak resident memory in KiB.
    pub peak_rss_kib: u64,
    /// CPU seconds the server used, where a server ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_cpu_secs: Option<f64>,
    /// The server's peak resident memory in KiB, where a server ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_peak_rss_kib: Option<u64>,
    /// A remark printed and recorded with the result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Benchmark-specific fields, flattened into the JSON line.
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl BenchResult {
    /// Fills the latency fields from a histogram of nanoseconds.
    pub fn latencies(&mut self, h: &hdrhistogram::Histogram<u64>) {
        if h.is_empty() {
            return;
        }
        let us = |q: f64| (h.value_at_quantile(q) as f64 / 1000.0 * 100.0).round() / 100.0;
        self.p50_us = Some(us(0.5));
        self.p99_us = Some(us(0.99));
        self.p999_us = Some(us(0.999));
    }

    /// Fills rates from bytes, ops and seconds; a bulk run ([`is_bulk`]) also gets the
    /// machine's limit beside it ([`BenchResult::memcpy_reference`]).
    pub fn rates(&mut self) {
        if self.secs > 0.0 {
            self.gbps = (self.bytes as f64 * 8.0 / self.secs / 1e9 * 1000.0).round() / 1000.0;
            self.mops = (self.ops as f64 / self.secs / 1e6 * 10000.0).round() / 10000.0;
        }
        self.secs = (self.secs * 1000.0).round() / 1000.0;
        if is_bulk(self.msg_bytes, self.bytes) && self.gbps > 0.0 {
            self.memcpy_reference();
        }
    }

    /// Adds `memcpy_gbps`, what one core of this process copies in `memcpy`s of the run's
    /// message size over a working set larger than the caches ([`memcpy_gbps`]), and
    /// `of_memcpy`, the run's Gbit/s as a fraction of it: each bulk figure also reads as a
    /// share of what this machine can move with one copy per byte, in the same run.
    pub fn memcpy_reference(&mut self) {
        let m = memcpy_gbps(self.msg_bytes as usize);
        if m > 0.0 {
            let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
            self.extra.insert("memcpy_gbps".into(), r3(m).into());
            self.extra.insert("of_memcpy".into(), r3(self.gbps / m).into());
        }
    }

    /// Prints as one JSON line or one human-readable line.
    pub fn print(&self, json: bool) {
        if json {
            println!("{}", serde_json::to_string(self).expect("serializable"));
        } else {
            let lat = match (self.p50_us, self.p99_us) {
                (Some(a), Some(b)) => format!("  p50 {a:>8.2} us  p99 {b:>8.2} us"),
                _ => String::new(),
            };
            println!(
                "{:<12} {:<8} {:>9} B x{:<3} qps {:<4} {:>9.3} Gbit/s {:>9.4} Mop/s{}  verified={}  cpu {:.2}s  rss {} KiB{}",
                self.bench,
                self.system,
                self.msg_bytes,
                self.depth,
                self.qps,
                self.gbps,
                self.mops,
                lat,
                self.verified,
                self.cpu_secs,
                self.peak_rss_kib,
                if self.incomplete { "  INCOMPLETE" } else { "" }
            );
        }
    }
}

/// Whether a run of `msg_bytes` messages that moved `bytes` is a bulk transfer (for which a
/// memcpy reference means something): messages of 4 KiB or more, 16 MiB or more in all.
pub fn is_bulk(msg_bytes: u64, bytes: u64) -> bool {
    msg_bytes >= 4096 && bytes >= 16 << 20
}

/// Bytes of each of the memcpy reference's source and destination: larger than the caches,
/// as the bytes a transfer moves are.
const MEMCPY_SET: usize = 64 << 20;

/// Gbit/s of payload one core copies with `memcpy` in pieces of `msg_bytes` (at most
/// [`MEMCPY_SET`]), from a 64 MiB source to a 64 MiB destination walked in order, four passes,
/// best of three; measured once per size per process (cached), in the process that reports.
pub fn memcpy_gbps(msg_bytes: usize) -> f64 {
    static CACHE: std::sync::OnceLock<parking_lot::Mutex<std::collections::HashMap<usize, f64>>> =
        std::sync::OnceLock::new();
    let piece = msg_bytes.clamp(1, MEMCPY_SET);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(&g) = cache.lock().get(&piece) {
        return g;
    }
    let src: Vec<u8> = (0..MEMCPY_SET)
        .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
        .collect();
    let mut dst = vec![1u8; MEMCPY_SET];
    let n = MEMCPY_SET / piece * piece;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for _ in 0..4 {
            for off in (0..n).step_by(piece) {
                dst[off..off + piece].copy_from_slice(&src[off..off + piece]);
            }
            std::hint::black_box(&mut dst);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let g = if best > 0.0 {
        (4 * n) as f64 * 8.0 / best / 1e9
    } else {
        0.0
    };
    cache.lock().insert(piece, g);
    g
}

/// A latency histogram in nanoseconds (1 ns .. 100 s, 3 significant digits).
pub fn histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds")
}

/// CPU seconds and peak RSS (KiB) of this process or of its waited-for children.
pub fn rusage(children: bool) -> (f64, u64) {
    // SAFETY: getrusage fills a zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let who = if children {
        libc::RUSAGE_CHILDREN
    } else {
        libc::RUSAGE_SELF
    };
    // SAFETY: ru is a valid out-pointer.
    unsafe { libc::getrusage(who, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    (t(ru.ru_utime) + t(ru.ru_stime), ru.ru_maxrss as u64)
}

/// A process whose CPU time and memory a run accounts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// What it is in the run (`client`, `server`, `agent`, `node1`, `qemu-nbd`, ...).
    pub role: String,
    /// Its process id.
    pub pid: u32,
}

impl Proc {
    /// A process `pid` in role `role`.
    pub fn new(role: impl Into<String>, pid: u32) -> Proc {
        Proc { role: role.into(), pid }
    }

    /// This process.
    pub fn this(role: impl Into<String>) -> Proc {
        Proc::new(role, std::process::id())
    }
}

/// CPU seconds (user + system, all threads, those ended included) a process has used so far,
/// from /proc (10 ms resolution); None when it is gone.
pub fn proc_cpu_secs(pid: u32) -> Option<f64> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = st.rsplit_once(") ")?.1.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok());
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // after the command: utime and stime are fields 14 and 15 of the line
    Some((ticks(11)? + ticks(12)?) / hz)
}

/// The peak resident memory (VmHWM, KiB) of a process since its start or its last
/// [`reset_peak_rss`].
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmHWM:")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
}

/// Lowers a process's peak-RSS mark to what it uses now (`/proc/PID/clear_refs`, value 5), so
/// the next [`peak_rss_kib`] is the peak of what happened since; false where the kernel or
/// the process's owner does not allow it.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// What one process used during a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProcUsage {
    /// What the process was in the run.
    pub role: String,
    /// Its process id.
    pub pid: u32,
    /// CPU seconds it used during the run (user and system).
    pub cpu_secs: f64,
    /// Peak resident memory during the run (since the process started, where the mark could
    /// not be reset: `peak_rss_since_start`).
    pub peak_rss_kib: u64,
    /// The peak covers the process's whole life, not only the run.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub peak_rss_since_start: bool,
}

/// Per-process accounting of one run: each process's CPU time during the run and its peak
/// resident memory during the run (its mark is reset at the start).
#[derive(Debug)]
pub struct Meter {
    start: Vec<(Proc, f64, bool)>,
}

impl Meter {
    /// Starts accounting `procs` (reads their CPU time, resets their peak-RSS marks).
    pub fn start(procs: &[Proc]) -> Meter {
        Meter {
            start: procs
                .iter()
                .map(|p| {
                    let reset = reset_peak_rss(p.pid);
                    (p.clone(), proc_cpu_secs(p.pid).unwrap_or(0.0), reset)
                })
                .collect(),
        }
    }

    /// What each process used since [`Meter::start`].
    pub fn finish(self) -> Vec<ProcUsage> {
        self.start
            .into_iter()
            .map(|(p, cpu0, reset)| ProcUsage {
                cpu_secs: ((proc_cpu_secs(p.pid).unwrap_or(cpu0) - cpu0).max(0.0) * 1000.0).round() / 1000.0,
                peak_rss_kib: peak_rss_kib(p.pid).unwrap_or(0),
                peak_rss_since_start: !reset,
                role: p.role,
                pid: p.pid,
            })
            .collect()
    }
}

/// Rounds to 3 significant decimals for result lines.
fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

impl BenchResult {
    /// Records what each process used during the run: a `processes` list with every
    /// process's CPU seconds, CPU per operation (`cpu_us_per_op`), payload bytes per CPU
    /// second (`bytes_per_cpu_sec`) and peak memory, and the same two rates for all of them
    /// together. The first process is this one (the client): its figures also fill
    /// `cpu_secs` and `peak_rss_kib`.
    pub fn account(&mut self, usage: &[ProcUsage]) {
        let per = |cpu: f64| -> (Option<f64>, Option<f64>) {
            let per_op = (self.ops > 0).then(|| round3(cpu * 1e6 / self.ops as f64));
            let per_byte = (cpu > 0.0 && self.bytes > 0).then(|| (self.bytes as f64 / cpu).round());
            (per_op, per_byte)
        };
        let procs: Vec<serde_json::Value> = usage
            .iter()
            .map(|u| {
                let (op, b) = per(u.cpu_secs);
                let mut v = serde_json::to_value(u).expect("serializable");
                v["cpu_us_per_op"] = op.into();
                v["bytes_per_cpu_sec"] = b.into();
                v
            })
            .collect();
        let total: f64 = usage.iter().map(|u| u.cpu_secs).sum();
        let (op, b) = per(total);
        if let Some(c) = usage.first() {
            self.cpu_secs = c.cpu_secs;
            self.peak_rss_kib = c.peak_rss_kib;
        }
        if usage.len() > 1 {
            let servers: f64 = usage[1..].iter().map(|u| u.cpu_secs).sum();
            self.server_cpu_secs = Some(round3(servers));
            self.server_peak_rss_kib = Some(usage[1..].iter().map(|u| u.peak_rss_kib).sum());
        }
        self.extra.insert("processes".into(), procs.into());
        self.extra.insert("cpu_us_per_op".into(), op.into());
        self.extra.insert("bytes_per_cpu_sec".into(), b.into());
    }
}

/// A fresh seed for one run's data, never the same twice (time, process and a counter), so a
/// run's verification can only pass on bytes that run wrote.
pub fn run_seed() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (t ^ ((std::process::id() as u64) << 32) ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
        | 1
}

/// A server started as a child process (dying with this program, see [`crate::procs`]),
/// stopped (SIGTERM, SIGKILL after 3 s, then reaped with its rusage) on drop or by
/// [`ChildServer::stop`].
pub struct ChildServer {
    child: Option<Child>,
    /// The first line the child printed (its addresses).
    pub banner: String,
}

impl ChildServer {
    /// Starts `exe args...` and waits for its first stdout line. Its logs share this
    /// program's stderr, so unless `RUST_LOG` says otherwise it logs warnings and errors only
    /// (a server on its own logs at info).
    pub fn start(exe: &std::path::Path, args: &[String]) -> Result<ChildServer> {
        let mut cmd = crate::procs::command(exe);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let mut child = crate::procs::spawn(&mut cmd).with_context(|| format!("starting {}", exe.display()))?;
        let out = child.stdout.take().context("child stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut l = String::new();
            let mut r = BufReader::new(out);
            let _ = r.read_line(&mut l);
            let _ = tx.send(l);
            // keep draining so the child never blocks on a full pipe
            let mut sink = String::new();
            while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                sink.clear();
            }
        });
        let banner = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) if !l.trim().is_empty() => l.trim().to_string(),
            _ => {
                let st = child.try_wait().ok().flatten();
                match st {
                    Some(_) => crate::procs::reaped(child.id()),
                    None => {
                        crate::procs::terminate(child, Duration::ZERO);
                    }
                }
                bail!("server {} did not start (exit: {st:?})", exe.display());
            }
        };
        Ok(ChildServer {
            child: Some(child),
            banner,
        })
    }

    /// The value of `key=value` in the banner.
    pub fn field(&self, key: &str) -> Option<String> {
        self.banner.split_whitespace().find_map(|kv| {
            kv.strip_prefix(key)
                .and_then(|r| r.strip_prefix('='))
                .map(str::to_string)
        })
    }

    /// The child's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Whether the child is still running (it has not exited or crashed by itself).
    pub fn is_running(&mut self) -> bool {
        let Some(c) = self.child.as_mut() else { return false };
        match c.try_wait() {
            Ok(None) => true,
            _ => {
                // it exited and std reaped it: nothing is left to stop
                crate::procs::reaped(c.id());
                self.child = None;
                false
            }
        }
    }

    /// Stops the child; returns its CPU seconds and peak RSS (KiB).
    pub fn stop(&mut self) -> Option<(f64, u64)> {
        crate::procs::terminate(self.child.take()?, Duration::from_secs(3))
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Median of a non-empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A deterministic byte pattern for position `i` of a buffer (used to verify data end to end).
pub fn pattern_byte(i: u64, seed: u64) -> u8 {
    let x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// Fills `buf`, which sits at offset `base` of a patterned span, with the pattern.
pub fn fill_pattern(buf: &mut [u8], base: u64, seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(base + i as u64, seed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_works() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn bulk_runs_carry_a_memcpy_reference_and_small_ones_do_not() {
        let mut r = BenchResult {
            msg_bytes: 65536,
            bytes: 1 << 30,
            secs: 1.0,
            ..Default::default()
        };
        r.rates();
        let m = r.extra["memcpy_gbps"].as_f64().unwrap();
        assert!(m > 1.0, "one core copies more than 1 Gbit/s: {m}");
        let of = r.extra["of_memcpy"].as_f64().unwrap();
        assert!((of - r.gbps / m).abs() < 0.01, "{of} vs {} / {m}", r.gbps);
        let mut small = BenchResult {
            msg_bytes: 64,
            bytes: 1 << 30,
            secs: 1.0,
            ..Default::default()
        };
        small.rates();
        assert!(!small.extra.contains_key("memcpy_gbps"));
    }
}
