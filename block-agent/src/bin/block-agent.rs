//! `block-agent`: see [`block_agent::daemon::run_agent`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the agent daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::AgentArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_agent(Cli::parse().args).await?)
}
