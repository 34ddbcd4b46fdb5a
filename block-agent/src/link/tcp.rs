//! The plain-TCP link: the plain block protocol ([`crate::tcp_proto`]) over one kernel TCP
//! connection to the storage node, the reference the Solar link is measured against. A sender
//! thread writes requests as they are submitted (as many in flight as callers make); a receiver
//! thread reads the replies, matched by id, and answers them. When the connection breaks, or
//! the node moves ([`super::Link::retarget`]), the sender reconnects and sends again what was
//! in flight (a write keeps its version, so a repeat cannot overtake a newer write); a request
//! not answered within the I/O timeout fails.

use super::{Cmd, LinkConfig, LinkError, LinkStatus, ReadResult, Target};
use crate::tcp_proto::{self, Header};
use netstack::transport::solar::client::{ClientStats, IoError, SubmitError};
use netstack::transport::solar::wire::Status;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

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

struct Shared {
    server: Mutex<SocketAddr>,
    queue: Mutex<VecDeque<Cmd>>,
    cv: Condvar,
    /// By request id, so a reconnect resends in order.
    inflight: Mutex<BTreeMap<u64, InFlight>>,
    /// The connection's write half; None while disconnected.
    conn: Mutex<Option<TcpStream>>,
    /// The connection failed (the receiver saw it, or the node moved): the sender reconnects.
    broken: AtomicBool,
    stop: AtomicBool,
    status: Mutex<LinkStatus>,
}

/// A plain-TCP link; dropping it stops its threads (requests in flight fail).
pub(super) struct TcpLink {
    sh: Arc<Shared>,
    sender: Option<JoinHandle<()>>,
}

impl TcpLink {
    pub(super) fn start(cfg: LinkConfig) -> Result<TcpLink, LinkError> {
        let server = cfg.server;
        let sh = Arc::new(Shared {
            server: Mutex::new(server),
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            inflight: Mutex::new(BTreeMap::new()),
            conn: Mutex::new(None),
            broken: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            status: Mutex::new(LinkStatus {
                paths: 1,
                ..Default::default()
            }),
        });
        let s2 = sh.clone();
        let io_timeout = Duration::from_nanos(cfg.client.io_timeout_ns);
        let sender = std::thread::Builder::new()
            .name(format!("tblk-{server}"))
            .spawn(move || Sender::new(s2, io_timeout).run())
            .map_err(|e| LinkError::Setup(server, format!("thread: {e}")))?;
        Ok(TcpLink {
            sh,
            sender: Some(sender),
        })
    }

    pub(super) fn submit(&self, c: Cmd) {
        self.sh.queue.lock().push_back(c);
        self.sh.cv.notify_one();
    }

    pub(super) fn status(&self) -> LinkStatus {
        self.sh.status.lock().clone()
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.cv.notify_all();
        if let Some(s) = self.sh.conn.lock().as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.sender.take() {
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

/// Writes a frame: the header and, for a WRITE, its blocks (one vectored write where the
/// socket takes it all).
fn write_frame(s: &mut TcpStream, hdr: &Header, data: Option<&[u8]>) -> std::io::Result<()> {
    let h = hdr.encode();
    let data = data.unwrap_or(&[]);
    let total = h.len() + data.len();
    let mut done = 0;
    while done < total {
        let n = if done < h.len() {
            s.write_vectored(&[IoSlice::new(&h[done..]), IoSlice::new(data)])?
        } else {
            s.write(&data[done - h.len()..])?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

struct Sender {
    sh: Arc<Shared>,
    io_timeout: Duration,
    next_id: u64,
    receiver: Option<JoinHandle<()>>,
    /// The next time to try connecting while disconnected.
    retry_at: Instant,
    sent: u64,
}

impl Sender {
    fn new(sh: Arc<Shared>, io_timeout: Duration) -> Sender {
        Sender {
            sh,
            io_timeout,
            next_id: 1,
            receiver: None,
            retry_at: Instant::now(),
            sent: 0,
        }
    }

    fn server(&self) -> SocketAddr {
        *self.sh.server.lock()
    }

    fn run(mut self) {
        while !self.sh.stop.load(Ordering::SeqCst) {
            if self.sh.broken.load(Ordering::SeqCst) && Instant::now() >= self.retry_at {
                self.reconnect();
            }
            let cmd = {
                let mut q = self.sh.queue.lock();
                if q.is_empty() {
                    self.sh.cv.wait_for(&mut q, Duration::from_millis(20));
                }
                q.pop_front()
            };
            if let Some(c) = cmd {
                self.handle(c);
            }
            self.expire();
            self.publish();
        }
        self.teardown();
        let addr = self.server();
        for (_, f) in std::mem::take(&mut *self.sh.inflight.lock()) {
            answer(f.done, Err(LinkError::Stopped(addr)));
        }
        for c in self.sh.queue.lock().drain(..) {
            match c {
                Cmd::Write { done, .. } | Cmd::WriteZeroes { done, .. } => {
                    answer(Done::Write(done), Err(LinkError::Stopped(addr)))
                }
                Cmd::Read { done, .. } => answer(Done::Read(done), Err(LinkError::Stopped(addr))),
                Cmd::Retarget => {}
            }
        }
    }

    fn handle(&mut self, c: Cmd) {
        let addr = self.server();
        let (hdr, data, done) = match c {
            Cmd::Retarget => {
                // the new address is in `server`: reconnect there, resending what is in flight
                self.break_conn();
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
        let data2 = data.clone();
        self.sh.inflight.lock().insert(
            hdr.id,
            InFlight {
                hdr,
                data,
                done,
                deadline: Instant::now() + self.io_timeout,
            },
        );
        // disconnected: it goes out with the others when the connection is back
        let mut g = self.sh.conn.lock();
        if let Some(s) = g.as_mut() {
            if let Err(e) = write_frame(s, &hdr, data2.as_deref()) {
                tracing::warn!("TCP link to {addr}: {e}; reconnecting");
                drop(g);
                self.break_conn();
            } else {
                self.sent += 1;
            }
        }
    }

    /// Fails requests not answered within the I/O timeout.
    fn expire(&mut self) {
        let now = Instant::now();
        let addr = self.server();
        let late: Vec<u64> = self
            .sh
            .inflight
            .lock()
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(f) = self.sh.inflight.lock().remove(&id) {
                let e = IoError::TimedOut {
                    blocks_left: f.hdr.blocks.min(u16::MAX as u32) as u16,
                    paths_up: u16::from(!self.sh.broken.load(Ordering::SeqCst)),
                };
                answer(f.done, Err(LinkError::Io(addr, e)));
            }
        }
    }

    fn publish(&self) {
        let up = !self.sh.broken.load(Ordering::SeqCst);
        *self.sh.status.lock() = LinkStatus {
            stats: ClientStats {
                packets_sent: self.sent,
                ..Default::default()
            },
            paths: 1,
            paths_up: u16::from(up),
            path_stats: Vec::new(),
            outstanding: self.sh.inflight.lock().len(),
        };
    }

    fn break_conn(&self) {
        self.sh.broken.store(true, Ordering::SeqCst);
        if let Some(s) = self.sh.conn.lock().as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Closes the connection and waits for its receiver.
    fn teardown(&mut self) {
        self.break_conn();
        *self.sh.conn.lock() = None;
        if let Some(r) = self.receiver.take() {
            let _ = r.join();
        }
    }

    /// Connects (again) and sends every request in flight, in order.
    fn reconnect(&mut self) {
        self.teardown();
        let addr = self.server();
        let s = match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("TCP link to {addr}: {e}");
                self.retry_at = Instant::now() + Duration::from_millis(50);
                return;
            }
        };
        let _ = s.set_nodelay(true);
        let Ok(r) = s.try_clone() else {
            self.retry_at = Instant::now() + Duration::from_millis(50);
            return;
        };
        let sh = self.sh.clone();
        match std::thread::Builder::new()
            .name(format!("tblk-rx-{addr}"))
            .spawn(move || receive(sh, r, addr))
        {
            Ok(t) => self.receiver = Some(t),
            Err(_) => {
                self.retry_at = Instant::now() + Duration::from_millis(50);
                return;
            }
        }
        let mut g = self.sh.conn.lock();
        *g = Some(s);
        self.sh.broken.store(false, Ordering::SeqCst);
        let resend: Vec<(Header, Option<Arc<[u8]>>)> = self
            .sh
            .inflight
            .lock()
            .values()
            .map(|f| (f.hdr, f.data.clone()))
            .collect();
        if !resend.is_empty() {
            tracing::info!("TCP link to {addr}: connected; sending {} requests again", resend.len());
        }
        let s = g.as_mut().expect("just set");
        for (h, d) in resend {
            if write_frame(s, &h, d.as_deref()).is_err() {
                drop(g);
                self.break_conn();
                return;
            }
        }
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

/// The receiver of one connection: answers replies by id until the connection ends.
fn receive(sh: Arc<Shared>, mut s: TcpStream, addr: SocketAddr) {
    let mut hdr = [0u8; tcp_proto::HDR];
    let end = |sh: &Shared, why: String| {
        if !sh.broken.swap(true, Ordering::SeqCst) && !sh.stop.load(Ordering::SeqCst) {
            tracing::warn!("TCP link to {addr}: {why}; reconnecting");
        }
        sh.cv.notify_all();
    };
    loop {
        if let Err(e) = s.read_exact(&mut hdr) {
            return end(&sh, e.to_string());
        }
        let h = match Header::decode(&hdr) {
            Ok(h) => h,
            Err(e) => return end(&sh, format!("a bad reply: {e}")),
        };
        let mut data = vec![0u8; h.payload(true)];
        if let Err(e) = s.read_exact(&mut data) {
            return end(&sh, e.to_string());
        }
        // an answer to a request that timed out meanwhile is dropped
        let Some(f) = sh.inflight.lock().remove(&h.id) else {
            continue;
        };
        let r = match h.status() {
            Status::Ok => Ok(data),
            st => Err(LinkError::Io(addr, IoError::Status(st, 0))),
        };
        answer(f.done, r);
    }
}
