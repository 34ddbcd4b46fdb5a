//! kvcache-bench: prefill→decode KVCache transfer benchmark (see `clients::kvbench`).
//!
//! `kvcache-bench --system flexns --size 16MiB --compare tcp --json` starts a decode engine per
//! system as a child process, writes to it and verifies; `--sweep` covers 64 KiB … 256 MiB.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvcache-bench", version, about = "prefill→decode KVCache transfer benchmark")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    bench: clients::kvbench::BenchArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// A decode engine with a registered pool (what the benchmark starts as its child).
    #[command(hide = true)]
    Serve(kvcache_engine::daemon::ServeArgs),
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("kvcache-bench", run())
}

fn run() -> anyhow::Result<()> {
    clients::bench::init_cli();
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Serve(a)) => kvcache_engine::daemon::run(&a)?,
        None => {
            clients::procs::install_stop_handler("kvcache-bench");
            clients::kvbench::run(&cli.bench, &std::env::current_exe()?, &["serve".to_string()])?;
            clients::procs::finish()?;
        }
    }
    Ok(())
}
