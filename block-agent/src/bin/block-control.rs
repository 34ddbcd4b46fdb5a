//! `block-control`: see [`block_agent::daemon::run_control`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the control daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::ControlArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_control(Cli::parse().args).await?)
}
