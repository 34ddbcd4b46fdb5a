//! The `kvcache-engine` daemon: a transfer engine with a registered KV pool (a decode node's
//! pre-allocated blocks, or any node's transfer buffer), serving until SIGTERM or Ctrl-C.
//!
//! It prints one banner line of `key=value` words (`segment=`, `rpc=`, `transport=`,
//! `pool_addr=`, `pool_len=`, `instance=`) and then one JSON line per notification received,
//! so a supervisor or a test can read where it is and what landed.

use crate::{EngineConfig, Location, MetadataConfig, TransferEngine, TransferError, TransportKind};
use std::io::Write;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Flags of `kvcache-engine serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Segment name (replaced by IP:RPC_PORT with P2PHANDSHAKE metadata).
    #[arg(long, default_value = "decode-0")]
    pub name: String,
    /// Data transport: flexns or tcp (used as given: no fallback).
    #[arg(long, default_value = "flexns")]
    pub transport: TransportKind,
    /// Metadata: P2PHANDSHAKE (peers ask this engine), embedded (this process only: useless for a
    /// daemon), or etcd://HOST:PORT.
    #[arg(long, default_value = "P2PHANDSHAKE")]
    pub metadata: String,
    /// Key prefix in etcd (tenants sharing one etcd use different prefixes).
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// Address to bind (default: the advertised one).
    #[arg(long)]
    pub bind: Option<Ipv4Addr>,
    /// Address to advertise (default: the default route's source address, never a bridge).
    #[arg(long)]
    pub advertise: Option<Ipv4Addr>,
    /// RPC port (0 = a free one).
    #[arg(long, default_value_t = 0)]
    pub rpc_port: u16,
    /// Size of the registered pool, e.g. 1GiB.
    #[arg(long, default_value = "256MiB")]
    pub pool: String,
    /// flexns data cores.
    #[arg(long, default_value_t = 1)]
    pub data_cores: usize,
    /// Paths per queue pair (spraying).
    #[arg(long, default_value_t = 1)]
    pub paths: usize,
    /// More local addresses (NICs) to stripe over.
    #[arg(long = "extra-addr")]
    pub extra_addrs: Vec<Ipv4Addr>,
    /// flexns stack configuration (TOML, netstack's ContextConfig). Without it the engine's
    /// default stack, whose link is `shm`; a file's `link` is netstack's default (`udp`)
    /// unless it says otherwise (or `--link` does).
    #[arg(long)]
    pub stack_config: Option<std::path::PathBuf>,
    /// The flexns stack's link, overriding the stack's: `shm` (same-host peers on `shm` get
    /// the one-copy path, others UDP) or `udp` (kernel UDP to every peer). Default: the
    /// stack config's, or `shm` without one.
    #[arg(long, value_parser = parse_link)]
    pub link: Option<netstack::config::LinkMode>,
    /// Run the flexns stack in the `flexnsd` listening at this Unix socket instead of in this
    /// process (the daemon's configuration then governs links and data cores).
    #[arg(long, value_name = "SOCKET")]
    pub flexnsd: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// With etcd metadata: seconds of the lease the descriptor is published under (it
    /// disappears this long after the engine dies).
    #[arg(long, default_value_t = 10)]
    pub lease_ttl: u64,
    /// Most queue pairs one caller (one IP address) of the connection manager may hold
    /// (flexns); more are refused. Engines on one host share its address.
    #[arg(long, default_value_t = 1024)]
    pub max_qps_per_caller: usize,
    /// Seconds an accepted queue pair may go without receiving a packet before it is reaped
    /// (flexns; its caller named an endpoint that never answers). QPs quiet for half of it are
    /// probed: a live idle peer's QP answers, that of a peer that left fails and is dropped.
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    pub unused_qp_timeout: Duration,
}

/// `udp` or `shm` as a link mode.
pub fn parse_link(s: &str) -> Result<netstack::config::LinkMode, String> {
    match s {
        "udp" => Ok(netstack::config::LinkMode::Udp),
        "shm" => Ok(netstack::config::LinkMode::Shm),
        o => Err(format!("{o:?} is not a link (udp, shm)")),
    }
}

/// Seconds (a decimal number, e.g. `0.5`) as a duration.
fn parse_seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("{s:?} is not a number of seconds >= 0"))
}

impl ServeArgs {
    /// The engine configuration these flags describe; errors name the flag.
    pub fn engine_config(&self) -> Result<EngineConfig, TransferError> {
        let mut c = EngineConfig::new(&self.name, self.transport);
        c.metadata = MetadataConfig::parse(&self.metadata, self.etcd_prefix.as_deref())?;
        c.bind_ip = self.bind;
        c.advertise_ip = self.advertise;
        c.rpc_port = self.rpc_port;
        c.lease_ttl = std::time::Duration::from_secs(self.lease_ttl);
        c.data_cores = self.data_cores;
        c.paths = self.paths;
        c.extra_addrs = self.extra_addrs.clone();
        c.max_qps_per_caller = self.max_qps_per_caller;
        c.unused_qp_timeout = self.unused_qp_timeout;
        if let Some(p) = &self.stack_config {
            c.stack = Some(
                netstack::verbs::ContextConfig::from_file(p)
                    .map_err(|e| TransferError::Config(format!("--stack-config {}: {e}", p.display())))?,
            );
        }
        if let Some(l) = self.link {
            c.set_link(l);
        }
        if let Some(p) = &self.flexnsd {
            c.set_flexnsd(p.clone());
        }
        c.validate()?;
        Ok(c)
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(args: &ServeArgs) -> Result<(), TransferError> {
    let pool = netstack::config::parse_size(&args.pool).map_err(|e| TransferError::Config(format!("--pool: {e}")))?;
    if pool == 0 || pool > 1 << 40 {
        return Err(TransferError::Config(format!("--pool: {pool} bytes not in 1..=1TiB")));
    }
    if let Some(addr) = args.metrics_addr {
        netstack::telemetry::serve_prometheus(addr).map_err(|e| TransferError::Config(e.to_string()))?;
    }
    let engine = TransferEngine::new(args.engine_config()?)?;
    let region = engine.allocate_memory(pool as usize, Location::Cpu(0))?;
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::Builder::new().name("kvc-signals".into()).spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Ok(rt) = rt {
            rt.block_on(async {
                let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
                }
            });
        }
        s2.store(true, Ordering::Relaxed);
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "segment={} rpc={} transport={} pool_addr={:#x} pool_len={} instance={:#x}",
        engine.segment_name(),
        engine.rpc_addr(),
        engine.transport(),
        region.addr(),
        region.len(),
        engine.local_descriptor().instance
    )?;
    out.flush()?;
    while !stop.load(Ordering::Relaxed) {
        if let Some(n) = engine.wait_notify(Duration::from_millis(100)) {
            let _ = writeln!(out, "{}", serde_json::json!({"notify": n}));
            let _ = out.flush();
        }
    }
    tracing::info!("stopping: withdrawing segment {}", engine.segment_name());
    Ok(())
}
