//! `block-server`: see [`block_agent::daemon::run_node`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the server daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::NodeArgs,
}

fn main() -> std::process::ExitCode {
    // the error chain on one line, no backtrace
    if let Err(e) = run() {
        eprintln!("block-server: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

#[tokio::main]
async fn run() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_node(Cli::parse().args).await?)
}
