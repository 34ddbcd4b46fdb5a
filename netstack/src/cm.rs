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
    /// The peer's connection manager could not be reached.
    #[error("cannot reach connection manager at {addr}: {source}")]
    Transport {
        /// Its address.
        addr: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// The peer refused the connection (its reason).
    #[error("connection manager refused: {0}")]
    Refused(String),
    /// An endpoint description had a bad field (which, and why).
    #[error("bad endpoint field {0}")]
    BadEndpoint(String),
    /// Making or moving the local QP failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// A socket failed.
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
    /// The bytes the connecting side sent with its request.
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

/// Most QPs one [`Connector::connect_many`] exchange (one `ConnectQps` call) may carry; a
/// larger batch is refused whole, so one caller cannot make the server build an unbounded reply.
pub const MAX_BATCH: usize = 4096;

/// Requests per `ConnectQps` call that [`Connector::connect_many`] sends (N QPs take
/// `N.div_ceil(CHUNK)` calls), and how many calls it keeps in flight: the server accepts one
/// batch while the client connects its QPs to the last.
pub const CHUNK: usize = 256;
const CHUNKS_IN_FLIGHT: usize = 4;

/// Creates and connects the server's QP for one request.
fn accept_one<A: Acceptor>(acceptor: &A, remote: &Endpoint, private_data: &[u8]) -> Result<pb::ConnectReply, String> {
    let acc = acceptor.accept(remote, private_data)?;
    acc.qp.connect(remote).map_err(|e| e.to_string())?;
    let ep = acc.qp.local_endpoint();
    acceptor.connected(acc.qp);
    Ok(pb::ConnectReply {
        endpoint: Some(ep.into()),
        private_data: acc.private_data,
    })
}

#[tonic::async_trait]
impl<A: Acceptor> pb::connection_manager_server::ConnectionManager for Service<A> {
    async fn connect_qp(
        &self,
        req: tonic::Request<pb::ConnectRequest>,
    ) -> Result<tonic::Response<pb::ConnectReply>, tonic::Status> {
        let req = req.into_inner();
        let remote = Endpoint::try_from(req.endpoint).map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
        accept_one(&*self.0, &remote, &req.private_data)
            .map(tonic::Response::new)
            .map_err(tonic::Status::failed_precondition)
    }

    async fn connect_qps(
        &self,
        req: tonic::Request<pb::ConnectBatch>,
    ) -> Result<tonic::Response<pb::ConnectBatchReply>, tonic::Status> {
        let reqs = req.into_inner().requests;
        if reqs.len() > MAX_BATCH {
            return Err(tonic::Status::invalid_argument(format!(
                "{} connection requests in one batch; at most {MAX_BATCH}",
                reqs.len()
            )));
        }
        let acceptor = self.0.clone();
        // acceptors may block briefly per QP: a whole batch runs off the async workers
        let results = tokio::task::spawn_blocking(move || {
            reqs.into_iter()
                .map(|r| pb::ConnectResult {
                    result: Some(
                        match Endpoint::try_from(r.endpoint)
                            .map_err(|e| e.to_string())
                            .and_then(|remote| accept_one(&*acceptor, &remote, &r.private_data))
                        {
                            Ok(reply) => pb::connect_result::Result::Reply(reply),
                            Err(e) => pb::connect_result::Result::Error(e),
                        },
                    ),
                })
                .collect()
        })
        .await
        .map_err(|e| tonic::Status::internal(format!("accepting a batch: {e}")))?;
        Ok(tonic::Response::new(pb::ConnectBatchReply { results }))
    }
}

/// The connection-manager gRPC service for `acceptor`, to serve beside other services on one
/// port (`tonic::transport::Server::builder().add_service(cm::service(a)).add_service(..)`).
pub fn service<A: Acceptor>(
    acceptor: Arc<A>,
) -> pb::connection_manager_server::ConnectionManagerServer<impl pb::connection_manager_server::ConnectionManager> {
    pb::connection_manager_server::ConnectionManagerServer::new(Service(acceptor))
}

/// Serves the connection manager on `listener` until `shutdown` resolves (then open calls get
/// at most [`DRAIN`] to finish).
pub async fn serve<A: Acceptor>(
    listener: tokio::net::TcpListener,
    acceptor: Arc<A>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), CmError> {
    let addr = listener.local_addr()?.to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let serve = tonic::transport::Server::builder()
        .add_service(service(acceptor))
        .serve_with_incoming_shutdown(incoming(listener), async move {
            shutdown.await;
            let _ = stop.send(());
        });
    drain_bounded(serve, stopped)
        .await
        .map_err(|source| CmError::Transport { addr, source })
}

/// How long a stopping gRPC server of ours lets its open connections finish. tonic's graceful
/// shutdown waits for every connection to close, and a peer that vanished without closing its
/// connection (its FIN lost, its host gone; HTTP/2 keepalive is off) would keep the server,
/// and the daemon around it, from ever exiting.
pub const DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Awaits `serve`, a tonic server future whose graceful shutdown `stopped` announces (the
/// shutdown future sends on its sender when it resolves), for at most [`DRAIN`] after the
/// stop; connections still open then are dropped with the future.
pub async fn drain_bounded<E>(
    serve: impl std::future::Future<Output = Result<(), E>>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), E> {
    tokio::pin!(serve);
    let deadline = async {
        match stopped.await {
            Ok(()) => tokio::time::sleep(DRAIN).await,
            // the server ended without a stop: only `serve` can finish now
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        r = &mut serve => r,
        () = deadline => {
            tracing::warn!("gRPC connections still open {DRAIN:?} after the stop: dropping them");
            Ok(())
        }
    }
}

/// The connections `listener` accepts, with `TCP_NODELAY` set, for a gRPC server of ours.
///
/// A server given a raw listener stream leaves Nagle's algorithm on. HTTP/2 writes a reply as
/// headers and data, then a separate trailers frame. Nagle holds that small last write until
/// the client acknowledges the first, and the client delays that acknowledgement (40 ms on
/// Linux). So every unary call took about 44 ms: 10,000 QP connects took 7 minutes. Every
/// tonic server in the workspace serves through this.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
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

    /// Connects many QPs to one peer, each with its private data: the requests travel
    /// `CHUNK` per exchange with a few exchanges in flight, so N QPs cost N / 256 round trips
    /// rather than N. Returns, in order, each QP's reply private data (the QP is then in RTS)
    /// or why that QP was refused or could not connect; the outer error is a failed exchange.
    pub async fn connect_many(&mut self, reqs: &[(&Qp, Vec<u8>)]) -> Result<Vec<Result<Vec<u8>, CmError>>, CmError> {
        use futures_util::stream::{self, StreamExt, TryStreamExt};
        let calls = reqs.chunks(CHUNK).map(|chunk| {
            let mut client = self.client.clone();
            let batch = pb::ConnectBatch {
                requests: chunk
                    .iter()
                    .map(|(qp, pd)| pb::ConnectRequest {
                        endpoint: Some(qp.local_endpoint().into()),
                        private_data: pd.clone(),
                    })
                    .collect(),
            };
            async move {
                let n = batch.requests.len();
                let reply = client
                    .connect_qps(batch)
                    .await
                    .map_err(|s| CmError::Refused(s.message().to_string()))?
                    .into_inner();
                if reply.results.len() != n {
                    return Err(CmError::Refused(format!(
                        "{} answers to {n} connection requests",
                        reply.results.len()
                    )));
                }
                Ok(reply.results)
            }
        });
        let answers: Vec<Vec<pb::ConnectResult>> = stream::iter(calls).buffered(CHUNKS_IN_FLIGHT).try_collect().await?;
        Ok(answers
            .into_iter()
            .flatten()
            .zip(reqs)
            .map(|(r, (qp, _))| match r.result {
                Some(pb::connect_result::Result::Reply(reply)) => {
                    let remote = Endpoint::try_from(reply.endpoint)?;
                    qp.connect(&remote)?;
                    Ok(reply.private_data)
                }
                Some(pb::connect_result::Result::Error(e)) => Err(CmError::Refused(e)),
                None => Err(CmError::Refused("an empty answer".into())),
            })
            .collect())
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
