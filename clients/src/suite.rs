//! `flexns bench`: the headline comparisons in one command. Each runs the project's benchmark
//! program for its area (`nsperf`, `kvcache-bench`, `blkctl bench`, `ycsb`, started from the
//! same directory as `flexns`) against its strongest reference, interleaved, with at least 3
//! pairs, and writes into one folder:
//! - `results.jsonl`: every line every program printed, tagged with its comparison;
//! - `summary.md`: a table of the ratios (median over pairs, the pairs, CPU per operation of
//!   all processes, verified) and how to read it;
//! - `speedup.png` and `cpu.png`: how many times better flexns is than each reference (bars
//!   past 1 are better), in speed and in CPU per operation.
//!
//! The `netns-*` comparisons run the servers in one network namespace and the program in
//! another, joined by a veth pair ([`crate::netns`]); without root or the tools they need they
//! are skipped, and the summary lists them with the reason.
//!
//! The `python-*` comparisons run the Python package's benchmarks (`python/bench/`, with
//! `python3`) against the real NIXL and Mooncake packages; where the package or a reference is
//! not installed (`python/bench/install-refs.sh` installs the references) they are skipped with
//! the script's reason.
//!
//! The `perftest-*` comparisons run the unmodified perftest programs over flexns's
//! `libibverbs.so.1` beside `nsperf` at the same size and depth ([`perftest`]); without
//! perftest or the library they are skipped with the reason.
//!
//! Every program already proves its own run (fresh data checked where it landed) and accounts
//! CPU per process; this command only runs them and collects what they report.

pub(crate) mod perftest;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Flags of `flexns bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct SuiteArgs {
    /// Shorter runs (about 2 minutes in all instead of about 5; ratios are noisier).
    #[arg(long)]
    pub quick: bool,
    /// Interleaved pairs per comparison (at least 3).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..=20))]
    pub pairs: u32,
    /// Folder for results.jsonl, summary.md and the PNG charts.
    #[arg(long, default_value = "flexns-bench")]
    pub out: PathBuf,
    /// Run only the comparisons whose name contains this (e.g. `kvcache`).
    #[arg(long)]
    pub only: Option<String>,
}

/// One comparison: a program and its arguments.
struct Comparison {
    name: &'static str,
    what: &'static str,
    program: &'static str,
    args: Vec<String>,
    /// Judged on p50 latency (small transfers) rather than throughput.
    latency: bool,
    /// Between two network namespaces joined by a veth pair ([`crate::netns`]): the servers
    /// run in one, the program in the other, so the bytes cross a link as between two hosts.
    netns: bool,
    /// A benchmark of the Python package: `program` is its script in `python/bench/`, run by
    /// `python3`, and skipped (with its reason) when the script's `--check` exits with 3.
    python: bool,
    /// A perftest program over flexns's libibverbs, interleaved with `program` (nsperf) run
    /// with `args`: the ratio is perftest's figure over nsperf's.
    perftest: Option<perftest::Perftest>,
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn comparisons(a: &SuiteArgs) -> Vec<Comparison> {
    let (d, blk_d, blk_size) = if a.quick {
        ("0.5", "1", "32MiB")
    } else {
        ("2", "3", "64MiB")
    };
    let p = a.pairs;
    let c = |name, what, program, args: String| Comparison {
        name,
        what,
        program,
        args: words(&args),
        latency: false,
        netns: false,
        python: false,
        perftest: None,
    };
    let py = |name, what, script, args: String| Comparison {
        python: true,
        ..c(name, what, script, args)
    };
    let (write_n, lat_n) = if a.quick { ("10000", "5000") } else { ("30000", "20000") };
    let pt = |name, what, nsperf_args: String, program, args: String, latency| Comparison {
        latency,
        perftest: Some(perftest::Perftest {
            program,
            args: words(&args),
        }),
        ..c(name, what, "nsperf", nsperf_args)
    };
    let mut v = vec![
        c(
            "datapath-write-udp",
            "RDMA WRITE 64 KiB x64 vs a sendmmsg/GRO UDP blaster (the link limit)",
            "nsperf",
            format!("client --op write --size 64KiB --depth 64 --compare udp-raw --pairs {p} --duration {d}"),
        ),
        c(
            "datapath-write-tcp",
            "RDMA WRITE 64 KiB x64 vs kernel TCP (one stream per QP, receiver-checked)",
            "nsperf",
            format!("client --op write --size 64KiB --depth 64 --compare tcp --pairs {p} --duration {d}"),
        ),
        c(
            "samehost-write-1MiB",
            "RDMA WRITE 1 MiB x64 between two processes on this host over the shm link (one copy into the peer's memory) vs kernel TCP",
            "nsperf",
            format!("client --op write --size 1MiB --depth 64 --link shm --compare tcp --pairs {p} --duration {d}"),
        ),
        Comparison {
            netns: true,
            ..c(
                "netns-write-64KiB",
                "RDMA WRITE 64 KiB x64 from one network namespace to another across a veth pair (MTU 9000), flexns forced onto the UDP link, vs the sendmmsg/GRO UDP blaster",
                "nsperf",
                format!("client --op write --size 64KiB --depth 64 --link udp --compare udp-raw --pairs {p} --duration {d}"),
            )
        },
        c(
            "datapath-send-latency",
            "SEND 64 B ping-pong vs UDP ping-pong, both spinning",
            "nsperf",
            format!("client --op send --size 64 --depth 1 --wait spin --compare udp-raw --pairs {p} --duration {d}"),
        ),
        // perftest spins on its CQs; nsperf spins too (--wait spin), the same discipline
        pt(
            "perftest-write-64KiB",
            "perftest's ib_write_bw 64 KiB, 128 outstanding, over flexns's libibverbs.so.1 vs nsperf's WRITE at the same size and depth, both spinning (ratio: perftest / nsperf)",
            format!("client --op write --size 64KiB --depth 128 --wait spin --duration {d}"),
            "ib_write_bw",
            format!("-x 0 -s 65536 -t 128 -n {write_n} --report_gbits"),
            false,
        ),
        pt(
            "perftest-send-latency",
            "perftest's ib_send_lat 64 B (t_typical) over flexns's libibverbs.so.1 vs nsperf's SEND 64 B ping-pong with every SEND signaled, as ib_send_lat's are, so that each waits for its ACK (p50; ratio: perftest / nsperf)",
            format!("client --op send --size 64 --depth 1 --signaled --duration {d}"),
            "ib_send_lat",
            format!("-x 0 -s 64 -n {lat_n}"),
            true,
        ),
        pt(
            "perftest-send-64KiB",
            "perftest's ib_send_bw 64 KiB, 128 outstanding, over flexns's libibverbs.so.1 vs nsperf's SEND at the same size and depth, both spinning (ratio: perftest / nsperf)",
            format!("client --op send --size 64KiB --depth 128 --wait spin --duration {d}"),
            "ib_send_bw",
            format!("-x 0 -s 65536 -t 128 -n {write_n} --report_gbits"),
            false,
        ),
        pt(
            "perftest-read-64KiB",
            "perftest's ib_read_bw 64 KiB, 16 outstanding (the initiator depth), over flexns's libibverbs.so.1 vs nsperf's READ at the same size and depth, both spinning (ratio: perftest / nsperf)",
            format!("client --op read --size 64KiB --depth 16 --wait spin --duration {d}"),
            "ib_read_bw",
            format!("-x 0 -s 65536 -t 16 -o 16 -n {write_n} --report_gbits"),
            false,
        ),
        pt(
            "perftest-read-latency",
            "perftest's ib_read_lat 64 B (t_typical: a READ's round trip) over flexns's libibverbs.so.1 vs nsperf's READ 64 B at depth 1, spinning (p50, post to completion; ratio: perftest / nsperf)",
            format!("client --op read --size 64 --depth 1 --wait spin --duration {d}"),
            "ib_read_lat",
            format!("-x 0 -s 64 -n {lat_n}"),
            true,
        ),
        c(
            "offload-batch-read",
            "batched-READ offload (32 x 64 B per request) vs 32 READs at the same depth",
            "nsperf",
            format!("client --op batch-read --batch 32 --size 64 --depth 32 --pairs {p} --duration {d}"),
        ),
        c(
            "offload-redn-get",
            "RedN hash get (a chain of work requests answers) vs one 64 B READ",
            "nsperf",
            format!("client --op redn-get --pairs {p} --duration {d}"),
        ),
        c(
            "kvcache-16MiB",
            "KV-cache 16 MiB transfers prefill -> decode over loopback UDP vs the pipelined tcp transport",
            "kvcache-bench",
            format!("--size 16MiB --link udp --compare tcp --pairs {p} --duration {d}"),
        ),
        c(
            "kvcache-16MiB-samehost",
            "KV-cache 16 MiB transfers prefill -> decode process on this host over the shm link (one copy into the decode pool), 2 data cores, vs the pipelined tcp transport",
            "kvcache-bench",
            format!("--size 16MiB --link shm --data-cores 2 --compare tcp --pairs {p} --duration {d}"),
        ),
        Comparison {
            netns: true,
            ..c(
                "netns-kvcache-16MiB",
                "KV-cache 16 MiB transfers prefill (one network namespace) -> decode (another, across a veth pair, MTU 9000), flexns forced onto the UDP link, vs the pipelined tcp transport",
                "kvcache-bench",
                format!("--size 16MiB --link udp --compare tcp --pairs {p} --duration {d}"),
            )
        },
        Comparison {
            latency: true,
            ..c(
                "kvcache-4KiB",
                "KV-cache 4 KiB transfers (latency) vs the pipelined tcp transport",
                "kvcache-bench",
                format!("--size 4KiB --compare tcp --pairs {p} --duration {d}"),
            )
        },
        c(
            "flexnsd",
            "the same verbs through the flexnsd daemon (shared-memory rings, memfd regions) vs the in-process engine: WRITE 1 MiB one at a time (every byte checked at the target) and SEND 64 B ping (p50), CPU of application and daemon together",
            "flexnsd-bench",
            if a.quick {
                format!("--pairs {p} --writes 100 --sends 1000")
            } else {
                format!("--pairs {p}")
            },
        ),
        py(
            "python-nixl-vs-ucx",
            "NIXL agent API READs with a notification (vLLM NixlConnector's loop: 64 x 16 KiB scattered blocks, and 16 MiB) between two processes on this host, flexns.nixl vs the real NIXL (PyPI nixl) over UCX with its default transports",
            "nixl_vs_ucx.py",
            format!("--pairs {p} --duration {d}"),
        ),
        py(
            "python-mooncake-vs-wheel",
            "Mooncake TransferEngine batch_transfer_sync_write 64 x 256 KiB between two processes on this host, flexns.TransferEngine vs the real Mooncake wheel's TCP transport",
            "mooncake_vs_wheel.py",
            format!("--pairs {p} --duration {d}"),
        ),
        c(
            "block-randread",
            "block 4 KiB randread QD32 through fio's NBD engine vs qemu-nbd (writethrough, and O_DIRECT|O_DSYNC with aio) and the plain-TCP agent",
            "blkctl",
            format!("bench --system all --rw randread --bs 4k --depth 32 --size {blk_size} --duration {blk_d} --repeat {p}"),
        ),
        c(
            "ycsb-c",
            "YCSB-C gets (offloaded, one-sided A1) vs redis-server with a pipelined client, 2 threads x depth 8",
            "ycsb",
            format!("--workload c --records 100000 --system flexns,redis --get-path offload,a1 --threads 2 --depth 8 --pairs {p} --duration {d}"),
        ),
    ];
    if !a.quick {
        v.push(c(
            "block-randwrite",
            "block 4 KiB randwrite QD32 vs the same references",
            "blkctl",
            format!("bench --system all --rw randwrite --bs 4k --depth 32 --size {blk_size} --duration {blk_d} --repeat {p}"),
        ));
    }
    if let Some(o) = &a.only {
        v.retain(|c| c.name.contains(o.as_str()));
    }
    v
}

/// One row of the summary: flexns against one reference in one comparison.
struct Row {
    comparison: String,
    reference: String,
    /// `gbps`, `mops`, `p50_us` or `iops`.
    metric: String,
    /// flexns / reference, median over pairs.
    ratio: f64,
    pairs: Vec<f64>,
    /// How many times better flexns is (higher-is-better metrics: the ratio; latency: 1 / it).
    speedup: f64,
    /// flexns's CPU per operation / the reference's (below 1: flexns is cheaper).
    cpu_ratio: Option<f64>,
    verified: bool,
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// Which path flexns's bytes took in a comparison's runs, where it is not the UDP link: `one
/// copy` (the same-host path put them into the peer's memory), `shm rings` (packets through
/// shared memory), or, for a program that does not count them, the `shm` link its runs name.
fn path(lines: &[Value]) -> Option<&'static str> {
    let runs: Vec<&Value> = lines
        .iter()
        .filter(|l| l["bench"] != "ratio" && l["system"].as_str().is_some_and(|s| s.starts_with("flexns")))
        .collect();
    let sum = |k: &str| runs.iter().filter_map(|l| l[k].as_u64()).sum::<u64>();
    if sum("same_host_copy_bytes") + sum("same_host_cma_bytes") > 0 {
        Some("one copy")
    } else if sum("shm_tx_messages") > 0 {
        Some("shm rings")
    } else if runs.iter().any(|l| l["link"] == "shm") {
        Some("shm link")
    } else {
        None
    }
}

/// The path of a comparison across namespaces whose flexns runs sent their bytes as packets
/// (no one-copy bytes, no ring messages, transmitted bytes counted): UDP across the veth.
fn netns_path(lines: &[Value]) -> Option<&'static str> {
    let runs: Vec<&Value> = lines
        .iter()
        .filter(|l| l["bench"] != "ratio" && l["system"].as_str().is_some_and(|s| s.starts_with("flexns")))
        .collect();
    let sum = |k: &str| runs.iter().filter_map(|l| l[k].as_u64()).sum::<u64>();
    (sum("tx_bytes") > 0 && sum("same_host_copy_bytes") + sum("same_host_cma_bytes") + sum("shm_tx_messages") == 0)
        .then_some("UDP across the veth")
}

/// The rows of one comparison's output lines.
fn rows(c: &Comparison, lines: &[Value]) -> Vec<Row> {
    let p = path(lines).or_else(|| if c.netns { netns_path(lines) } else { None });
    let named = p.map(|p| format!("{} (path: {p})", c.name));
    let name = named.as_deref().unwrap_or(c.name);
    let runs_verified = lines
        .iter()
        .filter(|l| l.get("verified").is_some() && !l["bench"].as_str().unwrap_or("").contains("ratio"))
        .all(|l| l["verified"] == true);
    let mut out = Vec::new();
    for l in lines {
        let bench = l["bench"].as_str().unwrap_or("");
        let pairs = |k: &str| -> Vec<f64> {
            l[k].as_array()
                .map(|a| a.iter().filter_map(f).collect())
                .unwrap_or_default()
        };
        let row = if bench == "ratio" {
            let (metric, ratio) = match (c.latency, f(&l["p50_ratio"])) {
                (true, Some(r)) => ("p50_us".to_string(), Some(r)),
                _ => (l["metric"].as_str().unwrap_or("").to_string(), f(&l["ratio"])),
            };
            let Some(ratio) = ratio else { continue };
            // throughput: CPU per byte (the references count their own units of work)
            let cpu = crate::perf::client::cpu_ratio(l, &metric).map(|(r, _)| r);
            Row {
                // one program, several cases (the NIXL benchmark's blocks and 16MiB)
                comparison: match l["case"].as_str() {
                    Some(case) => format!("{name} {case}"),
                    None => name.into(),
                },
                reference: l["reference"].as_str().unwrap_or("").into(),
                speedup: if metric == "p50_us" { 1.0 / ratio } else { ratio },
                metric,
                ratio,
                // kvcache's per-pair list is of throughput ratios
                pairs: if c.latency { Vec::new() } else { pairs("ratios") },
                cpu_ratio: cpu,
                verified: runs_verified && l.get("verified").is_none_or(|v| v == true),
            }
        } else if bench.ends_with("_ratio") && l.get("iops_ratio").is_some() {
            let Some(ratio) = f(&l["iops_ratio"]) else { continue };
            Row {
                comparison: name.into(),
                reference: l["reference"].as_str().unwrap_or("").into(),
                metric: "iops".into(),
                ratio,
                pairs: pairs("iops_ratios"),
                speedup: ratio,
                cpu_ratio: f(&l["server_cpu_per_io_ratio"]),
                verified: runs_verified,
            }
        } else if bench.ends_with("-ratio") && l["what"].as_str().is_some_and(|w| w.starts_with("throughput")) {
            let Some(ratio) = f(&l["ratio"]) else { continue };
            let what = l["what"].as_str().unwrap_or("");
            Row {
                comparison: format!("{name} {}", what.split_whitespace().nth(1).unwrap_or("")),
                reference: what.rsplit(" / ").next().unwrap_or("").into(),
                metric: "mops".into(),
                ratio,
                pairs: pairs("pairs"),
                speedup: ratio,
                cpu_ratio: f(&l["cpu_us_per_op_ratio"]),
                verified: runs_verified && l.get("verified").is_none_or(|v| v == true),
            }
        } else {
            continue;
        };
        out.push(row);
    }
    out
}

/// The directory of this executable (where the other programs of the build are).
fn sibling(program: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.with_file_name(program);
    if !p.is_file() {
        bail!(
            "{} not found beside {}: build every program first (`cargo build --release`)",
            p.display(),
            exe.display()
        );
    }
    Ok(p)
}

/// The interpreter of the Python benchmarks: `$PYTHON`, else `python3`.
fn python() -> std::ffi::OsString {
    std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into())
}

/// A script of `python/bench/`: under the current directory (a checkout), else in the
/// checkout this program was built from.
fn python_bench(script: &str) -> Result<PathBuf> {
    let rel = Path::new("python/bench").join(script);
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(&rel);
    [rel.clone(), built]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| format!("{} not found (run flexns bench from the checkout)", rel.display()))
}

/// Why a Python comparison cannot run here: the script's own reason when its `--check` exits
/// with 3 (the package or the reference is not installed), or why the check could not run;
/// None when it can. `cmd` is the script's command line, without `--check`.
fn python_unavailable(cmd: &mut std::process::Command) -> Option<String> {
    let o = match cmd.arg("--check").output() {
        Ok(o) => o,
        Err(e) => return Some(format!("{} did not start: {e}", python().to_string_lossy())),
    };
    if o.status.code() == Some(3) {
        let err = String::from_utf8_lossy(&o.stderr);
        return Some(err.lines().last().unwrap_or("the script's check failed").to_string());
    }
    None
}

/// The value of flag `name` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// A comparison across namespaces: the pair, the servers running in namespace B, and what the
/// program in namespace A is told to reach them (addresses, and the servers' process ids so
/// that its runs account their CPU as they would for servers it started).
struct Across {
    // dropped first: the servers stop, then the namespaces' holders
    servers: Vec<crate::bench::ChildServer>,
    pair: crate::netns::Pair,
    client_args: Vec<String>,
}

impl Across {
    fn start(c: &Comparison, exe: &Path) -> Result<Across> {
        use crate::netns::{A_IP, B_IP};
        let pair = crate::netns::Pair::create()?;
        let link = flag(&c.args, "--link");
        let cores = flag(&c.args, "--data-cores").unwrap_or("1");
        let pid =
            |s: &crate::bench::ChildServer| -> Result<String> { Ok(s.pid().context("the server exited")?.to_string()) };
        let field = |s: &crate::bench::ChildServer, k: &str| -> Result<String> {
            s.field(k)
                .with_context(|| format!("server banner lacks {k}: {}", s.banner))
        };
        let mut servers = Vec::new();
        let mut client_args = Vec::new();
        match c.program {
            "nsperf" => {
                let mut args = words(&format!(
                    "server --listen {B_IP}:0 --data {B_IP}:0 --mr-size 256MiB --recovery go-back-n \
                     --data-cores {cores} --drive threads --poll-mode adaptive --wait block"
                ));
                if let Some(l) = link {
                    args.extend(["--link".into(), l.into()]);
                }
                let s = pair.server(exe, &args)?;
                client_args = vec![
                    "--server".into(),
                    field(&s, "cm")?,
                    "--udp".into(),
                    field(&s, "udp")?,
                    "--tcp".into(),
                    field(&s, "tcp")?,
                    "--server-pid".into(),
                    pid(&s)?,
                    "--data".into(),
                    format!("{A_IP}:0"),
                ];
                servers.push(s);
            }
            "kvcache-bench" => {
                let size = crate::bench::parse_size(flag(&c.args, "--size").unwrap_or("16MiB"))
                    .map_err(|e| anyhow::anyhow!("--size: {e}"))?;
                let pool = size.max(crate::kvbench::MIN_POOL);
                let system = flag(&c.args, "--system").unwrap_or("flexns");
                let reference = flag(&c.args, "--compare").context("a kvcache comparison needs --compare")?;
                for (i, transport) in [system, reference].into_iter().enumerate() {
                    let mut args = words(&format!(
                        "serve --transport {transport} --metadata P2PHANDSHAKE --advertise {B_IP} \
                         --pool {pool} --data-cores {cores}"
                    ));
                    if let (Some(l), "flexns") = (link, transport) {
                        args.extend(["--link".into(), l.into()]);
                    }
                    let s = pair.server(exe, &args)?;
                    let (srv, srv_pid) = if i == 0 {
                        ("--server", "--server-pid")
                    } else {
                        ("--compare-server", "--compare-server-pid")
                    };
                    client_args.extend([srv.into(), field(&s, "segment")?, srv_pid.into(), pid(&s)?]);
                    servers.push(s);
                }
                client_args.extend(["--bind".into(), A_IP.into()]);
            }
            p => bail!("{}: no way to run {p} across namespaces", c.name),
        }
        Ok(Across {
            servers,
            pair,
            client_args,
        })
    }
}

fn run_one(c: &Comparison, out: &mut std::fs::File) -> Result<Vec<Value>> {
    use std::io::Write;
    // a Python comparison's program is its script
    let exe = if c.python {
        python_bench(c.program)?
    } else {
        sibling(c.program)?
    };
    let mut across = if c.netns { Some(Across::start(c, &exe)?) } else { None };
    let mut cmd = match &across {
        Some(x) => {
            let mut cmd = x.pair.command(crate::netns::Side::A, &exe);
            cmd.args(&c.args).args(&x.client_args);
            cmd
        }
        None if c.python => {
            let mut cmd = crate::procs::command(python());
            cmd.arg(&exe).args(&c.args);
            cmd
        }
        None => {
            let mut cmd = crate::procs::command(&exe);
            cmd.args(&c.args);
            cmd
        }
    };
    let before = across
        .as_ref()
        .map(|x| x.pair.counters(crate::netns::Side::A))
        .transpose()?;
    let o = crate::procs::output(cmd.arg("--json").env("RUST_BACKTRACE", "0"), libc::SIGINT)
        .with_context(|| format!("running {}", exe.display()))?;
    let text = String::from_utf8_lossy(&o.stdout);
    let mut lines = Vec::new();
    if let (Some(x), Some(b)) = (&mut across, before) {
        for s in &mut x.servers {
            if !s.is_running() {
                bail!("the server in namespace B ({}) exited during the run", s.banner);
            }
        }
        // what crossed the link during the program's runs (flexns's and the reference's)
        let a = x.pair.counters(crate::netns::Side::A)?;
        let v = serde_json::json!({
            "bench": "netns_veth",
            "comparison": c.name,
            "veth_mtu": crate::netns::MTU,
            "a_to_b_bytes": a.tx_bytes - b.tx_bytes,
            "b_to_a_bytes": a.rx_bytes - b.rx_bytes,
            "a_to_b_packets": a.tx_packets - b.tx_packets,
            "b_to_a_packets": a.rx_packets - b.rx_packets,
        });
        writeln!(out, "{v}")?;
        lines.push(v);
    }
    for l in text.lines() {
        let Ok(mut v) = serde_json::from_str::<Value>(l) else {
            continue;
        };
        v["comparison"] = c.name.into();
        writeln!(out, "{v}")?;
        lines.push(v);
    }
    if !o.status.success() && !crate::procs::stopping() {
        bail!(
            "{} {}: {}",
            c.program,
            c.args.join(" "),
            String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("failed")
        );
    }
    Ok(lines)
}

/// Runs the suite; writes the folder and prints the summary table.
pub fn run(a: &SuiteArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let jsonl = a.out.join("results.jsonl");
    let mut out = std::fs::File::create(&jsonl).with_context(|| format!("creating {}", jsonl.display()))?;
    let list = comparisons(a);
    if list.is_empty() {
        bail!("--only {:?} matches no comparison", a.only);
    }
    let start = Instant::now();
    let mut all = Vec::new();
    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    let mut links = Vec::new();
    let progress = crate::progress::Progress::new("flexns bench", list.len() as u64);
    for (i, c) in list.iter().enumerate() {
        if crate::procs::stopping() {
            break;
        }
        progress.println(format!(
            "[{}/{}] {} ({:.0} s so far): {}",
            i + 1,
            list.len(),
            c.name,
            start.elapsed().as_secs_f64(),
            c.what
        ));
        progress.start(c.name);
        let unavailable = if c.python {
            python_bench(c.program).map_or_else(
                |e| Some(format!("{e:#}")),
                |script| python_unavailable(crate::procs::command(python()).arg(script)),
            )
        } else if let Some(p) = &c.perftest {
            perftest::unavailable(p)
        } else {
            c.netns.then(crate::netns::unavailable).flatten()
        };
        if let Some(why) = unavailable {
            progress.println(format!("  skipped: {why}"));
            skipped.push(format!("{}: {why}", c.name));
            progress.finished_one();
            continue;
        }
        let ran = match &c.perftest {
            Some(p) => perftest::run(c, p, a.pairs, &mut out),
            None => run_one(c, &mut out),
        };
        match ran {
            Ok(lines) => {
                links.extend(lines.iter().filter(|l| l["bench"] == "netns_veth").map(|l| {
                    format!(
                        "{}: {:.3} GB from namespace A to B, {:.3} GB back, over the veth",
                        c.name,
                        l["a_to_b_bytes"].as_f64().unwrap_or(0.0) / 1e9,
                        l["b_to_a_bytes"].as_f64().unwrap_or(0.0) / 1e9
                    )
                }));
                all.extend(rows(c, &lines));
            }
            Err(e) => {
                progress.println(format!("  {e:#}"));
                failed.push(format!("{}: {e:#}", c.name));
            }
        }
        progress.finished_one();
    }
    drop(progress);
    let ends = Ends {
        failed: &failed,
        skipped: &skipped,
        links: &links,
    };
    let md = summary(a, &list, &all, &ends, start.elapsed().as_secs_f64());
    std::fs::write(a.out.join("summary.md"), &md)?;
    print!("{md}");
    let label = |r: &Row| format!("{} / {}", r.comparison, r.reference);
    let speed: Vec<(String, f64)> = all.iter().map(|r| (label(r), r.speedup)).collect();
    let cpu: Vec<(String, f64)> = all
        .iter()
        .filter_map(|r| Some((label(r), 1.0 / r.cpu_ratio?)))
        .collect();
    let charts = [
        (
            "speedup.png",
            "flexns speed against each reference (past 1: better)",
            "times the reference",
            speed,
        ),
        (
            "cpu.png",
            "CPU per operation: reference / flexns (past 1: flexns is cheaper)",
            "times cheaper",
            cpu,
        ),
    ];
    for (file, title, x, rows) in charts {
        if let Err(e) = crate::plot::bars(&a.out.join(file), title, x, &rows, 1.0) {
            eprintln!("no chart {file}: {e:#}");
        }
    }
    eprintln!(
        "wrote {} (results.jsonl, summary.md, speedup.png, cpu.png) in {:.0} s",
        a.out.display(),
        start.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        bail!("{} comparisons failed: {}", failed.len(), failed.join("; "));
    }
    crate::procs::finish()
}

/// What the summary lists after its table: comparisons that failed, that were skipped (and
/// why), and what crossed the veth in the comparisons across namespaces.
struct Ends<'a> {
    failed: &'a [String],
    skipped: &'a [String],
    links: &'a [String],
}

fn summary(a: &SuiteArgs, list: &[Comparison], rows: &[Row], ends: &Ends, secs: f64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# flexns bench{}\n\n{} comparisons, {} interleaved pairs each, {secs:.0} s on this machine ({} cores).\n",
        if a.quick { " --quick" } else { "" },
        list.len(),
        a.pairs,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = writeln!(
        s,
        "| comparison | against | metric | flexns / reference (median) | pairs | speed-up | CPU per op (per byte for gbps), flexns / reference | verified |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {} | {:.2}x | {} | {} |",
            r.comparison,
            r.reference,
            r.metric,
            r.ratio,
            r.pairs.iter().map(|p| format!("{p:.2}")).collect::<Vec<_>>().join(" "),
            r.speedup,
            r.cpu_ratio.map_or("-".into(), |c| format!("{c:.2}")),
            if r.verified { "yes" } else { "NO" }
        );
    }
    let _ = writeln!(s, "\nWhat each comparison runs:\n");
    for c in list {
        let _ = writeln!(s, "- `{}`: {} (`{} {}`)", c.name, c.what, c.program, c.args.join(" "));
    }
    for (title, items) in [
        ("Across namespaces (the veth's counters)", ends.links),
        ("Skipped", ends.skipped),
        ("Failed", ends.failed),
    ] {
        if !items.is_empty() {
            let _ = writeln!(s, "\n{title}:\n");
            for f in items {
                let _ = writeln!(s, "- {f}");
            }
        }
    }
    let _ = writeln!(
        s,
        "\nHow to read it: each ratio is flexns's figure over the reference's, both measured in the \
         same run, alternating (A B A B ...), and the median over the pairs is shown with every \
         pair's own ratio (their spread is the noise of this machine). For throughput (gbps, mops, \
         iops) above 1 is better; for latency (p50_us) below 1 is better; the speed-up column turns \
         both into 'times better'. CPU per op is the CPU time of every process of the run (client \
         and servers, from /proc) per operation, flexns's over the reference's: below 1 means \
         flexns does the same work with less CPU, the figure that decides on a shared machine. \
         verified says every run checked, where the data landed, bytes that run wrote. \
         results.jsonl holds every line the programs printed (per-run figures, per-process CPU \
         and memory); docs/BENCHMARKS.md describes the fields."
    );
    s
}

/// The folder's files, for a test or a caller.
pub fn outputs(dir: &Path) -> [PathBuf; 4] {
    ["results.jsonl", "summary.md", "speedup.png", "cpu.png"].map(|f| dir.join(f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn comparison(name: &'static str) -> Comparison {
        Comparison {
            name,
            what: "",
            program: "nsperf",
            args: Vec::new(),
            latency: false,
            netns: false,
            python: false,
            perftest: None,
        }
    }

    fn ratio() -> Value {
        json!({"bench": "ratio", "metric": "gbps", "system": "flexns", "reference": "tcp", "ratio": 3.0, "ratios": [3.0]})
    }

    #[test]
    fn same_host_rows_name_the_path_their_bytes_took() {
        let run = |sys: &str, copy: u64, shm: u64| json!({"bench": "write_bw", "system": sys, "verified": true, "same_host_copy_bytes": copy, "shm_tx_messages": shm});
        let cases = [
            // one copy into the peer's memory (a few control messages through the rings too)
            (vec![run("flexns", 1 << 30, 1), run("tcp", 0, 0)], "x (path: one copy)"),
            // --no-same-host-copy: packets through the rings
            (vec![run("flexns", 0, 6000), run("tcp", 0, 0)], "x (path: shm rings)"),
            // kvcache-bench: no counters, the link its runs name
            (
                vec![json!({"bench": "kvcache_write", "system": "flexns", "verified": true, "link": "shm"})],
                "x (path: shm link)",
            ),
            // the UDP link: the name alone, whatever the reference's line holds
            (vec![run("flexns", 0, 0), run("tcp", 5, 5)], "x"),
        ];
        for (mut lines, want) in cases {
            lines.push(ratio());
            let r = rows(&comparison("x"), &lines);
            assert_eq!(r.len(), 1, "{lines:?}");
            assert_eq!(r[0].comparison, want, "{lines:?}");
            assert!(r[0].verified);
        }
    }

    #[test]
    fn the_same_host_comparisons_run_the_shm_link_against_tcp() {
        let a = SuiteArgs {
            quick: true,
            pairs: 3,
            out: PathBuf::new(),
            only: Some("samehost".into()),
        };
        let v = comparisons(&a);
        let names: Vec<&str> = v.iter().map(|c| c.name).collect();
        assert_eq!(names, ["samehost-write-1MiB", "kvcache-16MiB-samehost"]);
        for c in &v {
            let args = c.args.join(" ");
            assert!(args.contains("--link shm") && args.contains("--compare tcp"), "{args}");
        }
    }

    #[test]
    fn the_netns_comparisons_force_the_udp_link_and_name_the_veth_only_for_packets() {
        let a = SuiteArgs {
            quick: true,
            pairs: 3,
            out: PathBuf::new(),
            only: Some("netns".into()),
        };
        let v = comparisons(&a);
        let names: Vec<&str> = v.iter().map(|c| c.name).collect();
        assert_eq!(names, ["netns-write-64KiB", "netns-kvcache-16MiB"]);
        for c in &v {
            // over shm, peers in two namespaces of one host still meet by one copy
            assert!(c.netns && flag(&c.args, "--link") == Some("udp"), "{:?}", c.args);
        }
        assert_eq!(flag(&v[0].args, "--compare"), Some("udp-raw"));
        assert_eq!(flag(&v[1].args, "--compare"), Some("tcp"));
        let run = |copy: u64, tx: u64| json!({"bench": "write_bw", "system": "flexns", "verified": true, "same_host_copy_bytes": copy, "tx_bytes": tx});
        let mut c = comparison("n");
        c.netns = true;
        for (line, want) in [
            (run(0, 1 << 30), "n (path: UDP across the veth)"),
            (run(1 << 30, 72), "n (path: one copy)"),
            (run(0, 0), "n"),
        ] {
            let r = rows(&c, &[line.clone(), ratio()]);
            assert_eq!(r[0].comparison, want, "{line}");
        }
        // the same lines of a comparison on one namespace name no veth
        assert_eq!(rows(&comparison("n"), &[run(0, 1 << 30), ratio()])[0].comparison, "n");
    }

    #[test]
    fn the_perftest_comparisons_pair_perftest_with_nsperf_at_the_same_size_and_depth() {
        let a = SuiteArgs {
            quick: false,
            pairs: 3,
            out: PathBuf::new(),
            only: Some("perftest".into()),
        };
        let v = comparisons(&a);
        let names: Vec<&str> = v.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "perftest-write-64KiB",
                "perftest-send-latency",
                "perftest-send-64KiB",
                "perftest-read-64KiB",
                "perftest-read-latency"
            ]
        );
        let p: Vec<&perftest::Perftest> = v.iter().map(|c| c.perftest.as_ref().unwrap()).collect();
        let programs: Vec<&str> = p.iter().map(|p| p.program).collect();
        assert_eq!(
            programs,
            ["ib_write_bw", "ib_send_lat", "ib_send_bw", "ib_read_bw", "ib_read_lat"]
        );
        // every one on both sides: the operation, the size, the depth in flight, and both spin
        // (perftest always does)
        for (c, p) in v.iter().zip(&p) {
            let op = match p.program {
                "ib_write_bw" => "write",
                "ib_send_lat" | "ib_send_bw" => "send",
                _ => "read",
            };
            assert_eq!(flag(&c.args, "--op"), Some(op), "{}", c.name);
            let size = if c.latency { ("64", "64") } else { ("64KiB", "65536") };
            assert_eq!(
                (flag(&c.args, "--size"), flag(&p.args, "-s")),
                (Some(size.0), Some(size.1)),
                "{}",
                c.name
            );
            if c.latency {
                assert_eq!(flag(&c.args, "--depth"), Some("1"), "{}", c.name);
            } else {
                assert_eq!(flag(&c.args, "--depth"), flag(&p.args, "-t"), "{}", c.name);
            }
            if p.program == "ib_read_bw" {
                assert_eq!(flag(&p.args, "-o"), flag(&p.args, "-t"), "reads in flight: {}", c.name);
            }
            let spins = c.args.iter().any(|w| w == "spin") || flag(&c.args, "--depth") == Some("1");
            assert!(spins, "{}: nsperf must spin as perftest does", c.name);
        }
        assert_eq!(flag(&p[0].args, "-t"), Some("128"));
        // ib_send_lat signals every SEND and waits for it: so does its reference
        assert!(v[1].args.iter().any(|w| w == "--signaled"), "{:?}", v[1].args);
        assert!(!v[0].latency && v[1].latency);
        // perftest's tables: BW average of the size's row, t_typical of a latency row
        let bw = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n 65536      30000            0.00               8.92   \t\t   0.017014\n";
        assert_eq!(perftest::figure(bw, 65536.0, false).unwrap(), 8.92);
        assert!(perftest::figure(bw, 64.0, false).is_err());
        let lat = " 64      5000          9.43           12170.77      10.47    \t       188.18\n";
        assert_eq!(perftest::figure(lat, 64.0, true).unwrap(), 10.47);
        let inf = " 64      2000          inf            inf          inf      \t       inf\n";
        assert!(perftest::figure(inf, 64.0, true).is_err());
        // the ratio line makes one row against nsperf; latency is judged on its p50 ratio
        let ratio = json!({"bench": "ratio", "metric": "p50_us", "system": "perftest-flexns", "reference": "nsperf", "ratio": 0.85, "p50_ratio": 0.85, "ratios": [0.8, 0.85, 0.9]});
        let r = rows(&v[1], &[ratio]);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].comparison.as_str(), r[0].reference.as_str(), r[0].metric.as_str()),
            ("perftest-send-latency", "nsperf", "p50_us")
        );
        assert!((r[0].speedup - 1.0 / 0.85).abs() < 1e-9);
    }

    #[test]
    fn the_python_comparisons_run_their_scripts_and_name_each_case() {
        let a = SuiteArgs {
            quick: true,
            pairs: 4,
            out: PathBuf::new(),
            only: Some("python".into()),
        };
        let v = comparisons(&a);
        let names: Vec<&str> = v.iter().map(|c| c.name).collect();
        assert_eq!(names, ["python-nixl-vs-ucx", "python-mooncake-vs-wheel"]);
        for c in &v {
            assert!(c.python && !c.netns, "{}", c.name);
            assert!(python_bench(c.program).is_ok(), "{} has no script", c.program);
            assert_eq!(flag(&c.args, "--pairs"), Some("4"));
        }
        // the NIXL benchmark prints one ratio line per case: one row each, named by its case
        let run = |case: &str| json!({"bench": "nixl_read", "system": "flexns", "case": case, "verified": true, "same_host_cma_bytes": 1 << 20});
        let ratio = |case: &str| json!({"bench": "ratio", "metric": "gbps", "system": "flexns", "reference": "nixl-ucx", "case": case, "ratio": 1.6, "ratios": [1.6, 1.5, 1.7], "cpu_per_byte_ratio": 0.5, "verified": true});
        let lines = [run("blocks"), ratio("blocks"), run("16MiB"), ratio("16MiB")];
        let r = rows(&v[0], &lines);
        let got: Vec<(&str, &str, Option<f64>)> = r
            .iter()
            .map(|r| (r.comparison.as_str(), r.reference.as_str(), r.cpu_ratio))
            .collect();
        assert_eq!(
            got,
            [
                ("python-nixl-vs-ucx (path: one copy) blocks", "nixl-ucx", Some(0.5)),
                ("python-nixl-vs-ucx (path: one copy) 16MiB", "nixl-ucx", Some(0.5)),
            ]
        );
    }

    #[test]
    fn a_python_comparison_whose_reference_does_not_import_is_skipped_with_the_reason() {
        let numpy = std::process::Command::new(python())
            .args(["-c", "import numpy"])
            .output();
        if !numpy.is_ok_and(|o| o.status.success()) {
            return test_support::skip(
                "a_python_comparison_whose_reference_does_not_import_is_skipped_with_the_reason",
                test_support::Missing::Tool,
                "python3 with NumPy is not installed (scripts/install-test-deps.sh)",
            );
        }
        // packages named as the references, first on the path, whose import fails as a
        // broken or absent wheel's does
        let dir = std::env::temp_dir().join(format!("flexns-suite-refs-{}", std::process::id()));
        for pkg in ["nixl", "mooncake"] {
            std::fs::create_dir_all(dir.join(pkg)).unwrap();
            std::fs::write(
                dir.join(pkg).join("__init__.py"),
                format!("raise ImportError('{pkg} shadowed by the suite test')\n"),
            )
            .unwrap();
        }
        for (script, reference) in [("nixl_vs_ucx.py", "nixl"), ("mooncake_vs_wheel.py", "mooncake")] {
            let mut cmd = std::process::Command::new(python());
            cmd.arg(python_bench(script).unwrap()).env("PYTHONPATH", &dir);
            let why = python_unavailable(&mut cmd).unwrap_or_else(|| panic!("{script} did not say why it cannot run"));
            // the package itself may be what is missing on a machine that has not built it
            let flexns_missing = why.contains("scripts/python.sh");
            assert!(
                flexns_missing || why.contains(&format!("install-refs.sh {reference}")),
                "{script}: {why}"
            );
            assert!(
                flexns_missing || why.contains("shadowed by the suite test"),
                "{script}: {why}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
