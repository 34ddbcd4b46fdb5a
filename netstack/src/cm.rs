//! Connection management over gRPC (tonic): exchanges QPN, starting PSN, data-path address,
//! MTU and loss-recovery mode, plus application private data, then connects both QPs.
//!
//! The server side is an [`Acceptor`]: for each request it creates a QP, connects it to the
//! caller's endpoint and returns the QP's endpoint. The client side is [`connect`].

use crate::verbs::{Endpoint, Qp, Recovery, VerbsError};
use std::net::SocketAddr;
use std::sync::Arc;

/// Generated protobuf types and gRPC stubs.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("flexns.cm.v1");
}

/// Errors of connection management.
#[derive(Debug, thiserror::Error)]
pub enum CmError {
    #[error("cannot reach connection manager at {addr}: {source}")]
    Transport {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("connection manager refused: {0}")]
    Refused(String),
    #[error("bad endpoint field {0}")]
    BadEndpoint(String),
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

fn recovery_str(r: Recovery) -> &'static str {
    match r {
        Recovery::GoBackN => "go-back-n",
        Recovery::SelectiveRepeat => "selective-repeat",
    }
}

impl From<Endpoint> for pb::QpEndpoint {
    fn from(e: Endpoint) -> pb::QpEndpoint {
        pb::QpEndpoint {
            qpn: e.qpn,
            psn: e.psn,
            addr: e.addr.to_string(),
            mtu: e.mtu,
            recovery: recovery_str(e.recovery).into(),
            cc: e.cc.name().into(),
            paths: e.paths as u32,
            spray: e.spray.to_string(),
            extra_addrs: e.extra_addrs.iter().map(|a| a.to_string()).collect(),
            sources: e.sources.iter().map(|a| a.to_string()).collect(),
        }
    }
}

fn parse_addrs(field: &str, v: &[String]) -> Result<Vec<std::net::SocketAddrV4>, CmError> {
    if v.len() > 4096 {
        return Err(CmError::BadEndpoint(format!("{field}: {} addresses", v.len())));
    }
    v.iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse()
                .map_err(|_| CmError::BadEndpoint(format!("{field}[{i}]: {a:?} is not an IPv4 socket address")))
        })
        .collect()
}

impl TryFrom<Option<pb::QpEndpoint>> for Endpoint {
    type Error = CmError;
    fn try_from(e: Option<pb::QpEndpoint>) -> Result<Endpoint, CmError> {
        let e = e.ok_or_else(|| CmError::BadEndpoint("endpoint: missing".into()))?;
        let addr = e
            .addr
            .parse()
            .map_err(|_| CmError::BadEndpoint(format!("addr: {:?} is not an IPv4 socket address", e.addr)))?;
        let recovery = match e.recovery.as_str() {
            "go-back-n" | "" => Recovery::GoBackN,
            "selective-repeat" => Recovery::SelectiveRepeat,
            o => return Err(CmError::BadEndpoint(format!("recovery: unknown mode {o:?}"))),
        };
        let cc = if e.cc.is_empty() {
            crate::cc::CcKind::None
        } else {
            e.cc.parse().map_err(|m| CmError::BadEndpoint(format!("cc: {m}")))?
        };
        let spray = if e.spray.is_empty() {
            crate::path::SprayPolicy::Single
        } else {
            e.spray
                .parse()
                .map_err(|m| CmError::BadEndpoint(format!("spray: {m}")))?
        };
        if e.paths as usize > crate::path::MAX_PATHS {
            return Err(CmError::BadEndpoint(format!(
                "paths: {} > {}",
                e.paths,
                crate::path::MAX_PATHS
            )));
        }
        let extra_addrs = parse_addrs("extra_addrs", &e.extra_addrs)?;
        let sources = parse_addrs("sources", &e.sources)?;
        if e.qpn > crate::wire::MASK24 || e.psn > crate::wire::MASK24 {
            return Err(CmError::BadEndpoint("qpn/psn: wider than 24 bits".into()));
        }
        Ok(Endpoint {
            qpn: e.qpn,
            psn: e.psn,
            addr,
            mtu: e.mtu,
            recovery,
            cc,
            paths: e.paths.max(1) as u8,
            spray,
            extra_addrs,
            sources,
        })
    }
}

/// What an acceptor decides for one connection request.
pub struct Accepted {
    /// The connected QP (kept alive by the acceptor's owner, e.g. in a list).
    pub qp: Qp,
    pub private_data: Vec<u8>,
}

/// Server-side policy: make a QP for a caller. Called on a tokio worker; may block briefly.
pub trait Acceptor: Send + Sync + 'static {
    /// Creates a QP for `remote` (not yet connected) and returns it with reply private data.
    fn accept(&self, remote: &Endpoint, private_data: &[u8]) -> Result<Accepted, String>;
    /// Takes ownership of the connected QP.
    fn connected(&self, qp: Qp);
}

struct Service<A: Acceptor>(Arc<A>);

#[tonic::async_trait]
impl<A: Acceptor> pb::connection_manager_server::ConnectionManager for Service<A> {
    async fn connect_qp(
        &self,
        req: tonic::Request<pb::ConnectRequest>,
    ) -> Result<tonic::Response<pb::ConnectReply>, tonic::Status> {
        let req = req.into_inner();
        let remote = Endpoint::try_from(req.endpoint).map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
        let acc = self
            .0
            .accept(&remote, &req.private_data)
            .map_err(tonic::Status::failed_precondition)?;
        acc.qp
            .connect(&remote)
            .map_err(|e| tonic::Status::failed_precondition(e.to_string()))?;
        let ep = acc.qp.local_endpoint();
        self.0.connected(acc.qp);
        Ok(tonic::Response::new(pb::ConnectReply {
            endpoint: Some(ep.into()),
            private_data: acc.private_data,
        }))
    }
}

/// The connection-manager gRPC service for `acceptor`, to serve beside other services on one
/// port (`tonic::transport::Server::builder().add_service(cm::service(a)).add_service(..)`).
pub fn service<A: Acceptor>(
    acceptor: Arc<A>,
) -> pb::connection_manager_server::ConnectionManagerServer<impl pb::connection_manager_server::ConnectionManager> {
    pb::connection_manager_server::ConnectionManagerServer::new(Service(acceptor))
}

/// Serves the connection manager on `listener` until `shutdown` resolves.
pub async fn serve<A: Acceptor>(
    listener: tokio::net::TcpListener,
    acceptor: Arc<A>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), CmError> {
    let addr = listener.local_addr()?.to_string();
    let incoming = tokio_stream_from(listener);
    tonic::transport::Server::builder()
        .add_service(service(acceptor))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|source| CmError::Transport { addr, source })
}

fn tokio_stream_from(
    l: tokio::net::TcpListener,
) -> impl tonic::codegen::tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tonic::codegen::tokio_stream::wrappers::TcpListenerStream::new(l)
}

/// A client of one connection manager, reusing its gRPC channel for many QPs.
pub struct Connector {
    client: pb::connection_manager_client::ConnectionManagerClient<tonic::transport::Channel>,
}

impl Connector {
    /// Opens a channel to the connection manager at `cm`.
    pub async fn new(cm: SocketAddr) -> Result<Connector, CmError> {
        let client = pb::connection_manager_client::ConnectionManagerClient::connect(format!("http://{cm}"))
            .await
            .map_err(|source| CmError::Transport {
                addr: cm.to_string(),
                source,
            })?;
        Ok(Connector { client })
    }

    /// Connects `qp` to the QP the server creates for it; returns the reply's private data.
    /// On return the QP is in RTS.
    pub async fn connect(&mut self, qp: &Qp, private_data: Vec<u8>) -> Result<Vec<u8>, CmError> {
        let req = pb::ConnectRequest {
            endpoint: Some(qp.local_endpoint().into()),
            private_data,
        };
        let reply = self
            .client
            .connect_qp(req)
            .await
            .map_err(|s| CmError::Refused(s.message().to_string()))?
            .into_inner();
        let remote = Endpoint::try_from(reply.endpoint)?;
        qp.connect(&remote)?;
        Ok(reply.private_data)
    }
}

/// Connects `qp` to the QP a connection manager at `cm` creates for it; returns the reply's
/// private data. On return the QP is in RTS.
pub async fn connect(cm: SocketAddr, qp: &Qp, private_data: Vec<u8>) -> Result<Vec<u8>, CmError> {
    Connector::new(cm).await?.connect(qp, private_data).await
}

/// Blocking form of [`connect`] for threads outside a tokio runtime.
pub fn connect_blocking(cm: SocketAddr, qp: &Qp, private_data: Vec<u8>) -> Result<Vec<u8>, CmError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(connect(cm, qp, private_data))
}
