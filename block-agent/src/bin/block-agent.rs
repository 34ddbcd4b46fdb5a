//! `block-agent`: see [`block_agent::daemon::run_agent`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the agent daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::AgentArgs,
}

fn main() -> std::process::ExitCode {
    // the error chain on one line, no backtrace
    if let Err(e) = run() {
        eprintln!("block-agent: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

#[tokio::main]
async fn run() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_agent(Cli::parse().args).await?)
}
