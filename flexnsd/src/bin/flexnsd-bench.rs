//! `flexnsd-bench`: the same work through the in-process engine and through `flexnsd`, in
//! interleaved pairs (issue 46's targets): WRITE 1 MiB bandwidth, SEND 64 B latency (post to the
//! receiver's completion, p50), and CPU per operation (the application's, plus the daemon's in
//! flexnsd mode). Two QPs of one context (or attachment) connected to each other, same host.
//!
//! Polling discipline, the same on both sides by default: the application polls its CQ (its
//! completion ring, through flexnsd) yielding between looks for 50 us, then sleeps on its
//! eventfd (`--inproc-spin-us` changes the in-process side's); the in-process engine's threads
//! and the daemon's attachment threads poll, yielding, for their `spin_us` (50), then sleep.
//!
//! Each run writes a pattern of its own into the source and zeros the destination first, and
//! checks every byte at the destination after its WRITEs; each WRITE and each SEND also carries
//! a stamp of its own, checked at the target after its completion, so every operation is seen
//! to have moved its data. A run whose data differs fails.
//!
//! `--json` prints JSON lines in place of the table (docs/BENCHMARKS.md): one per run, then one
//! `"bench": "ratio"` line per case with the median over pairs of flexnsd / in-process (the
//! lines `flexns bench` reads for its `flexnsd-*` rows).

use anyhow::{bail, Context as _};
use clap::Parser;
use netstack::verbs::{Access, RecvWr, SendWr, WcStatus, WrOpcode};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// In-process engine vs flexnsd, interleaved pairs.
#[derive(Parser, Debug)]
#[command(name = "flexnsd-bench")]
struct Args {
    /// Interleaved (in-process, flexnsd) pairs.
    #[arg(long, default_value_t = 3)]
    pairs: u32,
    /// 1 MiB WRITEs per run.
    #[arg(long, default_value_t = 300)]
    writes: u32,
    /// 64-byte SENDs per run (one at a time).
    #[arg(long, default_value_t = 3000)]
    sends: u32,
    /// A configuration file for the daemon (flexnsd --config).
    #[arg(long)]
    daemon_config: Option<PathBuf>,
    /// The flexnsd binary [default: next to this one].
    #[arg(long)]
    flexnsd: Option<PathBuf>,
    /// Attach to a flexnsd at this socket (waiting up to 10 s for it to accept) instead of
    /// starting one (its owner stops it); needs --daemon-pid, whose CPU time the flexnsd runs
    /// count.
    #[arg(long, requires = "daemon_pid", conflicts_with_all = ["flexnsd", "daemon_config"])]
    socket: Option<PathBuf>,
    /// The process id of the daemon at --socket.
    #[arg(long, requires = "socket")]
    daemon_pid: Option<u32>,
    /// Microseconds the in-process application polls its CQ (yielding between looks) before
    /// it sleeps in `Cq::wait`: the same discipline as flexnsd's client, whose waits poll its
    /// completion ring for 50 us. 0: netstack's `Cq::next`, which sleeps at once.
    #[arg(long, default_value_t = 50)]
    inproc_spin_us: u64,
    /// JSON lines (each run, then the ratios) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct Run {
    write_gbps: f64,
    send_p50_us: f64,
    /// CPU seconds (application + daemon) per 1 MiB WRITE and per 64 B SEND.
    cpu_write_us: f64,
    cpu_send_us: f64,
}

fn cpu_self() -> f64 {
    flexnsd::sys::cpu_seconds_self()
}

/// CPU seconds the threads of process `pid` have run: the sum of their schedstat run times
/// (nanoseconds; /proc/<pid>/stat counts in 10 ms ticks, coarser than a short run's share).
fn cpu_of(pid: u32) -> anyhow::Result<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("the daemon's threads (pid {pid}) cannot be read"))?;
    let mut ns = 0u64;
    for t in tasks.flatten() {
        // a thread that ended since the listing counts nothing
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        ns += s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(ns as f64 * 1e-9)
}

/// The two ways of running the same verbs: the posts and completions the shared loops
/// ([`writes`], [`sends`]) time and check.
trait Bench {
    /// Posts WRITE `i`: the source's first MiB to the destination's.
    fn post_write(&self, i: u64) -> anyhow::Result<()>;
    /// The next completion of QP `a` (its WRITEs and SENDs), which must be a success.
    fn writer_done(&self) -> anyhow::Result<()>;
    /// Posts receive `i` into the destination's first 64 bytes.
    fn post_recv(&self, i: u64) -> anyhow::Result<()>;
    /// Posts SEND `i` of the source's first 64 bytes.
    fn post_send(&self, i: u64) -> anyhow::Result<()>;
    /// The next completion of the receiver's QP, a success; returns its byte count.
    fn receiver_done(&self) -> anyhow::Result<u32>;
    /// The WRITE source and destination regions.
    fn regions(
        &self,
    ) -> (
        &std::sync::Arc<netstack::mem::Region>,
        &std::sync::Arc<netstack::mem::Region>,
    );
}

/// The stamp of operation `i` of the run seeded `seed`: different for every operation of
/// every run, so a check cannot pass on bytes an earlier one left.
fn stamp(seed: u64, i: u64) -> u64 {
    (seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(i + 1) | 1
}

/// WRITEs `n` MiB one after another; returns the time. Before each, its stamp goes into the
/// source's first and last 8 bytes; after its completion both must be at the destination,
/// so every WRITE is seen to have moved data (two 8-byte stores and loads per MiB, inside
/// the timed loop, the same on both sides).
fn writes(b: &dyn Bench, n: u32, seed: u64) -> anyhow::Result<Duration> {
    let (src, dst) = b.regions();
    let t = Instant::now();
    for i in 0..u64::from(n) {
        let s = stamp(seed, i);
        src.store_u64(0, s).context("source")?;
        src.store_u64(MIB - 8, s).context("source")?;
        b.post_write(i)?;
        b.writer_done()?;
        if dst.load_u64(0) != Some(s) || dst.load_u64(MIB - 8) != Some(s) {
            bail!("WRITE {i} completed but its data is not at the target");
        }
    }
    Ok(t.elapsed())
}

/// SENDs 64 B `n` times, one at a time; returns each one's latency (post to the receive
/// completion). Each carries its own stamp, checked at the receiver after the clock stopped.
fn sends(b: &dyn Bench, n: u32, seed: u64) -> anyhow::Result<Vec<Duration>> {
    let (src, dst) = b.regions();
    let mut lat = Vec::with_capacity(n as usize);
    for i in 0..u64::from(n) {
        let s = stamp(!seed, i);
        src.store_u64(0, s).context("source")?;
        b.post_recv(i)?;
        let t = Instant::now();
        b.post_send(i)?;
        let len = b.receiver_done()?;
        lat.push(t.elapsed());
        if len != 64 || dst.load_u64(0) != Some(s) {
            bail!("SEND {i} arrived with {len} bytes or not its own");
        }
        b.writer_done()?;
    }
    Ok(lat)
}

/// Before a run: a pattern of this run's own (from `seed`) in the WRITE source, and zeros at
/// the destination, so the check after it sees only what this run moved.
fn prepare(b: &dyn Bench, seed: u64) {
    let (src, dst) = b.regions();
    let mut x = seed | 1;
    let pattern: Vec<u8> = (0..MIB)
        .map(|_| {
            // xorshift64: cheap, and different for every run
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    src.write(0, &pattern);
    dst.fill(0, MIB, 0);
}

/// After a run's WRITEs: the destination holds the source's bytes, every one.
fn verify(b: &dyn Bench) -> anyhow::Result<()> {
    let (src, dst) = b.regions();
    let (mut want, mut got) = (vec![0u8; MIB], vec![0u8; MIB]);
    src.read(0, &mut want);
    dst.read(0, &mut got);
    match want.iter().zip(&got).position(|(w, g)| w != g) {
        None => Ok(()),
        Some(i) => bail!("the WRITEs' data differs at the target from byte {i}"),
    }
}

const MIB: usize = 1 << 20;

struct InProc {
    a: netstack::verbs::Qp,
    b: netstack::verbs::Qp,
    cq_a: netstack::verbs::Cq,
    cq_b: netstack::verbs::Cq,
    src: netstack::verbs::Mr,
    dst: netstack::verbs::Mr,
    _ctx: netstack::verbs::Context,
    /// How long a wait polls before it sleeps.
    spin: Duration,
}

impl InProc {
    /// One completion of `cq`: polled (yielding) for `spin`, then waited for.
    fn next(&self, cq: &netstack::verbs::Cq) -> Option<netstack::verbs::Wc> {
        let start = Instant::now();
        let mut wc = [netstack::verbs::EMPTY_WC];
        while start.elapsed() < self.spin {
            if cq.poll(&mut wc) == 1 {
                return Some(wc[0]);
            }
            std::thread::yield_now();
        }
        cq.next(T)
    }

    fn new(spin: Duration) -> anyhow::Result<InProc> {
        use netstack::verbs::*;
        let ctx = Context::open(ContextConfig::default())?;
        let pd = ctx.alloc_pd();
        let src = pd.reg_mr(MIB, Access::ALL)?;
        let dst = pd.reg_mr(MIB, Access::ALL)?;
        let cq_a = ctx.create_cq(1024)?;
        let cq_b = ctx.create_cq(1024)?;
        let a = ctx.create_qp(&pd, &cq_a, &cq_a, QpInitAttr::default())?;
        let b = ctx.create_qp(&pd, &cq_b, &cq_b, QpInitAttr::default())?;
        a.connect(&b.local_endpoint())?;
        b.connect(&a.local_endpoint())?;
        Ok(InProc {
            a,
            b,
            cq_a,
            cq_b,
            src,
            dst,
            _ctx: ctx,
            spin,
        })
    }
}

/// A successful completion's byte count.
fn ok(wc: Option<netstack::verbs::Wc>) -> anyhow::Result<u32> {
    match wc {
        Some(w) if w.status == WcStatus::Success => Ok(w.byte_len),
        w => bail!("completion {w:?}"),
    }
}

const T: Duration = Duration::from_secs(10);

fn recv(wr_id: u64, sge: netstack::verbs::Sge) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: [sge].into_iter().collect(),
    }
}

impl Bench for InProc {
    fn post_write(&self, i: u64) -> anyhow::Result<()> {
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(self.src.sge(0, MIB))
            .remote(self.dst.addr(), self.dst.rkey());
        Ok(self.a.post_send(wr)?)
    }
    fn writer_done(&self) -> anyhow::Result<()> {
        ok(self.next(&self.cq_a)).map(|_| ())
    }
    fn post_recv(&self, i: u64) -> anyhow::Result<()> {
        Ok(self.b.post_recv(recv(i, self.dst.sge(0, 64)))?)
    }
    fn post_send(&self, i: u64) -> anyhow::Result<()> {
        Ok(self
            .a
            .post_send(SendWr::new(i, WrOpcode::Send).sge(self.src.sge(0, 64)))?)
    }
    fn receiver_done(&self) -> anyhow::Result<u32> {
        ok(self.next(&self.cq_b))
    }
    fn regions(
        &self,
    ) -> (
        &std::sync::Arc<netstack::mem::Region>,
        &std::sync::Arc<netstack::mem::Region>,
    ) {
        (self.src.region(), self.dst.region())
    }
}

struct ViaDaemon {
    a: flexnsd::client::Qp,
    b: flexnsd::client::Qp,
    cq_a: flexnsd::client::Cq,
    cq_b: flexnsd::client::Cq,
    src: flexnsd::client::Mr,
    dst: flexnsd::client::Mr,
    _pd: flexnsd::client::Pd,
}

impl ViaDaemon {
    fn new(socket: &std::path::Path) -> anyhow::Result<ViaDaemon> {
        use flexnsd::client::*;
        let att = Attachment::connect(socket, "bench")?;
        let pd = att.alloc_pd()?;
        let src = pd.reg_mr(MIB, Access::ALL)?;
        let dst = pd.reg_mr(MIB, Access::ALL)?;
        let cq_a = att.create_cq(1024)?;
        let cq_b = att.create_cq(1024)?;
        let a = att.create_qp(&pd, &cq_a, &cq_a, QpInitAttr::default())?;
        let b = att.create_qp(&pd, &cq_b, &cq_b, QpInitAttr::default())?;
        a.connect(&b.local_endpoint()?)?;
        b.connect(&a.local_endpoint()?)?;
        Ok(ViaDaemon {
            a,
            b,
            cq_a,
            cq_b,
            src,
            dst,
            _pd: pd,
        })
    }
}

impl Bench for ViaDaemon {
    fn post_write(&self, i: u64) -> anyhow::Result<()> {
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(self.src.sge(0, MIB))
            .remote(self.dst.addr(), self.dst.rkey());
        Ok(self.a.post_send(wr)?)
    }
    fn writer_done(&self) -> anyhow::Result<()> {
        ok(self.cq_a.next(T)?).map(|_| ())
    }
    fn post_recv(&self, i: u64) -> anyhow::Result<()> {
        Ok(self.b.post_recv(recv(i, self.dst.sge(0, 64)))?)
    }
    fn post_send(&self, i: u64) -> anyhow::Result<()> {
        Ok(self
            .a
            .post_send(SendWr::new(i, WrOpcode::Send).sge(self.src.sge(0, 64)))?)
    }
    fn receiver_done(&self) -> anyhow::Result<u32> {
        ok(self.cq_b.next(T)?)
    }
    fn regions(
        &self,
    ) -> (
        &std::sync::Arc<netstack::mem::Region>,
        &std::sync::Arc<netstack::mem::Region>,
    ) {
        (self.src.region(), self.dst.region())
    }
}

fn measure(b: &dyn Bench, args: &Args, daemon: Option<u32>, seed: u64) -> anyhow::Result<Run> {
    let cpu = || -> anyhow::Result<f64> { Ok(cpu_self() + daemon.map(cpu_of).transpose()?.unwrap_or(0.0)) };
    writes(b, 10, !seed)?; // warm up
    prepare(b, seed);
    let c0 = cpu()?;
    let t = writes(b, args.writes, seed)?;
    let c1 = cpu()?;
    verify(b)?;
    let mut lat = sends(b, args.sends, seed)?;
    let c2 = cpu()?;
    lat.sort();
    Ok(Run {
        write_gbps: f64::from(args.writes) * MIB as f64 * 8.0 / t.as_secs_f64() / 1e9,
        send_p50_us: lat[lat.len() / 2].as_secs_f64() * 1e6,
        cpu_write_us: (c1 - c0) / f64::from(args.writes) * 1e6,
        cpu_send_us: (c2 - c1) / f64::from(args.sends) * 1e6,
    })
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("flexnsd-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if args.writes == 0 || args.sends == 0 || args.pairs == 0 {
        bail!("--pairs, --writes and --sends must be at least 1");
    }
    let (daemon, socket, dir) = match (&args.socket, args.daemon_pid) {
        (Some(s), Some(pid)) => {
            if !listens(s) {
                bail!("--socket {}: no flexnsd accepted within {T:?}", s.display());
            }
            (Daemon::Attached(pid), s.clone(), None)
        }
        _ => {
            let dir = std::env::temp_dir().join(format!("flexnsd-bench-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let socket = dir.join("flexnsd.sock");
            (Daemon::Child(start_daemon(&args, &socket)?), socket, Some(dir))
        }
    };
    let result = (|| -> anyhow::Result<()> {
        if !args.json {
            println!(
                "in-process application polls its CQ {} us before sleeping; flexnsd's polls its ring 50 us",
                args.inproc_spin_us
            );
            println!("mode      WRITE-1MiB-Gbit/s  SEND-64B-p50-us  CPU-us/WRITE  CPU-us/SEND");
        }
        let mut ratios = Vec::new();
        let t0 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        for pair in 0..u64::from(args.pairs) {
            let spin = Duration::from_micros(args.inproc_spin_us);
            let inproc = measure(&InProc::new(spin)?, &args, None, t0 ^ (2 * pair))?;
            let via = measure(
                &ViaDaemon::new(&socket)?,
                &args,
                Some(daemon.pid()),
                t0 ^ (2 * pair + 1),
            )?;
            for (name, r) in [("in-proc", inproc), ("flexnsd", via)] {
                if args.json {
                    println!("{}", run_line(name, &r, &args));
                } else {
                    println!(
                        "{name:8}  {:17.2}  {:15.1}  {:12.1}  {:11.2}",
                        r.write_gbps, r.send_p50_us, r.cpu_write_us, r.cpu_send_us
                    );
                }
            }
            ratios.push((
                via.write_gbps / inproc.write_gbps,
                via.send_p50_us / inproc.send_p50_us,
                via.cpu_write_us / inproc.cpu_write_us,
                via.cpu_send_us / inproc.cpu_send_us,
            ));
        }
        if args.json {
            for line in ratio_lines(&ratios) {
                println!("{line}");
            }
            return Ok(());
        }
        println!(
            "every run's WRITEs verified at the target (a fresh pattern per run, the destination zeroed before it), and each WRITE's and SEND's own stamp after its completion"
        );
        println!("ratio flexnsd/in-proc per pair (targets: WRITE >= 0.9, SEND p50 <= 1.3, CPU <= 1.2):");
        for (w, s, cw, cs) in ratios {
            println!("  WRITE {w:.2}  SEND p50 {s:.2}  CPU/WRITE {cw:.2}  CPU/SEND {cs:.2}");
        }
        Ok(())
    })();
    if let Daemon::Child(mut c) = daemon {
        let _ = c.kill();
        let _ = c.wait();
    }
    if let Some(dir) = dir {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// The JSON line of one run (`mode`: `in-proc` or `flexnsd`). A run that returned verified its
/// WRITEs at the target ([`verify`]); its SENDs carry no checked data.
fn run_line(mode: &str, r: &Run, args: &Args) -> serde_json::Value {
    serde_json::json!({
        "bench": "flexnsd",
        "system": if mode == "flexnsd" { "flexns-flexnsd" } else { "flexns-inproc" },
        "write_size": MIB,
        "writes": args.writes,
        "gbps": r.write_gbps,
        "send_size": 64,
        "sends": args.sends,
        "p50_us": r.send_p50_us,
        "cpu_us_per_write": r.cpu_write_us,
        "cpu_us_per_send": r.cpu_send_us,
        "verified": true,
    })
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The ratio lines over the pairs' (WRITE, SEND p50, CPU per WRITE, CPU per SEND) ratios,
/// flexnsd / in-process: one for WRITE 1 MiB (Gbit/s) and one for SEND 64 B (p50).
fn ratio_lines(pairs: &[(f64, f64, f64, f64)]) -> [serde_json::Value; 2] {
    let col = |f: fn(&(f64, f64, f64, f64)) -> f64| pairs.iter().map(f).collect::<Vec<f64>>();
    let line = |case: &str, metric: &str, ratios: Vec<f64>, cpu: Vec<f64>, target: &str| {
        serde_json::json!({
            "bench": "ratio",
            "case": case,
            "metric": metric,
            "reference": "the in-process engine",
            "ratio": median(ratios.clone()),
            "ratios": ratios,
            "cpu_us_per_op_ratio": median(cpu),
            "target": target,
        })
    };
    [
        line("WRITE-1MiB", "gbps", col(|p| p.0), col(|p| p.2), ">= 0.9, CPU <= 1.2"),
        line("SEND-64B", "p50_us", col(|p| p.1), col(|p| p.3), "<= 1.3, CPU <= 1.2"),
    ]
}

/// The daemon the flexnsd runs go through: one this bench started, or one it was given.
enum Daemon {
    Child(std::process::Child),
    Attached(u32),
}

impl Daemon {
    fn pid(&self) -> u32 {
        match self {
            Daemon::Child(c) => c.id(),
            Daemon::Attached(pid) => *pid,
        }
    }
}

/// Starts `flexnsd` listening at `socket` and waits until it accepts an attachment.
fn start_daemon(args: &Args, socket: &std::path::Path) -> anyhow::Result<std::process::Child> {
    let exe = match &args.flexnsd {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this binary's directory")?
            .join("flexnsd"),
    };
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("--socket").arg(socket).env("RUST_LOG", "warn");
    if let Some(c) = &args.daemon_config {
        cmd.arg("--config").arg(c);
    }
    let mut daemon = cmd.spawn().with_context(|| format!("--flexnsd {}", exe.display()))?;
    if !listens(socket) {
        let _ = daemon.kill();
        let _ = daemon.wait();
        bail!("flexnsd did not listen at {} within {T:?}", socket.display());
    }
    Ok(daemon)
}

/// Whether a flexnsd accepts an attachment at `socket` within `T`.
fn listens(socket: &std::path::Path) -> bool {
    let deadline = Instant::now() + T;
    while flexnsd::client::Attachment::connect(socket, "probe").is_err() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
