//! `kv`: get, put and delete keys of a kv-store cluster from the command line.

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use kv_store::client::{ClientConfig, GetPath, KvClient};
use netstack::verbs::{Context, ContextConfig};
use std::io::Write;
use std::net::SocketAddr;

#[derive(Parser)]
#[command(name = "kv", version, about = "Get, put and delete keys of a flexns kv-store")]
struct Cli {
    /// A kv-server's connection-manager address (its banner's cm=); the others are found
    /// through its shard map. Several: every shard, shard 0 first.
    #[arg(long, short, value_delimiter = ',')]
    server: Vec<SocketAddr>,
    /// Read the shard map from etcd at this endpoint instead (`http://HOST:PORT`).
    #[arg(long)]
    etcd: Option<String>,
    /// Key prefix of the shard map in etcd.
    #[arg(long, default_value = "/flexns/kv/")]
    etcd_prefix: String,
    /// How gets travel.
    #[arg(long, value_enum, default_value = "offload")]
    get_path: GetPath,
    /// Local IPv4 address of this client's data path (the servers send to it): one on the
    /// network the servers are on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::Ipv4Addr,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Prints the value (raw bytes) of KEY; exits 1 when it is absent.
    Get { key: String },
    /// Sets KEY to VALUE.
    Put { key: String, value: String },
    /// Deletes KEY; exits 1 when it was absent.
    Del { key: String },
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("kv", run())
}

fn run() -> anyhow::Result<()> {
    clients::bench::init_cli();
    let cli = Cli::parse();
    if cli.server.is_empty() && cli.etcd.is_none() {
        bail!("no server: pass --server ADDR (the cm= address a kv-server prints) or --etcd URL");
    }
    let ctx = Context::open(ContextConfig {
        bind: std::net::SocketAddrV4::new(cli.bind, 0),
        ..ContextConfig::default()
    })
    .with_context(|| format!("--bind {}", cli.bind))?;
    let mut c = KvClient::connect(
        &ctx,
        ClientConfig {
            servers: cli.server.clone(),
            depth: 2,
            get_path: cli.get_path,
            etcd: cli
                .etcd
                .as_deref()
                .map(|e| kv_store::shardmap::EtcdMap::new(e, &cli.etcd_prefix)),
            ..Default::default()
        },
    )
    .with_context(|| format!("connecting to {:?}", cli.server))?;
    match cli.cmd {
        Cmd::Get { key } => match c.get(key.as_bytes())? {
            Some(v) => {
                let mut o = std::io::stdout();
                o.write_all(&v)?;
                o.write_all(b"\n")?;
            }
            None => {
                eprintln!("{key}: not found");
                std::process::exit(1);
            }
        },
        Cmd::Put { key, value } => c.put(key.as_bytes(), value.as_bytes())?,
        Cmd::Del { key } => match c.delete(key.as_bytes()) {
            Ok(()) => {}
            Err(kv_store::KvError::NotFound) => {
                eprintln!("{key}: not found");
                std::process::exit(1);
            }
            Err(e) => return Err(e.into()),
        },
    }
    Ok(())
}
