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
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    block_agent::daemon::run_agent(cli.args).await?;
    Ok(())
}
