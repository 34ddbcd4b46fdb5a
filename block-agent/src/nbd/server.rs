//! The NBD server of the agent: fixed newstyle negotiation (EXPORT_NAME, ABORT, LIST, INFO, GO,
//! STRUCTURED_REPLY, LIST/SET_META_CONTEXT for `base:allocation`) and transmission with many
//! requests in flight per connection, answered out of order. Connections come over TCP or a
//! unix socket.
//!
//! Every write is durable on every replica when it is answered, so FLUSH has nothing left to
//! do and FUA is free, and multi-conn is promised: what one connection saw acknowledged, every
//! other connection reads. TRIM and WRITE_ZEROES deallocate the whole blocks they cover (the
//! storage nodes punch holes; only headers cross the network; reads return zeros), FAST_ZERO
//! included; WRITE_ZEROES with NO_HOLE writes zeros as data (and FAST_ZERO with it is refused,
//! ENOTSUP). BLOCK_STATUS (`base:allocation`) reports holes and data as a clean replica's
//! storage node has them (a range it cannot learn is reported as data, which is always true).
//! A request that fails its checks gets its NBD error and the connection goes on; only a
//! request header with a bad magic (the stream is lost) closes the connection.
//!
//! One client cannot exhaust the agent's memory: each connection has a budget of bytes in
//! flight ([`MAX_INFLIGHT_BYTES`], 64 MiB), taken by every request (its
//! data, at least 4 KiB) before its payload is read and returned when its reply is written. A
//! client past its budget waits (its requests stay in its socket, then in its own send queue);
//! nothing is dropped, and other connections are not slowed.

use super::proto::*;
use crate::volume::{Volume, VolumeError};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// Budget of bytes in flight per connection: two of the largest requests.
pub const MAX_INFLIGHT_BYTES: usize = 2 * MAX_REQUEST as usize;

/// Least budget a request takes (headers, a reply, a task), whatever its data.
const MIN_REQUEST_COST: usize = 4096;
/// The request reader's buffer: many queued requests per system call.
const READ_BUFFER: usize = 64 << 10;

/// The volumes this agent exports, by export name.
#[derive(Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Volume>>>,
    /// Counters.
    pub stats: NbdStats,
}

/// Counters of the NBD server.
#[derive(Debug, Default)]
pub struct NbdStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Requests answered with an error.
    pub errors: AtomicU64,
    /// Negotiation options refused.
    pub refused_options: AtomicU64,
    /// Requests with a bad magic (each closes its connection).
    pub bad_magic: AtomicU64,
    /// Requests that waited for their connection's in-flight budget.
    pub throttled: AtomicU64,
}

impl Exports {
    /// An empty set of exports.
    pub fn new() -> Arc<Exports> {
        Arc::new(Exports::default())
    }

    /// The per-connection budget of bytes in flight.
    pub fn max_inflight_bytes(&self) -> usize {
        MAX_INFLIGHT_BYTES
    }

    /// Exports `v` as `name` (replacing an export of that name).
    pub fn insert(&self, name: &str, v: Arc<Volume>) {
        self.map.write().insert(name.to_string(), v);
    }

    /// Removes the export `name`, returning its volume.
    pub fn remove(&self, name: &str) -> Option<Arc<Volume>> {
        self.map.write().remove(name)
    }

    /// The volume exported as `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Volume>> {
        self.map.read().get(name).cloned()
    }

    /// The names of the exports.
    pub fn names(&self) -> Vec<String> {
        self.map.read().keys().cloned().collect()
    }
}

/// Why a connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// A socket operation failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The client broke the protocol (what it sent).
    #[error("client: {0}")]
    Protocol(String),
}

fn protocol(s: impl Into<String>) -> NbdError {
    NbdError::Protocol(s.into())
}

/// Largest option payload read; bigger ones are refused (and skipped).
const MAX_OPTION: u32 = 64 << 10;

/// Serves one client connection to the end.
pub async fn serve<S>(exports: Arc<Exports>, stream: S) -> Result<(), NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    exports.stats.connections.fetch_add(1, Ordering::Relaxed);
    let (mut r, mut w) = tokio::io::split(stream);
    let Some(session) = negotiate(&exports, &mut r, &mut w).await? else {
        return Ok(());
    };
    transmission(exports, session, r, w).await
}

struct Session {
    /// The export's metric handles (`volume` label: the export name).
    metrics: NbdMetrics,
    volume: Arc<Volume>,
    structured: bool,
    meta: bool,
}

async fn negotiate<R, W>(exports: &Exports, r: &mut R, w: &mut W) -> Result<Option<Session>, NbdError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&hello).await?;
    let cflags = r.read_u32().await?;
    if cflags & !((FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES) as u32) != 0 {
        return Err(protocol(format!("unknown client flags {cflags:#x}")));
    }
    let no_zeroes = cflags & FLAG_NO_ZEROES as u32 != 0;
    let (mut structured, mut meta) = (false, false);
    loop {
        let magic = r.read_u64().await?;
        if magic != IHAVEOPT {
            return Err(protocol(format!("bad option magic {magic:#x}")));
        }
        let opt = r.read_u32().await?;
        let len = r.read_u32().await?;
        let mut out = Vec::new();
        if len > MAX_OPTION {
            // skip it, then refuse
            tokio::io::copy(&mut r.take(len as u64), &mut tokio::io::sink()).await?;
            option_reply(&mut out, opt, REP_ERR_TOO_BIG, b"option payload too large");
            w.write_all(&out).await?;
            exports.stats.refused_options.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data).await?;
        match opt {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data).to_string();
                // no error reply exists for this option: an unknown name closes the connection
                let Some(v) = exports.get(&name) else {
                    return Err(protocol(format!("unknown export {name:?}")));
                };
                out.extend_from_slice(&v.size().to_be_bytes());
                out.extend_from_slice(&EXPORT_FLAGS.to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                w.write_all(&out).await?;
                return Ok(Some(Session {
                    metrics: NbdMetrics::new(&name),
                    volume: v,
                    structured: false,
                    meta: false,
                }));
            }
            OPT_ABORT => {
                option_reply(&mut out, opt, REP_ACK, &[]);
                let _ = w.write_all(&out).await;
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    option_reply(&mut out, opt, REP_ERR_INVALID, b"LIST takes no data");
                } else {
                    for n in exports.names() {
                        let mut d = (n.len() as u32).to_be_bytes().to_vec();
                        d.extend_from_slice(n.as_bytes());
                        option_reply(&mut out, opt, REP_SERVER, &d);
                    }
                    option_reply(&mut out, opt, REP_ACK, &[]);
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    option_reply(&mut out, opt, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data");
                } else {
                    structured = true;
                    option_reply(&mut out, opt, REP_ACK, &[]);
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => match parse_meta(&data) {
                None => option_reply(&mut out, opt, REP_ERR_INVALID, b"malformed meta context request"),
                Some(_) if opt == OPT_SET_META_CONTEXT && !structured => {
                    option_reply(&mut out, opt, REP_ERR_INVALID, b"structured replies first")
                }
                Some((name, _)) if exports.get(&name).is_none() => {
                    option_reply(&mut out, opt, REP_ERR_UNKNOWN, format!("no export {name:?}").as_bytes())
                }
                Some((_, queries)) => {
                    let hit = if opt == OPT_LIST_META_CONTEXT {
                        queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION)
                    } else {
                        queries.iter().any(|q| q == BASE_ALLOCATION)
                    };
                    if opt == OPT_SET_META_CONTEXT {
                        meta = hit;
                    }
                    if hit {
                        let mut d = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                        d.extend_from_slice(BASE_ALLOCATION.as_bytes());
                        option_reply(&mut out, opt, REP_META_CONTEXT, &d);
                    }
                    option_reply(&mut out, opt, REP_ACK, &[]);
                }
            },
            OPT_INFO | OPT_GO => match parse_go(&data) {
                None => option_reply(&mut out, opt, REP_ERR_INVALID, b"malformed INFO/GO request"),
                Some((name, infos)) => match exports.get(&name) {
                    None => option_reply(&mut out, opt, REP_ERR_UNKNOWN, format!("no export {name:?}").as_bytes()),
                    Some(v) => {
                        let mut d = INFO_EXPORT.to_be_bytes().to_vec();
                        d.extend_from_slice(&v.size().to_be_bytes());
                        d.extend_from_slice(&EXPORT_FLAGS.to_be_bytes());
                        option_reply(&mut out, opt, REP_INFO, &d);
                        for i in infos {
                            let mut d = i.to_be_bytes().to_vec();
                            match i {
                                INFO_BLOCK_SIZE => {
                                    d.extend_from_slice(&1u32.to_be_bytes());
                                    d.extend_from_slice(&PREFERRED_BLOCK.to_be_bytes());
                                    d.extend_from_slice(&MAX_REQUEST.to_be_bytes());
                                }
                                INFO_NAME => d.extend_from_slice(name.as_bytes()),
                                INFO_DESCRIPTION => d.extend_from_slice(
                                    format!("flexns volume {} ({} replicas)", v.id(), v.replicas().len()).as_bytes(),
                                ),
                                _ => continue,
                            }
                            option_reply(&mut out, opt, REP_INFO, &d);
                        }
                        option_reply(&mut out, opt, REP_ACK, &[]);
                        if opt == OPT_GO {
                            w.write_all(&out).await?;
                            return Ok(Some(Session {
                                metrics: NbdMetrics::new(&name),
                                volume: v,
                                structured,
                                meta,
                            }));
                        }
                    }
                },
            },
            OPT_STARTTLS => option_reply(&mut out, opt, REP_ERR_POLICY, b"TLS is not offered"),
            _ => option_reply(&mut out, opt, REP_ERR_UNSUP, b"option not supported"),
        }
        if u32::from_be_bytes(out[16..20].try_into().expect("4")) & (1 << 31) != 0 {
            exports.stats.refused_options.fetch_add(1, Ordering::Relaxed);
        }
        w.write_all(&out).await?;
    }
}

/// The NBD error a failed request answers: `ENOSPC` when a replica's storage is full.
pub(crate) fn errno(e: &VolumeError) -> u32 {
    match e {
        VolumeError::OutOfRange { .. } => EINVAL,
        e if e.is_no_space() => ENOSPC,
        _ => EIO,
    }
}

async fn transmission<R, W>(exports: Arc<Exports>, s: Session, r: R, w: W) -> Result<(), NbdError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // requests a client queued together are read with one system call (a header is 28 bytes;
    // a write's payload larger than the buffer is read past it)
    let mut r = tokio::io::BufReader::with_capacity(READ_BUFFER, r);
    // every queued reply holds its request's share of the budget, so the channel is bounded
    // by the budget
    let (tx, rx) = mpsc::unbounded_channel::<(Vec<u8>, OwnedSemaphorePermit)>();
    let session = Arc::new(s);
    let cap = MAX_INFLIGHT_BYTES;
    let budget = Arc::new(Semaphore::new(cap));
    let writer = tokio::spawn(write_replies(w, rx, budget.clone(), cap));
    let mut hdr = [0u8; Request::LEN];
    let result = loop {
        match r.read_exact(&mut hdr).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e.into()),
        }
        let req = match Request::parse(&hdr) {
            Ok(q) => q,
            Err(e) => {
                exports.stats.bad_magic.fetch_add(1, Ordering::Relaxed);
                break Err(protocol(e.to_string()));
            }
        };
        exports.stats.requests.fetch_add(1, Ordering::Relaxed);
        if req.typ == CMD_WRITE && req.length > MAX_REQUEST * 2 {
            break Err(protocol(format!("write of {} bytes", req.length)));
        }
        // the request's share of the budget, before its payload is read: a client past its
        // budget waits here, and its further requests wait in the socket
        let cost = (req.length as usize).clamp(MIN_REQUEST_COST, cap) as u32;
        let permit = match budget.clone().try_acquire_many_owned(cost) {
            Ok(p) => p,
            Err(_) => {
                exports.stats.throttled.fetch_add(1, Ordering::Relaxed);
                match budget.clone().acquire_many_owned(cost).await {
                    Ok(p) => p,
                    Err(_) => break Ok(()), // never closed
                }
            }
        };
        let mut payload = Vec::new();
        if req.typ == CMD_WRITE {
            payload = vec![0u8; req.length as usize];
            if let Err(e) = r.read_exact(&mut payload).await {
                break Err(e.into());
            }
        }
        if req.typ == CMD_DISC {
            break Ok(());
        }
        if let Err(e) = req.check(session.volume.size(), session.structured, session.meta) {
            exports.stats.errors.fetch_add(1, Ordering::Relaxed);
            session.metrics.op(req.typ).errors.increment(1);
            let _ = tx.send((error_reply(&session, &req, e, "request refused"), permit));
            continue;
        }
        let (session, tx, exports) = (session.clone(), tx.clone(), exports.clone());
        tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let reply = run(&session, &req, payload).await;
            record(&session, &req, t0.elapsed(), reply.1);
            if reply.1 {
                exports.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            let _ = tx.send((reply.0, permit));
        });
    };
    drop(tx);
    // replies of requests still running are written before the connection closes
    let _ = writer.await;
    result
}

fn error_reply(s: &Session, req: &Request, e: u32, msg: &str) -> Vec<u8> {
    if s.structured && matches!(req.typ, CMD_READ | CMD_BLOCK_STATUS) {
        structured_error(req.handle, e, msg)
    } else {
        simple_reply(req.handle, e).to_vec()
    }
}

/// The commands with their `op` labels; anything else is `unknown` (the last handles).
const OPS: [(u16, &str); 7] = [
    (CMD_READ, "read"),
    (CMD_WRITE, "write"),
    (CMD_FLUSH, "flush"),
    (CMD_TRIM, "trim"),
    (CMD_WRITE_ZEROES, "write_zeroes"),
    (CMD_BLOCK_STATUS, "block_status"),
    (CMD_DISC, "disconnect"),
];

/// One operation's metric handles.
struct OpMetrics {
    requests: metrics::Counter,
    bytes: metrics::Counter,
    errors: metrics::Counter,
    latency: metrics::Histogram,
}

/// A connection's metric handles, per operation: labels are built once, at negotiation, not
/// per request.
struct NbdMetrics([OpMetrics; OPS.len() + 1]);

impl NbdMetrics {
    fn new(volume: &str) -> NbdMetrics {
        let labels = OPS.map(|(_, op)| op);
        let ops = std::array::from_fn(|i| {
            let (v, op) = (volume.to_string(), labels.get(i).copied().unwrap_or("unknown"));
            OpMetrics {
                requests: metrics::counter!("flexns_nbd_requests_total", "volume" => v.clone(), "op" => op),
                bytes: metrics::counter!("flexns_nbd_bytes_total", "volume" => v.clone(), "op" => op),
                errors: metrics::counter!("flexns_nbd_errors_total", "volume" => v.clone(), "op" => op),
                latency: metrics::histogram!("flexns_nbd_request_duration_seconds", "volume" => v, "op" => op),
            }
        });
        NbdMetrics(ops)
    }

    fn op(&self, typ: u16) -> &OpMetrics {
        let i = OPS.iter().position(|(t, _)| *t == typ).unwrap_or(OPS.len());
        &self.0[i]
    }
}

/// Metrics of one request: count, bytes moved, latency, failure.
fn record(s: &Session, req: &Request, took: std::time::Duration, failed: bool) {
    let m = s.metrics.op(req.typ);
    m.requests.increment(1);
    if matches!(req.typ, CMD_READ | CMD_WRITE) && !failed {
        m.bytes.increment(req.length as u64);
    }
    if failed {
        m.errors.increment(1);
    }
    m.latency.record(took.as_secs_f64());
}

/// Runs a checked request; returns its reply and whether it failed.
async fn run(s: &Session, req: &Request, payload: Vec<u8>) -> (Vec<u8>, bool) {
    let v = &s.volume;
    let (off, len) = (req.offset, req.length as u64);
    let res: Result<Vec<u8>, (u32, String)> = match req.typ {
        CMD_READ => match v.read(off, len).await {
            Ok(data) => {
                let mut out = Vec::with_capacity(32 + data.len());
                if s.structured {
                    chunk_header(
                        &mut out,
                        REPLY_FLAG_DONE,
                        CHUNK_OFFSET_DATA,
                        req.handle,
                        8 + data.len() as u32,
                    );
                    out.extend_from_slice(&off.to_be_bytes());
                } else {
                    out.extend_from_slice(&simple_reply(req.handle, 0));
                }
                out.extend_from_slice(&data);
                Ok(out)
            }
            Err(e) => Err((errno(&e), e.to_string())),
        },
        CMD_WRITE => v
            .write(off, &payload, req.flags & CMD_FLAG_FUA != 0)
            .await
            .map(|()| simple_reply(req.handle, 0).to_vec())
            .map_err(|e| (errno(&e), e.to_string())),
        CMD_WRITE_ZEROES if req.flags & CMD_FLAG_FAST_ZERO != 0 && req.flags & CMD_FLAG_NO_HOLE != 0 => Err((
            ENOTSUP,
            "zeros kept allocated (NO_HOLE) are written as data: not fast".into(),
        )),
        CMD_WRITE_ZEROES | CMD_TRIM => v
            .write_zeroes(off, len, req.flags & CMD_FLAG_NO_HOLE == 0)
            .await
            .map(|()| simple_reply(req.handle, 0).to_vec())
            .map_err(|e| (errno(&e), e.to_string())),
        // every acknowledged write is already durable on every replica
        CMD_FLUSH => Ok(simple_reply(req.handle, 0).to_vec()),
        CMD_BLOCK_STATUS => {
            let mut runs = match v.allocation(off, len).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("BLOCK_STATUS {off}+{len}: {e}; answering \"data\"");
                    vec![(len, crate::store::ALLOC_DATA)]
                }
            };
            if req.flags & CMD_FLAG_REQ_ONE != 0 {
                runs.truncate(1);
            }
            let mut out = Vec::new();
            chunk_header(
                &mut out,
                REPLY_FLAG_DONE,
                CHUNK_BLOCK_STATUS,
                req.handle,
                4 + 8 * runs.len() as u32,
            );
            out.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
            for (bytes, state) in runs {
                let flags = if state == crate::store::ALLOC_HOLE {
                    STATE_HOLE | STATE_ZERO
                } else {
                    0
                };
                out.extend_from_slice(&(bytes as u32).to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
            }
            Ok(out)
        }
        _ => Err((EINVAL, "unknown command".into())),
    };
    match res {
        Ok(out) => (out, false),
        Err((e, msg)) => {
            if e == ENOSPC {
                // a full replica fails every write: the volume logs that once per failure
                // episode, and flexns_nbd_errors_total counts each
                tracing::debug!("NBD request {:?}: {msg}", req);
            } else {
                tracing::warn!("NBD request {:?}: {msg}", req);
            }
            (error_reply(s, req, e, &msg), true)
        }
    }
}

/// Writes replies as they come, coalescing what is queued (up to 4 MiB); a reply's budget
/// share is returned once it is written. A lone reply while other requests of the connection
/// still run waits for one turn of the runtime first: the answers the engine completed in
/// the same pass finish in that turn and leave in the same write (at depth, one system call
/// for several replies); a reply with none running beside it (QD1) leaves at once.
async fn write_replies<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::UnboundedReceiver<(Vec<u8>, OwnedSemaphorePermit)>,
    budget: Arc<Semaphore>,
    cap: usize,
) {
    let mut batch: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut held = Vec::new();
    while let Some((first, permit)) = rx.recv().await {
        // with no other reply queued, the budget that this reply does not hold is held by
        // requests still running (or being read)
        if rx.is_empty() && budget.available_permits() + permit.num_permits() < cap {
            tokio::task::yield_now().await;
        }
        if rx.is_empty() {
            if w.write_all(&first).await.is_err() {
                return;
            }
            drop(permit);
            continue;
        }
        batch.clear();
        batch.extend_from_slice(&first);
        held.push(permit);
        while batch.len() < (4 << 20) {
            match rx.try_recv() {
                Ok((m, p)) => {
                    batch.extend_from_slice(&m);
                    held.push(p);
                }
                Err(_) => break,
            }
        }
        if w.write_all(&batch).await.is_err() {
            return;
        }
        held.clear();
    }
    let _ = w.shutdown().await;
}

/// Accepts NBD clients on a TCP listener until the task is dropped.
pub async fn serve_tcp(exports: Arc<Exports>, l: tokio::net::TcpListener) {
    loop {
        match l.accept().await {
            Ok((s, from)) => {
                let _ = s.set_nodelay(true);
                let e = exports.clone();
                tokio::spawn(async move {
                    if let Err(err) = serve(e, s).await {
                        tracing::info!("NBD client {from}: {err}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("NBD accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// Accepts NBD clients on a unix socket until the task is dropped.
pub async fn serve_unix(exports: Arc<Exports>, l: tokio::net::UnixListener) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let e = exports.clone();
                tokio::spawn(async move {
                    if let Err(err) = serve(e, s).await {
                        tracing::info!("NBD unix client: {err}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("NBD accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
