//! Benchmark plumbing per `BENCH.md`: result lines, sizes with suffixes, latency histograms,
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
    pub bench: String,
    pub system: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    pub msg_bytes: u64,
    pub qps: u32,
    pub depth: u32,
    pub bytes: u64,
    pub ops: u64,
    pub secs: f64,
    pub gbps: f64,
    pub mops: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p999_us: Option<f64>,
    pub verified: bool,
    /// The run was cut short by SIGINT/SIGTERM: its figures cover only part of it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub incomplete: bool,
    pub cpu_secs: f64,
    pub peak_rss_kib: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_cpu_secs: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_peak_rss_kib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
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

    /// Fills rates from bytes, ops and seconds.
    pub fn rates(&mut self) {
        if self.secs > 0.0 {
            self.gbps = (self.bytes as f64 * 8.0 / self.secs / 1e9 * 1000.0).round() / 1000.0;
            self.mops = (self.ops as f64 / self.secs / 1e6 * 10000.0).round() / 10000.0;
        }
        self.secs = (self.secs * 1000.0).round() / 1000.0;
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

/// A server started as a child process (dying with this program, see [`crate::procs`]),
/// stopped (SIGTERM, SIGKILL after 3 s, then reaped with its rusage) on drop or by
/// [`ChildServer::stop`].
pub struct ChildServer {
    child: Option<Child>,
    /// The first line the child printed (its addresses).
    pub banner: String,
}

impl ChildServer {
    /// Starts `exe args...` and waits for its first stdout line.
    pub fn start(exe: &std::path::Path, args: &[String]) -> Result<ChildServer> {
        let mut child = crate::procs::spawn(
            crate::procs::command(exe)
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .with_context(|| format!("starting {}", exe.display()))?;
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
}
