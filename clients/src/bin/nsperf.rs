//! nsperf: verbs micro-benchmarks (like perftest's ib_write_bw / ib_read_bw / ib_send_lat).
//!
//! `nsperf server` serves; `nsperf client --op write --size 64KiB --depth 64 --json` measures
//! (starting its own server when no `--server` is given). `--system udp-raw|tcp` runs the
//! references, `--compare udp-raw` interleaves one with flexns and prints the median ratio.

use clap::{Parser, Subcommand};
use clients::perf::{args, client, server};

#[derive(Parser)]
#[command(name = "nsperf", version, about = "flexns verbs micro-benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve benchmark clients (flexns CM + data path, udp-raw and tcp references).
    Server(server::ServerArgs),
    /// Run a benchmark against a server (started as a child when --server is not given).
    Client(args::ClientArgs),
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("nsperf", run())
}

fn run() -> anyhow::Result<()> {
    clients::bench::init_cli();
    match Cli::parse().cmd {
        Cmd::Server(a) => server::run(a),
        Cmd::Client(a) => {
            let spawn = client::ServerSpawn {
                exe: std::env::current_exe()?,
                subcommand: vec!["server".into()],
            };
            clients::procs::install_stop_handler("nsperf");
            client::run(&a, &spawn)?;
            clients::procs::finish()
        }
    }
}
