//! `kv-server`: one partition of the kv-store (see `kv_store::server`).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "kv-server",
    version,
    about = "A kv-store partition served by the flexns stack"
)]
struct Cli {
    #[command(flatten)]
    args: kv_store::cli::ServerArgs,
}

fn main() -> std::process::ExitCode {
    // the error chain on one line, no backtrace
    if let Err(e) = run() {
        eprintln!("kv-server: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    kv_store::cli::run(Cli::parse().args)
}
