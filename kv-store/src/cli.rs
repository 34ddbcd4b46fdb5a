//! The `kv-server` command line (shared by the `kv-server` binary and the programs that start
//! partitions as child processes, such as `ycsb` and `flexns demo`).

use crate::server::{KvServer, ServerConfig};
use anyhow::{Context as _, Result};
use netstack::verbs::ContextConfig;
use std::net::{SocketAddr, SocketAddrV4};

/// Options of one partition.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Connection-manager (gRPC) listen address: what clients and the shard map name.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub cm: SocketAddrV4,
    /// RESP (redis protocol) front door listen address; `off` for none.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub resp: String,
    /// Keys the index is sized for.
    #[arg(long, default_value_t = 1 << 20)]
    pub capacity: u64,
    /// Bytes of entry memory (suffixes k, MiB, GiB).
    #[arg(long, default_value = "256MiB", value_parser = netstack::config::parse_size)]
    pub data_size: u64,
    /// The value length RedN gets serve (their responses have a fixed length).
    #[arg(long, default_value_t = 64)]
    pub redn_value_len: usize,
    /// This partition's shard number.
    #[arg(long, default_value_t = 0)]
    pub shard: u32,
    /// Number of shards.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// The shard map clients fetch: every shard's connection-manager address, shard 0 first.
    #[arg(long, default_value = "")]
    pub map: String,
    /// Entries of the hybrid get's hot-value cache (0: off).
    #[arg(long, default_value_t = 4096)]
    pub hot_entries: usize,
    /// Most client connections at once on the RDMA (connection-manager) door; the RESP door
    /// has --resp-max-clients.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Most RDMA connections one caller (one IP address) may hold, so that one caller cannot
    /// take them all [default: three quarters of --max-connections]. Clients on one host
    /// share its address: raise it for many clients from one machine.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections_per_caller: Option<u64>,
    /// Seconds an RDMA connection may go without its QP receiving a packet before it is
    /// dropped (a caller of the connection manager that named an endpoint that never
    /// answers); half-way a probe makes a live client's idle QP answer.
    #[arg(long, default_value = "10", value_parser = parse_unused_timeout)]
    pub unused_connection_timeout: std::time::Duration,
    /// Most RESP connections at once (redis `maxclients`): one more gets `-ERR max number of
    /// clients reached` and is closed.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub resp_max_clients: u64,
    /// Most bytes of one command a RESP connection buffers (redis
    /// `client-query-buffer-limit`; suffixes k, MiB, GiB; 1KiB to 1GiB): a command declared or
    /// buffered beyond it gets `-ERR max query buffer length reached ...` and the connection
    /// is closed.
    #[arg(long, default_value = "512KiB", value_parser = query_buffer_limit)]
    pub resp_query_buffer_limit: u64,
    /// Longest RESP bulk string (redis `proto-max-bulk-len`; 1 to 66560, the largest value and
    /// 1 KiB): a longer one is a protocol error, refused as soon as its `$N` line arrives.
    #[arg(long, default_value_t = crate::resp::MAX_BULK as u64,
          value_parser = clap::value_parser!(u64).range(1..=crate::resp::MAX_BULK as u64))]
    pub resp_max_bulk_len: u64,
    /// Most elements of one RESP command (1 to 1048576, redis's limit).
    #[arg(long, default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=crate::resp::MAX_MULTIBULK as u64))]
    pub resp_max_multibulk_len: u64,
    /// Offload threads (the offloaded gets run there) [config: offload.threads].
    #[arg(long)]
    pub offload_threads: Option<usize>,
    /// Register this shard in the shard map kept in etcd at this endpoint (`http://HOST:PORT`).
    #[arg(long)]
    pub etcd: Option<String>,
    /// Key prefix of the shard map in etcd (one per cluster).
    #[arg(long, default_value = "/flexns/kv/")]
    pub etcd_prefix: String,
    /// Seconds of the lease this shard's address is registered under in etcd (it drops out of
    /// the map this long after the server dies).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub etcd_lease_ttl: u64,
    /// Context config (TOML, `deploy/config/context.toml`); a flag given explicitly overrides
    /// the file, a flag left out leaves the file's value.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The stack's flags (`--data`, `--data-cores`, `--link`, ...), applied over --config.
    #[command(flatten)]
    pub ctx: netstack::cli::ContextArgs,
}

/// Parses a door timeout flag: seconds, 0.1 to 86400 (a fraction allowed).
pub fn parse_unused_timeout(s: &str) -> Result<std::time::Duration, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.1..=86_400.0).contains(&v) {
        return Err(format!("{v} seconds is out of range: 0.1 to 86400"));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

fn query_buffer_limit(s: &str) -> Result<u64, String> {
    let v = netstack::config::parse_size(s)?;
    let (lo, hi) = (
        crate::resp::MIN_QUERY_BUFFER as u64,
        crate::resp::MAX_QUERY_BUFFER as u64,
    );
    if !(lo..=hi).contains(&v) {
        return Err(format!("{v} bytes is out of range: {lo} (1KiB) to {hi} (1GiB)"));
    }
    Ok(v)
}

impl ServerArgs {
    /// The partition configuration these flags describe.
    pub fn config(&self) -> Result<ServerConfig> {
        let mut ctx = match &self.config {
            Some(p) => ContextConfig::from_file(p).with_context(|| format!("config {}", p.display()))?,
            None => ContextConfig::default(),
        };
        if let Some(t) = self.offload_threads {
            ctx.offload.threads = t;
        }
        self.ctx.apply(&mut ctx)?;
        let resp = match self.resp.as_str() {
            "off" | "none" => None,
            a => Some(
                a.parse::<SocketAddr>()
                    .with_context(|| format!("--resp: {a:?} is not an address or `off`"))?,
            ),
        };
        let map = crate::proto::parse_map(&self.map).context("--map")?;
        Ok(ServerConfig {
            cm: self.cm,
            resp,
            capacity: self.capacity,
            data_bytes: self.data_size,
            redn_value_len: self.redn_value_len,
            shard: self.shard,
            shards: self.shards,
            map,
            hot_entries: self.hot_entries,
            max_connections: self.max_connections,
            max_connections_per_caller: self.max_connections_per_caller.map(|n| n as usize),
            unused_timeout: self.unused_connection_timeout,
            resp_limits: crate::resp::RespLimits {
                max_clients: self.resp_max_clients as usize,
                query_buffer_limit: self.resp_query_buffer_limit as usize,
                max_bulk_len: self.resp_max_bulk_len as usize,
                max_multibulk_len: self.resp_max_multibulk_len as usize,
            },
            etcd: self.etcd.as_deref().map(|e| crate::shardmap::EtcdMap {
                lease_ttl: std::time::Duration::from_secs(self.etcd_lease_ttl),
                ..crate::shardmap::EtcdMap::new(e, &self.etcd_prefix)
            }),
            ctx,
            ..Default::default()
        })
    }
}

/// Runs a partition until SIGTERM or SIGINT. Prints one banner line first:
/// `kv-server cm=ADDR data=ADDR resp=ADDR shard=I/N`.
pub fn run(args: ServerArgs) -> Result<()> {
    if let Some(addr) = args.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let s = KvServer::start(args.config()?)?;
    println!(
        "kv-server cm={} data={} resp={} shard={}/{}",
        s.cm_addr(),
        s.data_addr(),
        s.resp_addr().map(|a| a.to_string()).unwrap_or_else(|| "off".into()),
        args.shard,
        args.shards
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {},
            _ = tokio::signal::ctrl_c() => {},
        }
        Ok::<_, std::io::Error>(())
    })?;
    tracing::info!("kv-server stopping: {:?}", s.stats());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServerArgs,
    }

    #[test]
    fn config_file_values_hold_unless_a_flag_is_given() {
        let p = std::env::temp_dir().join(format!("kv-cli-config-{}.toml", std::process::id()));
        std::fs::write(
            &p,
            "data_cores = 2\nbind = \"127.0.0.1:4791\"\n[offload]\nthreads = 3\n",
        )
        .unwrap();
        let parse = |extra: &[&str]| {
            let mut a = vec!["kv-server", "--config", p.to_str().unwrap()];
            a.extend_from_slice(extra);
            Cli::parse_from(a).args.config().unwrap().ctx
        };
        let c = parse(&[]);
        assert_eq!((c.data_cores, c.bind.port(), c.offload.threads), (2, 4791, 3));
        let c = parse(&["--data-cores", "1", "--data", "127.0.0.1:0", "--offload-threads", "1"]);
        assert_eq!((c.data_cores, c.bind.port(), c.offload.threads), (1, 0, 1));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn door_limits_come_from_flags() {
        let parse = |extra: &[&str]| {
            let mut a = vec!["kv-server"];
            a.extend_from_slice(extra);
            Cli::parse_from(a).args.config().unwrap().door_limits().unwrap()
        };
        let d = parse(&[]);
        assert_eq!((d.max_qps_per_caller, d.unused_timeout.as_secs()), (768, 10));
        let d = parse(&["--max-connections", "100"]);
        assert_eq!(d.max_qps_per_caller, 75, "three quarters of --max-connections");
        let d = parse(&[
            "--max-connections-per-caller",
            "9",
            "--unused-connection-timeout",
            "0.5",
        ]);
        assert_eq!((d.max_qps_per_caller, d.unused_timeout.as_millis()), (9, 500));
    }

    #[test]
    fn resp_limits_come_from_flags_and_bad_values_name_the_flag() {
        let l = Cli::parse_from(["kv-server"]).args.config().unwrap().resp_limits;
        assert_eq!(l, crate::resp::RespLimits::default());
        let l = Cli::parse_from([
            "kv-server",
            "--resp-max-clients",
            "8",
            "--resp-query-buffer-limit",
            "64KiB",
            "--resp-max-bulk-len",
            "4096",
            "--resp-max-multibulk-len",
            "16",
        ])
        .args
        .config()
        .unwrap()
        .resp_limits;
        assert_eq!(
            (l.max_clients, l.query_buffer_limit, l.max_bulk_len, l.max_multibulk_len),
            (8, 64 << 10, 4096, 16)
        );
        for (flag, bad) in [
            ("--resp-max-clients", "0"),
            ("--resp-query-buffer-limit", "100"),
            ("--resp-query-buffer-limit", "2GiB"),
            ("--resp-query-buffer-limit", "lots"),
            ("--resp-max-bulk-len", "1000000000"),
            ("--resp-max-multibulk-len", "0"),
            ("--max-connections-per-caller", "0"),
            ("--unused-connection-timeout", "0"),
            ("--unused-connection-timeout", "soon"),
        ] {
            let e = Cli::try_parse_from(["kv-server", flag, bad])
                .err()
                .expect(bad)
                .to_string();
            assert!(e.contains(flag), "{flag} {bad}: {e}");
        }
    }
}
