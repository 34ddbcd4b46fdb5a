//! `blkctl bench`: block I/O through real NBD clients (`fio --ioengine=nbd`, `qemu-img bench`)
//! against the flexns agent (Solar over UDP), the same agent and storage nodes over the plain
//! block protocol on kernel TCP (`tcp`: whole requests, no Solar layer), and `qemu-nbd` serving
//! a raw file directly, twice: `qemu-nbd` writethrough (like the agent, a write is durable when
//! it completes; reads from the page cache) and `qemu-nbd-direct` (`--cache=directsync
//! --aio=native`: O_DIRECT|O_DSYNC and Linux AIO, what a performance-minded qemu user runs
//! when each write must be durable when it completes, as the agent's are). Systems
//! run interleaved (A B C D A B C D ...); every round's ratio against each reference is taken
//! and the summary gives the median over rounds, per `docs/BENCHMARKS.md`.
//!
//! Every invocation proves its own data, in the timed I/O itself (fio): read rounds read a
//! volume filled with random data of a fresh seed and a fio CRC32C header per block, and fio
//! checks every read; write rounds are fio verify workloads, each block written read back
//! after the round and checked (CRC32C, offset, and that it holds the last write to it).
//! After read rounds `qemu-img compare` also checks every byte. CPU is accounted per process
//! and per round: fio (the client), and the agent and storage nodes, or qemu-nbd.

use crate::bench::{median, BenchResult};
use crate::blk::{ClusterSpec, LocalCluster, Spawner};
use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `blkctl bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// flexns, tcp, qemu-nbd, qemu-nbd-direct, or all (interleaved, with ratios).
    #[arg(long, default_value = "all")]
    pub system: String,
    /// fio (its nbd engine) or qemu-img (bench).
    #[arg(long, default_value = "fio")]
    pub client: String,
    /// randread, randwrite, read or write.
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Block size of each I/O.
    #[arg(long, default_value = "4k", value_parser = size)]
    pub bs: u64,
    /// I/Os in flight.
    #[arg(long, default_value_t = 32)]
    pub depth: u32,
    /// Replicas of the flexns and tcp volumes (as many storage nodes are started).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Replicas a write needs durable before it is acknowledged, for the flexns and tcp
    /// agents (0: a majority, the service's default).
    #[arg(long, default_value_t = 0)]
    pub write_quorum: usize,
    /// Also run flexns with this many replicas (a majority needed for a write), as a
    /// reference: the cost of replication, interleaved (`flexns-rN` in the lines).
    #[arg(long)]
    pub compare_replicas: Option<usize>,
    /// Volume size.
    #[arg(long, default_value = "256MiB", value_parser = size)]
    pub size: u64,
    /// Seconds per fio run.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Requests per qemu-img bench run.
    #[arg(long, default_value_t = 50_000)]
    pub ops: u64,
    /// Rounds (each system once per round).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Solar paths per storage node.
    #[arg(long, default_value_t = 4)]
    pub paths: u16,
    /// The agent's Solar congestion control: swift or none.
    #[arg(long, default_value = "swift")]
    pub cc: String,
    /// How the flexns and tcp clusters' Solar data cores wait: sleep, adaptive or busy.
    #[arg(long, default_value = "sleep")]
    pub poll_mode: String,
    /// Who runs the flexns and tcp agents' Solar data core: runtime (a task beside the NBD
    /// connections) or threads (a data-core thread).
    #[arg(long, default_value = "runtime")]
    pub engine_drive: String,
    /// Benchmark this NBD URI instead of starting anything (one system, named by --system).
    #[arg(long)]
    pub uri: Option<String>,
    /// Print the results as JSON lines.
    #[arg(long)]
    pub json: bool,
}

fn size(s: &str) -> Result<u64, String> {
    crate::bench::parse_size(s).map_err(|e| e.to_string())
}

fn tool(name: &str) -> Result<()> {
    match Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(_) => Ok(()),
        Err(_) => bail!("{name} is not installed (scripts/install-test-deps.sh installs it: fio, qemu-utils)"),
    }
}

fn random_file(path: &Path, bytes: u64, seed: u64) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut x = seed | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        for c in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(())
}

/// Runs a tool to its end (fio ends its jobs on SIGINT and still reports them; others are
/// stopped with it); fails with its output if it fails.
fn run_ok(cmd: &mut Command) -> Result<String> {
    let o = crate::procs::output(cmd, libc::SIGINT).with_context(|| format!("running {cmd:?}"))?;
    if !o.status.success() {
        bail!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).to_string())
}

/// A qemu-nbd serving a file; stopped on drop.
struct QemuNbd(Option<Child>);

impl Drop for QemuNbd {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            crate::procs::terminate(c, Duration::from_secs(2));
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts qemu-nbd on `file`: writethrough (page cache, each write synced), or `direct`
/// (`--cache=directsync --aio=native`: O_DIRECT|O_DSYNC with Linux AIO). Either way a write
/// is durable when its reply leaves, as the agent's writes are on their write quorum.
fn start_qemu_nbd(file: &Path, direct: bool) -> Result<(QemuNbd, String)> {
    tool("qemu-nbd")?;
    let port = free_port()?;
    let child = crate::procs::spawn(
        crate::procs::command("qemu-nbd")
            .args([
                "-f",
                "raw",
                "-x",
                "vol",
                "-b",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-t",
                "-e",
                "8",
            ])
            .args(if direct {
                &["--cache=directsync", "--aio=native"][..]
            } else {
                &["--cache=writethrough"][..]
            })
            .arg(file)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .context("starting qemu-nbd")?;
    let q = QemuNbd(Some(child));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("qemu-nbd did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((q, format!("nbd://127.0.0.1:{port}/vol")))
}

/// One measurement.
struct Run {
    iops: f64,
    mbps: f64,
    p50: Option<f64>,
    p99: Option<f64>,
    p999: Option<f64>,
    secs: f64,
    ops: u64,
    /// CPU seconds of the client (fio and its job process; qemu-img bench: none).
    client_cpu: Option<f64>,
    /// What each serving process used during the run.
    servers: Vec<crate::bench::ProcUsage>,
    /// Blocks the client checked in this run (fio: every read, or every block written read
    /// back; qemu-img bench: none).
    checked: u64,
    /// Why this run's data is not proven (a block that failed, no check that ran).
    failure: Option<String>,
}

/// I/Os a fio round may issue before it has a measured rate to size it by: at most this many
/// per second of the round (ramp included), on the generous side, since a read round that
/// runs out of its log ends early (and says so in its `secs`).
const FIRST_ROUND_IOPS: f64 = 20_000.0;

/// I/Os a round of `a` issues (ramp included), from a system's measured rate so far.
fn budget(a: &BenchArgs, iops: Option<f64>) -> u64 {
    let secs = a.duration + 1.0;
    match iops {
        // reads end at --duration: a log with room to spare; writes end at their count
        Some(r) if a.rw.contains("read") => (r * secs * 2.0).ceil() as u64,
        Some(r) => (r * secs).ceil() as u64,
        None => (FIRST_ROUND_IOPS * secs) as u64,
    }
    .max(4 * a.depth as u64)
}

/// The replay log of a read round: `n` reads of `bs` at offsets of this run's own (random,
/// or in order from a random start for `read`), for fio's `--read_iolog`: fio stops a
/// time-based read job that verifies after one pass of `--size`, but a job replaying a log runs
/// its whole log (or until `--runtime`), verifying every read.
fn read_log(path: &Path, a: &BenchArgs, n: u64, seed: u64) -> Result<()> {
    use std::io::Write;
    let blocks = a.size / a.bs;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "fio version 2 iolog\nnbd add\nnbd open")?;
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let first = next() % blocks;
    for i in 0..n {
        let b = if a.rw == "read" {
            (first + i) % blocks
        } else {
            next() % blocks
        };
        writeln!(f, "nbd read {} {}", b * a.bs, a.bs)?;
    }
    writeln!(f, "nbd close")?;
    f.flush()?;
    Ok(())
}

/// What fio's verification of one round found, from its JSON job and its stderr: the blocks
/// it checked, or why the round's data is not proven. A write round must have read back
/// blocks (fio's verify phase after the writes), a read round must have checked reads (each
/// read against its block's CRC32C header); any job error (EILSEQ: a block failed) fails it.
fn fio_check(job: &serde_json::Value, writes: bool, stderr: &str) -> (u64, Option<String>) {
    let error = job["error"].as_i64().unwrap_or(-1);
    let (w, r) = (
        job["write"]["total_ios"].as_u64().unwrap_or(0),
        job["read"]["total_ios"].as_u64().unwrap_or(0),
    );
    if error != 0 {
        let why = stderr
            .lines()
            .find(|l| l.contains("verify:") || l.contains("bad "))
            .unwrap_or("")
            .trim();
        return (0, Some(format!("fio job error {error}: {why}")));
    }
    if writes && (w == 0 || r == 0) {
        return (
            0,
            Some(format!("fio wrote {w} blocks and read back {r}: no verify phase ran")),
        );
    }
    if !writes && r == 0 {
        return (0, Some("fio read nothing".into()));
    }
    (r, None)
}

fn fio(a: &BenchArgs, uri: &str, ops: u64, log: &Path) -> Result<Run> {
    tool("fio")?;
    let writes = a.rw.contains("write");
    let mut cmd = crate::procs::command("fio");
    cmd.args(["--name=b", "--ioengine=nbd", "--ramp_time=1"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--bs={}", a.bs))
        .arg(format!("--iodepth={}", a.depth))
        .arg(format!("--size={}", a.size))
        .args(["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"])
        .arg("--output-format=json");
    if writes {
        // not time-based: fio then reads back every block the round wrote (ramp included)
        // and checks its CRC32C, offset and that it holds the last write to it (numberio);
        // overlapping writes are never in flight together, so that last write is defined
        cmd.args([
            "--do_verify=1",
            "--norandommap",
            "--randrepeat=0",
            "--serialize_overlap=1",
        ])
        .arg(format!("--rw={}", a.rw))
        .arg(format!("--io_size={}", ops * a.bs))
        // written data of this run's own
        .arg(format!("--randseed={}", crate::bench::run_seed() >> 1));
    } else {
        read_log(log, a, ops, crate::bench::run_seed() ^ ops)?;
        cmd.arg(format!("--read_iolog={}", log.display()))
            .arg(format!("--runtime={}", a.duration));
    }
    let (c0, _) = crate::bench::rusage(true);
    let o = crate::procs::output(&mut cmd, libc::SIGINT).with_context(|| format!("running {cmd:?}"))?;
    // fio and its job process, both reaped children: their CPU over the whole run
    let (c1, _) = crate::bench::rusage(true);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    // a failed verification exits non-zero with its report; no report is a failure to run
    let start = out
        .find('{')
        .with_context(|| format!("{cmd:?} printed no report: {out}{err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out[start..]).context("fio JSON")?;
    let job = &v["jobs"][0];
    let side = if writes { &job["write"] } else { &job["read"] };
    let pct = |k: &str| {
        side["clat_ns"]["percentile"][k]
            .as_f64()
            .map(|ns| (ns / 10.0).round() / 100.0)
    };
    let (checked, failure) = fio_check(job, writes, &err);
    let failure = match failure {
        // stopped early: fio's report of the time it ran, not a verification failure
        Some(_) if crate::procs::stopping() => None,
        f => f,
    };
    Ok(Run {
        iops: side["iops"].as_f64().unwrap_or(0.0),
        mbps: side["bw_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        p50: pct("50.000000"),
        p99: pct("99.000000"),
        p999: pct("99.900000"),
        secs: side["runtime"].as_f64().unwrap_or(0.0) / 1000.0,
        ops: side["total_ios"].as_u64().unwrap_or(0),
        client_cpu: Some(c1 - c0),
        servers: Vec::new(),
        checked,
        failure,
    })
}

fn qemu_img(a: &BenchArgs, uri: &str) -> Result<Run> {
    tool("qemu-img")?;
    let mut c = crate::procs::command("qemu-img");
    c.args(["bench", "-f", "raw", "-t", "none"]).args([
        "-c",
        &a.ops.to_string(),
        "-d",
        &a.depth.to_string(),
        "-s",
        &a.bs.to_string(),
    ]);
    if a.rw.starts_with("rand") {
        // no random mode: a stride of 7919 blocks visits the volume in a scattered order
        c.args(["-S", &(7919 * a.bs).to_string()]);
    }
    if a.rw.contains("write") {
        c.args(["-w", "--pattern=165"]);
    }
    let out = run_ok(c.arg(uri))?;
    let secs: f64 = out
        .lines()
        .find_map(|l| {
            l.strip_prefix("Run completed in ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|x| x.parse().ok())
        })
        .context("qemu-img bench printed no run time")?;
    Ok(Run {
        iops: a.ops as f64 / secs,
        mbps: a.ops as f64 * a.bs as f64 / secs / 1048576.0,
        p50: None,
        p99: None,
        p999: None,
        secs,
        ops: a.ops,
        client_cpu: None,
        servers: Vec::new(),
        checked: 0,
        failure: None,
    })
}

/// A system under test and how to reach it.
struct Target {
    name: String,
    uri: String,
    /// The serving processes (agent and storage nodes, or qemu-nbd), for CPU and memory.
    procs: Vec<crate::bench::Proc>,
    _keep: Keep,
}

#[allow(dead_code)] // held only to stop the processes on drop
enum Keep {
    None,
    Cluster(Box<LocalCluster>),
    Qemu(QemuNbd),
}

fn fill(src: &Path, uri: &str) -> Result<()> {
    tool("qemu-img")?;
    run_ok(
        crate::procs::command("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(src)
            .arg(uri),
    )?;
    Ok(())
}

fn verify(src: &Path, uri: &str) -> bool {
    crate::procs::output(
        crate::procs::command("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(src)
            .arg(uri),
        libc::SIGTERM,
    )
    .is_ok_and(|o| o.status.success())
}

/// Runs the benchmark.
pub fn run(a: &BenchArgs, sp: &Spawner) -> Result<()> {
    if !matches!(a.rw.as_str(), "randread" | "randwrite" | "read" | "write") {
        bail!("--rw {:?}: randread, randwrite, read or write", a.rw);
    }
    if !matches!(a.client.as_str(), "fio" | "qemu-img") {
        bail!("--client {:?}: fio or qemu-img", a.client);
    }
    if a.bs == 0 || !a.bs.is_multiple_of(512) || a.bs > 32 << 20 {
        bail!("--bs {}: a multiple of 512 up to 32 MiB", a.bs);
    }
    if a.size < a.bs || !a.size.is_multiple_of(4096) {
        bail!("--size {}: a multiple of 4096, at least --bs", a.size);
    }
    if a.depth == 0 || a.repeat == 0 {
        bail!("--depth and --repeat must be at least 1");
    }
    let mut systems: Vec<String> = match a.system.as_str() {
        "all" => vec!["flexns", "tcp", "qemu-nbd", "qemu-nbd-direct"],
        s @ ("flexns" | "tcp" | "qemu-nbd" | "qemu-nbd-direct") => vec![s],
        s => bail!("--system {s:?}: flexns, tcp, qemu-nbd, qemu-nbd-direct or all"),
    }
    .into_iter()
    .map(String::from)
    .collect();
    if a.write_quorum > a.replicas {
        bail!("--write-quorum {}: at most --replicas ({})", a.write_quorum, a.replicas);
    }
    if let Some(r) = a.compare_replicas {
        if r == 0 || r > 16 {
            bail!("--compare-replicas {r}: 1 to 16");
        }
        if a.uri.is_some() {
            bail!("--compare-replicas starts its own cluster: not with --uri");
        }
        systems.push(format!("flexns-r{r}"));
    }
    let systems: Vec<&str> = systems.iter().map(String::as_str).collect();
    let dir = std::env::temp_dir().join(format!("blkbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = bench(a, sp, &systems, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn bench(a: &BenchArgs, sp: &Spawner, systems: &[&str], dir: &Path) -> Result<()> {
    let src = dir.join("src.img");
    // this invocation's data, not what an earlier one left; what fio reads carries a CRC32C
    // header per block, which it checks on every read
    if a.client == "fio" && a.rw.contains("read") {
        lay_down(&src, a)?;
    } else {
        random_file(&src, a.size, crate::bench::run_seed())?;
    }
    let mut targets = Vec::new();
    if let Some(u) = &a.uri {
        if systems.len() != 1 {
            bail!("--uri needs one --system (the name to report it under)");
        }
        fill(&src, u)?;
        targets.push(Target {
            name: systems[0].to_string(),
            uri: u.clone(),
            procs: Vec::new(),
            _keep: Keep::None,
        });
    } else {
        for &s in systems {
            let t = match s {
                "qemu-nbd" | "qemu-nbd-direct" => {
                    let f: PathBuf = dir.join(format!("{s}.img"));
                    std::fs::copy(&src, &f)?;
                    let (q, uri) = start_qemu_nbd(&f, s == "qemu-nbd-direct")?;
                    Target {
                        name: s.into(),
                        uri,
                        procs: q
                            .0
                            .iter()
                            .map(|c| crate::bench::Proc::new("qemu-nbd", c.id()))
                            .collect(),
                        _keep: Keep::Qemu(q),
                    }
                }
                _ => {
                    let mut spec = ClusterSpec::new(dir.join(s));
                    // `flexns-rN`: the replication reference, N replicas, all needed
                    let reference = s.strip_prefix("flexns-r").and_then(|n| n.parse::<usize>().ok());
                    spec.replicas = reference.unwrap_or(a.replicas);
                    spec.nodes = spec.replicas;
                    spec.write_quorum = if reference.is_some() { 0 } else { a.write_quorum };
                    spec.size = a.size;
                    spec.transport = if s == "tcp" { "tcp".into() } else { "solar".into() };
                    spec.paths = a.paths;
                    spec.cc = a.cc.clone();
                    spec.poll_mode = a.poll_mode.clone();
                    spec.engine_drive = a.engine_drive.clone();
                    let c = LocalCluster::start(sp, spec)?;
                    let uri = c.uri.clone();
                    fill(&src, &uri).with_context(|| format!("filling the {s} volume"))?;
                    let mut procs = vec![crate::bench::Proc::new("agent", c.agent.pid)];
                    procs.extend(
                        c.nodes
                            .iter()
                            .enumerate()
                            .map(|(i, n)| crate::bench::Proc::new(format!("node{i}"), n.pid)),
                    );
                    Target {
                        name: s.into(),
                        uri,
                        procs,
                        _keep: Keep::Cluster(Box::new(c)),
                    }
                }
            };
            targets.push(t);
        }
    }
    let mut runs: Vec<Vec<Run>> = targets.iter().map(|_| Vec::new()).collect();
    let progress = crate::progress::Progress::new("blkctl bench", a.repeat as u64 * targets.len() as u64);
    'rounds: for round in 0..a.repeat {
        for (i, t) in targets.iter().enumerate() {
            if crate::procs::stopping() {
                break 'rounds;
            }
            progress.start(format!("{} round {}", t.name, round + 1));
            // a round's I/Os from this system's rate in its last round
            let ops = budget(a, runs[i].last().map(|r: &Run| r.iops));
            let meter = crate::bench::Meter::start(&t.procs);
            let r = match a.client.as_str() {
                "fio" => fio(a, &t.uri, ops, &dir.join("reads.log")),
                _ => qemu_img(a, &t.uri),
            };
            // fio stopped by SIGINT reports its jobs so far; a tool killed mid-run has nothing
            let mut r = match r {
                Err(_) if crate::procs::stopping() => break 'rounds,
                r => r.with_context(|| format!("{} round {}", t.name, round + 1))?,
            };
            r.servers = meter.finish();
            if !a.json {
                progress.println(format!(
                    "round {} {:<15} {:>10.0} IOPS {:>8.1} MiB/s",
                    round + 1,
                    t.name,
                    r.iops,
                    r.mbps
                ));
            }
            progress.finished_one();
            runs[i].push(r);
        }
    }
    // a run cut short is reported as such and not verified (the program has to stop now)
    let interrupted = crate::procs::stopping();
    for (t, rs) in targets.iter().zip(&runs) {
        if rs.is_empty() {
            continue;
        }
        let (verified, how) = verdict(a, rs, interrupted, || verify(&src, &t.uri));
        let result = system_result(a, t, rs, verified, interrupted, how);
        if a.json {
            result.print(true);
        } else {
            println!(
                "{:<15} {:<8} bs {:>8} QD{:<3} {:>10.0} IOPS  p50 {:>8} us  p99 {:>8} us  server cpu {:>6} us/IO  verified={}{}",
                t.name,
                a.rw,
                a.bs,
                a.depth,
                result.extra.get("iops").and_then(|v| v.as_f64()).unwrap_or(0.0),
                result.p50_us.map_or("-".into(), |x| format!("{x:.1}")),
                result.p99_us.map_or("-".into(), |x| format!("{x:.1}")),
                result.extra.get("server_cpu_us_per_io").map_or("-".into(), |v| v.to_string()),
                verified,
                if interrupted { "  INCOMPLETE" } else { "" }
            );
        }
    }
    if !interrupted {
        ratio_lines(a, &targets, &runs);
    }
    Ok(())
}

/// Whether a system's rounds are proven, and how: fio checked the timed I/O of every round
/// itself (every read against its block's CRC32C header; every block a write round wrote read
/// back after the round, its CRC32C, offset and write number checked); reads are also
/// compared byte for byte with the source image after the rounds (`compare`). qemu-img bench
/// checks nothing it reads or writes: its rounds are not proven, whatever the image holds.
fn verdict(a: &BenchArgs, rs: &[Run], interrupted: bool, compare: impl FnOnce() -> bool) -> (bool, String) {
    if interrupted {
        return (false, "interrupted: stopped early, not verified".into());
    }
    if let Some((k, e)) = rs
        .iter()
        .enumerate()
        .find_map(|(k, r)| r.failure.as_ref().map(|e| (k, e)))
    {
        return (false, format!("round {}: {e}", k + 1));
    }
    let reads = a.rw.contains("read");
    let checked: u64 = rs.iter().map(|r| r.checked).sum();
    if a.client != "fio" {
        let same = reads && compare();
        return (
            false,
            format!(
                "qemu-img bench does not check its I/O: not verified{}",
                if !reads {
                    ""
                } else if same {
                    " (the image still equals its source after the rounds)"
                } else {
                    " (and the image differs from its source after the rounds)"
                }
            ),
        );
    }
    if reads {
        if !compare() {
            return (
                false,
                format!("{checked} timed reads checked (fio CRC32C header per block), but the image differs from its source after the rounds (qemu-img compare)"),
            );
        }
        return (
            true,
            format!("every timed read checked by fio against its block's CRC32C header ({checked} after the ramps), and every byte compared with the source image after the rounds (qemu-img compare)"),
        );
    }
    (
        true,
        format!("every block the timed writes wrote read back after each round and checked by fio: CRC32C, offset and that it holds the last write to it ({checked} blocks)"),
    )
}

/// When a system's write is durable: each acknowledges a write only once it is (the same
/// guarantee for every system compared).
fn durability(system: &str) -> &'static str {
    match system {
        "qemu-nbd" => "writethrough: each write flushed (fdatasync) before its reply",
        "qemu-nbd-direct" => "directsync: O_DIRECT|O_DSYNC, each write on the disk before its reply",
        _ => "each write in its write quorum's storage-node logs, fdatasync'd, before its reply",
    }
}

/// Writes `a.size` bytes of this run's own random data to `path`, a CRC32C verify header at
/// the start of each `a.bs` block (fio's, so that fio checks each block it reads).
fn lay_down(path: &Path, a: &BenchArgs) -> Result<()> {
    tool("fio")?;
    run_ok(
        crate::procs::command("fio")
            .args([
                "--name=lay",
                "--ioengine=psync",
                "--rw=write",
                "--verify=crc32c",
                "--do_verify=0",
            ])
            .args(["--verify_state_save=0", "--output-format=json"])
            .arg(format!("--filename={}", path.display()))
            .arg(format!("--bs={}", a.bs))
            .arg(format!("--size={}", a.size))
            .arg(format!("--randseed={}", crate::bench::run_seed() >> 1)),
    )?;
    Ok(())
}

/// The median result of one system's rounds, with per-process CPU of the median round's
/// processes summed over all rounds.
fn system_result(a: &BenchArgs, t: &Target, rs: &[Run], verified: bool, interrupted: bool, how: String) -> BenchResult {
    let med = |f: &dyn Fn(&Run) -> Option<f64>| {
        let mut v: Vec<f64> = rs.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    let iops = med(&|r| Some(r.iops)).unwrap_or(0.0);
    let ops: u64 = rs.iter().map(|r| r.ops).sum();
    let mut b = BenchResult {
        bench: a.rw.clone(),
        system: t.name.clone(),
        transport: Some(match t.name.as_str() {
            "flexns" => format!("solar/udp x{}", a.paths),
            "tcp" => "plain block protocol over kernel tcp".into(),
            "qemu-nbd-direct" => "nbd over tcp, O_DIRECT|O_DSYNC (cache=directsync) + linux aio".into(),
            _ => "nbd over tcp, writethrough".into(),
        }),
        msg_bytes: a.bs,
        qps: 1,
        depth: a.depth,
        bytes: ops * a.bs,
        ops,
        secs: rs.iter().map(|r| r.secs).sum(),
        p50_us: med(&|r| r.p50),
        p99_us: med(&|r| r.p99),
        p999_us: med(&|r| r.p999),
        verified,
        incomplete: interrupted,
        note: Some(how),
        ..Default::default()
    };
    // the client (fio) first, then each serving process, CPU summed over the rounds
    let mut usage = vec![crate::bench::ProcUsage {
        role: a.client.clone(),
        pid: 0,
        cpu_secs: rs.iter().filter_map(|r| r.client_cpu).sum(),
        peak_rss_kib: 0,
        peak_rss_since_start: false,
    }];
    for (k, p) in t.procs.iter().enumerate() {
        usage.push(crate::bench::ProcUsage {
            role: p.role.clone(),
            pid: p.pid,
            cpu_secs: rs.iter().filter_map(|r| r.servers.get(k)).map(|u| u.cpu_secs).sum(),
            peak_rss_kib: rs
                .iter()
                .filter_map(|r| r.servers.get(k))
                .map(|u| u.peak_rss_kib)
                .max()
                .unwrap_or(0),
            peak_rss_since_start: false,
        });
    }
    b.rates();
    b.account(&usage);
    if let (Some(c), true) = (b.server_cpu_secs, ops > 0) {
        b.extra.insert(
            "server_cpu_us_per_io".into(),
            ((c * 1e6 / ops as f64 * 10.0).round() / 10.0).into(),
        );
    }
    let ex = &mut b.extra;
    ex.insert("client".into(), a.client.clone().into());
    ex.insert("bs".into(), a.bs.into());
    ex.insert("iops".into(), ((iops * 10.0).round() / 10.0).into());
    let replicas = match t.name.strip_prefix("flexns-r").and_then(|n| n.parse::<usize>().ok()) {
        Some(n) => n,
        None if t.name.starts_with("qemu-nbd") => 1,
        None => a.replicas,
    };
    ex.insert("replicas".into(), replicas.into());
    let quorum = if t.name.starts_with("flexns-r") || a.write_quorum == 0 {
        replicas / 2 + 1
    } else {
        a.write_quorum
    };
    ex.insert("write_quorum".into(), quorum.into());
    ex.insert("runs".into(), rs.len().into());
    ex.insert("durability".into(), durability(&t.name).into());
    ex.insert(
        "iops_runs".into(),
        rs.iter()
            .map(|r| serde_json::Value::from(r.iops.round()))
            .collect::<Vec<_>>()
            .into(),
    );
    b
}

/// flexns against every other system: the median over rounds of each round's IOPS ratio
/// (interleaved, so both saw the same machine), of its p50 ratio, and of the serving
/// processes' CPU per I/O.
fn ratio_lines(a: &BenchArgs, targets: &[Target], runs: &[Vec<Run>]) {
    let Some(f) = targets.iter().position(|t| t.name == "flexns") else {
        return;
    };
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let server_cpu = |r: &Run| r.servers.iter().map(|u| u.cpu_secs).sum::<f64>() / r.ops.max(1) as f64;
    for (o, t) in targets.iter().enumerate().filter(|(o, _)| *o != f) {
        let pairs: Vec<(&Run, &Run)> = runs[f].iter().zip(&runs[o]).collect();
        if pairs.is_empty() {
            continue;
        }
        let mut iops: Vec<f64> = pairs.iter().map(|(x, y)| r3(x.iops / y.iops.max(1e-9))).collect();
        let per_round = iops.clone();
        let mut p50: Vec<f64> = pairs.iter().filter_map(|(x, y)| Some(r3(x.p50? / y.p50?))).collect();
        let mut cpu: Vec<f64> = pairs.iter().map(|(x, y)| r3(server_cpu(x) / server_cpu(y))).collect();
        let line = serde_json::json!({
            "bench": format!("{}_ratio", a.rw), "system": "flexns", "reference": t.name, "client": a.client,
            "bs": a.bs, "depth": a.depth, "replicas": a.replicas,
            "write_quorum": if a.write_quorum == 0 { a.replicas / 2 + 1 } else { a.write_quorum }, "pairs": pairs.len(),
            "iops_ratio": r3(median(&mut iops)), "iops_ratios": per_round,
            "p50_ratio": (!p50.is_empty()).then(|| r3(median(&mut p50))),
            "server_cpu_per_io_ratio": r3(median(&mut cpu)),
        });
        if a.json {
            println!("{line}");
        } else {
            println!(
                "flexns / {:<15} IOPS {}  p50 {}  server CPU per I/O {}  (medians of {} interleaved rounds)",
                t.name,
                line["iops_ratio"],
                line["p50_ratio"],
                line["server_cpu_per_io_ratio"],
                pairs.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn args(rw: &str, client: &str) -> BenchArgs {
        Cli::parse_from(["t", "--rw", rw, "--client", client]).a
    }

    fn job(error: i64, writes: u64, reads: u64) -> serde_json::Value {
        serde_json::json!({"error": error, "write": {"total_ios": writes}, "read": {"total_ios": reads}})
    }

    fn run(checked: u64, failure: Option<&str>) -> Run {
        Run {
            iops: 1.0,
            mbps: 1.0,
            p50: None,
            p99: None,
            p999: None,
            secs: 1.0,
            ops: 1,
            client_cpu: None,
            servers: Vec::new(),
            checked,
            failure: failure.map(String::from),
        }
    }

    #[test]
    fn fio_verify_failures_and_missing_checks_are_not_verified() {
        let bad = "verify: bad header numberio 4524, wanted 6999 at file nbd offset 6037504, length 4096";
        let (n, e) = fio_check(&job(84, 8192, 1281), true, bad);
        assert_eq!(n, 0);
        assert!(e.unwrap().contains("numberio 4524"));
        // a write round whose verify phase never ran (its runtime was used up) proves nothing
        assert!(fio_check(&job(0, 8192, 0), true, "").1.is_some());
        assert!(fio_check(&job(0, 0, 0), false, "").1.is_some());
        assert_eq!(fio_check(&job(0, 8192, 3561), true, ""), (3561, None));
        assert_eq!(fio_check(&job(0, 0, 50_000), false, ""), (50_000, None));
    }

    #[test]
    fn a_round_that_failed_or_a_client_that_checks_nothing_is_not_verified() {
        let reads = args("randread", "fio");
        let (ok, how) = verdict(
            &reads,
            &[run(10, None), run(5, Some("fio job error 84: verify: bad magic"))],
            false,
            || true,
        );
        assert!(!ok && how.starts_with("round 2: fio job error 84"), "{how}");
        let (ok, how) = verdict(&reads, &[run(10, None)], false, || false);
        assert!(!ok && how.contains("differs"), "{how}");
        let (ok, how) = verdict(&reads, &[run(10, None), run(20, None)], false, || true);
        assert!(ok && how.contains("(30 after the ramps)"), "{how}");
        let writes = args("randwrite", "fio");
        let (ok, how) = verdict(&writes, &[run(7, None)], false, || panic!("writes compare nothing"));
        assert!(ok && how.contains("(7 blocks)"), "{how}");
        assert!(!verdict(&args("randread", "qemu-img"), &[run(0, None)], false, || true).0);
        assert!(!verdict(&reads, &[run(10, None)], true, || true).0);
    }

    #[test]
    fn read_logs_stay_in_the_volume() {
        let dir = std::env::temp_dir().join(format!("blkbench-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a = args("randread", "fio");
        a.size = 1 << 20;
        a.bs = 8192;
        read_log(&dir.join("l"), &a, 1000, 7).unwrap();
        let text = std::fs::read_to_string(dir.join("l")).unwrap();
        let offsets: Vec<u64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("nbd read "))
            .map(|l| l.split(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(offsets.len(), 1000);
        assert!(offsets.iter().all(|o| o % 8192 == 0 && *o < 1 << 20));
        assert!(offsets.iter().collect::<std::collections::HashSet<_>>().len() > 100);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
