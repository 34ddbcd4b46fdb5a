//! flexns: the umbrella command. `flexns demo` runs the system on this machine with nothing to
//! start by hand.

use anyhow::Result;
use clap::{Parser, Subcommand};
use clients::demo::Outcome;
use clients::perf::{client, server, Op, System};

#[derive(Parser)]
#[command(
    name = "flexns",
    version,
    about = "flexns: a software-programmable RDMA network stack"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run everything on this machine: two netstack nodes (two processes) exchanging data.
    Demo {
        /// Seconds per demo step.
        #[arg(long, default_value_t = 2.0)]
        duration: f64,
        /// JSON result lines instead of the table.
        #[arg(long)]
        json: bool,
        /// Run only these steps (comma-separated) [default: all].
        #[arg(long, value_delimiter = ',')]
        only: Vec<DemoStep>,
        /// Leave out the LLM serving step (two vLLM engines: about 90 s on a 2-core host).
        #[arg(long)]
        no_llm: bool,
    },
    /// The headline comparisons (datapath, offloads, KV-cache, block, YCSB) against their
    /// strongest references, interleaved, into a folder: JSON lines, a Markdown table, charts.
    Bench(clients::suite::SuiteArgs),
    /// The benchmark server the demo starts as its second node.
    #[command(hide = true)]
    PerfServer(server::ServerArgs),
    /// The kv-store partition the demo's KV step starts.
    #[command(hide = true)]
    KvServer(kv_store::cli::ServerArgs),
    /// The decode engine the demo's KV-cache step starts.
    #[command(hide = true)]
    KvcacheServe(kvcache_engine::daemon::ServeArgs),
    /// The block service daemons the demo's volume step starts.
    #[command(hide = true)]
    BlkDaemon {
        #[command(subcommand)]
        cmd: clients::blk::DaemonCmd,
    },
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("flexns", run())
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::PerfServer(_) | Cmd::KvServer(_) | Cmd::KvcacheServe(_) | Cmd::BlkDaemon { .. } => {
            clients::bench::init_daemon()
        }
        _ => clients::bench::init_cli(),
    }
    match cli.cmd {
        Cmd::PerfServer(a) => server::run(a),
        Cmd::KvServer(a) => kv_store::cli::run(a),
        Cmd::KvcacheServe(a) => Ok(kvcache_engine::daemon::run(&a)?),
        Cmd::BlkDaemon { cmd } => clients::blk::run_daemon(cmd),
        Cmd::Bench(a) => {
            clients::procs::install_stop_handler("flexns bench");
            clients::suite::run(&a)
        }
        Cmd::Demo {
            duration,
            json,
            only,
            no_llm,
        } => {
            clients::procs::install_stop_handler("flexns demo");
            if !(duration.is_finite() && duration > 0.0) {
                anyhow::bail!("--duration: a positive number of seconds, not {duration}");
            }
            let steps = selected_steps(&only, no_llm)?;
            demo(duration, json, &steps)?;
            clients::procs::finish()
        }
    }
}

/// The steps to run: `--only`'s (all when it names none), each once and in the demo's own
/// order, less the LLM step under `--no-llm`. An empty set is an error: a demo that runs
/// nothing must not say that all its data verified.
fn selected_steps(only: &[DemoStep], no_llm: bool) -> Result<Vec<DemoStep>> {
    let steps: Vec<DemoStep> = <DemoStep as clap::ValueEnum>::value_variants()
        .iter()
        .copied()
        .filter(|s| only.is_empty() || only.contains(s))
        .filter(|s| !(no_llm && *s == DemoStep::Llm))
        .collect();
    if steps.is_empty() {
        anyhow::bail!(
            "--only {} with --no-llm leaves no step to run",
            only.iter()
                .map(|s| format!("{s:?}").to_lowercase())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(steps)
}

/// The demo's steps, in the order they run.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum DemoStep {
    /// The RDMA operations between two netstack nodes (nsperf runs).
    Verbs,
    /// A kv-store partition and YCSB-C gets.
    Kv,
    /// A KV-cache transfer into a decode engine.
    Kvcache,
    /// A 3-replica block volume through NBD.
    Block,
    /// The stack as a daemon (flexnsd) against the in-process engine.
    Flexnsd,
    /// Unmodified perftest on flexns's libibverbs.so.1.
    Ibverbs,
    /// A served disaggregated vLLM prefill/decode pair over flexns.
    Llm,
}

/// One step of the demo: an nsperf run.
struct Step {
    what: &'static str,
    op: Op,
    size: u64,
    depth: u32,
    compare: Option<System>,
    paths: usize,
    /// The link both nodes use (`None`: the UDP default).
    link: Option<netstack::config::LinkMode>,
}

fn demo(duration: f64, json: bool, steps: &[DemoStep]) -> Result<()> {
    let spawn = client::ServerSpawn {
        exe: std::env::current_exe()?,
        subcommand: vec!["perf-server".into()],
    };
    if !json {
        println!("flexns demo: a second netstack node starts as a child process on 127.0.0.1;");
        println!("this process connects RC queue pairs to it through the gRPC connection manager and");
        println!("moves data over RoCEv2/UDP (one step: by one copy over the shm link), verifying");
        println!("every byte end to end; then the services, the stack as a daemon (flexnsd), unmodified");
        println!("perftest on flexns's libibverbs and a served vLLM prefill/decode pair.\n");
    }
    let mut all_verified = true;
    let mut skipped = Vec::new();
    type StepFn = fn(f64, bool) -> Result<()>;
    for &step in steps {
        if clients::procs::stopping() {
            return Ok(());
        }
        let other: Option<StepFn> = match step {
            DemoStep::Verbs => {
                for st in demo_steps() {
                    if clients::procs::stopping() {
                        return Ok(());
                    }
                    all_verified &= perf_step(&st, &spawn, duration, json)?;
                }
                None
            }
            DemoStep::Kv => Some(kv_step),
            DemoStep::Kvcache => Some(kvcache_step),
            DemoStep::Block => Some(block_step),
            DemoStep::Flexnsd | DemoStep::Ibverbs | DemoStep::Llm => {
                match program_step(step, duration, json) {
                    Ok(Outcome::Skipped(why)) => skipped.push(why),
                    Ok(_) => {}
                    Err(e) => {
                        if clients::procs::stopping() {
                            return Ok(());
                        }
                        eprintln!("{} step failed: {e:#}", format!("{step:?}").to_lowercase());
                        all_verified = false;
                    }
                }
                if !json {
                    println!();
                }
                None
            }
        };
        if let Some(f) = other {
            all_verified &= f(duration, json).is_ok();
        }
    }
    if clients::procs::stopping() {
        return Ok(());
    }
    if !all_verified {
        anyhow::bail!("a demo step failed or moved data that did not verify");
    }
    if !json {
        if skipped.is_empty() {
            println!("all data verified end to end (perftest's own runs check none: see above).");
        } else {
            println!(
                "all data verified end to end (perftest's own runs check none); {} step(s) skipped, see above.",
                skipped.len()
            );
        }
    }
    Ok(())
}

/// The steps that run other programs (`clients::demo`): their heading, then their lines, or
/// one line saying why the step was skipped.
fn program_step(step: DemoStep, duration: f64, json: bool) -> Result<Outcome> {
    if !json {
        println!(
            "== {}",
            match step {
                DemoStep::Flexnsd =>
                    "flexnsd: the stack as its own process; an application attaches over a Unix socket and \
                     shared-memory rings, against the same verbs on an in-process engine; a KV-cache \
                     engine runs on it by configuration",
                DemoStep::Ibverbs =>
                    "libibverbs: unmodified perftest programs (server and client processes) on flexns's libibverbs.so.1",
                _ =>
                    "LLM serving: vLLM prefill and decode engines (tiny Llama, dummy weights, CPU), \
                     the KV cache moved by vLLM's NixlConnector over flexns",
            }
        );
    }
    let r = match step {
        DemoStep::Flexnsd => clients::demo::flexnsd_step(duration, json),
        DemoStep::Ibverbs => clients::demo::ibverbs_step(duration, json),
        _ => clients::demo::llm_step(8, json),
    };
    if let Ok(Outcome::Skipped(why)) = &r {
        if json {
            println!(
                "{}",
                serde_json::json!({"bench": format!("demo-{step:?}").to_lowercase(), "skipped": why})
            );
        } else {
            println!("skipped: {why}");
        }
    }
    r
}

/// The demo's nsperf steps, in the order they run.
fn demo_steps() -> [Step; 8] {
    let step = |what, op, size, depth, compare, paths| Step {
        what,
        op,
        size,
        depth,
        compare,
        paths,
        link: None,
    };
    [
        step(
            "RDMA WRITE 64 KiB x depth 64, against a plain UDP blaster with 4 KiB datagrams",
            Op::Write,
            64 << 10,
            64,
            Some(System::UdpRaw),
            1,
        ),
        Step {
            link: Some(netstack::config::LinkMode::Shm),
            ..step(
                "RDMA WRITE 1 MiB x depth 64 between two processes on this host over the shm link: one copy into the peer's memory, against kernel TCP",
                Op::Write,
                1 << 20,
                64,
                Some(System::Tcp),
                1,
            )
        },
        step("RDMA READ 64 KiB x depth 16", Op::Read, 64 << 10, 16, None, 1),
        step(
            "SEND 64 B ping-pong latency, against UDP ping-pong",
            Op::Send,
            64,
            1,
            Some(System::UdpRaw),
            1,
        ),
        step("FETCH_AND_ADD x depth 16", Op::Atomic, 8, 16, None, 1),
        step(
            "RDMA WRITE 64 KiB x depth 64 sprayed over 4 paths (UDP source ports, selective repeat)",
            Op::Write,
            64 << 10,
            64,
            None,
            4,
        ),
        step(
            "Offload: batched READ of 32 x 64 B per request x depth 32, against 32 separate READs",
            Op::BatchRead,
            64,
            32,
            None,
            1,
        ),
        step(
            "RedN hash get (one SEND, answered by a chain of work requests on the server), against one 64 B READ",
            Op::RednGet,
            64,
            1,
            None,
            1,
        ),
    ]
}

/// Runs one nsperf step of the demo; returns whether its flexns runs verified.
fn perf_step(st: &Step, spawn: &client::ServerSpawn, duration: f64, json: bool) -> Result<bool> {
    if !json {
        println!("== {}", st.what);
    }
    let res = client::run(&step_args(st, duration, json), spawn)?;
    let verified = res
        .iter()
        .filter(|r| r.system.starts_with("flexns"))
        .all(|r| r.verified);
    if st.link.is_some() && !json {
        println!("{}", path_line(&res));
    }
    if !json {
        println!();
    }
    Ok(verified)
}

/// The `nsperf client` options of a demo step.
fn step_args(st: &Step, duration: f64, json: bool) -> clients::perf::args::ClientArgs {
    clients::perf::args::ClientArgs {
        metrics_addr: None,
        idle_qps: 0,
        server: None,
        udp: None,
        tcp: None,
        server_pid: None,
        system: System::Flexns,
        op: st.op,
        size: st.size,
        depth: st.depth,
        qps: 1,
        duration,
        json,
        recovery: if st.paths > 1 {
            netstack::verbs::Recovery::SelectiveRepeat
        } else {
            netstack::verbs::Recovery::GoBackN
        },
        mtu: 4096,
        compare: st.compare,
        pairs: 1,
        server_mr_size: 64 << 20,
        poll_mode: clients::perf::args::PollModeArg::Adaptive,
        wait: None,
        drive: None,
        standard_qp: false,
        signaled: false,
        rate_limit: None,
        cc: netstack::cc::CcKind::None,
        compare_cc: None,
        paths: st.paths,
        spray: netstack::path::SprayPolicy::Weighted,
        compare_paths: None,
        bytes: None,
        batch: 32,
        hops: 8,
        mode: clients::perf::WalkMode::Offload,
        // one interleaved pair of the offload steps and their READ reference
        no_reference: false,
        ctx: netstack::cli::ContextArgs {
            link: st.link,
            ..Default::default()
        },
    }
}

/// Which path the flexns runs' bytes took, from their counters: one copy into the peer's
/// memory (through its mapped memory or CMA), or packets.
fn path_line(res: &[clients::bench::BenchResult]) -> String {
    let sum = |k: &str| -> u64 {
        res.iter()
            .filter(|r| r.system.starts_with("flexns"))
            .filter_map(|r| r.extra.get(k)?.as_u64())
            .sum()
    };
    let (copy, cma, tx, shm) = (
        sum("same_host_copy_bytes"),
        sum("same_host_cma_bytes"),
        sum("tx_bytes"),
        sum("shm_tx_messages"),
    );
    if copy + cma > 0 {
        format!(
            "path: {:.0} MB by one copy into the server process's memory ({:.0} MB of it by CMA); \
             {tx} B sent as packets (shm ring messages: {shm})",
            (copy + cma) as f64 / 1e6,
            cma as f64 / 1e6,
        )
    } else {
        format!("path: no same-host copy; {tx} B sent as packets (shm ring messages: {shm})")
    }
}

/// The block step: controller, three storage nodes and an agent as child processes; a
/// 3-replica volume written and read back through NBD.
fn block_step(duration: f64, json: bool) -> Result<()> {
    if !json {
        println!("== Block volume: controller, 3 storage nodes and an agent as processes; random 4 KiB");
        println!("   writes to a 3-replica volume over NBD and Solar/UDP, then every block read back");
    }
    let sp = clients::blk::Spawner {
        exe: std::env::current_exe()?,
        prefix: vec!["blk-daemon".into()],
    };
    let r = clients::blk::demo_step(&sp, (duration / 2.0).max(0.5));
    match &r {
        Ok(lines) => {
            for l in lines {
                if json {
                    l.print(true);
                } else {
                    println!(
                        "volume   QD1 4 KiB writes {:>8.0} IOPS  p50 {:>7.1} us  p99 {:>7.1} us  {} blocks checked  verified={}",
                        l.extra.get("iops").and_then(|v| v.as_f64()).unwrap_or(0.0),
                        l.p50_us.unwrap_or(0.0),
                        l.p99_us.unwrap_or(0.0),
                        l.extra.get("blocks_checked").and_then(|v| v.as_u64()).unwrap_or(0),
                        l.verified
                    );
                }
            }
            if !json {
                println!();
            }
            if lines.iter().any(|l| !l.verified) {
                anyhow::bail!("volume data did not read back");
            }
            Ok(())
        }
        Err(e) => {
            eprintln!("block step failed: {e:#}");
            anyhow::bail!("block step failed")
        }
    }
}

/// The KV step: a kv-store partition as a child process, 20 000 records loaded over RPC, then
/// YCSB-C gets over every get path (and redis-server's GET when it is installed), each checked.
fn kv_step(duration: f64, json: bool) -> Result<()> {
    let with_redis = clients::ycsb::redis::which("redis-server").is_some();
    if !json {
        println!(
            "== KV store: load 20000 records, then YCSB-C gets (zipf 0.99) over each get path{}",
            if with_redis { ", against redis-server GET" } else { "" }
        );
    }
    let mut systems = vec![clients::ycsb::System::Flexns];
    if with_redis {
        systems.push(clients::ycsb::System::Redis);
    }
    use kv_store::client::GetPath::*;
    let a = clients::ycsb::YcsbArgs {
        workload: clients::ycsb::workload::Workload::C,
        records: 20_000,
        value_size: 64,
        dist: clients::ycsb::workload::Distribution::Zipfian,
        theta: 0.99,
        system: systems,
        get_path: vec![A1, Offload, Redn, Rpc, Hybrid],
        threads: 1,
        drive: clients::perf::args::DriveArg::Application,
        depth: 8,
        batch: 8,
        duration: (duration / 2.0).max(0.3),
        ops: None,
        pairs: 1,
        servers: Vec::new(),
        shards: 1,
        etcd: None,
        redis: None,
        no_load: false,
        json,
        metrics_addr: None,
        ctx: Default::default(),
    };
    let r = clients::ycsb::run(a, &std::env::current_exe()?, &["kv-server".to_string()]);
    if let Err(e) = &r {
        eprintln!("KV step failed: {e:#}");
    }
    r
}

/// The KV-cache step: a decode engine as a child process; this process, the prefill node,
/// moves one 1000-token request's KV cache (Llama-3-8B geometry, 16-token paged blocks) into
/// scattered decode blocks with a notification, over flexns and over kernel TCP, verified.
fn kvcache_step(duration: f64, json: bool) -> Result<()> {
    #[derive(Parser)]
    struct W {
        #[command(flatten)]
        a: clients::kvbench::BenchArgs,
    }
    if !json {
        println!(
            "== KV-cache transfer: prefill → decode process, one 1000-token request (Llama-3-8B KV, \
             63 blocks of 2 MiB) per transfer with a notification, against kernel TCP"
        );
    }
    let d = format!("{}", (duration / 2.0).max(0.3));
    let mut args = vec![
        "kvcache",
        "--tokens",
        "1000",
        "--compare",
        "tcp",
        "--pairs",
        "1",
        "--duration",
        &d,
    ];
    if json {
        args.push("--json");
    }
    let w = W::parse_from(args);
    let r = clients::kvbench::run(&w.a, &std::env::current_exe()?, &["kvcache-serve".to_string()]);
    if let Err(e) = &r {
        eprintln!("KV-cache step failed: {e:#}");
    }
    if !json {
        println!();
    }
    r.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::{selected_steps, DemoStep};

    /// `--only` runs each named step once, in the demo's order, whatever order it names them
    /// in; `--no-llm` takes the LLM step out; a set left empty is an error.
    #[test]
    fn only_dedups_and_keeps_the_demo_order() {
        use DemoStep::*;
        assert_eq!(
            selected_steps(&[Llm, Flexnsd, Verbs, Flexnsd], false).unwrap(),
            [Verbs, Flexnsd, Llm]
        );
        assert_eq!(selected_steps(&[Llm, Kv, Llm], true).unwrap(), [Kv]);
        assert_eq!(selected_steps(&[], true).unwrap().len(), 6);
        assert_eq!(selected_steps(&[], false).unwrap().len(), 7);
        let e = selected_steps(&[Llm, Llm], true).unwrap_err().to_string();
        assert!(e.contains("--only llm,llm") && e.contains("--no-llm"), "{e}");
    }
}
