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
    /// Attachments served at once (docs/FLEXNSD.md, "Limits").
    max_attachments: Option<usize>,
    /// Objects (PDs, MRs, CQs, QPs together) one attachment may hold.
    max_app_objects: Option<u64>,
    /// Bytes of application memory one attachment may have mapped into the daemon.
    max_app_bytes: Option<u64>,
    /// Milliseconds a new connection may take to send its Hello.
    hello_timeout_ms: Option<u64>,
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
    if ctx_cfg.flexnsd.is_some() {
        anyhow::bail!(
            "config [context] flexnsd: the daemon runs the engine itself; it cannot attach to another flexnsd"
        );
    }
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
    let d = flexnsd::daemon::Limits::default();
    let limits = flexnsd::daemon::Limits {
        max_attachments: cfg.max_attachments.unwrap_or(d.max_attachments),
        max_app_objects: cfg.max_app_objects.unwrap_or(d.max_app_objects),
        max_app_bytes: cfg.max_app_bytes.unwrap_or(d.max_app_bytes),
        hello_timeout: cfg
            .hello_timeout_ms
            .map_or(d.hello_timeout, std::time::Duration::from_millis),
    };
    if limits.max_attachments == 0 || limits.max_app_objects == 0 || limits.max_app_bytes == 0 {
        anyhow::bail!("config: max_attachments, max_app_objects and max_app_bytes must be at least 1");
    }
    raise_nofile();
    flexnsd::daemon::Daemon::with_limits(ctx, spin, limits)
        .serve(listener)
        .context("accepting attachments")?;
    Ok(())
}

/// Raises the soft limit on open descriptors to the hard one: the attachments' memfds and
/// eventfds are held open (bounded by the limits of the config).
fn raise_nofile() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a live, initialized struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::warn!("cannot raise RLIMIT_NOFILE: {}", std::io::Error::last_os_error());
            }
        }
    }
}
