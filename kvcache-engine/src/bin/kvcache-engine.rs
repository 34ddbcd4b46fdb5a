//! `kvcache-engine`: the transfer-engine daemon (see `kvcache_engine::daemon`).

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "Mooncake-style KVCache transfer engine over flexns")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start an engine with a registered pool and serve until SIGTERM/Ctrl-C.
    Serve(kvcache_engine::daemon::ServeArgs),
}

fn main() -> std::process::ExitCode {
    // the error chain on one line, no backtrace
    if let Err(e) = run() {
        eprintln!("kvcache-engine: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Serve(a) => kvcache_engine::daemon::run(&a)?,
    }
    Ok(())
}
