//! `flexnsd`: the flexns stack as a daemon applications attach to (docs/FLEXNSD.md).

use anyhow::Context as _;
use clap::Parser;
use std::path::PathBuf;

/// The flexns stack as its own process: applications attach over a Unix socket and post work
/// through shared-memory rings (docs/FLEXNSD.md).
#[derive(Parser, Debug)]
#[command(name = "flexnsd", version)]
struct Args {
    /// The Unix socket applications attach to [default: /run/flexnsd.sock, or the config's].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// A TOML configuration: `socket`, `metrics`, `spin_us` and a `[context]` table (the engine
    /// context, netstack's ContextConfig).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (GET /metrics).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
}

/// The configuration file.
#[derive(serde::Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
struct Config {
    socket: Option<PathBuf>,
    metrics: Option<std::net::SocketAddr>,
    /// Microseconds an attachment's thread polls its rings after the last work before it sleeps.
    spin_us: Option<u64>,
    context: Option<toml::Table>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Args::parse()) {
        eprintln!("flexnsd: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let cfg: Config = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str(&text).map_err(|e| {
                // one line: the message and where, not toml's multi-line snippet
                let line = e.span().map_or(0, |s| text[..s.start].lines().count().max(1));
                anyhow::anyhow!("config {} line {line}: {}", p.display(), e.message().trim())
            })?
        }
        None => Config::default(),
    };
    // The daemon's own default is run to completion from the attachment threads, not
    // netstack's engine threads: on a host with few cores a third spinning thread and a hop per
    // operation cost 1.4-1.8x the SEND latency (docs/FLEXNSD.md, figures). `drive` in the
    // config's [context] table overrides it.
    let mut table = cfg.context.clone().unwrap_or_default();
    table
        .entry("drive")
        .or_insert_with(|| toml::Value::String("application".into()));
    let ctx_cfg = netstack::verbs::ContextConfig::from_toml(&toml::to_string(&table)?).context("config [context]")?;
    let socket = args
        .socket
        .or(cfg.socket)
        .unwrap_or_else(|| PathBuf::from("/run/flexnsd.sock"));
    if let Some(addr) = args.metrics.or(cfg.metrics) {
        netstack::telemetry::serve_prometheus(addr).context("--metrics")?;
    }
    let ctx = netstack::verbs::Context::open(ctx_cfg).context("opening the engine context")?;
    let listener = flexnsd::sys::listen(&socket).with_context(|| format!("--socket {}", socket.display()))?;
    tracing::info!(
        "flexnsd: engine on {}, applications attach at {}",
        ctx.local_addr(),
        socket.display()
    );
    let spin = std::time::Duration::from_micros(cfg.spin_us.unwrap_or(50));
    flexnsd::daemon::Daemon::new(ctx, spin)
        .serve(listener)
        .context("accepting attachments")?;
    Ok(())
}
