//! The three daemons of the block service, as library functions the binaries (`block-server`,
//! `block-agent`, `block-control`, and `blkctl`'s local cluster) run: command-line arguments,
//! start-up, one banner line on stdout (`key=value` fields, for scripts and parent
//! processes), then serving until SIGTERM or Ctrl-C.

use crate::agent::{Agent, AgentConfig};
use crate::control::{pb, AgentAdmin, Controller, MetaStore, NodeAdmin};
use crate::link::Carrier;
use crate::nbd::server::{serve_tcp, serve_unix};
use crate::storage_node::{NodeConfig, StorageNode};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tonic::codegen::tokio_stream::wrappers::TcpListenerStream;

/// Errors that stop a daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Node(#[from] crate::storage_node::NodeError),
    #[error(transparent)]
    Meta(#[from] crate::control::MetaError),
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("registering with the controller at {0}: {1}")]
    Register(String, String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Io { what, source }
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
    /// `solar` (UDP, sprayed over --paths paths) or `tcp` (the same packets over kernel TCP).
    #[arg(long, default_value = "solar")]
    pub transport: String,
    /// Solar paths (UDP source ports) per storage node.
    #[arg(long, default_value_t = 4)]
    pub paths: u16,
    /// Solar congestion control: swift, none (other algorithms of the stack need INT or ECN).
    #[arg(long, default_value = "swift")]
    pub cc: String,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
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
        Ok(c)
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

async fn register<F, Fut>(control: &str, f: F) -> Result<(), DaemonError>
where
    F: Fn(pb::block_control_client::BlockControlClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let url = format!("http://{}", control.trim_start_matches("http://"));
    let mut last = String::new();
    // the controller may be starting beside us
    for _ in 0..50 {
        match pb::block_control_client::BlockControlClient::connect(url.clone()).await {
            Ok(c) => match f(c).await {
                Ok(()) => return Ok(()),
                Err(e) => last = e.message().to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Err(DaemonError::Register(control.to_string(), last))
}

/// Runs a storage node.
pub async fn run_node(a: NodeArgs) -> Result<(), DaemonError> {
    let mut cfg = NodeConfig::new(&a.dir);
    cfg.listen = a.listen;
    cfg.write_threads = a.write_threads;
    let node = Arc::new(
        tokio::task::spawn_blocking(move || StorageNode::start(cfg))
            .await
            .map_err(|e| DaemonError::Config(e.to_string()))??,
    );
    let (l, admin) = listen(a.admin, "admin").await?;
    let data = node.addr();
    if let Some(c) = &a.control {
        let (d, ad) = (data.to_string(), admin.to_string());
        register(c, |mut cl| {
            let (d, ad) = (d.clone(), ad.clone());
            async move {
                cl.register_node(pb::RegisterNodeRequest { addr: d, admin: ad }).await?;
                Ok(())
            }
        })
        .await?;
    }
    banner(&format!(
        "block-server data={data} admin={admin} dir={}",
        a.dir.display()
    ));
    tonic::transport::Server::builder()
        .add_service(pb::storage_node_admin_server::StorageNodeAdminServer::new(NodeAdmin(
            node.clone(),
        )))
        .serve_with_incoming_shutdown(TcpListenerStream::new(l), shutdown())
        .await?;
    tracing::info!("block-server stopping");
    Ok(())
}

/// Runs an agent.
pub async fn run_agent(a: AgentArgs) -> Result<(), DaemonError> {
    let agent = Agent::new(a.config()?);
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
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(TcpListenerStream::new(l), shutdown()),
    );
    if let Some(c) = &a.control {
        let (n, ad, nb) = (a.name.clone(), admin.to_string(), nbd.to_string());
        register(c, |mut cl| {
            let (n, ad, nb) = (n.clone(), ad.clone(), nb.clone());
            async move {
                cl.register_agent(pb::RegisterAgentRequest {
                    name: n,
                    admin: ad,
                    nbd: nb,
                })
                .await?;
                Ok(())
            }
        })
        .await?;
    }
    let unix = a
        .unix
        .as_ref()
        .map(|p| format!(" unix={}", p.display()))
        .unwrap_or_default();
    banner(&format!(
        "block-agent name={} nbd={nbd} admin={admin} transport={}{unix}",
        a.name, a.transport
    ));
    let r = server.await.map_err(|e| DaemonError::Config(e.to_string()))?;
    nbd_task.abort();
    if let Some(t) = unix_task {
        t.abort();
    }
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    r?;
    Ok(())
}

/// Runs the controller.
pub async fn run_control(a: ControlArgs) -> Result<(), DaemonError> {
    let meta = match &a.etcd {
        Some(e) => MetaStore::etcd(e, &a.prefix).await?,
        None => MetaStore::File(a.state.clone()),
    };
    let store = match &a.etcd {
        Some(e) => format!("etcd://{e}{}", a.prefix),
        None => a.state.display().to_string(),
    };
    let c = Controller::new(meta).await?;
    let (l, at) = listen(a.listen, "control").await?;
    banner(&format!("block-control control={at} metadata={store}"));
    tonic::transport::Server::builder()
        .add_service(pb::block_control_server::BlockControlServer::new(c))
        .serve_with_incoming_shutdown(TcpListenerStream::new(l), shutdown())
        .await?;
    Ok(())
}
