//! `block-server`: see [`block_agent::daemon::run_node`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the server daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::NodeArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_node(Cli::parse().args).await?)
}
