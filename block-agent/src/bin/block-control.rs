//! `block-control`: see [`block_agent::daemon::run_control`].

use clap::Parser;

#[derive(Parser)]
#[command(about = "flexns block service: the control daemon")]
struct Cli {
    #[command(flatten)]
    args: block_agent::daemon::ControlArgs,
}

fn main() -> std::process::ExitCode {
    // the error chain on one line, no backtrace
    if let Err(e) = run() {
        eprintln!("block-control: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

#[tokio::main]
async fn run() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    Ok(block_agent::daemon::run_control(Cli::parse().args).await?)
}
