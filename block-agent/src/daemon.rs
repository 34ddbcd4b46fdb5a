//! The three daemons of the block service, as library functions the binaries (`block-server`,
//! `block-agent`, `block-control`, and `blkctl`'s local cluster) run: command-line arguments,
//! start-up, one banner line on stdout (`key=value` fields, for scripts and parent
//! processes), then serving until SIGTERM or Ctrl-C.

use crate::agent::{Agent, AgentConfig};
use crate::control::{
    attach_spec, pb, AgentAdmin, Controller, ControllerConfig, ControllerService, MetaStore, NodeAdmin,
};
use crate::link::Carrier;
use crate::nbd::server::{serve_tcp, serve_unix};
use crate::storage_node::{NodeConfig, StorageNode};
use netstack::cm::incoming;
use netstack::verbs::{Drive, PollMode};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Errors that stop a daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A command-line or configuration value is invalid (the message names it).
    #[error("{0}")]
    Config(String),
    /// An I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The storage node failed.
    #[error(transparent)]
    Node(#[from] crate::storage_node::NodeError),
    /// The controller's metadata store failed.
    #[error(transparent)]
    Meta(#[from] crate::control::MetaError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// Registering with the controller (its address) failed (why).
    #[error("registering with the controller at {0}: {1}")]
    Register(String, String),
    /// The process lost its liveness key to another one and stopped (the reason).
    #[error("stopped: {0}")]
    Superseded(String),
    /// The metrics endpoint failed.
    #[error(transparent)]
    Metrics(#[from] netstack::telemetry::TelemetryError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
}

/// Where a process says it is alive: a key under `PREFIX/block/live/` in etcd, held under a
/// lease the process renews (deleted within the lease when it dies; at once when it stops).
#[derive(clap::Args, Debug, Clone)]
pub struct LiveArgs {
    /// Register this process in etcd at this endpoint (host:port), under a lease.
    #[arg(long, value_name = "HOST:PORT")]
    pub etcd: Option<String>,
    /// etcd key prefix (the controller's `--prefix`).
    #[arg(long, default_value = "/flexns")]
    pub etcd_prefix: String,
    /// Seconds of the lease: a process that dies leaves etcd within this.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub etcd_lease_ttl: u64,
}

/// The key of a live process of `kind` (`nodes`, `agents`) named `name` under `prefix`.
pub fn live_key(prefix: &str, kind: &str, name: &str) -> String {
    format!("{}/block/live/{kind}/{name}", prefix.trim_end_matches('/'))
}

impl LiveArgs {
    /// Registers `value` under the process's key, when `--etcd` was given.
    async fn register(
        &self,
        kind: &str,
        name: &str,
        value: String,
    ) -> Result<Option<etcd_lite::Registration>, DaemonError> {
        let Some(e) = &self.etcd else { return Ok(None) };
        let key = live_key(&self.etcd_prefix, kind, name);
        let r = etcd_lite::Registration::start(e, key, value, Duration::from_secs(self.etcd_lease_ttl))
            .await
            .map_err(|e| DaemonError::Config(format!("--etcd: registering this process: {e}")))?;
        Ok(Some(r))
    }
}

/// Resolves, after an error log, when the live registration is lost: another process holds
/// this process's key now (this one was paused or cut off from etcd past its lease and a
/// successor registered in its place, or one was started under the same name). The daemon
/// stops then rather than serve beside its successor. Never resolves without a registration.
fn when_lost(live: &Option<etcd_lite::Registration>) -> impl std::future::Future<Output = String> + Send + 'static {
    let lost = live.as_ref().map(|r| r.when_lost());
    async move {
        match lost {
            Some(lost) => {
                let e = lost.await;
                tracing::error!(
                    "another process holds this process's etcd key now (it serves in this one's place): \
                     stopping; {e}"
                );
                format!("another process holds this process's etcd key: {e}")
            }
            None => std::future::pending().await,
        }
    }
}

/// Leaves etcd at a clean stop (the key goes now rather than when the lease runs out).
async fn deregister(r: Option<etcd_lite::Registration>) {
    if let Some(r) = r {
        match tokio::time::timeout(Duration::from_secs(2), r.revoke()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("leaving etcd: {e}"),
            Err(_) => tracing::warn!("leaving etcd: no answer in 2 s"),
        }
    }
}

/// `block-server`: a storage node.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeArgs {
    /// Directory of the volume files.
    #[arg(long)]
    pub dir: PathBuf,
    /// Solar (UDP) and TCP data address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// gRPC admin address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub admin: SocketAddr,
    /// Controller to register with (host:port).
    #[arg(long)]
    pub control: Option<String>,
    /// Threads making writes durable.
    #[arg(long, default_value_t = 16)]
    pub write_threads: usize,
    /// How the Solar data core waits for work: `sleep` (as soon as there is none), `adaptive`
    /// (spin a while first: lower latency, more CPU) or `busy` (spin always: a core of its own).
    #[arg(long, default_value = "sleep", value_parser = parse_poll_mode)]
    pub poll_mode: PollMode,
    /// Milliseconds between heartbeats to the controller.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Where the process says it is alive (etcd).
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `block-agent`: exports volumes over NBD.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// Name the controller knows this agent by.
    #[arg(long, default_value = "agent0")]
    pub name: String,
    /// NBD address (TCP).
    #[arg(long, default_value = "127.0.0.1:10809")]
    pub nbd: SocketAddr,
    /// Also serve NBD on this unix socket.
    #[arg(long)]
    pub unix: Option<PathBuf>,
    /// gRPC admin address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub admin: SocketAddr,
    /// Controller to register with (host:port).
    #[arg(long)]
    pub control: Option<String>,
    /// `solar` (UDP, sprayed over --paths paths) or `tcp` (the plain block protocol over one
    /// kernel TCP connection per storage node: the reference, no Solar layer).
    #[arg(long, default_value = "solar")]
    pub transport: String,
    /// Solar paths (UDP source ports) per storage node.
    #[arg(long, default_value_t = 4)]
    pub paths: u16,
    /// Solar congestion control: swift, none (other algorithms of the stack need INT or ECN).
    #[arg(long, default_value = "swift")]
    pub cc: String,
    /// Runtime worker threads (the NBD side). One by default: blocks move on the Solar data
    /// core, and a second worker wakes alongside the first for every request (fio at QD1
    /// through the agent: 3.5 runtime context switches per I/O with two workers, 2.1 with
    /// one; QD32 IOPS no lower). More help only with many busy NBD connections and cores.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// How the Solar data core waits for work: `sleep` (as soon as there is none), `adaptive`
    /// (spin a while first: lower latency, more CPU) or `busy` (spin always: a core of its own).
    #[arg(long, default_value = "sleep", value_parser = parse_poll_mode)]
    pub poll_mode: PollMode,
    /// Who runs the Solar data core: `runtime` (a task on the agent's runtime, beside the NBD
    /// connections: an answer is received, completed and replied to on one thread) or
    /// `threads` (a data-core thread of its own, which hands each answer to the runtime). A
    /// `--poll-mode` that spins (adaptive, busy) gets the thread it spins on either way.
    #[arg(long, default_value = "runtime", value_parser = parse_drive)]
    pub engine_drive: Drive,
    /// Replicas that must have a write durable before it is acknowledged, for volumes whose
    /// controller record sets none (0: a majority, 2 of 3). Fewer than all gives degraded
    /// writes: a replica that misses writes is caught up in the background from a good copy;
    /// after an agent restart the replicas are compared when the volume is attached again.
    #[arg(long, default_value_t = 0)]
    pub write_quorum: usize,
    /// Milliseconds between heartbeats to the controller (each also brings the volumes
    /// attached here and where their replicas serve now).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Where the process says it is alive (etcd).
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `block-control`: volumes, placement, attachments.
#[derive(clap::Args, Debug, Clone)]
pub struct ControlArgs {
    /// gRPC address.
    #[arg(long, default_value = "127.0.0.1:7420")]
    pub listen: SocketAddr,
    /// Embedded metadata: the state file.
    #[arg(long, default_value = "flexns-block/control.json")]
    pub state: PathBuf,
    /// Metadata in etcd instead (host:port); the state file is then not used.
    #[arg(long)]
    pub etcd: Option<String>,
    /// etcd key prefix.
    #[arg(long, default_value = "/flexns")]
    pub prefix: String,
    /// A storage node not heard from in this many milliseconds is down.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(50..=600_000))]
    pub node_timeout_ms: u64,
    /// A replica whose storage node has been silent this many milliseconds is replaced by a
    /// new one on another node that is up (rebuilt from the others by the volume's agent);
    /// 0: never. Volumes with snapshots or clones are not moved (their snapshots live on
    /// their nodes).
    #[arg(long, default_value_t = 60_000)]
    pub replace_after_ms: u64,
    /// Serve Prometheus metrics on this address (`GET /metrics`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

impl AgentArgs {
    /// The agent configuration these arguments describe (errors name the flag).
    pub fn config(&self) -> Result<AgentConfig, DaemonError> {
        let carrier = match self.transport.as_str() {
            "solar" | "flexns" | "udp" => {
                if !(1..=64).contains(&self.paths) {
                    return Err(DaemonError::Config(format!("--paths {}: 1 to 64", self.paths)));
                }
                Carrier::Udp { paths: self.paths }
            }
            "tcp" => Carrier::Tcp,
            t => return Err(DaemonError::Config(format!("--transport {t:?}: solar or tcp"))),
        };
        let mut c = AgentConfig::new(carrier);
        c.link.cc = match self.cc.as_str() {
            "swift" => netstack::cc::CcKind::Swift,
            "none" => netstack::cc::CcKind::None,
            x => return Err(DaemonError::Config(format!("--cc {x:?}: swift or none"))),
        };
        c.volume.write_quorum = (self.write_quorum > 0).then_some(self.write_quorum);
        c.link.poll_mode = self.poll_mode;
        c.link.drive = self.engine_drive;
        Ok(c)
    }
}

/// `--poll-mode`: sleep, adaptive or busy.
fn parse_poll_mode(s: &str) -> Result<PollMode, String> {
    match s {
        "sleep" => Ok(PollMode::Sleep),
        "adaptive" => Ok(PollMode::Adaptive),
        "busy" => Ok(PollMode::BusyPoll),
        x => Err(format!("{x:?}: sleep, adaptive or busy")),
    }
}

/// `--engine-drive`: runtime or threads.
fn parse_drive(s: &str) -> Result<Drive, String> {
    match s {
        "runtime" => Ok(Drive::Runtime),
        "threads" => Ok(Drive::Threads),
        x => Err(format!("{x:?}: runtime or threads")),
    }
}

/// What each daemon binary does first: `tracing` logs on stderr (`RUST_LOG`, default info);
/// stdout carries only the banner.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
}

fn banner(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn listen(a: SocketAddr, what: &str) -> Result<(tokio::net::TcpListener, SocketAddr), DaemonError> {
    let l = tokio::net::TcpListener::bind(a)
        .await
        .map_err(io(format!("binding the {what} address {a}")))?;
    let at = l.local_addr().map_err(io(format!("{what} address")))?;
    Ok((l, at))
}

/// A client of the controller at `control` that connects when first used and again after the
/// controller restarts.
fn control_client(control: &str) -> Result<ControlClient, DaemonError> {
    let url = format!("http://{}", control.trim_start_matches("http://"));
    let ep = tonic::transport::Endpoint::from_shared(url)
        .map_err(|e| DaemonError::Config(format!("--control {control:?}: {e}")))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(5));
    Ok(pb::block_control_client::BlockControlClient::new(ep.connect_lazy()))
}

type ControlClient = pb::block_control_client::BlockControlClient<tonic::transport::Channel>;

/// Calls `f` until it succeeds or 5 s passed (the controller may be starting beside us).
async fn register<T, F, Fut>(control: &str, f: F) -> Result<T, DaemonError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut last = String::new();
    for _ in 0..50 {
        match f().await {
            Ok(t) => return Ok(t),
            Err(e) => last = e.message().to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(DaemonError::Register(control.to_string(), last))
}

/// A number drawn at each start of a process, telling its registrations from an earlier or
/// concurrent process's under the same node id.
fn incarnation() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ ((std::process::id() as u64) << 40) | 1
}

/// Calls `beat` every `every` in the background until it answers `Ok(false)`; a failure is
/// logged once per outage, and the recovery.
fn heartbeats<F, Fut>(every: Duration, mut beat: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<bool, tonic::Status>> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        let mut failing = false;
        loop {
            tick.tick().await;
            match beat().await {
                Ok(true) => {
                    if failing {
                        tracing::info!("heartbeat: the controller answers again");
                    }
                    failing = false;
                }
                Ok(false) => return,
                Err(e) => {
                    if !failing {
                        tracing::warn!("heartbeat to the controller: {}; retrying every heartbeat", e.message());
                    }
                    failing = true;
                }
            }
        }
    });
}

/// Runs a storage node.
pub async fn run_node(a: NodeArgs) -> Result<(), DaemonError> {
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let mut cfg = NodeConfig::new(&a.dir);
    cfg.listen = a.listen;
    cfg.write_threads = a.write_threads;
    cfg.poll_mode = a.poll_mode;
    let node = Arc::new(
        tokio::task::spawn_blocking(move || StorageNode::start(cfg))
            .await
            .map_err(|e| DaemonError::Config(e.to_string()))??,
    );
    let (l, admin) = listen(a.admin, "admin").await?;
    let data = node.addr();
    let (superseded_tx, superseded_rx) = tokio::sync::oneshot::channel::<String>();
    if let Some(c) = &a.control {
        let client = control_client(c)?;
        let inc = incarnation();
        let req = {
            let (node, data, admin) = (node.clone(), data.to_string(), admin.to_string());
            move |first: bool| pb::RegisterNodeRequest {
                addr: data.clone(),
                admin: admin.clone(),
                node_id: node.id().to_string(),
                incarnation: inc,
                first,
                volumes: node.volumes().into_iter().map(|(id, _)| id).collect(),
            }
        };
        register(c, || {
            let (mut cl, r) = (client.clone(), req(true));
            async move { cl.register_node(r).await.map(|_| ()) }
        })
        .await?;
        // taken only by the heartbeat that is refused: one that succeeds must not drop it (a
        // dropped sender disables the shutdown branch below, and the node would keep serving)
        let superseded_tx = Arc::new(parking_lot::Mutex::new(Some(superseded_tx)));
        heartbeats(Duration::from_millis(a.heartbeat_ms), move || {
            let (mut cl, r) = (client.clone(), req(false));
            let tx = superseded_tx.clone();
            async move {
                match cl.register_node(r).await {
                    Ok(_) => Ok(true),
                    Err(e) if e.code() == tonic::Code::FailedPrecondition && e.message().contains("superseded") => {
                        tracing::error!("{}", e.message());
                        if let Some(tx) = tx.lock().take() {
                            let _ = tx.send(e.message().to_string());
                        }
                        Ok(false)
                    }
                    Err(e) => Err(e),
                }
            }
        });
    }
    let live = a
        .live
        .register(
            "nodes",
            node.id(),
            serde_json::json!({"data": data.to_string(), "admin": admin.to_string(), "pid": std::process::id()})
                .to_string(),
        )
        .await?;
    let lost = when_lost(&live);
    banner(&format!(
        "block-server node={} data={data} admin={admin} dir={}",
        node.id(),
        a.dir.display()
    ));
    let mut why = None;
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let serve = tonic::transport::Server::builder()
        .add_service(pb::storage_node_admin_server::StorageNodeAdminServer::new(NodeAdmin(
            node.clone(),
        )))
        .serve_with_incoming_shutdown(incoming(l), async {
            tokio::select! {
                _ = shutdown() => {}
                Ok(m) = superseded_rx => why = Some(m),
                m = lost => why = Some(m),
            }
            let _ = stop.send(());
        });
    netstack::cm::drain_bounded(serve, stopped).await?;
    tracing::info!("block-server stopping");
    deregister(live).await;
    match why {
        Some(m) => Err(DaemonError::Superseded(m)),
        None => Ok(()),
    }
}

/// Runs an agent.
pub async fn run_agent(a: AgentArgs) -> Result<(), DaemonError> {
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let agent = Agent::new(a.config()?);
    agent.set_node_queries(crate::control::node_queries());
    let (nbd_l, nbd) = listen(a.nbd, "NBD").await?;
    let nbd_task = tokio::spawn(serve_tcp(agent.exports().clone(), nbd_l));
    let unix_task = match &a.unix {
        Some(p) => {
            let _ = std::fs::remove_file(p);
            let u =
                tokio::net::UnixListener::bind(p).map_err(io(format!("binding the unix socket {}", p.display())))?;
            Some(tokio::spawn(serve_unix(agent.exports().clone(), u)))
        }
        None => None,
    };
    let (l, admin) = listen(a.admin, "admin").await?;
    let svc = pb::agent_admin_server::AgentAdminServer::new(AgentAdmin {
        agent: agent.clone(),
        nbd: nbd.to_string(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel();
    // why the agent stopped, when it was not asked to: its etcd registration was lost
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel::<String>();
    let why = Arc::new(parking_lot::Mutex::new(None));
    let why_set = why.clone();
    let server = tokio::spawn(netstack::cm::drain_bounded(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming(l), async move {
                tokio::select! {
                    _ = shutdown() => {}
                    Ok(m) = lost_rx => *why_set.lock() = Some(m),
                }
                let _ = stop.send(());
            }),
        stopped,
    ));
    if let Some(c) = &a.control {
        let client = control_client(c)?;
        let req = pb::RegisterAgentRequest {
            name: a.name.clone(),
            admin: admin.to_string(),
            nbd: nbd.to_string(),
            first: false,
        };
        // export what belongs here as the controller says (asked at `asked`), following
        // replicas that moved, and drop what it moved elsewhere
        let reconcile = {
            let agent = agent.clone();
            Arc::new(move |r: pb::RegisterAgentReply, asked: std::time::Instant| {
                for v in &r.volumes {
                    if let Err(e) = attach_spec(&agent, v) {
                        tracing::warn!("attaching {}: {}", v.name, e.message());
                    }
                }
                let names: Vec<&str> = r
                    .volumes
                    .iter()
                    .map(|v| {
                        if v.export_name.is_empty() {
                            &v.name
                        } else {
                            &v.export_name
                        }
                    })
                    .map(String::as_str)
                    .collect();
                agent.keep_only(&names, asked);
            })
        };
        let asked = std::time::Instant::now();
        let first = register(c, || {
            let (mut cl, r) = (
                client.clone(),
                pb::RegisterAgentRequest {
                    first: true,
                    ..req.clone()
                },
            );
            async move { cl.register_agent(r).await.map(|r| r.into_inner()) }
        })
        .await?;
        reconcile(first, asked);
        heartbeats(Duration::from_millis(a.heartbeat_ms), move || {
            let (mut cl, r, reconcile) = (client.clone(), req.clone(), reconcile.clone());
            async move {
                let asked = std::time::Instant::now();
                reconcile(cl.register_agent(r).await?.into_inner(), asked);
                Ok(true)
            }
        });
    }
    let unix = a
        .unix
        .as_ref()
        .map(|p| format!(" unix={}", p.display()))
        .unwrap_or_default();
    let live = a
        .live
        .register(
            "agents",
            &a.name,
            serde_json::json!({"nbd": nbd.to_string(), "admin": admin.to_string(), "pid": std::process::id()})
                .to_string(),
        )
        .await?;
    let lost = when_lost(&live);
    let lost = tokio::spawn(async move {
        let _ = lost_tx.send(lost.await);
    });
    banner(&format!(
        "block-agent name={} nbd={nbd} admin={admin} transport={}{unix}",
        a.name, a.transport
    ));
    let r = server.await.map_err(|e| DaemonError::Config(e.to_string()))?;
    lost.abort();
    deregister(live).await;
    nbd_task.abort();
    if let Some(t) = unix_task {
        t.abort();
    }
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    r?;
    let why = why.lock().take();
    match why {
        Some(m) => Err(DaemonError::Superseded(m)),
        None => Ok(()),
    }
}

/// Runs the controller.
pub async fn run_control(a: ControlArgs) -> Result<(), DaemonError> {
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let meta = match &a.etcd {
        Some(e) => MetaStore::etcd(e, &a.prefix).await?,
        None => MetaStore::File(a.state.clone()),
    };
    let store = match &a.etcd {
        Some(e) => format!("etcd://{e}{}", a.prefix),
        None => a.state.display().to_string(),
    };
    let cfg = ControllerConfig {
        node_timeout: Duration::from_millis(a.node_timeout_ms),
        replace_after: (a.replace_after_ms > 0).then(|| Duration::from_millis(a.replace_after_ms)),
    };
    let c = Arc::new(Controller::new(meta, cfg).await?);
    let weak: std::sync::Weak<dyn netstack::telemetry::Collect> = Arc::downgrade(&c) as _;
    netstack::telemetry::register(weak);
    let (l, at) = listen(a.listen, "control").await?;
    tokio::spawn(c.clone().watch());
    if let Some(e) = &a.etcd {
        let view = etcd_lite::PrefixView::start(e, live_key(&a.prefix, "nodes", "").as_bytes())
            .map_err(io("starting the etcd watch of live storage nodes"))?;
        tokio::spawn(c.clone().follow_live(view));
    }
    banner(&format!("block-control control={at} metadata={store}"));
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let serve = tonic::transport::Server::builder()
        .add_service(pb::block_control_server::BlockControlServer::new(ControllerService(c)))
        .serve_with_incoming_shutdown(incoming(l), async move {
            shutdown().await;
            let _ = stop.send(());
        });
    netstack::cm::drain_bounded(serve, stopped).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Agent {
        #[command(flatten)]
        a: AgentArgs,
    }

    #[test]
    fn poll_mode_reaches_the_agents_links_and_a_bad_one_is_named() {
        let a = Agent::try_parse_from(["agent", "--poll-mode", "adaptive"]).unwrap().a;
        assert_eq!(a.config().unwrap().link.poll_mode, PollMode::Adaptive);
        let d = Agent::try_parse_from(["agent"]).unwrap().a;
        assert_eq!(d.config().unwrap().link.poll_mode, PollMode::Sleep);
        let e = Agent::try_parse_from(["agent", "--poll-mode", "fast"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--poll-mode") && e.contains("sleep, adaptive or busy"),
            "{e}"
        );
    }
}
