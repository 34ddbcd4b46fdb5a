//! The daemon's service: an accept loop, and per attachment one thread that answers its
//! commands, drains its send rings into the engine and writes the engine's completions into its
//! completion rings (docs/FLEXNSD.md, "Who owns what, threads").

use netstack::verbs::attach::proto::{self, Counts, ModifyStep, Reply, Request, Status};
use netstack::verbs::attach::shm::{self, Mapping, RingFault, Wqe};
use netstack::verbs::attach::sys;
use netstack::verbs::{Access, Context, Cq, Mr, Pd, Qp, QpInitAttr, VerbsError, Wc, WcOpcode, WcStatus, EMPTY_WC};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;

/// The longest memory region an application may register (16 GiB; an attachment's total is
/// bounded by [`Limits::max_app_bytes`] too).
pub const MAX_MR: u64 = 16 << 30;
/// Work requests taken from one send ring per pass (the others get their turn).
const BATCH: u64 = 64;
/// How long an idle pass watches the send rings before it yields and runs the engine again
/// (see `App::serve`).
const RING_WATCH: Duration = Duration::from_micros(2);
/// While spinning, the control socket is read once every this many passes (one `recvmsg` per
/// pass was a tenth of a busy daemon's time); a sleeping daemon wakes on it at once.
const CONTROL_EVERY: u32 = 16;

/// What one application, and all of them, may hold (docs/FLEXNSD.md, "Limits"): bounds on the
/// daemon's address space, mappings, descriptors and threads that no attachment can pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Attachments served at once; one more is refused (`max_attachments`) and closed.
    pub max_attachments: usize,
    /// Objects (PDs, MRs, CQs and QPs together) one attachment may hold.
    pub max_app_objects: u64,
    /// Bytes of application memory (MRs, rounded up to pages, and rings) one attachment may
    /// have mapped into the daemon.
    pub max_app_bytes: u64,
    /// How long a new connection may take to send its Hello before it is closed.
    pub hello_timeout: Duration,
}

impl Default for Limits {
    /// 64 attachments of at most 512 objects and 64 GiB each (64 x 512 mappings stay well
    /// below the default `vm.max_map_count` of 65530), 5 s for the Hello.
    fn default() -> Limits {
        Limits {
            max_attachments: 64,
            max_app_objects: 512,
            max_app_bytes: 64 << 30,
            hello_timeout: Duration::from_secs(5),
        }
    }
}

/// What every attachment thread shares: the engine context and the status table.
pub struct Daemon {
    ctx: Context,
    /// Poll the rings this long after the last work before sleeping.
    spin: Duration,
    limits: Limits,
    apps: std::sync::Mutex<HashMap<u64, Counts>>,
    next_app: AtomicU64,
    /// Which metric slots (`slot` label, 0..max_attachments) an attachment holds: the per-app
    /// series are labelled by slot, so their number stays bounded however many applications
    /// come and go (labelled by attachment id, every one ever made would stay in the registry).
    slots: std::sync::Mutex<Vec<bool>>,
    /// Connections accepted and not yet closed (each has, or is about to have, a thread).
    live: std::sync::atomic::AtomicUsize,
}

/// One accepted connection's claim on the daemon: dropped when its thread ends, however it
/// ends (a panic included), it removes the attachment's status entry and
/// frees its place under [`Limits::max_attachments`].
struct Live {
    d: Arc<Daemon>,
    id: u64,
    slot: usize,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.d.apps.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
        // the slot's series read 0 until the next attachment takes it
        publish_slot(self.slot, 0, Counts::default());
        if let Some(s) = self
            .d
            .slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(self.slot)
        {
            *s = false;
        }
        self.d.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Sets the per-attachment gauges of metric slot `slot`: which attachment holds it (`id`, 0 for
/// none) and its counts.
fn publish_slot(slot: usize, id: u64, c: Counts) {
    let slot = slot.to_string();
    metrics::gauge!("flexnsd_app_id", "slot" => slot.clone()).set(id as f64);
    metrics::gauge!("flexnsd_app_qps", "slot" => slot.clone()).set(c.qps as f64);
    metrics::gauge!("flexnsd_app_mrs", "slot" => slot.clone()).set(c.mrs as f64);
    metrics::gauge!("flexnsd_app_cqs", "slot" => slot.clone()).set(c.cqs as f64);
    metrics::gauge!("flexnsd_app_wrs", "slot" => slot.clone()).set(c.wrs as f64);
    metrics::gauge!("flexnsd_app_bytes", "slot" => slot.clone()).set(c.bytes as f64);
    metrics::gauge!("flexnsd_app_errors", "slot" => slot).set(c.errors as f64);
}

impl Daemon {
    /// A daemon serving `ctx`, spinning `spin` before each sleep, with the default [`Limits`].
    pub fn new(ctx: Context, spin: Duration) -> Arc<Daemon> {
        Daemon::with_limits(ctx, spin, Limits::default())
    }

    /// A daemon serving `ctx`, spinning `spin` before each sleep, with `limits`.
    pub fn with_limits(ctx: Context, spin: Duration, limits: Limits) -> Arc<Daemon> {
        Arc::new(Daemon {
            ctx,
            spin,
            limits,
            apps: Default::default(),
            next_app: AtomicU64::new(1),
            slots: std::sync::Mutex::new(vec![false; limits.max_attachments]),
            live: Default::default(),
        })
    }

    /// Accepts attachments on `listener` forever, one thread each.
    pub fn serve(self: &Arc<Daemon>, listener: OwnedFd) -> std::io::Result<()> {
        // refused connections stay open a moment (at most 16 of them) so that their Hello,
        // unread, does not reset the connection before the refusal is read
        let mut refused: VecDeque<(Instant, OwnedFd)> = VecDeque::new();
        loop {
            let sock = match sys::accept(listener.as_fd()) {
                Ok(s) => s,
                // out of descriptors or memory for now, or a connection that died before it
                // was accepted: the attached applications are served on; try again shortly
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(
                            libc::EMFILE
                                | libc::ENFILE
                                | libc::ENOBUFS
                                | libc::ENOMEM
                                | libc::ECONNABORTED
                                | libc::EPROTO
                        )
                    ) =>
                {
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(e),
            };
            if self.live.fetch_add(1, Ordering::AcqRel) >= self.limits.max_attachments {
                self.live.fetch_sub(1, Ordering::AcqRel);
                // told why, then closed (the client reads the reply even if its Hello found
                // the socket closed)
                let _ = sys::set_nonblocking(sock.as_fd(), true);
                let msg = format!(
                    "{} attachments already (the daemon's limit)",
                    self.limits.max_attachments
                );
                tracing::warn!("refused a connection: {msg}");
                let _ = proto::send(
                    sock.as_fd(),
                    &Reply::Err {
                        field: "max_attachments".into(),
                        message: msg,
                    },
                    &[],
                );
                while refused
                    .front()
                    .is_some_and(|(t, _)| refused.len() >= 16 || t.elapsed() > Duration::from_secs(1))
                {
                    refused.pop_front();
                }
                refused.push_back((Instant::now(), sock));
                continue;
            }
            // fewer than max_attachments are live, so a slot is free (each Live frees its own)
            let slot = {
                let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                let free = slots.iter().position(|taken| !taken).unwrap_or(slots.len());
                if let Some(s) = slots.get_mut(free) {
                    *s = true;
                }
                free
            };
            let id = self.next_app.fetch_add(1, Ordering::Relaxed);
            let live = Live {
                d: self.clone(),
                id,
                slot,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("flexnsd-app{id}"))
                .spawn(move || {
                    let live = live;
                    live.d.clone().run_app(id, live.slot, sock);
                });
            // out of threads or memory: this connection is dropped (with the closure, its
            // socket and its place), the attached applications are served on
            if let Err(e) = spawned {
                tracing::warn!("attachment {id}: cannot start its thread: {e}");
            }
        }
    }

    /// What the daemon holds now.
    pub fn status(&self) -> Status {
        let apps: Vec<(u64, Counts)> = {
            let mut v: Vec<_> = self
                .apps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(k, c)| (*k, *c))
                .collect();
            v.sort_by_key(|x| x.0);
            v
        };
        let mut totals = Counts::default();
        for (_, c) in &apps {
            totals.pds += c.pds;
            totals.mrs += c.mrs;
            totals.cqs += c.cqs;
            totals.qps += c.qps;
            totals.wrs += c.wrs;
            totals.bytes += c.bytes;
            totals.errors += c.errors;
        }
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        Status {
            attachments: apps.len() as u64,
            totals,
            apps,
            mapped_memfds: maps.lines().filter(|l| l.contains("/memfd:flexnsd-")).count() as u64,
            open_fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64),
        }
    }

    fn run_app(self: Arc<Daemon>, id: u64, slot: usize, sock: OwnedFd) {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!("attachment {id}: cannot start its runtime: {e}");
                return;
            }
        };
        rt.block_on(async {
            let sock = match sys::set_nonblocking(sock.as_fd(), true).and_then(|_| sys::async_fd(sock)) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("attachment {id}: {e}");
                    return;
                }
            };
            self.apps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, Counts::default());
            // listed in /metrics from the start, idle or not
            publish_slot(slot, id, Counts::default());
            let mut app = App {
                qps: HashMap::new(),
                mrs: HashMap::new(),
                cqs: HashMap::new(),
                pds: HashMap::new(),
                id,
                slot,
                name: String::new(),
                d: self.clone(),
                sock,
                doorbell: None,
                next: 1,
                counts: Counts::default(),
                published: Counts::default(),
                mapped: 0,
            };
            tracing::info!("attachment {id}: attached");
            app.serve().await;
            // drop order: QPs out of the engine first, then the memory and queues they used
            let counts = app.counts;
            app.qps.clear();
            app.mrs.clear();
            app.cqs.clear();
            app.pds.clear();
            app.counts = Counts {
                wrs: counts.wrs,
                bytes: counts.bytes,
                errors: counts.errors,
                ..Counts::default()
            };
            app.publish();
            let name = std::mem::take(&mut app.name);
            // its socket and doorbell closed too before the status stops listing it
            drop(app);
            self.apps.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            tracing::info!(
                "attachment {id} ({name}): detached; freed {} QPs, {} MRs, {} CQs",
                counts.qps,
                counts.mrs,
                counts.cqs
            );
        });
    }
}

struct AppCq {
    cq: Cq,
    ring: Mapping,
    slots: usize,
    /// The daemon's own copy of the ring's tail (the ring's word is only published).
    tail: u64,
    notify: OwnedFd,
    /// Completions polled from `cq` so far (compared with its produced count).
    taken: u64,
    /// Completions the daemon made itself (refused posts) waiting for room.
    pending: VecDeque<Wc>,
}

struct AppQp {
    qp: Qp,
    ring: Mapping,
    slots: usize,
    /// The daemon's own copy of the ring's head.
    head: u64,
    send_cq: u32,
    recv_cq: u32,
    /// Its PD's handle.
    pd: u32,
    /// Closed for a fault: served no more.
    fault: Option<RingFault>,
    /// Send WRs taken from the ring that the engine's full queue refused, in order (the ring
    /// is not read until they are posted; at most one pass's worth).
    deferred: VecDeque<netstack::verbs::SendWr>,
    /// Sends posted to the engine whose completions are not polled yet, in posting order, each
    /// with whether the application asked for its completion. The daemon posts every send
    /// signaled, so each one completes in the engine and is known done (an unsignaled one
    /// completes silently, and counted by completions it would stay outstanding for ever, with
    /// a held error behind it); a successful completion the application did not ask for is not
    /// written to its ring.
    sends_out: VecDeque<bool>,
    /// A send error completion the daemon made (a refused post, a bad entry), held until every
    /// send posted before it has completed, so it does not overtake their completions; the QP's
    /// sends wait behind it (at most one per pass).
    held: VecDeque<Wc>,
}

/// One attachment. Fields drop in order: QPs before the MRs and CQs they use.
struct App {
    qps: HashMap<u32, AppQp>,
    /// Each with the bytes it maps and its PD's handle.
    mrs: HashMap<u32, (Mr, u64, u32)>,
    cqs: HashMap<u32, AppCq>,
    pds: HashMap<u32, Pd>,
    id: u64,
    /// Its metric slot (the `slot` label of its series).
    slot: usize,
    name: String,
    d: Arc<Daemon>,
    sock: AsyncFd<OwnedFd>,
    doorbell: Option<AsyncFd<OwnedFd>>,
    next: u32,
    counts: Counts,
    published: Counts,
    /// Bytes of its memory mapped into the daemon (MRs rounded up to pages, rings).
    mapped: u64,
}

/// A refused command: the field and why.
struct Refusal(&'static str, String);

fn refuse<T>(field: &'static str, message: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal(field, message.into()))
}

impl App {
    async fn serve(&mut self) {
        let mut buf = vec![0u8; proto::MAX_MSG];
        let mut last_work = Instant::now();
        let mut packets = self.engine_packets();
        // a connection that does not say Hello in time is closed (before it holds anything)
        let hello_by = tokio::time::Instant::now() + self.d.limits.hello_timeout;
        while self.doorbell.is_none() {
            match tokio::time::timeout_at(hello_by, self.sock.readable()).await {
                Ok(Ok(mut g)) => g.clear_ready(),
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::warn!(
                        "attachment {}: no Hello within {:?}: closed",
                        self.id,
                        self.d.limits.hello_timeout
                    );
                    return;
                }
            }
            if self.control(&mut buf).is_err() {
                return;
            }
        }
        // the first pass (and the first after every sleep) answers commands
        let mut pass: u32 = 0;
        loop {
            let mut work = false;
            if pass.is_multiple_of(CONTROL_EVERY) {
                work = match self.control(&mut buf) {
                    Ok(w) => w,
                    Err(()) => return,
                };
            }
            pass = pass.wrapping_add(1);
            work |= self.drain_rings();
            work |= self.drain_cqs();
            // the engine moving packets is work outstanding too: its completion comes soon,
            // and a sleeping daemon would add a wake-up to it
            let now_packets = self.engine_packets();
            work |= now_packets != packets;
            packets = now_packets;
            if work {
                self.publish();
                last_work = Instant::now();
                continue;
            }
            if last_work.elapsed() < self.d.spin {
                // the send rings are watched for up to RING_WATCH first: a work request posted
                // meanwhile is taken at once instead of after an engine pass and a yield
                // (docs/FLEXNSD.md, "Figures on 2026-12-06"); the engine's idle passes come
                // that much further apart. Then polling idle yields the core between passes, as
                // the engine's adaptive mode does: an application woken on this core runs at
                // once instead of waiting for the end of the spin (on two cores that wait was
                // most of a SEND's latency)
                let blocked = self.blocked_cqs();
                let until = Instant::now() + RING_WATCH;
                let mut ready = self.takeable(&blocked);
                while !ready && Instant::now() < until {
                    std::hint::spin_loop();
                    ready = self.takeable(&blocked);
                }
                if !ready {
                    std::thread::yield_now();
                }
                continue;
            }
            self.sleep().await;
            last_work = Instant::now();
            pass = 0;
        }
    }

    /// Whether a send ring holds an entry the next pass would take: its QP serves, nothing of
    /// it waits behind the engine's full queue or a held error, and neither of its CQs is in
    /// `blocked` (full, with completions waiting for room).
    fn takeable(&self, blocked: &[u32]) -> bool {
        self.qps.values().any(|q| {
            q.fault.is_none()
                && q.deferred.is_empty()
                && q.held.is_empty()
                && !blocked.contains(&q.send_cq)
                && !blocked.contains(&q.recv_cq)
                && q.ring.word(shm::SQ_TAIL).load(Ordering::SeqCst) != q.head
        })
    }

    /// Packets the engine context sent and received so far (all attachments'): a change
    /// between two passes means work is in flight.
    fn engine_packets(&self) -> u64 {
        let st = self.d.ctx.stats();
        st.tx_packets.wrapping_add(st.rx_datagrams)
    }

    /// Sleeps until a command, a doorbell or a completion (at most 1 ms while a completion
    /// ring is full: the application's reads of it do not ring).
    async fn sleep(&mut self) {
        for q in self.qps.values() {
            q.ring.word(shm::SQ_SLEEPING).store(1, Ordering::SeqCst);
        }
        // entries waiting behind a full engine queue or a blocked CQ are not work to spin on:
        // the engine's completion (or the 1 ms tick of a full ring) wakes the thread for them
        let pending = self.takeable(&self.blocked_cqs());
        if !pending {
            let full = self.cqs.values().any(|c| c.room() == 0);
            let waits: Vec<_> = self
                .cqs
                .values()
                .filter(|c| c.room() > 0)
                .map(|c| Box::pin(c.cq.wait_async()))
                .collect();
            let cq_ready = async {
                if waits.is_empty() {
                    std::future::pending::<()>().await
                } else {
                    futures_util::future::select_all(waits).await;
                }
            };
            let door = async {
                match &self.doorbell {
                    Some(d) => {
                        if let Ok(mut g) = d.readable().await {
                            g.clear_ready();
                            sys::eventfd_drain(d.get_ref().as_fd());
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            let tick = async {
                if full {
                    tokio::time::sleep(Duration::from_millis(1)).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                r = self.sock.readable() => if let Ok(mut g) = r { g.clear_ready() },
                _ = door => {},
                _ = cq_ready => {},
                _ = tick => {},
            }
        }
        for q in self.qps.values() {
            q.ring.word(shm::SQ_SLEEPING).store(0, Ordering::SeqCst);
        }
    }

    /// Publishes the counts to the status table and metrics when they changed.
    fn publish(&mut self) {
        if self.counts == self.published {
            return;
        }
        let c = self.counts;
        self.published = c;
        if let Some(e) = self.d.apps.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&self.id) {
            *e = c;
        }
        publish_slot(self.slot, self.id, c);
    }

    /// Answers every command waiting; `Err` when the application is gone.
    fn control(&mut self, buf: &mut [u8]) -> Result<bool, ()> {
        let mut any = false;
        loop {
            let (n, fds) = match sys::recv_msg(self.sock.get_ref().as_fd(), buf, true) {
                Ok(sys::Recv::Msg(n, fds)) => (n, fds),
                Ok(sys::Recv::WouldBlock) => return Ok(any),
                Ok(sys::Recv::Eof) => return Err(()),
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    self.counts.errors += 1;
                    self.reply(&Reply::Err {
                        field: "message".into(),
                        message: e.to_string(),
                    });
                    any = true;
                    continue;
                }
                Err(e) => {
                    tracing::warn!("attachment {}: control socket: {e}", self.id);
                    return Err(());
                }
            };
            any = true;
            let reply = match proto::decode::<Request>(&buf[..n]) {
                Ok(req) => self.command(req, fds).unwrap_or_else(|Refusal(f, m)| {
                    self.counts.errors += 1;
                    tracing::debug!("attachment {}: refused: {f}: {m}", self.id);
                    Reply::Err {
                        field: f.into(),
                        message: m,
                    }
                }),
                Err(e) => {
                    self.counts.errors += 1;
                    Reply::Err {
                        field: e.field.into(),
                        message: e.message,
                    }
                }
            };
            // published before the reply: a status asked after it counts what it did
            self.publish();
            self.reply(&reply);
        }
    }

    fn reply(&self, r: &Reply) {
        // a socket that cannot take the reply is closing: its EOF ends the attachment
        let _ = proto::send(self.sock.get_ref().as_fd(), r, &[]);
    }

    fn handle(&mut self) -> u32 {
        let h = self.next;
        self.next += 1;
        h
    }

    fn command(&mut self, req: Request, mut fds: Vec<OwnedFd>) -> Result<Reply, Refusal> {
        let want = match &req {
            Request::Hello { .. } | Request::RegMr { .. } | Request::CreateQp { .. } => 1,
            Request::CreateCq { .. } => 2,
            _ => 0,
        };
        if fds.len() != want {
            return refuse(
                "fds",
                format!("{} descriptors passed, this command takes {want}", fds.len()),
            );
        }
        if self.doorbell.is_none() && !matches!(req, Request::Hello { .. }) {
            return refuse("message", "the first command must be Hello");
        }
        match req {
            Request::Hello { name } => {
                if self.doorbell.is_some() {
                    return refuse("message", "Hello twice");
                }
                let fd = fds.pop().expect("one descriptor, checked");
                if !sys::is_eventfd(fd.as_fd()) {
                    return refuse("fds", "the doorbell must be an eventfd");
                }
                sys::set_nonblocking(fd.as_fd(), true)
                    .map_err(|e| Refusal("fds", format!("the doorbell cannot be made non-blocking: {e}")))?;
                self.doorbell = Some(sys::async_fd(fd).map_err(|e| Refusal("fds", e.to_string()))?);
                self.name = name.chars().take(64).collect();
                Ok(Reply::Hello {
                    app: self.id,
                    addr: Some(self.d.ctx.local_addr()),
                })
            }
            Request::AllocPd => {
                self.room_for(0)?;
                let h = self.handle();
                self.pds.insert(h, self.d.ctx.alloc_pd());
                self.counts.pds += 1;
                Ok(Reply::Handle(h))
            }
            Request::RegMr { pd, len, addr, access } => {
                let pd_h = pd;
                let Some(pd) = self.pds.get(&pd) else {
                    return refuse("pd", format!("{pd} is not a PD of this application"));
                };
                if len == 0 || len > MAX_MR {
                    return refuse("len", format!("{len} bytes: must be 1..={MAX_MR}"));
                }
                if addr.checked_add(len).is_none() {
                    return refuse("addr", format!("{addr:#x} + {len} passes the end of the address space"));
                }
                if access & !Access::ALL.0 != 0 {
                    return refuse("access", format!("{access:#x} has bits that are not access rights"));
                }
                let map_len = len.div_ceil(4096) * 4096;
                self.room_for(map_len)?;
                let file = std::fs::File::from(fds.pop().expect("one descriptor, checked"));
                let file = sealed(file, len)?;
                let region = netstack::mem::Region::from_memfd(file, len as usize)
                    .map_err(|e| Refusal("fds", format!("cannot map the memfd: {e}")))?
                    .at_iova(addr);
                let mr = pd
                    .reg_region(Arc::new(region), Access(access))
                    .map_err(|e| Refusal("pd", e.to_string()))?;
                let h = self.handle();
                let r = Reply::Mr {
                    handle: h,
                    lkey: mr.lkey(),
                    rkey: mr.rkey(),
                };
                self.mrs.insert(h, (mr, map_len, pd_h));
                self.counts.mrs += 1;
                self.mapped += map_len;
                Ok(r)
            }
            Request::DeregMr { mr } => {
                let Some((_, bytes, _)) = self.mrs.remove(&mr) else {
                    return refuse("mr", format!("{mr} is not an MR of this application"));
                };
                self.counts.mrs -= 1;
                self.mapped -= bytes;
                Ok(Reply::Done)
            }
            Request::CreateCq { slots } => {
                let slots = ring_slots(slots)?;
                let notify = fds.pop().expect("two descriptors, checked");
                if !sys::is_eventfd(notify.as_fd()) {
                    return refuse("fds", "the second descriptor (notify) must be an eventfd");
                }
                // a blocking eventfd at its maximum count would block the signal forever
                sys::set_nonblocking(notify.as_fd(), true)
                    .map_err(|e| Refusal("fds", format!("the notify eventfd cannot be made non-blocking: {e}")))?;
                let bytes = shm::cq_bytes(slots);
                let ring = self.map_ring(fds.pop().expect("checked"), bytes)?;
                let cq = self
                    .d
                    .ctx
                    .create_cq(slots)
                    .map_err(|e| Refusal("slots", e.to_string()))?;
                // the ring starts at 0 whatever the application stored there: its indices
                // are the daemon's to start, so no arithmetic on them nears u64::MAX
                ring.word(shm::CQ_HEAD).store(0, Ordering::Release);
                ring.word(shm::CQ_TAIL).store(0, Ordering::Release);
                let tail = 0;
                let h = self.handle();
                self.mapped += bytes as u64;
                self.cqs.insert(
                    h,
                    AppCq {
                        cq,
                        ring,
                        slots,
                        tail,
                        notify,
                        taken: 0,
                        pending: VecDeque::new(),
                    },
                );
                self.counts.cqs += 1;
                Ok(Reply::Handle(h))
            }
            Request::CreateQp {
                pd,
                send_cq,
                recv_cq,
                slots,
                config,
            } => {
                let slots = ring_slots(slots)?;
                let Some(pdo) = self.pds.get(&pd) else {
                    return refuse("pd", format!("{pd} is not a PD of this application"));
                };
                let (Some(scq), Some(rcq)) = (self.cqs.get(&send_cq), self.cqs.get(&recv_cq)) else {
                    let bad = if self.cqs.contains_key(&send_cq) {
                        "recv_cq"
                    } else {
                        "send_cq"
                    };
                    return refuse(bad, "not a CQ of this application");
                };
                let bytes = shm::sq_bytes(slots);
                let ring = self.map_ring(fds.pop().expect("checked"), bytes)?;
                let qp = self
                    .d
                    .ctx
                    .create_qp(
                        pdo,
                        &scq.cq,
                        &rcq.cq,
                        QpInitAttr {
                            config,
                            ..QpInitAttr::default()
                        },
                    )
                    .map_err(|e| Refusal("qp", e.to_string()))?;
                // indices start at 0 whatever the application stored (as for CQs)
                ring.word(shm::SQ_TAIL).store(0, Ordering::Release);
                ring.word(shm::SQ_HEAD).store(0, Ordering::Release);
                let head = 0;
                let h = self.handle();
                self.mapped += bytes as u64;
                let qpn = qp.qp_num();
                self.qps.insert(
                    h,
                    AppQp {
                        qp,
                        ring,
                        slots,
                        head,
                        send_cq,
                        recv_cq,
                        pd,
                        fault: None,
                        deferred: VecDeque::new(),
                        sends_out: VecDeque::new(),
                        held: VecDeque::new(),
                    },
                );
                self.counts.qps += 1;
                Ok(Reply::Qp { handle: h, qpn })
            }
            Request::QpEndpoint { qp } => Ok(Reply::Endpoint(self.qp(qp)?.qp.local_endpoint())),
            Request::Connect { qp, remote } => {
                self.qp(qp)?
                    .qp
                    .connect(&remote)
                    .map_err(|e| Refusal("remote", e.to_string()))?;
                Ok(Reply::Done)
            }
            Request::Modify { qp, step } => {
                let q = &self.qp(qp)?.qp;
                match step {
                    ModifyStep::Rtr { remote, accept: false } => q.modify_to_rtr(&remote),
                    ModifyStep::Rtr { remote, accept: true } => q.accept_rtr(&remote),
                    ModifyStep::Rts { sq_psn: None } => q.modify_to_rts(),
                    ModifyStep::Rts { sq_psn: Some(p) } => q.modify_to_rts_at(p),
                    ModifyStep::Err => {
                        q.modify_to_err();
                        Ok(())
                    }
                }
                .map_err(|e| Refusal("step", e.to_string()))?;
                Ok(Reply::Done)
            }
            Request::RateLimit {
                qp,
                bytes_per_sec,
                burst,
            } => {
                self.qp(qp)?.qp.set_rate_limit(bytes_per_sec, burst);
                Ok(Reply::Done)
            }
            Request::WindowLimit { qp, bytes } => {
                self.qp(qp)?.qp.set_window_limit(bytes);
                Ok(Reply::Done)
            }
            Request::EngineStats => Ok(Reply::EngineStats(Box::new(self.d.ctx.stats()))),
            Request::DestroyQp { qp } => {
                let Some(q) = self.qps.remove(&qp) else {
                    return refuse("qp", format!("{qp} is not a QP of this application"));
                };
                self.counts.qps -= 1;
                self.mapped -= shm::sq_bytes(q.slots) as u64;
                Ok(Reply::Done)
            }
            Request::DestroyCq { cq } => {
                if !self.cqs.contains_key(&cq) {
                    return refuse("cq", format!("{cq} is not a CQ of this application"));
                }
                if let Some((h, _)) = self.qps.iter().find(|(_, q)| q.send_cq == cq || q.recv_cq == cq) {
                    return refuse("cq", format!("{cq} is in use by QP {h}"));
                }
                let c = self.cqs.remove(&cq).expect("checked");
                self.counts.cqs -= 1;
                self.mapped -= shm::cq_bytes(c.slots) as u64;
                Ok(Reply::Done)
            }
            Request::DeallocPd { pd } => {
                if !self.pds.contains_key(&pd) {
                    return refuse("pd", format!("{pd} is not a PD of this application"));
                }
                if let Some((h, _)) = self.mrs.iter().find(|(_, m)| m.2 == pd) {
                    return refuse("pd", format!("{pd} is in use by MR {h}"));
                }
                if let Some((h, _)) = self.qps.iter().find(|(_, q)| q.pd == pd) {
                    return refuse("pd", format!("{pd} is in use by QP {h}"));
                }
                self.pds.remove(&pd);
                self.counts.pds -= 1;
                Ok(Reply::Done)
            }
            Request::QpStats { qp } => {
                let q = &self.qp(qp)?.qp;
                let st = q.stats();
                Ok(Reply::QpStats(Box::new(proto::QpStats {
                    tx_packets: st.tx_packets,
                    rx_packets: st.rx_packets,
                    retransmitted_packets: st.retransmitted_packets,
                    rnr_naks_sent: st.rnr_naks_sent,
                    rnr_naks_received: st.rnr_naks_received,
                    rc: st,
                    state: Some(q.state()),
                    icrc: q.icrc_mode(),
                })))
            }
            Request::Status => {
                self.publish();
                Ok(Reply::Status(self.d.status()))
            }
        }
    }

    fn qp(&self, qp: u32) -> Result<&AppQp, Refusal> {
        self.qps
            .get(&qp)
            .ok_or_else(|| Refusal("qp", format!("{qp} is not a QP of this application")))
    }

    /// Takes new work requests from every send ring into the engine.
    ///
    /// Posts keep the application's order across QPs where it matters: a receive posted on one
    /// QP before a SEND on another (that the first QP receives) must reach the engine first, or
    /// the SEND meets no receive and waits out an RNR timer. So the tails are read twice; a send
    /// entry is taken only below the first reading (everything the application wrote before it,
    /// on any ring, is below the second), and a pass posts every receive it took before any send.
    fn drain_rings(&mut self) -> bool {
        let mut any = false;
        let mut failed: Vec<(u32, Wc)> = Vec::new();
        let fail = |failed: &mut Vec<(u32, Wc)>, cq: u32, wr_id: u64, opcode: WcOpcode, qpn: u32| {
            failed.push((
                cq,
                Wc {
                    wr_id,
                    status: WcStatus::LocQpOpErr,
                    opcode,
                    qp_num: qpn,
                    ..EMPTY_WC
                },
            ))
        };
        let made = |wr_id: u64, opcode: WcOpcode, qpn: u32| Wc {
            wr_id,
            status: WcStatus::LocQpOpErr,
            opcode,
            qp_num: qpn,
            ..EMPTY_WC
        };
        // held send errors go to their CQ once every send posted before them has completed
        for q in self.qps.values_mut() {
            if q.sends_out.is_empty() && !q.held.is_empty() {
                failed.extend(q.held.drain(..).map(|wc| (q.send_cq, wc)));
                any = true;
            }
        }
        // sends the engine's full queue refused earlier go first, in order
        for q in self.qps.values_mut() {
            if !q.held.is_empty() {
                continue;
            }
            while let Some(wr) = q.deferred.pop_front() {
                let (id, op, len) = (wr.wr_id, wr.opcode, wr.total_len());
                let signaled = wr.flags.contains(netstack::verbs::SendFlags::SIGNALED);
                match q.qp.post_send(signaled_always(&wr)) {
                    Ok(()) => {
                        self.counts.wrs += 1;
                        self.counts.bytes += len;
                        q.sends_out.push_back(signaled);
                        any = true;
                    }
                    Err(VerbsError::Post(netstack::transport::rc::PostError::QueueFull(_))) => {
                        q.deferred.push_front(wr);
                        break;
                    }
                    Err(e) => {
                        tracing::debug!("attachment {}: QP {}: post refused: {e}", self.id, q.qp.qp_num());
                        self.counts.errors += 1;
                        q.held.push_back(made(id, WcOpcode::from_wr(op), q.qp.qp_num()));
                        break;
                    }
                }
            }
        }
        let first: Vec<u64> = self
            .qps
            .values()
            .map(|q| q.ring.word(shm::SQ_TAIL).load(Ordering::Acquire))
            .collect();
        let mut sends: Vec<(u32, Vec<netstack::verbs::SendWr>)> = Vec::new();
        let blocked = self.blocked_cqs();
        for (q, t1) in self.qps.values_mut().zip(first) {
            // a QP whose CQ has a ring's worth of the daemon's own completions waiting (its
            // application reads none) is not read until they are taken: they stay bounded
            if q.fault.is_some()
                || !q.deferred.is_empty()
                || !q.held.is_empty()
                || blocked.contains(&q.send_cq)
                || blocked.contains(&q.recv_cq)
            {
                continue;
            }
            let tail = q.ring.word(shm::SQ_TAIL).load(Ordering::Acquire);
            let n = tail.wrapping_sub(q.head);
            if n == 0 {
                continue;
            }
            any = true;
            if n > q.slots as u64 || t1.wrapping_sub(q.head) > n {
                // an index out of range, or more entries than the ring has (or a tail that
                // went back): the ring is closed and the QP flushed, for this application only
                tracing::warn!(
                    "attachment {}: QP {} ring tail {tail} is {n} past head {} (ring of {}): closed",
                    self.id,
                    q.qp.qp_num(),
                    q.head,
                    q.slots
                );
                q.fault = Some(RingFault::Overrun);
                q.ring
                    .word(shm::SQ_ERROR)
                    .store(RingFault::Overrun as u64, Ordering::Release);
                q.qp.modify_to_err();
                self.counts.errors += 1;
                continue;
            }
            let qpn = q.qp.qp_num();
            let mut mine = Vec::new();
            let end = q.head + n.min(BATCH);
            while q.head < end {
                let w = q.ring.read_words::<8>(shm::slot_off(q.head, q.slots, shm::WQE_BYTES));
                match shm::decode(w) {
                    // a send the first reading did not cover waits for the next pass
                    Ok(Wqe::Send(_)) if q.head >= t1 => break,
                    Ok(Wqe::Send(wr)) => mine.push(wr),
                    Ok(Wqe::Recv(wr)) => {
                        let id = wr.wr_id;
                        match q.qp.post_recv(wr) {
                            Ok(()) => self.counts.wrs += 1,
                            Err(e) => {
                                tracing::debug!("attachment {}: QP {qpn}: receive refused: {e}", self.id);
                                self.counts.errors += 1;
                                fail(&mut failed, q.recv_cq, id, WcOpcode::Recv, qpn);
                            }
                        }
                    }
                    Err(why) => {
                        tracing::debug!("attachment {}: QP {qpn}: bad ring entry: {why}", self.id);
                        self.counts.errors += 1;
                        // after the sends taken before it complete; nothing more this pass
                        q.held.push_back(made(w[0], WcOpcode::Send, qpn));
                        q.head += 1;
                        break;
                    }
                }
                q.head += 1;
            }
            q.ring.word(shm::SQ_HEAD).store(q.head, Ordering::Release);
            if !mine.is_empty() {
                sends.push((qpn, mine));
            }
        }
        // every receive of this pass is posted; now the sends
        for (qpn, wrs) in sends {
            let Some(q) = self.qps.values_mut().find(|q| q.qp.qp_num() == qpn) else {
                continue;
            };
            let mut wrs = wrs.into_iter();
            for wr in wrs.by_ref() {
                let (id, op, len) = (wr.wr_id, wr.opcode, wr.total_len());
                let signaled = wr.flags.contains(netstack::verbs::SendFlags::SIGNALED);
                match q.qp.post_send(signaled_always(&wr)) {
                    Ok(()) => {
                        self.counts.wrs += 1;
                        self.counts.bytes += len;
                        q.sends_out.push_back(signaled);
                    }
                    // the engine's queue is full: this one and the rest wait in the daemon
                    // (and the ring is not read until they are posted)
                    Err(VerbsError::Post(netstack::transport::rc::PostError::QueueFull(_))) => {
                        q.deferred.push_back(wr);
                        break;
                    }
                    // held until the sends before it complete; the rest wait behind it
                    Err(e) => {
                        tracing::debug!("attachment {}: QP {qpn}: post refused: {e}", self.id);
                        self.counts.errors += 1;
                        q.held.push_back(made(id, WcOpcode::from_wr(op), qpn));
                        break;
                    }
                }
            }
            q.deferred.extend(wrs);
        }
        for (cq, wc) in failed {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.pending.push_back(wc);
            }
        }
        any
    }

    /// The CQs with at least a ring's worth of completions the daemon made waiting for room.
    fn blocked_cqs(&self) -> Vec<u32> {
        self.cqs
            .iter()
            .filter(|(_, c)| c.pending.len() >= c.slots)
            .map(|(h, _)| *h)
            .collect()
    }

    /// Moves completions into every completion ring with room; wakes an armed waiter.
    ///
    /// Run to completion (`drive = "application"`), a poll of an engine CQ that finds nothing
    /// runs the engine's cores once. One such poll per pass drives the engine; the other CQs
    /// are polled only when their produced count says a completion waits, so a pass over an
    /// attachment with many CQs is one engine pass, not one per CQ.
    fn drain_cqs(&mut self) -> bool {
        let mut any = false;
        let mut wcs = [EMPTY_WC; 32];
        let mut drove = false;
        for c in self.cqs.values_mut() {
            let mut wrote = 0u64;
            loop {
                let room = c.room();
                if room == 0 {
                    break;
                }
                let n = if !c.pending.is_empty() {
                    let mut k = 0;
                    while k < room.min(wcs.len()) {
                        match c.pending.pop_front() {
                            Some(wc) => wcs[k] = wc,
                            None => break,
                        }
                        k += 1;
                    }
                    k
                } else if drove && c.cq.produced() == c.taken {
                    0
                } else {
                    let k = c.cq.poll(&mut wcs[..room.min(32)]);
                    c.taken = c.taken.wrapping_add(k as u64);
                    // every send completes in the engine (posted signaled); the application
                    // gets those it asked for, and every failed one
                    let mut kept = 0;
                    for i in 0..k {
                        let wc = wcs[i];
                        let mut keep = true;
                        if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                            if let Some(q) = self.qps.values_mut().find(|q| q.qp.qp_num() == wc.qp_num) {
                                let asked = q.sends_out.pop_front().unwrap_or(true);
                                keep = asked || wc.status != WcStatus::Success;
                            }
                        }
                        if keep {
                            wcs[kept] = wc;
                            kept += 1;
                        }
                    }
                    // a poll that found nothing ran the engine (run to completion)
                    drove |= k == 0;
                    if k > 0 && kept == 0 {
                        // only completions nobody asked for: look again for the rest
                        continue;
                    }
                    kept
                };
                if n == 0 {
                    break;
                }
                for wc in &wcs[..n] {
                    c.ring
                        .write_words(shm::slot_off(c.tail, c.slots, shm::CQE_BYTES), &shm::encode_wc(wc));
                    c.tail += 1;
                }
                wrote += n as u64;
            }
            if wrote > 0 {
                any = true;
                c.ring.word(shm::CQ_TAIL).store(c.tail, Ordering::Release);
                fence(Ordering::SeqCst);
                if c.ring.word(shm::CQ_ARMED).swap(0, Ordering::SeqCst) != 0 {
                    sys::eventfd_signal_peer(c.notify.as_fd());
                }
            }
        }
        any
    }
}

impl App {
    /// Maps a ring of `bytes` from the memfd the application passed: within its limits, sealed
    /// against shrinking, and the descriptor closed once mapped.
    fn map_ring(&self, fd: OwnedFd, bytes: usize) -> Result<Mapping, Refusal> {
        self.room_for(bytes as u64)?;
        let file = sealed(std::fs::File::from(fd), bytes as u64)?;
        Mapping::map_and_close(file, bytes).map_err(|e| Refusal("fds", format!("cannot map the ring: {e}")))
    }

    /// Refuses a new object (of `bytes` to map) past the attachment's limits, before anything
    /// is mapped.
    fn room_for(&self, bytes: u64) -> Result<(), Refusal> {
        let l = self.d.limits;
        let c = self.counts;
        let objects = c.pds + c.mrs + c.cqs + c.qps;
        if objects >= l.max_app_objects {
            return refuse(
                "max_app_objects",
                format!("this application holds {objects} objects, the daemon's limit"),
            );
        }
        if self.mapped.saturating_add(bytes) > l.max_app_bytes {
            return refuse(
                "max_app_bytes",
                format!(
                    "{bytes} more bytes on the {} this application has mapped pass the daemon's limit of {}",
                    self.mapped, l.max_app_bytes
                ),
            );
        }
        Ok(())
    }
}

impl AppCq {
    /// Free entries of the ring, as the application's head says (a head the application broke
    /// reads as a full ring: it stops its own completions only).
    fn room(&self) -> usize {
        let head = self.ring.word(shm::CQ_HEAD).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        if used > self.slots as u64 {
            0
        } else {
            self.slots - used as usize
        }
    }
}

/// Checks a ring's slot count: a power of two, 1..=MAX_SLOTS.
fn ring_slots(slots: u32) -> Result<usize, Refusal> {
    let s = slots as usize;
    if s == 0 || s > shm::MAX_SLOTS || !s.is_power_of_two() {
        return refuse(
            "slots",
            format!("{slots}: must be a power of two, 1..={}", shm::MAX_SLOTS),
        );
    }
    Ok(s)
}

/// Checks a passed memfd is on tmpfs, seals it against shrinking, then checks it has at least `len` bytes (in that
/// order: a file checked first could shrink in between, and a mapping past its end faults).
/// `wr` with its completion asked for, whatever the application asked (see `AppQp::sends_out`).
fn signaled_always(wr: &netstack::verbs::SendWr) -> netstack::verbs::SendWr {
    let mut w = wr.clone();
    w.flags = netstack::verbs::SendFlags(w.flags.0 | netstack::verbs::SendFlags::SIGNALED.0);
    w
}

fn sealed(file: std::fs::File, len: u64) -> Result<std::fs::File, Refusal> {
    match sys::is_tmpfs(file.as_fd()) {
        Ok(true) => {}
        Ok(false) => {
            return refuse(
                "fds",
                "the memfd is not on tmpfs (a hugetlbfs memfd cannot be mapped safely: MFD_HUGETLB is not supported)",
            )
        }
        Err(e) => return refuse("fds", format!("fstatfs: {e}")),
    }
    sys::seal_shrink(file.as_fd()).map_err(|e| {
        Refusal(
            "fds",
            format!(
                "the memfd cannot be sealed against shrinking (a memfd made with MFD_ALLOW_SEALING is needed): {e}"
            ),
        )
    })?;
    let size = file
        .metadata()
        .map_err(|e| Refusal("fds", format!("fstat: {e}")))?
        .len();
    if size < len {
        return refuse("len", format!("{len} bytes, but the memfd has {size}"));
    }
    Ok(file)
}
