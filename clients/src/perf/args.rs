//! The options of `nsperf client` and the flag values both ends take: what the client, its
//! offload operations and the server share, in a module of its own so that none of them
//! imports another for it.

use super::reference::Wait;
use super::{Op, System, WalkMode};
use anyhow::Result;
use netstack::cli::ContextArgs;
use netstack::verbs::{ContextConfig, PollMode, RcConfig, Recovery};
use std::net::SocketAddr;

/// Client options.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// Connection manager of a running `nsperf server`; without it a server is started as a
    /// child process on 127.0.0.1 and stopped at the end.
    #[arg(long)]
    pub server: Option<SocketAddr>,
    /// udp-raw reference server address (with --server).
    #[arg(long)]
    pub udp: Option<SocketAddr>,
    /// tcp reference server address (with --server).
    #[arg(long)]
    pub tcp: Option<SocketAddr>,
    /// With --server: that server's process id, when it runs on this host (in another network
    /// namespace, say); the runs account its CPU and memory as the server's, as they do for a
    /// server they start.
    #[arg(long, requires = "server")]
    pub server_pid: Option<u32>,
    /// The system under test.
    #[arg(long, value_enum, default_value = "flexns")]
    pub system: System,
    /// The operation to run.
    #[arg(long, value_enum, default_value = "write")]
    pub op: Op,
    /// Message size.
    #[arg(long, default_value = "64KiB", value_parser = crate::bench::parse_size)]
    pub size: u64,
    /// Outstanding work requests per QP.
    #[arg(long, default_value_t = 64)]
    pub depth: u32,
    /// Queue pairs (connections) carrying traffic.
    #[arg(long, default_value_t = 1)]
    pub qps: u32,
    /// More QPs, connected to the server but carrying no traffic (a server's idle
    /// connections): what the data cores pay for QPs they have nothing to do for.
    #[arg(long, default_value_t = 0)]
    pub idle_qps: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// One JSON object per result line.
    #[arg(long)]
    pub json: bool,
    /// Serve this process's Prometheus metrics (its context's counters) on this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Loss recovery of the RC transport (`go-back-n` or `selective-repeat`).
    #[arg(long, default_value = "go-back-n", value_parser = parse_recovery)]
    pub recovery: Recovery,
    /// Path MTU in bytes.
    #[arg(long, default_value_t = 4096)]
    pub mtu: u32,
    /// Also run this reference, interleaved (A B A B ...), and print the median ratio.
    #[arg(long, value_enum)]
    pub compare: Option<System>,
    /// Runs of each system with --compare.
    #[arg(long, default_value_t = 3)]
    pub pairs: u32,
    /// Congestion control of the QPs on both ends (none, dcqcn, timely, hpcc, swift, homa).
    #[arg(long, default_value = "none")]
    pub cc: netstack::cc::CcKind,
    /// Also run flexns with this congestion control, interleaved (A B A B ...), and print the
    /// median ratio: the cost of `--cc` against, say, `none`.
    #[arg(long, conflicts_with = "compare")]
    pub compare_cc: Option<netstack::cc::CcKind>,
    /// Pace each QP to this many bytes per second (the congestion-control pacing hook).
    #[arg(long, value_parser = crate::bench::parse_size)]
    pub rate_limit: Option<u64>,
    /// Paths per QP (multipath: source ports, and address pairs with `--extra-addr`).
    #[arg(long, default_value_t = 1)]
    pub paths: usize,
    /// How a QP spreads packets over its paths: single, round-robin, weighted.
    #[arg(long, default_value = "weighted")]
    pub spray: netstack::path::SprayPolicy,
    /// Also run with this many paths (policy single), interleaved, and print the ratio.
    #[arg(long, conflicts_with_all = ["compare", "compare_cc"])]
    pub compare_paths: Option<usize>,
    /// Stop after this many bytes instead of after --duration.
    #[arg(long, value_parser = crate::bench::parse_size)]
    pub bytes: Option<u64>,
    /// SEND ping-pong over standard QPs instead of low-latency ones.
    #[arg(long)]
    pub standard_qp: bool,
    /// SEND ping-pong (`--op send --depth 1`, flexns) with every SEND signaled, the client's and
    /// the server's echoes, and each round trip waiting for its own send's completion as well
    /// as the echo, as perftest's ib_send_lat client does: an RC SEND that is signaled
    /// completes only on its ACK, so the ACK of each SEND is on the path (an unsignaled one is
    /// acknowledged later, in a coalesced ACK). The server does not wait for its echoes'
    /// completions (the client's ACK of an echo leaves before its next SEND).
    #[arg(long)]
    pub signaled: bool,
    /// batch-read: ranges per request.
    #[arg(long, default_value_t = 32)]
    pub batch: u32,
    /// list-walk: which node of the list is looked up (its hop count).
    #[arg(long, default_value_t = 8)]
    pub hops: u32,
    /// list-walk: where the walk runs.
    #[arg(long, value_enum, default_value = "offload")]
    pub mode: WalkMode,
    /// batch-read, list-walk, redn-get: do not interleave the reference run (separate READs,
    /// the other walk mode, one 64 B READ).
    #[arg(long)]
    pub no_reference: bool,
    /// Engine poll mode of this client's context (and of a server it starts).
    #[arg(long, value_enum, default_value = "adaptive")]
    pub poll_mode: PollModeArg,
    /// How this client and a server it starts wait for completions and replies, flexns and
    /// references alike: spin or block (default: spin for latency operations, block for
    /// bandwidth). The result lines say which.
    #[arg(long, value_enum)]
    pub wait: Option<Wait>,
    /// Who runs the engine's cores in this client's context (and in a server it starts):
    /// engine threads, or the application threads that post and poll (run to completion).
    /// Default: application when the run spins (latency operations), threads when it blocks
    /// (bandwidth), which is what measured faster for each on 2 cores (docs/BENCHMARKS.md).
    #[arg(long, value_enum)]
    pub drive: Option<DriveArg>,
    /// Memory region of a server this client starts.
    #[arg(long, default_value = "256MiB", value_parser = crate::bench::parse_size)]
    pub server_mr_size: u64,
    /// The stack's flags (`--data`, `--data-cores`, `--link`, ...), for this client's context
    /// and, but for `--data`, a server it starts.
    #[command(flatten)]
    pub ctx: ContextArgs,
}

/// `--drive` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriveArg {
    /// Engine threads drive the stack.
    Threads,
    /// The application's own calls drive the stack.
    Application,
}

impl DriveArg {
    /// The value as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DriveArg::Threads => "threads",
            DriveArg::Application => "application",
        }
    }
}

impl From<DriveArg> for netstack::verbs::Drive {
    fn from(d: DriveArg) -> netstack::verbs::Drive {
        match d {
            DriveArg::Threads => netstack::verbs::Drive::Threads,
            DriveArg::Application => netstack::verbs::Drive::Application,
        }
    }
}

/// `--poll-mode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PollModeArg {
    /// Data cores spin forever.
    BusyPoll,
    /// Data cores spin a while, then sleep until there is work.
    Adaptive,
    /// Data cores sleep as soon as there is no work.
    Sleep,
}

impl PollModeArg {
    /// The value as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PollModeArg::BusyPoll => "busy-poll",
            PollModeArg::Adaptive => "adaptive",
            PollModeArg::Sleep => "sleep",
        }
    }
}

impl From<PollModeArg> for PollMode {
    fn from(p: PollModeArg) -> PollMode {
        match p {
            PollModeArg::BusyPoll => PollMode::BusyPoll,
            PollModeArg::Adaptive => PollMode::Adaptive,
            PollModeArg::Sleep => PollMode::Sleep,
        }
    }
}

impl ClientArgs {
    /// Whether the operation measures latency (one request in flight).
    pub fn latency_op(&self) -> bool {
        matches!(self.op, Op::ListWalk | Op::RednGet) || (self.op == Op::Send && self.depth == 1)
    }

    /// The waiting discipline of the run's application threads.
    pub fn wait_mode(&self) -> Wait {
        self.wait
            .unwrap_or(if self.latency_op() { Wait::Spin } else { Wait::Block })
    }

    /// Who runs the engine's cores: as asked, or run to completion when the threads spin.
    pub fn drive_mode(&self) -> DriveArg {
        self.drive.unwrap_or(match self.wait_mode() {
            Wait::Spin => DriveArg::Application,
            Wait::Block => DriveArg::Threads,
        })
    }

    /// The context configuration of a flexns run: the stack's flags applied over `qp`, the
    /// run's source ports per path set and the engine settings this client decides (drive,
    /// poll mode); the error names the bad flag.
    pub fn context_config(&self, qp: RcConfig, path_ports: u8) -> Result<ContextConfig> {
        let mut cfg = ContextConfig {
            qp,
            path_ports,
            drive: self.drive_mode().into(),
            poll_mode: self.poll_mode.into(),
            ..Default::default()
        };
        self.ctx.apply(&mut cfg)?;
        Ok(cfg)
    }
}

/// Parses a recovery-mode flag value.
pub fn parse_recovery(s: &str) -> Result<Recovery, String> {
    match s {
        "go-back-n" | "gbn" => Ok(Recovery::GoBackN),
        "selective-repeat" | "sr" => Ok(Recovery::SelectiveRepeat),
        _ => Err(format!("unknown recovery {s:?}: use go-back-n or selective-repeat")),
    }
}

/// The flag value of a recovery mode ([`parse_recovery`] reads it back).
pub fn recovery_name(r: Recovery) -> &'static str {
    match r {
        Recovery::GoBackN => "go-back-n",
        Recovery::SelectiveRepeat => "selective-repeat",
    }
}
