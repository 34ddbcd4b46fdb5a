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
            same_host: e.same_host.map(|d| pb::SameHost {
                pid: d.pid,
                fd: d.fd,
                ino: d.ino,
                nonce: d.nonce,
            }),
            icrc: e.icrc.name().into(),
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
        let icrc = if e.icrc.is_empty() {
            crate::transport::rc::IcrcMode::Icrc
        } else {
            e.icrc.parse().map_err(|m| CmError::BadEndpoint(format!("icrc: {m}")))?
        };
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
            same_host: e.same_host.map(|d| crate::samehost::SameHostDesc {
                pid: d.pid,
                fd: d.fd,
                ino: d.ino,
                nonce: d.nonce,
            }),
            icrc,
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
    /// Packets the connected QP numbered `qpn` has received (`RcStats::rx_packets`), or `None`
    /// when this acceptor no longer holds it. The CM's door asks this to free a caller's slot
    /// once its QP is gone and to find phantoms (QPs that never received anything). The
    /// default, for acceptors that keep no lookup by QP number, answers `None`: their QPs
    /// then count against the per-caller cap only until the next sweep and are never reaped.
    fn rx_packets(&self, _qpn: u32) -> Option<u64> {
        None
    }
    /// Drops the connected QP numbered `qpn`: the CM reaps it because it received nothing
    /// within [`DoorLimits::unused_timeout`]. The default does nothing (see
    /// [`Acceptor::rx_packets`]).
    fn reap(&self, _qpn: u32) {}
}

/// Bounds on what callers of the connection manager may hold, so that unauthenticated
/// callers cannot shut a service's door (its QP limit) with phantom QPs.
#[derive(Debug, Clone, Copy)]
pub struct DoorLimits {
    /// Most requests one `ConnectQps` call may carry; a larger batch is refused whole
    /// (`invalid_argument`). At most [`MAX_BATCH`].
    pub max_batch: usize,
    /// Most QPs accepted for one caller (its IP address) that are still held; requests past
    /// it are refused (`resource_exhausted`) while other callers are served.
    pub max_qps_per_caller: usize,
    /// A QP accepted here that receives no packet within this time is reaped
    /// ([`Acceptor::reap`]) and counted in `flexns_cm_qps_reaped_total`.
    pub unused_timeout: std::time::Duration,
}

impl Default for DoorLimits {
    fn default() -> DoorLimits {
        DoorLimits {
            max_batch: CHUNK,
            max_qps_per_caller: 1024,
            unused_timeout: std::time::Duration::from_secs(10),
        }
    }
}

/// One QP accepted through the door and still counted against its caller.
struct Admitted {
    caller: std::net::IpAddr,
    qpn: u32,
    at: std::time::Instant,
    /// It has received a packet: no longer a reaping candidate.
    used: bool,
}

/// The door's accounting: QPs accepted per caller, and QPs reaped.
#[derive(Default)]
struct Door {
    admitted: Vec<Admitted>,
    per_caller: std::collections::HashMap<std::net::IpAddr, usize>,
    reaped: u64,
}

struct Service<A: Acceptor> {
    acceptor: Arc<A>,
    limits: DoorLimits,
    door: Arc<parking_lot::Mutex<Door>>,
}

impl<A: Acceptor> Service<A> {
    /// Frees the slots of QPs the acceptor no longer holds and reaps unused QPs older than the
    /// timeout. Runs before each admission and periodically under [`serve_with`].
    fn sweep(&self) {
        sweep(&*self.acceptor, &self.limits, &self.door);
    }

    /// Reserves `n` slots for `caller` (each later [`settle`]d), or says why not.
    fn admit(&self, caller: Option<std::net::IpAddr>, n: usize) -> Result<(), tonic::Status> {
        let Some(caller) = caller else { return Ok(()) };
        self.sweep();
        let mut door = self.door.lock();
        let held = door.per_caller.get(&caller).copied().unwrap_or(0);
        if held + n > self.limits.max_qps_per_caller {
            return Err(tonic::Status::resource_exhausted(format!(
                "caller {caller} holds {held} QPs and asks for {n}; max_qps_per_caller is {}",
                self.limits.max_qps_per_caller
            )));
        }
        door.per_caller.insert(caller, held + n);
        Ok(())
    }
}

/// Settles one slot [`Service::admit`] reserved for `caller`: the QP `qpn` was accepted (it is
/// now tracked) or, with `None`, the request failed (the slot is freed).
fn settle(door: &parking_lot::Mutex<Door>, caller: Option<std::net::IpAddr>, qpn: Option<u32>) {
    let Some(caller) = caller else { return };
    let mut door = door.lock();
    match qpn {
        Some(qpn) => door.admitted.push(Admitted {
            caller,
            qpn,
            at: std::time::Instant::now(),
            used: false,
        }),
        None => release(&mut door.per_caller, caller),
    }
}

fn release(per_caller: &mut std::collections::HashMap<std::net::IpAddr, usize>, caller: std::net::IpAddr) {
    if let Some(c) = per_caller.get_mut(&caller) {
        *c = c.saturating_sub(1);
        if *c == 0 {
            per_caller.remove(&caller);
        }
    }
}

fn sweep<A: Acceptor>(acceptor: &A, limits: &DoorLimits, door: &parking_lot::Mutex<Door>) {
    let now = std::time::Instant::now();
    let mut door = door.lock();
    let Door {
        admitted,
        per_caller,
        reaped,
    } = &mut *door;
    admitted.retain_mut(|a| {
        let keep = match acceptor.rx_packets(a.qpn) {
            None => false,
            Some(n) if n > 0 => {
                a.used = true;
                true
            }
            Some(_) if a.used => true,
            Some(_) if now.duration_since(a.at) >= limits.unused_timeout => {
                acceptor.reap(a.qpn);
                *reaped += 1;
                metrics::counter!("flexns_cm_qps_reaped_total").increment(1);
                tracing::debug!(qpn = a.qpn, caller = %a.caller, "reaped a QP that never received a packet");
                false
            }
            Some(_) => true,
        };
        if !keep {
            release(per_caller, a.caller);
        }
        keep
    });
}

/// Most QPs one [`Connector::connect_many`] exchange (one `ConnectQps` call) may carry; a
/// larger batch is refused whole, so one caller cannot make the server build an unbounded reply.
pub const MAX_BATCH: usize = 4096;

/// Requests per `ConnectQps` call that [`Connector::connect_many`] sends (N QPs take
/// `N.div_ceil(CHUNK)` calls), and how many calls it keeps in flight: the server accepts one
/// batch while the client connects its QPs to the last.
pub const CHUNK: usize = 256;
const CHUNKS_IN_FLIGHT: usize = 4;

/// Refuses an endpoint whose addresses make no sense for the caller at `caller`: an
/// unspecified, multicast or broadcast address, port 0, or, from a caller that is not on this
/// host's loopback, a loopback address (it would point the QP at this host's own services).
/// Addresses that pass still serve only after the peer answers a challenge there
/// ([`crate::transport::rc::validation`]).
fn plausible_for(remote: &Endpoint, caller: Option<std::net::IpAddr>) -> Result<(), String> {
    let remote_caller = caller.is_some_and(|c| !c.is_loopback());
    let fields = std::iter::once(("addr", &remote.addr))
        .chain(remote.extra_addrs.iter().map(|a| ("extra_addrs", a)))
        .chain(remote.sources.iter().map(|a| ("sources", a)));
    for (field, a) in fields {
        let ip = a.ip();
        let bad = if a.port() == 0 {
            Some("port 0")
        } else if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
            Some("not a unicast address")
        } else if remote_caller && ip.is_loopback() {
            Some("a loopback address from a caller that is not on this host")
        } else {
            None
        };
        if let Some(why) = bad {
            return Err(format!("{field}: {a} is {why}"));
        }
    }
    Ok(())
}

/// Creates and connects the server's QP for one request; returns the reply and its QP number.
fn accept_one<A: Acceptor>(
    acceptor: &A,
    remote: &Endpoint,
    private_data: &[u8],
) -> Result<(pb::ConnectReply, u32), String> {
    let acc = acceptor.accept(remote, private_data)?;
    // the caller named these addresses: they are challenged as its word (Qp::accept)
    acc.qp.accept(remote).map_err(|e| e.to_string())?;
    let ep = acc.qp.local_endpoint();
    let qpn = acc.qp.qp_num();
    acceptor.connected(acc.qp);
    Ok((
        pb::ConnectReply {
            endpoint: Some(ep.into()),
            private_data: acc.private_data,
        },
        qpn,
    ))
}

#[tonic::async_trait]
impl<A: Acceptor> pb::connection_manager_server::ConnectionManager for Service<A> {
    async fn connect_qp(
        &self,
        req: tonic::Request<pb::ConnectRequest>,
    ) -> Result<tonic::Response<pb::ConnectReply>, tonic::Status> {
        let caller = req.remote_addr().map(|a| a.ip());
        let req = req.into_inner();
        let remote = Endpoint::try_from(req.endpoint).map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
        plausible_for(&remote, caller).map_err(tonic::Status::invalid_argument)?;
        self.admit(caller, 1)?;
        match accept_one(&*self.acceptor, &remote, &req.private_data) {
            Ok((reply, qpn)) => {
                settle(&self.door, caller, Some(qpn));
                Ok(tonic::Response::new(reply))
            }
            Err(e) => {
                settle(&self.door, caller, None);
                Err(tonic::Status::failed_precondition(e))
            }
        }
    }

    async fn connect_qps(
        &self,
        req: tonic::Request<pb::ConnectBatch>,
    ) -> Result<tonic::Response<pb::ConnectBatchReply>, tonic::Status> {
        let caller = req.remote_addr().map(|a| a.ip());
        let reqs = req.into_inner().requests;
        let max = self.limits.max_batch.min(MAX_BATCH);
        if reqs.len() > max {
            return Err(tonic::Status::invalid_argument(format!(
                "{} connection requests in one batch; at most {max} (max_batch)",
                reqs.len()
            )));
        }
        self.admit(caller, reqs.len())?;
        let acceptor = self.acceptor.clone();
        let door = self.door.clone();
        // acceptors may block briefly per QP: a whole batch runs off the async workers
        let results = tokio::task::spawn_blocking(move || {
            reqs.into_iter()
                .map(|r| pb::ConnectResult {
                    result: Some(
                        match Endpoint::try_from(r.endpoint)
                            .map_err(|e| e.to_string())
                            .and_then(|remote| {
                                plausible_for(&remote, caller)?;
                                accept_one(&*acceptor, &remote, &r.private_data)
                            }) {
                            Ok((reply, qpn)) => {
                                settle(&door, caller, Some(qpn));
                                pb::connect_result::Result::Reply(reply)
                            }
                            Err(e) => {
                                settle(&door, caller, None);
                                pb::connect_result::Result::Error(e)
                            }
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

/// The connection-manager gRPC service for `acceptor` with the default [`DoorLimits`], to
/// serve beside other services on one port
/// (`tonic::transport::Server::builder().add_service(cm::service(a)).add_service(..)`).
pub fn service<A: Acceptor>(
    acceptor: Arc<A>,
) -> pb::connection_manager_server::ConnectionManagerServer<impl pb::connection_manager_server::ConnectionManager> {
    service_with(acceptor, DoorLimits::default()).0
}

/// Counts of the connection manager's door, read with [`DoorStats::reaped`].
#[derive(Clone)]
pub struct DoorStats(Arc<parking_lot::Mutex<Door>>);

impl DoorStats {
    /// QPs reaped because they received nothing within the timeout.
    pub fn reaped(&self) -> u64 {
        self.0.lock().reaped
    }

    /// QPs accepted for `caller` and still counted against its cap.
    pub fn held_by(&self, caller: std::net::IpAddr) -> usize {
        self.0.lock().per_caller.get(&caller).copied().unwrap_or(0)
    }
}

/// [`service`] with `limits`; also returns the door's counts. Sweeps (reaping) happen before
/// each admission; [`serve_with`] also sweeps periodically.
pub fn service_with<A: Acceptor>(
    acceptor: Arc<A>,
    limits: DoorLimits,
) -> (
    pb::connection_manager_server::ConnectionManagerServer<impl pb::connection_manager_server::ConnectionManager>,
    DoorStats,
) {
    let door = Arc::new(parking_lot::Mutex::new(Door::default()));
    let stats = DoorStats(door.clone());
    (
        pb::connection_manager_server::ConnectionManagerServer::new(Service { acceptor, limits, door }),
        stats,
    )
}

/// Serves the connection manager on `listener` with the default [`DoorLimits`] until
/// `shutdown` resolves (then open calls get at most [`DRAIN`] to finish).
pub async fn serve<A: Acceptor>(
    listener: tokio::net::TcpListener,
    acceptor: Arc<A>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), CmError> {
    serve_with(listener, acceptor, DoorLimits::default(), shutdown).await
}

/// [`serve`] with `limits`; sweeps the door (frees slots of QPs gone, reaps unused ones) every
/// quarter of `limits.unused_timeout` (at least every 10 ms) as well as before each admission.
pub async fn serve_with<A: Acceptor>(
    listener: tokio::net::TcpListener,
    acceptor: Arc<A>,
    limits: DoorLimits,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), CmError> {
    let addr = listener.local_addr()?.to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (svc, stats) = service_with(acceptor.clone(), limits);
    let sweeper = tokio::spawn(sweep_periodically(acceptor, limits, stats));
    let serve = tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming(listener), async move {
            shutdown.await;
            let _ = stop.send(());
        });
    let r = drain_bounded(serve, stopped)
        .await
        .map_err(|source| CmError::Transport { addr, source });
    sweeper.abort();
    r
}

/// Sweeps the door of a service made by [`service_with`] with `acceptor` and `limits` (frees
/// the slots of QPs gone, reaps unused ones) every quarter of `limits.unused_timeout` (at least
/// every 10 ms), until dropped: what [`serve_with`] runs beside its server, for a service
/// served with others on one port.
pub async fn sweep_periodically<A: Acceptor>(acceptor: Arc<A>, limits: DoorLimits, stats: DoorStats) {
    let period = (limits.unused_timeout / 4).max(std::time::Duration::from_millis(10));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (acceptor, door) = (acceptor.clone(), stats.0.clone());
        // the acceptor's lookups may block briefly
        let _ = tokio::task::spawn_blocking(move || sweep(&*acceptor, &limits, &door)).await;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(addr: &str) -> Endpoint {
        Endpoint {
            qpn: 0x100,
            psn: 0,
            addr: addr.parse().unwrap(),
            mtu: 4096,
            recovery: Recovery::GoBackN,
            cc: Default::default(),
            paths: 1,
            spray: Default::default(),
            extra_addrs: Vec::new(),
            sources: Vec::new(),
            same_host: None,
            icrc: Default::default(),
        }
    }

    #[test]
    fn the_icrc_offer_crosses_the_cm_and_a_bad_one_names_the_field() {
        use crate::transport::rc::IcrcMode;
        for mode in [IcrcMode::Icrc, IcrcMode::None] {
            let e = Endpoint {
                icrc: mode,
                ..ep("127.0.0.1:4791")
            };
            let wire = pb::QpEndpoint::from(e.clone());
            assert_eq!(wire.icrc, mode.name());
            assert_eq!(Endpoint::try_from(Some(wire)).unwrap(), e);
        }
        // an older peer says nothing: it runs the ICRC
        let mut wire = pb::QpEndpoint::from(ep("127.0.0.1:4791"));
        wire.icrc.clear();
        assert_eq!(Endpoint::try_from(Some(wire.clone())).unwrap().icrc, IcrcMode::Icrc);
        wire.icrc = "crc32".into();
        let err = Endpoint::try_from(Some(wire)).unwrap_err().to_string();
        assert!(err.contains("icrc: unknown ICRC mode \"crc32\""), "{err}");
    }

    #[test]
    fn endpoints_that_make_no_sense_for_the_caller_are_refused_by_field() {
        let local = Some("127.0.0.1".parse().unwrap());
        let remote = Some("10.1.2.3".parse().unwrap());
        assert!(plausible_for(&ep("127.0.0.1:4791"), local).is_ok());
        assert!(plausible_for(&ep("10.1.2.3:4791"), remote).is_ok());
        // a data network apart from the control one is fine
        assert!(plausible_for(&ep("192.168.7.3:4791"), remote).is_ok());
        let e = plausible_for(&ep("127.0.0.1:4791"), remote).unwrap_err();
        assert!(e.starts_with("addr: 127.0.0.1:4791 is a loopback"), "{e}");
        let mut x = ep("10.1.2.3:4791");
        x.sources = vec!["127.0.0.53:53".parse().unwrap()];
        assert!(plausible_for(&x, remote).unwrap_err().starts_with("sources: "));
        x.sources.clear();
        x.extra_addrs = vec!["224.0.0.1:4791".parse().unwrap()];
        assert!(plausible_for(&x, remote)
            .unwrap_err()
            .starts_with("extra_addrs: 224.0.0.1:4791 is not a unicast"));
        assert!(plausible_for(&ep("0.0.0.0:4791"), local).is_err());
        assert!(plausible_for(&ep("255.255.255.255:4791"), local).is_err());
        assert!(plausible_for(&ep("127.0.0.1:0"), local).unwrap_err().contains("port 0"));
    }
}
