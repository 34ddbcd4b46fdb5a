//! `ycsb`: YCSB core workloads against kv-store's get paths and redis-server (see
//! `clients::ycsb`). With no server address it starts its own kv-server processes and
//! redis-server.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ycsb",
    version,
    about = "YCSB core workloads against flexns kv-store (every get path) and redis-server",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    args: clients::ycsb::YcsbArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// A kv-server partition (what `ycsb` starts for itself).
    #[command(hide = true)]
    KvServer(kv_store::cli::ServerArgs),
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("ycsb", run())
}

fn run() -> anyhow::Result<()> {
    clients::bench::init_cli();
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::KvServer(a)) => kv_store::cli::run(a),
        None => {
            clients::procs::install_stop_handler("ycsb");
            clients::ycsb::run(cli.args, &std::env::current_exe()?, &["kv-server".to_string()])
        }
    }
}
