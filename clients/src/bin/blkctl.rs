//! blkctl: the block service's command-line client.
//!
//! `blkctl cluster up` starts a controller, storage nodes and an agent on this machine, creates
//! a volume and prints its NBD URI; `blkctl cluster down` stops them. `create`, `delete`,
//! `resize`, `list`, `describe`, `attach`, `detach`, `qos`, `snapshot` and `clone` talk to the
//! controller; `bench` measures the volume through real NBD clients against qemu-nbd and the
//! agent's TCP mode.

use anyhow::{Context as _, Result};
use block_agent::control::pb;
use block_agent::control::pb::block_control_client::BlockControlClient;
use clap::{Parser, Subcommand};
use clients::blk::{self, ClusterSpec, ClusterState, DaemonCmd, LocalCluster, Spawner};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "blkctl",
    version,
    about = "flexns block volumes: cluster, volumes, benchmarks"
)]
struct Cli {
    /// Controller address (default: the local cluster's, else 127.0.0.1:7420).
    #[arg(long, global = true)]
    control: Option<String>,
    /// Directory of the local cluster (logs, data, state).
    #[arg(long, global = true, default_value_os_t = default_dir())]
    dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

fn default_dir() -> PathBuf {
    std::env::var_os("FLEXNS_BLOCK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("flexns-block"))
}

#[derive(Subcommand)]
enum Cmd {
    /// A local cluster on this machine.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Creates a volume.
    Create {
        name: String,
        #[arg(long, value_parser = size)]
        size: u64,
        #[arg(long, default_value_t = 3)]
        replicas: u32,
        /// Replicas a write needs durable before it is acknowledged (0: a majority, 2 of 3).
        #[arg(long, default_value_t = 0)]
        write_quorum: u32,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Sets a volume's provisioned IOPS and bandwidth (online: its agent applies them at once).
    Qos {
        name: String,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Deletes a volume and its data on every replica.
    Delete { name: String },
    /// Grows a volume.
    Resize {
        name: String,
        #[arg(long, value_parser = size)]
        size: u64,
    },
    /// Lists volumes, storage nodes and agents.
    List,
    /// Shows one volume.
    Describe { name: String },
    /// Snapshots: crash-consistent, point in time, copy-on-write on the storage nodes.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
    /// Makes a new volume from a snapshot, usable at once: its blocks read as the snapshot's
    /// until written (it keeps the snapshot's storage nodes and its volume's QoS).
    Clone {
        /// VOLUME@SNAPSHOT
        #[arg(value_parser = snap_ref)]
        snapshot: (String, String),
        /// The new volume's name.
        name: String,
    },
    /// Attaches a volume to an agent; prints the NBD URI.
    Attach {
        name: String,
        #[arg(long, default_value = "agent0")]
        agent: String,
    },
    /// Takes a volume from its agent (to attach it to another). The agent must answer, unless
    /// --force (it is gone or cut off): the next attachment then fences it out, its I/O fails.
    Detach {
        name: String,
        #[arg(long)]
        force: bool,
    },
    /// NBD benchmark through real clients (fio, qemu-img) against qemu-nbd and `--transport tcp`.
    Bench(clients::blkbench::BenchArgs),
    /// The daemons (what `cluster up` starts).
    #[command(hide = true)]
    Daemon {
        #[command(subcommand)]
        cmd: DaemonCmd,
    },
}

/// Provisioned IOPS and bandwidth of a volume.
#[derive(clap::Args, Debug, Clone, Copy)]
struct QosArgs {
    /// I/O requests per second (0: no limit).
    #[arg(long, default_value_t = 0)]
    iops: u64,
    /// Bytes per second, reads and writes together, like 100MiB (0: no limit).
    #[arg(long, default_value = "0", value_parser = size)]
    bandwidth: u64,
    /// Unused allowance kept, in milliseconds of the rate (a burst; 0: 1000).
    #[arg(long, default_value_t = 0)]
    burst_ms: u64,
}

impl QosArgs {
    fn pb(self) -> pb::Qos {
        pb::Qos {
            iops: self.iops,
            bytes_per_sec: self.bandwidth,
            burst_ms: self.burst_ms,
        }
    }
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Takes a snapshot (an attached volume's writes wait while every replica takes it).
    Create {
        /// VOLUME@SNAPSHOT
        #[arg(value_parser = snap_ref)]
        snapshot: (String, String),
    },
    /// Lists the snapshots of one volume, or of all.
    List { volume: Option<String> },
    /// Deletes a snapshot (refused while a clone of it exists).
    Delete {
        /// VOLUME@SNAPSHOT
        #[arg(value_parser = snap_ref)]
        snapshot: (String, String),
    },
}

/// `VOLUME@SNAPSHOT`.
fn snap_ref(s: &str) -> Result<(String, String), String> {
    match s.split_once('@') {
        Some((v, n)) if !v.is_empty() && !n.is_empty() => Ok((v.to_string(), n.to_string())),
        _ => Err(format!("{s:?} is not VOLUME@SNAPSHOT")),
    }
}

fn print_snapshot(x: &pb::SnapshotInfo) {
    let clones = if x.clones.is_empty() {
        String::new()
    } else {
        format!("  clones {}", x.clones.join(", "))
    };
    println!(
        "{}@{:<16} number {:<4} {:>12} bytes  taken at {} (Unix){clones}",
        x.volume, x.name, x.id, x.size, x.created_unix
    );
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Starts a controller, storage nodes and an agent, creates a volume, prints its NBD URI.
    Up {
        #[arg(long, default_value_t = 3)]
        replicas: usize,
        /// Storage nodes (at least --replicas).
        #[arg(long)]
        nodes: Option<usize>,
        #[arg(long, default_value = "1GiB", value_parser = size)]
        size: u64,
        #[arg(long, default_value = "vol0")]
        volume: String,
        /// solar or tcp.
        #[arg(long, default_value = "solar")]
        transport: String,
        #[arg(long, default_value_t = 4)]
        paths: u16,
        /// NBD address of the agent.
        #[arg(long, default_value = "127.0.0.1:10809")]
        nbd: String,
        /// Keep the controller's metadata in etcd (host:port) instead of a file.
        #[arg(long)]
        etcd: Option<String>,
        /// Serve Prometheus metrics from every daemon on 127.0.0.1: the controller on this
        /// port, the storage nodes on the next ones, the agent after them.
        #[arg(long, value_name = "PORT")]
        metrics_base: Option<u16>,
        /// Replicas a write needs durable before it is acknowledged (0: a majority, 2 of 3:
        /// degraded writes; a replica that misses writes is caught up from a good copy).
        #[arg(long, default_value_t = 0)]
        write_quorum: usize,
    },
    /// Stops the local cluster (its data stays in --dir unless --purge).
    Down {
        #[arg(long)]
        purge: bool,
    },
    /// Shows the local cluster.
    Status,
    /// Starts a daemon of the local cluster again (node0, node1, ..., agent0, control) after
    /// it died or was killed, with the arguments `up` gave it.
    Restart { name: String },
}

fn size(s: &str) -> Result<u64, String> {
    clients::bench::parse_size(s).map_err(|e| e.to_string())
}

fn state_file(dir: &std::path::Path) -> PathBuf {
    dir.join("cluster.json")
}

fn load_state(dir: &std::path::Path) -> Option<ClusterState> {
    serde_json::from_slice(&std::fs::read(state_file(dir)).ok()?).ok()
}

fn control_addr(cli: &Cli) -> String {
    cli.control
        .clone()
        .or_else(|| load_state(&cli.dir).map(|s| s.control))
        .unwrap_or_else(|| "127.0.0.1:7420".into())
}

/// `node@addr (state)` per replica.
fn replicas_line(v: &pb::VolumeSpec) -> String {
    v.replicas
        .iter()
        .map(|r| {
            let node = if r.node.is_empty() { "?" } else { &r.node };
            format!("{node}@{} ({})", r.addr, r.state)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_spec(v: &pb::VolumeSpec) {
    let qos = match v.qos {
        Some(q) if q.iops > 0 || q.bytes_per_sec > 0 => format!("  qos {}", qos_text(&q)),
        _ => String::new(),
    };
    let parent = if v.parent.is_empty() {
        String::new()
    } else {
        format!("  clone of {}", v.parent)
    };
    println!(
        "{:<16} id {:<4} {:>12} bytes  agent {}  replicas {}{qos}{parent}",
        v.name,
        v.id,
        v.size,
        if v.agent.is_empty() { "-" } else { &v.agent },
        replicas_line(v)
    );
}

/// `5000 IOPS, 104857600 B/s, burst 1000 ms` (the limits set).
fn qos_text(q: &pb::Qos) -> String {
    let mut parts = Vec::new();
    if q.iops > 0 {
        parts.push(format!("{} IOPS", q.iops));
    }
    if q.bytes_per_sec > 0 {
        parts.push(format!("{} B/s", q.bytes_per_sec));
    }
    parts.push(format!("burst {} ms", if q.burst_ms == 0 { 1000 } else { q.burst_ms }));
    parts.join(", ")
}

fn print_nodes(nodes: &[pb::NodeInfo]) {
    println!("storage nodes:");
    for n in nodes {
        let seen = if n.last_seen_secs < 0.0 {
            "not heard from since the controller started".to_string()
        } else {
            format!("last heartbeat {:.1} s ago", n.last_seen_secs)
        };
        println!(
            "  {}  {:<8} data {}  admin {}  volumes {:?}  {seen}",
            n.id, n.state, n.data, n.admin, n.volumes
        );
    }
}

fn main() -> std::process::ExitCode {
    clients::bench::exit("blkctl", run())
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Daemon { .. }) {
        clients::bench::init_daemon();
    } else {
        clients::bench::init_cli();
    }
    let spawner = Spawner {
        exe: std::env::current_exe()?,
        prefix: vec!["daemon".into()],
    };
    let ctl = control_addr(&cli);
    match cli.cmd {
        Cmd::Daemon { cmd } => blk::run_daemon(cmd),
        Cmd::Bench(a) => {
            clients::procs::install_stop_handler("blkctl bench");
            clients::blkbench::run(&a, &spawner)?;
            clients::procs::finish()
        }
        Cmd::Cluster { cmd } => cluster(&cli.dir, &spawner, cmd),
        cmd => {
            let rt = blk::runtime()?;
            rt.block_on(async move {
                let mut c = blk::control(&ctl).await?;
                volume(&mut c, cmd).await
            })
        }
    }
}

/// The message of a controller's error.
fn st(e: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", e.message())
}

/// `blkctl cluster ...`: the local cluster in `dir`.
fn cluster(dir: &std::path::Path, spawner: &Spawner, cmd: ClusterCmd) -> Result<()> {
    match cmd {
        ClusterCmd::Up {
            replicas,
            nodes,
            size,
            volume,
            transport,
            paths,
            nbd,
            etcd,
            metrics_base,
            write_quorum,
        } => {
            if let Some(s) = load_state(dir) {
                anyhow::bail!(
                    "a cluster is already up in {} (NBD {}); `blkctl cluster down` first",
                    dir.display(),
                    s.uri
                );
            }
            let mut spec = ClusterSpec::new(dir.to_path_buf());
            spec.replicas = replicas;
            spec.nodes = nodes.unwrap_or(replicas).max(replicas);
            spec.size = size;
            let spec_volume = volume.clone();
            spec.volume = volume;
            spec.transport = transport;
            spec.paths = paths;
            spec.nbd = nbd;
            spec.etcd = etcd;
            spec.detached = true;
            spec.metrics_base = metrics_base;
            spec.write_quorum = write_quorum;
            cluster_up(dir, spawner, spec, &spec_volume)
        }
        ClusterCmd::Restart { name } => {
            let mut s = load_state(dir).with_context(|| format!("no cluster is up in {}", dir.display()))?;
            let pid = blk::restart_daemon(spawner, &mut s, &name)?;
            std::fs::write(state_file(dir), serde_json::to_vec_pretty(&s)?)?;
            eprintln!(
                "restarted {name} (pid {pid}); logs in {}",
                dir.join(format!("{name}.log")).display()
            );
            Ok(())
        }
        ClusterCmd::Down { purge } => {
            let s = load_state(dir).with_context(|| format!("no cluster is up in {}", dir.display()))?;
            blk::cluster_down(&s);
            std::fs::remove_file(state_file(dir))?;
            if purge {
                std::fs::remove_dir_all(dir)?;
                eprintln!("removed {}", dir.display());
            } else {
                eprintln!("data kept in {} (--purge removes it)", dir.display());
            }
            Ok(())
        }
        ClusterCmd::Status => cluster_status(dir),
    }
}

/// Starts the cluster `spec` describes, records its state in `dir` and says where it runs.
fn cluster_up(dir: &std::path::Path, spawner: &Spawner, spec: ClusterSpec, spec_volume: &str) -> Result<()> {
    let metrics = spec.metrics_addrs();
    let c = LocalCluster::start(spawner, spec)?;
    let state = c.state();
    std::fs::write(state_file(dir), serde_json::to_vec_pretty(&state)?)?;
    println!("{}", c.uri);
    if let Some(size) = c.reused {
        eprintln!(
            "volume {} ({size} bytes) is the one kept in {}: its data is served again (--size applies to new volumes only)",
            spec_volume, dir.display()
        );
    }
    eprintln!(
        "cluster up in {}: controller {}, {} storage nodes, agent NBD {} (unix socket {}); logs there",
        dir.display(),
        c.control_addr,
        c.nodes.len(),
        c.agent.field("nbd").unwrap_or_default(),
        dir.join("nbd.sock").display()
    );
    for (d, a) in metrics {
        eprintln!("metrics of {d}: http://{a}/metrics");
    }
    Ok(())
}

/// `blkctl cluster status`: each daemon's process, and the controller's view of the nodes and
/// volumes.
fn cluster_status(dir: &std::path::Path) -> Result<()> {
    let s = load_state(dir).with_context(|| format!("no cluster is up in {}", dir.display()))?;
    println!("controller {}  NBD {}", s.control, s.uri);
    for (i, (n, p)) in s.pids.iter().enumerate() {
        let state = match blk::daemon_alive(&s, i) {
            blk::Alive::Yes => "running",
            blk::Alive::Gone => "NOT RUNNING",
            blk::Alive::Other => "NOT RUNNING (its pid is another process now)",
        };
        println!("  {n:<10} pid {p:<8} {state}");
    }
    // the controller's view: each node's and each replica's state
    let rt = blk::runtime()?;
    let l = rt.block_on(async {
        let mut c = blk::control(&s.control).await?;
        c.list(pb::ListRequest {}).await.map_err(st)
    });
    match l {
        Ok(l) => {
            let l = l.into_inner();
            print_nodes(&l.nodes);
            println!("volumes:");
            for v in &l.volumes {
                print_spec(v);
            }
        }
        Err(e) => println!("the controller does not answer: {e:#}"),
    }
    Ok(())
}

/// The volume commands: one request to the controller, its answer printed.
async fn volume(c: &mut BlockControlClient<tonic::transport::Channel>, cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Create {
            name,
            size,
            replicas,
            write_quorum,
            qos,
        } => {
            let q = Some(qos.pb());
            let v = c
                .create(pb::CreateRequest {
                    name,
                    size,
                    replicas,
                    qos: q,
                    write_quorum,
                })
                .await
                .map_err(st)?;
            print_spec(v.get_ref());
        }
        Cmd::Qos { name, qos } => {
            let v = c
                .set_qos(pb::SetQosRequest {
                    name,
                    qos: Some(qos.pb()),
                })
                .await
                .map_err(st)?;
            print_spec(v.get_ref());
        }
        Cmd::Delete { name } => {
            c.delete(pb::NameRequest { name: name.clone() }).await.map_err(st)?;
            println!("deleted {name}");
        }
        Cmd::Resize { name, size } => {
            let v = c.resize(pb::ResizeRequest { name, size }).await.map_err(st)?;
            print_spec(v.get_ref());
        }
        Cmd::List => {
            let l = c.list(pb::ListRequest {}).await.map_err(st)?.into_inner();
            for v in &l.volumes {
                print_spec(v);
            }
            print_nodes(&l.nodes);
            println!("agents: {}", l.agents.join(", "));
        }
        Cmd::Describe { name } => {
            let v = c.describe(pb::NameRequest { name }).await.map_err(st)?;
            println!("{}", serde_json::to_string_pretty(&describe_json(v.get_ref()))?);
        }
        Cmd::Attach { name, agent } => {
            let r = c.attach(pb::AttachVolumeRequest { name, agent }).await.map_err(st)?;
            println!("{}", r.get_ref().uri);
        }
        Cmd::Detach { name, force } => {
            c.detach(pb::DetachVolumeRequest {
                name: name.clone(),
                force,
            })
            .await
            .map_err(st)?;
            println!("volume {name} detached");
        }
        Cmd::Snapshot { cmd } => snapshot(c, cmd).await?,
        Cmd::Clone {
            snapshot: (volume, snapshot),
            name,
        } => {
            let v = c
                .clone_snapshot(pb::CloneRequest {
                    volume,
                    snapshot,
                    name,
                    qos: None,
                })
                .await
                .map_err(st)?;
            print_spec(v.get_ref());
        }
        Cmd::Cluster { .. } | Cmd::Daemon { .. } | Cmd::Bench(_) => anyhow::bail!("not a volume command"),
    }
    Ok(())
}

/// `blkctl snapshot ...`.
async fn snapshot(c: &mut BlockControlClient<tonic::transport::Channel>, cmd: SnapshotCmd) -> Result<()> {
    match cmd {
        SnapshotCmd::Create {
            snapshot: (volume, name),
        } => {
            let x = c.create_snapshot(pb::SnapshotName { volume, name }).await.map_err(st)?;
            print_snapshot(x.get_ref());
        }
        SnapshotCmd::List { volume } => {
            let l = c
                .list_snapshots(pb::NameRequest {
                    name: volume.unwrap_or_default(),
                })
                .await
                .map_err(st)?;
            for x in &l.get_ref().snapshots {
                print_snapshot(x);
            }
        }
        SnapshotCmd::Delete {
            snapshot: (volume, name),
        } => {
            c.delete_snapshot(pb::SnapshotName {
                volume: volume.clone(),
                name: name.clone(),
            })
            .await
            .map_err(st)?;
            println!("deleted {volume}@{name}");
        }
    }
    Ok(())
}

/// A volume as `describe` prints it: the controller's record (each replica's node, address and
/// node state, `state`; the attachment epoch) and, when its agent answered, the agent's view: each replica's sync state
/// (`in-sync`, `catching-up`, `down`) and regions behind, its Solar paths' health, the write
/// quorum and the replication counters.
fn describe_json(v: &pb::VolumeSpec) -> serde_json::Value {
    let e = v.export.as_ref();
    let replicas: Vec<serde_json::Value> = v
        .replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut j = serde_json::json!({"node": r.node, "addr": r.addr, "state": r.state});
            if let Some(e) = e {
                j["sync"] = e.replica_states.get(i).cloned().into();
                j["regions_behind"] = e.regions_behind.get(i).copied().into();
                j["paths_up"] = e.paths_up.get(i).copied().into();
                if let Some(p) = e.replica_paths.get(i).filter(|p| !p.paths.is_empty()) {
                    j["paths"] = p
                        .paths
                        .iter()
                        .map(|p| {
                            serde_json::json!({"up": p.up, "sent": p.sent, "delivered": p.delivered,
                                "lost": p.lost, "srtt_us": p.srtt_ns as f64 / 1e3, "port": p.port,
                                "repaths": p.repaths})
                        })
                        .collect();
                }
            }
            j
        })
        .collect();
    let mut j = serde_json::json!({
        "name": v.name, "id": v.id, "size": v.size, "replicas": replicas,
        "agent": if v.agent.is_empty() { None } else { Some(&v.agent) },
        "epoch": v.epoch,
    });
    if !v.parent.is_empty() {
        j["clone_of"] = v.parent.clone().into();
    }
    let q = v.qos.unwrap_or_default();
    j["qos"] = serde_json::json!({"iops": q.iops, "bytes_per_sec": q.bytes_per_sec,
        "burst_ms": if q.burst_ms == 0 { 1000 } else { q.burst_ms }});
    if let Some(e) = e {
        j["qos"]["throttled"] = e.throttled.into();
        j["qos"]["throttled_ms"] = (e.throttled_us as f64 / 1e3).into();
        j["write_quorum"] = e.write_quorum.into();
        j["io"] = serde_json::json!({"reads": e.reads, "writes": e.writes, "read_failovers": e.read_failovers,
            "repairs": e.repairs, "degraded_writes": e.degraded_writes, "replica_downs": e.replica_downs,
            "resynced_regions": e.resynced_regions, "reconciled_blocks": e.reconciled_blocks});
    } else if !v.agent.is_empty() {
        j["agent_view"] = "the agent did not answer".into();
    }
    j
}
