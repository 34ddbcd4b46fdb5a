//! The application's side: attach to a running `flexnsd` and use its engine through the verbs
//! names netstack has ([`Pd::reg_mr`], [`Attachment::create_cq`], [`Attachment::create_qp`],
//! [`Qp::post_send`], [`Qp::post_recv`], [`Cq::poll`], [`Cq::wait`], [`Cq::next`]), with
//! netstack's work-request and completion types. Posting and polling touch only shared memory
//! (and, when the daemon sleeps, one eventfd write); commands go over the Unix socket.
//!
//! A daemon that dies (its socket closes) fails waiting calls and commands with
//! [`ClientError::DaemonGone`], and every work request posted and not completed then completes
//! with [`WcStatus::WrFlushErr`] on its CQ, as a QP in the error state flushes its queues: the
//! client keeps, per QP, what it posted until the completion that retires it.
//!
//! ```no_run
//! use netstack::verbs::attach::client::*;
//! use netstack::verbs::{Access, SendWr, WrOpcode};
//! let att = Attachment::connect("/run/flexnsd.sock", "demo").unwrap();
//! let pd = att.alloc_pd().unwrap();
//! let mr = pd.reg_mr(1 << 20, Access::ALL).unwrap();
//! let cq = att.create_cq(256).unwrap();
//! let qp = att.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
//! # let remote = qp.local_endpoint().unwrap();
//! qp.connect(&remote).unwrap();
//! qp.post_send(SendWr::new(1, WrOpcode::RdmaWrite).sge(mr.sge(0, 4096)).remote(0x1000, 0x1234)).unwrap();
//! let wc = cq.next(std::time::Duration::from_secs(1)).unwrap();
//! ```

use super::proto::{self, ModifyStep, Reply, Request, Status};
use super::shm::{self, Mapping, RingFault};
use super::sys;
use crate::mem::Region;
use crate::verbs::{Access, Endpoint, RecvWr, SendFlags, SendWr, Sge, Wc, WcOpcode, WcStatus};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A system call failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The daemon closed the connection (it died or was stopped).
    #[error("flexnsd is gone (its socket closed)")]
    DaemonGone,
    /// The daemon refused the command.
    #[error("flexnsd refused {field}: {message}")]
    Refused {
        /// The field at fault.
        field: String,
        /// Why.
        message: String,
    },
    /// The daemon answered something this client does not expect.
    #[error("protocol: {0}")]
    Protocol(String),
    /// An argument is invalid (which, and why).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The QP's send ring has no free entry, or the QP already has as many work requests
    /// outstanding (posted, not yet completed) as its ring has entries.
    #[error("send queue full ({0} entries outstanding)")]
    QueueFull(usize),
    /// The daemon closed the QP's send ring.
    #[error("the daemon closed this QP's ring: {0:?}")]
    RingClosed(RingFault),
}

type Result<T> = std::result::Result<T, ClientError>;

/// How long a waiting call polls its completion ring before it sleeps on the eventfd (as long
/// as netstack's default `spin_us`).
const SPIN: Duration = Duration::from_micros(50);

struct Inner {
    sock: OwnedFd,
    /// One command at a time.
    lock: Mutex<()>,
    doorbell: OwnedFd,
    app: u64,
    /// The daemon's socket closed: what is outstanding is flushed.
    dead: AtomicBool,
    /// When (ms since `epoch`) a poll that found nothing last looked at the socket.
    looked_ms: AtomicU64,
    epoch: Instant,
    /// Each live QP's outstanding work requests, by QP number.
    qps: Mutex<HashMap<u32, Arc<Track>>>,
    /// The daemon's data-path address, as its `Hello` said.
    addr: Option<std::net::SocketAddrV4>,
}

/// How often a poll that finds no completion checks whether the daemon is still there.
const LIVENESS_EVERY_MS: u64 = 1;

/// A QP's work requests posted and not yet completed, in posting order, with the CQs their
/// completions go to.
struct Track {
    send_cq: u32,
    recv_cq: u32,
    out: Mutex<Outstanding>,
    /// A completion of this QP failed (not a flush the client made): the daemon's QP is in
    /// the error state, as RC puts a QP whose work request failed.
    failed: AtomicBool,
}

#[derive(Default)]
struct Outstanding {
    /// Send WRs in posting order.
    sends: VecDeque<PostedSend>,
    /// Receive WRs' ids in posting order (a QP's receives complete in order).
    recvs: VecDeque<u64>,
}

/// A send WR as the client remembers it until its completion.
#[derive(Debug, Clone, Copy)]
struct PostedSend {
    wr_id: u64,
    opcode: WcOpcode,
    /// A signaled WR completes visibly; an unsignaled one is retired by the next completion
    /// after it (RC completes a QP's sends in order).
    signaled: bool,
}

impl Outstanding {
    /// Retires the WRs a completion of this QP accounts for. A receive: the oldest receive. A
    /// successful send: every send up to and including the oldest signaled one (the unsignaled
    /// ones before it completed silently). A send that failed: up to and including the oldest
    /// with its id, since a failed WR completes even when unsignaled and the flushes after it
    /// come one per WR (the ids may repeat; the oldest match is the one RC's order gives).
    fn retire(&mut self, wc: &Wc) {
        if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
            self.recvs.pop_front();
            return;
        }
        let upto = if wc.status == WcStatus::Success {
            self.sends.iter().position(|s| s.signaled)
        } else {
            self.sends.iter().position(|s| s.wr_id == wc.wr_id)
        };
        match upto {
            Some(i) => {
                self.sends.drain(..=i);
            }
            None => {
                self.sends.pop_front();
            }
        }
    }
}

impl Inner {
    fn call(&self, req: &Request, fds: &[BorrowedFd<'_>]) -> Result<Reply> {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = proto::send(self.sock.as_fd(), req, fds) {
            // a daemon that refused the connection (at its attachment limit) said why before
            // it closed: that reply is still queued here
            let mut buf = vec![0u8; proto::MAX_MSG];
            if let Ok(sys::Recv::Msg(n, _)) = sys::recv_msg(self.sock.as_fd(), &mut buf, true) {
                if let Ok(Reply::Err { field, message }) = proto::decode::<Reply>(&buf[..n]) {
                    return Err(ClientError::Refused { field, message });
                }
            }
            return Err(gone(e));
        }
        match proto::recv::<Reply>(self.sock.as_fd()).map_err(gone)? {
            None => Err(ClientError::DaemonGone),
            Some((Ok(Reply::Err { field, message }), _)) => Err(ClientError::Refused { field, message }),
            Some((Ok(r), _)) => Ok(r),
            Some((Err(e), _)) => Err(ClientError::Protocol(e.to_string())),
        }
    }

    /// Whether the daemon's end of the socket closed.
    fn hung_up(revents: i16) -> bool {
        revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
    }

    /// Notes that the daemon is gone (from then on outstanding work is flushed).
    fn died(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    /// Whether the daemon is gone: known already, or (at most every [`LIVENESS_EVERY_MS`]) its
    /// socket says so now, without waiting.
    fn gone_now(&self) -> bool {
        if self.dead.load(Ordering::Relaxed) {
            return true;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.looked_ms.load(Ordering::Relaxed);
        if now < last + LIVENESS_EVERY_MS || self.looked_ms.swap(now, Ordering::Relaxed) != last {
            return false;
        }
        match sys::poll(&[(self.sock.as_fd(), libc::POLLRDHUP)], Some(Duration::ZERO)) {
            Ok(r) if Inner::hung_up(r[0]) => {
                self.died();
                true
            }
            _ => false,
        }
    }

    /// Moves flush completions of every outstanding WR whose completion goes to CQ `cq` into
    /// `wc`; returns how many.
    fn flush_into(&self, cq: u32, wc: &mut [Wc]) -> usize {
        let qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for (&qpn, t) in qps.iter() {
            let mut out = t.out.lock().unwrap_or_else(|e| e.into_inner());
            let flushed = |wr_id, opcode| Wc {
                wr_id,
                status: WcStatus::WrFlushErr,
                opcode,
                byte_len: 0,
                imm_data: None,
                qp_num: qpn,
                src_qp: 0,
                vendor_err: 0,
            };
            while t.send_cq == cq && n < wc.len() {
                let Some(s) = out.sends.pop_front() else { break };
                wc[n] = flushed(s.wr_id, s.opcode);
                n += 1;
            }
            while t.recv_cq == cq && n < wc.len() {
                let Some(id) = out.recvs.pop_front() else { break };
                wc[n] = flushed(id, WcOpcode::Recv);
                n += 1;
            }
        }
        n
    }

    /// Whether a flush would give CQ `cq` anything.
    fn has_flush_for(&self, cq: u32) -> bool {
        let qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        qps.values().any(|t| {
            let out = t.out.lock().unwrap_or_else(|e| e.into_inner());
            (t.send_cq == cq && !out.sends.is_empty()) || (t.recv_cq == cq && !out.recvs.is_empty())
        })
    }
}

fn gone(e: std::io::Error) -> ClientError {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => ClientError::DaemonGone,
        _ => ClientError::Io(e),
    }
}

/// The memfd of a ring this side created (and so kept).
fn ring_file(ring: &Mapping) -> Result<&std::fs::File> {
    ring.file()
        .ok_or_else(|| ClientError::Protocol("a ring created here has no file".into()))
}

fn unexpected(r: Reply) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}

/// An application's attachment to a daemon (like netstack's `Context`). Cloning shares it.
#[derive(Clone)]
pub struct Attachment {
    inner: Arc<Inner>,
}

/// Creation attributes of a QP.
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr {
    /// Entries of its send ring (a power of two).
    pub sq_slots: u32,
    /// Its transport parameters; `None` takes the daemon context's defaults. Their
    /// `max_send_wr` and `max_recv_wr` (at most `sq_slots`) bound what the QP holds outstanding
    /// here, so that a post past them is refused at once (`QueueFull`), as the in-process
    /// engine refuses it, not later by the daemon.
    pub config: Option<crate::transport::rc::RcConfig>,
}

impl Default for QpInitAttr {
    fn default() -> QpInitAttr {
        QpInitAttr {
            sq_slots: 1024,
            config: None,
        }
    }
}

impl Attachment {
    /// Attaches to the daemon listening at `socket`, as `name` (for its logs and metrics).
    pub fn connect(socket: impl AsRef<Path>, name: &str) -> Result<Attachment> {
        let sock = sys::connect(socket.as_ref())?;
        let doorbell = sys::eventfd()?;
        let inner = Inner {
            sock,
            lock: Mutex::new(()),
            doorbell,
            app: 0,
            dead: AtomicBool::new(false),
            looked_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            qps: Mutex::new(HashMap::new()),
            addr: None,
        };
        let r = inner.call(&Request::Hello { name: name.into() }, &[inner.doorbell.as_fd()])?;
        let Reply::Hello { app, addr } = r else {
            return Err(unexpected(r));
        };
        Ok(Attachment {
            inner: Arc::new(Inner { app, addr, ..inner }),
        })
    }

    /// The daemon's id of this attachment.
    pub fn app_id(&self) -> u64 {
        self.inner.app
    }

    /// The daemon's data-path address (its first data core's), where peers of this
    /// attachment's QPs send; `None` from a daemon that did not say.
    pub fn daemon_addr(&self) -> Option<std::net::SocketAddrV4> {
        self.inner.addr
    }

    /// The daemon engine's counters (all its attachments together).
    pub fn engine_stats(&self) -> Result<crate::engine::StatsSnapshot> {
        match self.inner.call(&Request::EngineStats, &[])? {
            Reply::EngineStats(s) => Ok(*s),
            r => Err(unexpected(r)),
        }
    }

    /// Whether the daemon is known to be gone (its socket closed).
    pub fn is_gone(&self) -> bool {
        self.inner.gone_now()
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        match self.inner.call(&Request::AllocPd, &[])? {
            Reply::Handle(h) => Ok(Pd {
                att: self.clone(),
                handle: h,
            }),
            r => Err(unexpected(r)),
        }
    }

    /// Creates a completion queue whose ring holds `cqe` completions (rounded up to a power of
    /// two).
    pub fn create_cq(&self, cqe: usize) -> Result<Cq> {
        let slots = cqe.max(1).checked_next_power_of_two().unwrap_or(usize::MAX);
        if slots > shm::MAX_SLOTS {
            return Err(ClientError::Invalid(format!("cqe: {cqe}, at most {}", shm::MAX_SLOTS)));
        }
        let ring = Mapping::create(c"flexnsd-cq", shm::cq_bytes(slots))?;
        let notify = sys::eventfd()?;
        let file = ring_file(&ring)?;
        let r = self.inner.call(
            &Request::CreateCq { slots: slots as u32 },
            &[file.as_fd(), notify.as_fd()],
        )?;
        let Reply::Handle(handle) = r else {
            return Err(unexpected(r));
        };
        Ok(Cq {
            att: self.clone(),
            handle,
            ring,
            slots,
            head: Mutex::new(0),
            notify,
        })
    }

    /// Creates an RC queue pair (in INIT: receives can be posted before connecting).
    pub fn create_qp(&self, pd: &Pd, send_cq: &Cq, recv_cq: &Cq, attr: QpInitAttr) -> Result<Qp> {
        let slots = attr.sq_slots as usize;
        if slots == 0 || slots > shm::MAX_SLOTS || !slots.is_power_of_two() {
            return Err(ClientError::Invalid(format!(
                "sq_slots: {slots}, must be a power of two, 1..={}",
                shm::MAX_SLOTS
            )));
        }
        let depth = |d: Option<u32>| d.map_or(slots, |d| (d as usize).min(slots));
        let max_send = depth(attr.config.map(|c| c.max_send_wr));
        let max_recv = depth(attr.config.map(|c| c.max_recv_wr));
        let ring = Mapping::create(c"flexnsd-sq", shm::sq_bytes(slots))?;
        let r = self.inner.call(
            &Request::CreateQp {
                pd: pd.handle,
                send_cq: send_cq.handle,
                recv_cq: recv_cq.handle,
                slots: slots as u32,
                config: attr.config,
            },
            &[ring_file(&ring)?.as_fd()],
        )?;
        let Reply::Qp { handle, qpn } = r else {
            return Err(unexpected(r));
        };
        let track = Arc::new(Track {
            send_cq: send_cq.handle,
            recv_cq: recv_cq.handle,
            out: Mutex::new(Outstanding::default()),
            failed: AtomicBool::new(false),
        });
        let qps = &self.inner.qps;
        qps.lock().unwrap_or_else(|e| e.into_inner()).insert(qpn, track.clone());
        Ok(Qp {
            att: self.clone(),
            handle,
            qpn,
            ring,
            slots,
            tail: Mutex::new(0),
            track,
            inline_posts: Mutex::new(0),
            max_send,
            max_recv,
        })
    }

    /// The daemon's counts (all attachments).
    pub fn status(&self) -> Result<Status> {
        match self.inner.call(&Request::Status, &[])? {
            Reply::Status(s) => Ok(s),
            r => Err(unexpected(r)),
        }
    }

    /// Sends `req` as is, with `fds` (raw protocol access, for tools and for tests of the
    /// daemon's checks: what a broken or hostile application could send).
    pub fn raw_call(&self, req: &Request, fds: &[BorrowedFd<'_>]) -> Result<Reply> {
        self.inner.call(req, fds)
    }
}

/// A protection domain.
pub struct Pd {
    att: Attachment,
    handle: u32,
}

impl Pd {
    /// Its handle in the attachment.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Allocates `len` zeroed bytes in a memfd, maps them and registers them with the daemon,
    /// which maps the same pages (its engine reads and writes them directly).
    pub fn reg_mr(&self, len: usize, access: Access) -> Result<Mr> {
        if len == 0 {
            return Err(ClientError::Invalid("len: 0 bytes".into()));
        }
        let file = sys::memfd(c"flexnsd-mr")?;
        file.set_len(len as u64)?;
        let fd = file.try_clone()?;
        self.register(fd.as_fd(), Arc::new(Region::from_memfd(file, len)?), access)
    }

    /// Registers `region`, which lives in the memfd `fd` from its first byte on.
    fn register(&self, fd: BorrowedFd<'_>, region: Arc<Region>, access: Access) -> Result<Mr> {
        let r = self.att.inner.call(
            &Request::RegMr {
                pd: self.handle,
                len: region.len() as u64,
                addr: region.addr(),
                access: access.0,
            },
            &[fd],
        )?;
        let Reply::Mr { handle, lkey, rkey } = r else {
            return Err(unexpected(r));
        };
        Ok(Mr {
            att: self.att.clone(),
            handle,
            lkey,
            rkey,
            region,
        })
    }
}

impl Pd {
    /// Registers memory the caller already holds, which must live in a memfd (what
    /// `Region::alloc_shareable` gives from 64 KiB, `Pd::reg_mr` here, or
    /// `Region::share_in_place`) and be named by its address in this process: the daemon maps
    /// the same file. Other memory is refused (`ClientError::Invalid`, naming why): the daemon
    /// cannot reach it.
    pub fn reg_region(&self, region: Arc<Region>, access: Access) -> Result<Mr> {
        let Some(file) = region.memfd() else {
            return Err(ClientError::Invalid(format!(
                "region: {} bytes at {:#x} are not in a memfd, so flexnsd cannot map them \
                 (allocate with Pd::reg_mr, or Region::alloc_shareable from 64 KiB)",
                region.len(),
                region.addr()
            )));
        };
        if !region.is_process_memory() {
            return Err(ClientError::Invalid(format!(
                "region: named by the I/O virtual address {:#x}, not its address here",
                region.addr()
            )));
        }
        let fd = file.try_clone()?;
        self.register(fd.as_fd(), region, access)
    }
}

/// A registered memory region (deregistered on drop).
pub struct Mr {
    att: Attachment,
    handle: u32,
    lkey: u32,
    rkey: u32,
    region: Arc<Region>,
}

impl Mr {
    /// Its local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Its remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    /// The address of its first byte (what SGEs and peers' RETHs name).
    pub fn addr(&self) -> u64 {
        self.region.addr()
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// Whether it has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }
    /// A scatter-gather element over `len` bytes at offset `off`.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr() + off as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }
    /// Copies bytes out of the region.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.region.read(off, dst)
    }
    /// Copies bytes into the region.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.region.write(off, src)
    }
    /// The memory (this process's mapping).
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        let _ = self.att.inner.call(&Request::DeregMr { mr: self.handle }, &[]);
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let _ = self.att.inner.call(&Request::DestroyCq { cq: self.handle }, &[]);
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        let _ = self.att.inner.call(&Request::DeallocPd { pd: self.handle }, &[]);
    }
}

/// A completion queue: a ring the daemon writes completions into.
pub struct Cq {
    att: Attachment,
    handle: u32,
    ring: Mapping,
    slots: usize,
    head: Mutex<u64>,
    notify: OwnedFd,
}

impl Cq {
    /// Moves up to `wc.len()` completions into `wc`; returns how many. Once the daemon is
    /// gone, what it completed is delivered first, then a [`WcStatus::WrFlushErr`] completion
    /// for every work request still outstanding on this CQ's QPs.
    pub fn poll(&self, wc: &mut [Wc]) -> Result<usize> {
        // the head stays locked until what was taken is retired (or flushed), so that another
        // poller of this CQ cannot flush a WR whose completion this one holds
        let mut head = self.head.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.poll_ring(&mut head, wc)?;
        if n > 0 {
            self.retire(&wc[..n]);
            return Ok(n);
        }
        if !self.att.inner.gone_now() {
            return Ok(0);
        }
        // the daemon may have written its last completions after the look above and before
        // its socket closed; nothing comes after that, so a ring still empty now is final
        let n = self.poll_ring(&mut head, wc)?;
        if n > 0 {
            self.retire(&wc[..n]);
            return Ok(n);
        }
        Ok(self.att.inner.flush_into(self.handle, wc))
    }

    /// Retires the WRs the completions `wc` account for.
    fn retire(&self, wc: &[Wc]) {
        let qps = self.att.inner.qps.lock().unwrap_or_else(|e| e.into_inner());
        for w in wc {
            if let Some(t) = qps.get(&w.qp_num) {
                // LocQpOpErr is the daemon's answer to a post it refused (the in-process engine
                // refuses those at the post), which leaves its QP as it was
                if !matches!(w.status, WcStatus::Success | WcStatus::LocQpOpErr) {
                    t.failed.store(true, Ordering::Relaxed);
                }
                t.out.lock().unwrap_or_else(|e| e.into_inner()).retire(w);
            }
        }
    }

    /// The completions the daemon wrote into the ring, from `head` on.
    fn poll_ring(&self, head: &mut u64, wc: &mut [Wc]) -> Result<usize> {
        let tail = self.ring.word(shm::CQ_TAIL).load(Ordering::Acquire);
        let ready = tail.wrapping_sub(*head);
        if ready > self.slots as u64 {
            return Err(ClientError::Protocol(format!(
                "completion ring tail {tail} is {ready} past head {} (ring of {})",
                *head, self.slots
            )));
        }
        let n = (ready as usize).min(wc.len());
        for w in wc.iter_mut().take(n) {
            *w = shm::decode_wc(
                self.ring
                    .read_words::<4>(shm::slot_off(*head, self.slots, shm::CQE_BYTES)),
            );
            *head += 1;
        }
        if n > 0 {
            self.ring.word(shm::CQ_HEAD).store(*head, Ordering::Release);
        }
        Ok(n)
    }

    fn ready(&self) -> bool {
        let head = *self.head.lock().unwrap_or_else(|e| e.into_inner());
        self.ring.word(shm::CQ_TAIL).load(Ordering::SeqCst) != head
            || (self.att.inner.dead.load(Ordering::SeqCst) && self.att.inner.has_flush_for(self.handle))
    }

    /// The daemon is gone: completions remain (its last ones, or flushes), or the error.
    fn after_death(&self) -> Result<bool> {
        self.att.inner.died();
        if self.ready() {
            Ok(true)
        } else {
            Err(ClientError::DaemonGone)
        }
    }

    /// Blocks until a completion is available (`Ok(true)`) or `timeout` passes (`Ok(false)`):
    /// spins briefly, then sleeps on the CQ's eventfd. As soon as the daemon's socket closes it
    /// returns `Ok(true)` while completions remain (the daemon's last ones, then the flushes of
    /// the outstanding work requests), then [`ClientError::DaemonGone`].
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        let start = Instant::now();
        let deadline = start + timeout;
        while start.elapsed() < SPIN {
            if self.ready() {
                return Ok(true);
            }
            // yield between looks, as the daemon and the engine's adaptive mode do: the daemon
            // thread that writes this ring may be waiting for this core
            std::thread::yield_now();
        }
        loop {
            self.ring.word(shm::CQ_ARMED).store(1, Ordering::SeqCst);
            if self.ready() {
                self.ring.word(shm::CQ_ARMED).store(0, Ordering::Relaxed);
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let sock = self.att.inner.sock.as_fd();
            let r = sys::poll(
                &[(self.notify.as_fd(), libc::POLLIN), (sock, libc::POLLRDHUP)],
                Some(left.max(Duration::from_millis(1))),
            )?;
            if Inner::hung_up(r[1]) {
                return self.after_death();
            }
            if r[0] != 0 {
                sys::eventfd_drain(self.notify.as_fd());
            }
        }
    }

    /// Polls one completion, blocking up to `timeout`.
    pub fn next(&self, timeout: Duration) -> Result<Option<Wc>> {
        let deadline = Instant::now() + timeout;
        let mut wc = [crate::verbs::EMPTY_WC];
        loop {
            if self.poll(&mut wc)? == 1 {
                return Ok(Some(wc[0]));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.wait(left)?;
        }
    }

    /// Its handle in the attachment.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Whether the daemon is gone and this CQ has nothing left to deliver (neither the
    /// daemon's last completions nor flushes).
    pub fn is_finished(&self) -> bool {
        self.att.inner.dead.load(Ordering::SeqCst) && !self.ready()
    }

    /// Completions the daemon has written to this CQ so far (polling does not lower it).
    pub fn produced(&self) -> u64 {
        self.ring.word(shm::CQ_TAIL).load(Ordering::Acquire)
    }
}

/// An RC queue pair whose send ring the daemon drains (destroyed on drop).
pub struct Qp {
    att: Attachment,
    handle: u32,
    qpn: u32,
    ring: Mapping,
    slots: usize,
    tail: Mutex<u64>,
    /// What it posted and has not seen complete (flushed if the daemon dies).
    track: Arc<Track>,
    /// INLINE sends posted so far (the next one's bounce slot is this modulo `slots`).
    inline_posts: Mutex<u64>,
    /// Sends and receives it holds outstanding at most (its `max_send_wr` and `max_recv_wr`).
    max_send: usize,
    max_recv: usize,
}

impl Qp {
    /// Entries of its send ring: at most this many work requests of each kind outstanding.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Posts a send whose INLINE payload is `data` (`wr`'s scatter list only describes it):
    /// the bytes are copied now into slot `k mod slots` of `bounce` (slots of `slot_bytes`
    /// each, `k` counting this QP's INLINE posts) and the send names that slot, so the
    /// caller may reuse its buffer when this returns, as INLINE promises. A slot is written
    /// only once the send that used it last has completed: the QP holds at most `slots`
    /// sends outstanding, and they complete in order.
    pub fn post_send_inline(&self, wr: SendWr, data: &[u8], bounce: &Mr, slot_bytes: usize) -> Result<()> {
        if data.len() > slot_bytes || bounce.len() < self.slots * slot_bytes {
            return Err(ClientError::Invalid(format!(
                "INLINE payload of {} bytes, at most {slot_bytes}",
                data.len()
            )));
        }
        let mut next = self.inline_posts.lock().unwrap_or_else(|e| e.into_inner());
        // room now means the send that used the slot last has retired (all after it are
        // outstanding otherwise, `slots` in all); another thread's post can only fill the room
        // again, which makes the push below fail, never the slot busy
        let room = self.track.out.lock().unwrap_or_else(|e| e.into_inner()).sends.len() < self.slots;
        if !room {
            return Err(ClientError::QueueFull(self.slots));
        }
        let off = (*next % self.slots as u64) as usize * slot_bytes;
        bounce.write(off, data);
        let mut w = SendWr {
            flags: SendFlags(wr.flags.0 & !SendFlags::INLINE.0),
            ..wr
        };
        w.sg_list.clear();
        if !data.is_empty() {
            w.sg_list.push(bounce.sge(off, data.len()));
        }
        self.post_send(w)?;
        *next += 1;
        Ok(())
    }

    /// Its QP number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// Its handle in the attachment.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// This QP's half of a connection exchange.
    pub fn local_endpoint(&self) -> Result<Endpoint> {
        match self.att.inner.call(&Request::QpEndpoint { qp: self.handle }, &[])? {
            Reply::Endpoint(e) => Ok(e),
            r => Err(unexpected(r)),
        }
    }

    /// One step of the QP state machine (see [`ModifyStep`]).
    pub fn modify(&self, step: ModifyStep) -> Result<()> {
        match self.att.inner.call(&Request::Modify { qp: self.handle, step }, &[])? {
            Reply::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Limits the QP's sending rate (bytes per second, with a burst), or lifts it (`None`).
    pub fn set_rate_limit(&self, bytes_per_sec: Option<u64>, burst: u64) -> Result<()> {
        let req = Request::RateLimit {
            qp: self.handle,
            bytes_per_sec,
            burst,
        };
        match self.att.inner.call(&req, &[])? {
            Reply::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Limits the QP's payload bytes in flight, or lifts it (`None`).
    pub fn set_window_limit(&self, bytes: Option<u64>) -> Result<()> {
        let req = Request::WindowLimit { qp: self.handle, bytes };
        match self.att.inner.call(&req, &[])? {
            Reply::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Whether one of its completions failed (the daemon's QP is then in the error state), or
    /// the daemon is gone.
    pub fn failed(&self) -> bool {
        self.track.failed.load(Ordering::Relaxed) || self.att.inner.dead.load(Ordering::Relaxed)
    }

    /// Connects to a peer (INIT -> RTR -> RTS).
    pub fn connect(&self, remote: &Endpoint) -> Result<()> {
        match self.att.inner.call(
            &Request::Connect {
                qp: self.handle,
                remote: remote.clone(),
            },
            &[],
        )? {
            Reply::Done => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Writes an entry into the send ring. `posted` records the WR among the outstanding ones
    /// and says whether there was room: a QP holds at most its ring's size of WRs not yet
    /// completed, unsignaled sends included (as an SQ holds `max_send_wr`), however fast the
    /// daemon takes entries.
    fn push(&self, words: [u64; 8], posted: impl FnOnce(&mut Outstanding) -> bool) -> Result<()> {
        if self.att.inner.dead.load(Ordering::Relaxed) {
            return Err(ClientError::DaemonGone);
        }
        if let Some(f) = RingFault::from_word(self.ring.word(shm::SQ_ERROR).load(Ordering::Acquire)) {
            return Err(ClientError::RingClosed(f));
        }
        let mut tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let head = self.ring.word(shm::SQ_HEAD).load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used >= self.slots as u64 {
            return Err(ClientError::QueueFull(used as usize));
        }
        // recorded before the daemon can see it, so that its completion finds it
        if !posted(&mut self.track.out.lock().unwrap_or_else(|e| e.into_inner())) {
            return Err(ClientError::QueueFull(self.slots));
        }
        self.ring
            .write_words(shm::slot_off(*tail, self.slots, shm::WQE_BYTES), &words);
        *tail += 1;
        self.ring.word(shm::SQ_TAIL).store(*tail, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.ring.word(shm::SQ_SLEEPING).load(Ordering::SeqCst) != 0 {
            sys::eventfd_signal(self.att.inner.doorbell.as_fd());
        }
        Ok(())
    }

    /// Posts a send work request (SEND, WRITE or READ, with or without immediate; at most two
    /// SGEs, in this attachment's memory regions).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        let words = shm::encode_send(&wr).map_err(|e| ClientError::Invalid(e.into()))?;
        let send = PostedSend {
            wr_id: wr.wr_id,
            opcode: WcOpcode::from_wr(wr.opcode),
            signaled: wr.flags.contains(SendFlags::SIGNALED),
        };
        let max = self.max_send;
        self.push(words, |o| {
            o.sends.len() < max && {
                o.sends.push_back(send);
                true
            }
        })
    }

    /// Posts a receive work request (at most two SGEs).
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let words = shm::encode_recv(&wr).map_err(|e| ClientError::Invalid(e.into()))?;
        let max = self.max_recv;
        self.push(words, |o| {
            o.recvs.len() < max && {
                o.recvs.push_back(wr.wr_id);
                true
            }
        })
    }

    /// Its transport counters, from the daemon's engine.
    pub fn stats(&self) -> Result<super::proto::QpStats> {
        match self.att.inner.call(&Request::QpStats { qp: self.handle }, &[])? {
            Reply::QpStats(s) => Ok(*s),
            r => Err(unexpected(r)),
        }
    }

    /// Stores `tail` as the send ring's tail without writing entries: what a broken or hostile
    /// application can do to the ring it shares (for tests of the daemon's checks).
    pub fn store_raw_tail(&self, tail: u64) {
        self.ring.word(shm::SQ_TAIL).store(tail, Ordering::Release);
        sys::eventfd_signal(self.att.inner.doorbell.as_fd());
    }

    /// Why the daemon closed this QP's ring, if it did.
    pub fn ring_fault(&self) -> Option<RingFault> {
        RingFault::from_word(self.ring.word(shm::SQ_ERROR).load(Ordering::Acquire))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        let qps = &self.att.inner.qps;
        qps.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.qpn);
        let _ = self.att.inner.call(&Request::DestroyQp { qp: self.handle }, &[]);
    }
}
