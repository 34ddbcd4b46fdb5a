//! The plain-TCP link: the plain block protocol ([`crate::tcp_proto`]) over one kernel TCP
//! connection to the storage node, the reference the Solar link is measured against.
//!
//! One task owns the link: the connection, the requests in flight and the request ids. It runs
//! on the runtime the link is opened on (the agent's, as the Solar link's data core does), so a
//! request goes from the NBD side to the socket, and its reply back, without a hand-off to
//! another thread; a link opened outside a runtime gets a thread running one. Requests that
//! arrive together leave in one `write`, and one `read` takes every reply the socket holds.
//! When the connection breaks, or the node moves ([`super::Link::retarget`]), the task
//! reconnects and sends again what was in flight (a write keeps its version, so a repeat cannot
//! overtake a newer write); a request not answered within the I/O timeout fails.

use super::{Cmd, LinkConfig, LinkError, LinkStatus, ReadResult, Target};
use crate::tcp_proto::{self, Header};
use bytes::{Buf, BytesMut};
use netstack::transport::solar::client::{ClientStats, IoError, SubmitError};
use netstack::transport::solar::wire::Status;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// How often the task fails requests past their deadline and publishes its status.
const TICK: Duration = Duration::from_millis(20);
/// How long a failed connect waits before the next one.
const RETRY: Duration = Duration::from_millis(50);
/// What one `read` takes at least room for.
const READ_CHUNK: usize = 64 * 1024;

enum Done {
    Write(oneshot::Sender<Result<(), LinkError>>),
    Read(oneshot::Sender<ReadResult>),
}

/// A request sent (or to send again after a reconnect), not answered yet.
struct InFlight {
    hdr: Header,
    data: Option<Arc<[u8]>>,
    done: Done,
    deadline: Instant,
}

/// A plain-TCP link; dropping it stops its task (requests in flight fail).
pub(super) struct TcpLink {
    /// Commands to the task; taken on drop, which ends the task.
    tx: Option<mpsc::UnboundedSender<Cmd>>,
    status: Arc<Mutex<LinkStatus>>,
    /// The thread running the task's runtime, for a link opened outside a runtime.
    thread: Option<JoinHandle<()>>,
    server: SocketAddr,
}

impl TcpLink {
    pub(super) fn start(cfg: LinkConfig) -> Result<TcpLink, LinkError> {
        let server = cfg.server;
        let (tx, rx) = mpsc::unbounded_channel();
        let status = Arc::new(Mutex::new(LinkStatus {
            paths: 1,
            ..Default::default()
        }));
        let task = Task {
            server,
            io_timeout: Duration::from_nanos(cfg.client.io_timeout_ns),
            rx,
            status: status.clone(),
            next_id: 1,
            inflight: BTreeMap::new(),
            conn: None,
            retry_at: Instant::now(),
            sent: 0,
        };
        let thread = match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(task.run());
                None
            }
            Err(_) => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| LinkError::Setup(server, format!("runtime: {e}")))?;
                let t = std::thread::Builder::new()
                    .name(format!("tblk-{server}"))
                    .spawn(move || rt.block_on(task.run()))
                    .map_err(|e| LinkError::Setup(server, format!("thread: {e}")))?;
                Some(t)
            }
        };
        Ok(TcpLink {
            tx: Some(tx),
            status,
            thread,
            server,
        })
    }

    pub(super) fn submit(&self, c: Cmd) {
        let Some(tx) = &self.tx else { return };
        if let Err(mpsc::error::SendError(c)) = tx.send(c) {
            // the task is gone (its runtime shut down)
            fail(c, LinkError::Stopped(self.server));
        }
    }

    pub(super) fn status(&self) -> LinkStatus {
        self.status.lock().clone()
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // the task sees the channel closed, fails what is in flight and closes the connection
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The header of a request without payload (READ, WRITE_ZEROES).
fn header(op: u8, t: Target, blocks: u16, version: u64) -> Header {
    Header {
        op,
        volume: t.volume,
        blocks: blocks as u32,
        lba: t.lba,
        version,
        epoch: t.epoch,
        ..Default::default()
    }
}

/// Appends a frame to `out`: the header and, for a WRITE, its blocks.
fn encode_frame(out: &mut BytesMut, hdr: &Header, data: Option<&[u8]>) {
    out.extend_from_slice(&hdr.encode());
    if let Some(d) = data {
        out.extend_from_slice(d);
    }
}

fn answer(d: Done, r: Result<Vec<u8>, LinkError>) {
    match d {
        Done::Write(tx) => {
            let _ = tx.send(r.map(|_| ()));
        }
        Done::Read(tx) => {
            let _ = tx.send(r);
        }
    }
}

/// Answers a command the task never took with `e`.
fn fail(c: Cmd, e: LinkError) {
    match c {
        Cmd::Write { done, .. } | Cmd::WriteZeroes { done, .. } => answer(Done::Write(done), Err(e)),
        Cmd::Read { done, .. } => answer(Done::Read(done), Err(e)),
        Cmd::Retarget(_) => {}
    }
}

/// One connection: its halves, the replies read but not yet parsed, the frames not yet
/// written.
struct Conn {
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    inbuf: BytesMut,
    out: BytesMut,
}

/// What woke the task.
enum Event {
    Cmd(Option<Cmd>),
    Read(std::io::Result<usize>),
    Wrote(std::io::Result<usize>),
    Tick,
}

/// The link's owner: every field is this task's alone.
struct Task {
    server: SocketAddr,
    io_timeout: Duration,
    rx: mpsc::UnboundedReceiver<Cmd>,
    status: Arc<Mutex<LinkStatus>>,
    next_id: u64,
    /// By request id, so a reconnect resends in order.
    inflight: BTreeMap<u64, InFlight>,
    /// None while disconnected.
    conn: Option<Conn>,
    /// The next time to try connecting while disconnected.
    retry_at: Instant,
    sent: u64,
}

impl Task {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.conn.is_none() && Instant::now() >= self.retry_at {
                self.reconnect().await;
            }
            // every branch is cancel-safe: a branch that loses the race did nothing
            let ev = {
                let (rx, conn) = (&mut self.rx, &mut self.conn);
                match conn {
                    Some(c) => {
                        c.inbuf.reserve(READ_CHUNK);
                        let writing = !c.out.is_empty();
                        let Conn { rd, wr, inbuf, out } = c;
                        // the tick first: it is ready once per TICK, and a stream of replies
                        // (always readable) must not starve the timeouts behind it
                        tokio::select! {
                            biased;
                            _ = tick.tick() => Event::Tick,
                            r = wr.write(out), if writing => Event::Wrote(r),
                            r = rd.read_buf(inbuf) => Event::Read(r),
                            c = rx.recv() => Event::Cmd(c),
                        }
                    }
                    None => tokio::select! {
                        c = rx.recv() => Event::Cmd(c),
                        _ = tick.tick() => Event::Tick,
                    },
                }
            };
            match ev {
                Event::Cmd(None) => break,
                Event::Cmd(Some(c)) => {
                    self.handle(c);
                    // what arrived meanwhile leaves in the same write
                    while let Ok(c) = self.rx.try_recv() {
                        self.handle(c);
                    }
                }
                Event::Wrote(Ok(n)) if n > 0 => {
                    if let Some(c) = &mut self.conn {
                        c.out.advance(n);
                    }
                }
                Event::Wrote(r) => self.broken(r.map_or_else(|e| e.to_string(), |_| "wrote nothing".into())),
                Event::Read(Ok(0)) => self.broken("the node closed the connection".into()),
                Event::Read(Ok(_)) => self.replies(),
                Event::Read(Err(e)) => self.broken(e.to_string()),
                Event::Tick => {
                    self.expire();
                    self.publish();
                }
            }
        }
        self.conn = None;
        let addr = self.server;
        for (_, f) in std::mem::take(&mut self.inflight) {
            answer(f.done, Err(LinkError::Stopped(addr)));
        }
        self.rx.close();
        while let Ok(c) = self.rx.try_recv() {
            fail(c, LinkError::Stopped(addr));
        }
    }

    fn handle(&mut self, c: Cmd) {
        let addr = self.server;
        let (hdr, data, done) = match c {
            Cmd::Retarget(to) => {
                // reconnect there, resending what is in flight
                self.server = to;
                self.conn = None;
                self.retry_at = Instant::now();
                return;
            }
            Cmd::Write {
                target,
                data,
                fua,
                version,
                done,
            } => {
                let blocks = data.len() / tcp_proto::BLOCK;
                if data.is_empty() || !data.len().is_multiple_of(tcp_proto::BLOCK) {
                    let _ = done.send(Err(LinkError::Submit(addr, SubmitError::Length(data.len()))));
                    return;
                }
                if blocks > tcp_proto::MAX_BLOCKS as usize {
                    let _ = done.send(Err(LinkError::Submit(addr, SubmitError::TooLarge(blocks))));
                    return;
                }
                let hdr = Header {
                    op: tcp_proto::WRITE,
                    flags: if fua { tcp_proto::FUA } else { 0 },
                    volume: target.volume,
                    blocks: blocks as u32,
                    lba: target.lba,
                    version,
                    epoch: target.epoch,
                    ..Default::default()
                };
                (hdr, Some(data), Done::Write(done))
            }
            // the requests without payload: a header for `blocks` blocks
            Cmd::WriteZeroes {
                target,
                blocks,
                version,
                done,
            } => (
                header(tcp_proto::WRITE_ZEROES, target, blocks, version),
                None,
                Done::Write(done),
            ),
            Cmd::Read { target, blocks, done } => (header(tcp_proto::READ, target, blocks, 0), None, Done::Read(done)),
        };
        if hdr.blocks == 0 {
            answer(done, Err(LinkError::Submit(addr, SubmitError::Length(0))));
            return;
        }
        let hdr = Header {
            id: self.next_id,
            ..hdr
        };
        self.next_id += 1;
        // disconnected: it goes out with the others when the connection is back
        if let Some(c) = &mut self.conn {
            encode_frame(&mut c.out, &hdr, data.as_deref());
            self.sent += 1;
        }
        self.inflight.insert(
            hdr.id,
            InFlight {
                hdr,
                data,
                done,
                deadline: Instant::now() + self.io_timeout,
            },
        );
    }

    /// Answers every whole reply read so far.
    fn replies(&mut self) {
        let addr = self.server;
        loop {
            let Some(c) = &mut self.conn else { return };
            let Some(head) = c.inbuf.get(..tcp_proto::HDR) else {
                return;
            };
            let h = match Header::decode(head.try_into().expect("a header's length")) {
                Ok(h) => h,
                Err(e) => return self.broken(format!("a bad reply: {e}")),
            };
            let len = tcp_proto::HDR + h.payload(true);
            if c.inbuf.len() < len {
                c.inbuf.reserve(len - c.inbuf.len());
                return;
            }
            let data = c.inbuf[tcp_proto::HDR..len].to_vec();
            c.inbuf.advance(len);
            // an answer to a request that timed out meanwhile is dropped
            let Some(f) = self.inflight.remove(&h.id) else {
                continue;
            };
            let r = match h.status() {
                Status::Ok => Ok(data),
                st => Err(LinkError::Io(addr, IoError::Status(st, 0))),
            };
            answer(f.done, r);
        }
    }

    /// Fails requests not answered within the I/O timeout.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        let paths_up = u16::from(self.conn.is_some());
        for id in late {
            if let Some(f) = self.inflight.remove(&id) {
                let e = IoError::TimedOut {
                    blocks_left: f.hdr.blocks.min(u16::MAX as u32) as u16,
                    paths_up,
                };
                answer(f.done, Err(LinkError::Io(self.server, e)));
            }
        }
    }

    fn publish(&self) {
        *self.status.lock() = LinkStatus {
            stats: ClientStats {
                packets_sent: self.sent,
                ..Default::default()
            },
            paths: 1,
            paths_up: u16::from(self.conn.is_some()),
            path_stats: Vec::new(),
            outstanding: self.inflight.len(),
        };
    }

    /// Drops the connection; the next turn connects again.
    fn broken(&mut self, why: String) {
        tracing::warn!("TCP link to {}: {why}; reconnecting", self.server);
        self.conn = None;
    }

    /// Connects (again) and queues every request in flight, in order, to be sent first.
    async fn reconnect(&mut self) {
        self.conn = None;
        let addr = self.server;
        let s = match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!("TCP link to {addr}: {e}");
                self.retry_at = Instant::now() + RETRY;
                return;
            }
            Err(_) => {
                tracing::debug!("TCP link to {addr}: connect timed out");
                self.retry_at = Instant::now() + RETRY;
                return;
            }
        };
        let _ = s.set_nodelay(true);
        let (rd, wr) = s.into_split();
        let mut out = BytesMut::new();
        for f in self.inflight.values() {
            encode_frame(&mut out, &f.hdr, f.data.as_deref());
        }
        if !self.inflight.is_empty() {
            tracing::info!(
                "TCP link to {addr}: connected; sending {} requests again",
                self.inflight.len()
            );
        }
        self.sent += self.inflight.len() as u64;
        self.conn = Some(Conn {
            rd,
            wr,
            inbuf: BytesMut::with_capacity(READ_CHUNK),
            out,
        });
    }
}
