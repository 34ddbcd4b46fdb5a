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

fn run() -> anyhow::Result<()> {
    block_agent::daemon::init_logging();
    let args = Cli::parse().args;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    Ok(rt.block_on(block_agent::daemon::run_agent(args))?)
}
