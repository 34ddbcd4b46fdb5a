//! The engine: a data-core thread that owns a link and drives the QPs' transport state machines
//! (receive, dispatch, timers, transmit) and delivers completions to completion queues.
//!
//! Applications reach it only through QP handles (posting marks a QP active and wakes the engine
//! if it said it sleeps) and completion queues. Payload bytes move once: from registered memory
//! to the socket as an iovec on transmit, from the receive buffer into registered memory on
//! receive.

mod cq;
mod stats;

pub use cq::CqShared;
pub use stats::{EngineStats, StatsSnapshot};

use crate::link::sys::{self, EventFd, OutMsg, RecvBatch};
use crate::link::udp::UdpLink;
use crate::mem::MrTable;
use crate::transport::rc::RcQp;
use crate::transport::TxPacket;
use crate::wire::{icrc, PacketView, MAX_DATAGRAM, PAD_ZEROS};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How an idle engine thread waits for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PollMode {
    /// Spin forever (a dedicated core).
    BusyPoll,
    /// Spin for `spin_us`, then sleep until a packet, a post or a timer.
    #[default]
    Adaptive,
    /// Sleep as soon as there is no work.
    Sleep,
}

/// Datagrams per send or receive batch.
pub const BATCH: usize = 64;

/// A QP as the engine holds it.
pub struct QpSlot {
    pub qp: RcQp,
    pub remote: Option<SocketAddrV4>,
    pub send_cq: Arc<CqShared>,
    pub recv_cq: Arc<CqShared>,
}

impl QpSlot {
    /// Moves the transport's completions to the completion queues.
    pub fn deliver_completions(&mut self) {
        while let Some(wc) = self.qp.poll_completion() {
            let recv = matches!(
                wc.opcode,
                crate::work::WcOpcode::Recv | crate::work::WcOpcode::RecvRdmaWithImm
            );
            if recv { &self.recv_cq } else { &self.send_cq }.push(wc);
        }
    }
}

/// State shared between the engine thread and application handles.
pub struct EngineShared {
    pub mrs: Arc<MrTable>,
    pub qps: RwLock<HashMap<u32, Arc<Mutex<QpSlot>>>>,
    active_tx: Sender<u32>,
    wake: EventFd,
    sleeping: AtomicBool,
    stop: AtomicBool,
    pub stats: EngineStats,
    local: SocketAddrV4,
    epoch: Instant,
}

impl EngineShared {
    /// Tells the engine a QP has work; wakes it only if it said it sleeps.
    pub fn kick(&self, qpn: u32) {
        let _ = self.active_tx.send(qpn);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake.notify();
        }
    }
    /// Nanoseconds since the engine started (the transports' clock).
    pub fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }
}

/// A running engine thread.
pub struct Engine {
    shared: Arc<EngineShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Engine {
    /// Binds the link and starts the data-core thread.
    pub fn start(bind: SocketAddrV4, mrs: Arc<MrTable>, mode: PollMode, spin: Duration) -> std::io::Result<Engine> {
        let link = UdpLink::bind(bind)?;
        let (active_tx, active_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(EngineShared {
            mrs,
            qps: RwLock::new(HashMap::new()),
            active_tx,
            wake: EventFd::new()?,
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            stats: EngineStats::default(),
            local: link.local_addr(),
            epoch: Instant::now(),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("flexns-engine-{}", link.local_addr().port()))
            .spawn(move || DataCore::new(s2, link, active_rx, mode, spin).run())?;
        Ok(Engine {
            shared,
            thread: Some(thread),
        })
    }

    pub fn shared(&self) -> &Arc<EngineShared> {
        &self.shared
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One outgoing datagram being assembled: the packet (holding its payload regions alive), the
/// destination, and the pad + ICRC trailer.
struct Outgoing {
    pkt: TxPacket,
    dst: SocketAddrV4,
    trailer: [u8; 8],
    trailer_len: usize,
}

struct DataCore {
    shared: Arc<EngineShared>,
    link: UdpLink,
    active_rx: Receiver<u32>,
    mode: PollMode,
    spin: Duration,
    active: HashSet<u32>,
    rx: RecvBatch,
    out: Vec<Outgoing>,
}

impl DataCore {
    fn new(
        shared: Arc<EngineShared>,
        link: UdpLink,
        active_rx: Receiver<u32>,
        mode: PollMode,
        spin: Duration,
    ) -> DataCore {
        let rx = RecvBatch::new(BATCH, MAX_DATAGRAM + 64);
        shared.stats.set_staging_bytes(rx.staging_bytes() as u64);
        DataCore {
            shared,
            link,
            active_rx,
            mode,
            spin,
            active: HashSet::new(),
            rx,
            out: Vec::with_capacity(BATCH),
        }
    }

    fn run(mut self) {
        let mut idle_since: Option<Instant> = None;
        while !self.shared.stop.load(Ordering::Relaxed) {
            let now = self.shared.now();
            let mut work = false;
            while let Ok(q) = self.active_rx.try_recv() {
                self.active.insert(q);
                work = true;
            }
            work |= self.receive(now);
            let next_deadline = self.timers(now);
            work |= self.transmit(now);
            if work {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            match self.mode {
                PollMode::BusyPoll => std::hint::spin_loop(),
                PollMode::Adaptive if since.elapsed() < self.spin => std::thread::yield_now(),
                _ => self.sleep(next_deadline),
            }
        }
    }

    fn sleep(&mut self, next_deadline: Option<u64>) {
        self.shared.sleeping.store(true, Ordering::SeqCst);
        // a post between our last check and the flag would not ring: check again
        if self.active_rx.is_empty() {
            let now = self.shared.now();
            let wait = next_deadline
                .map(|d| d.saturating_sub(now))
                .unwrap_or(100_000_000)
                .min(100_000_000);
            let _ = sys::ppoll_readable(&[self.link.fd(), self.shared.wake.fd()], wait.max(1_000));
            self.shared.wake.drain();
        }
        self.shared.sleeping.store(false, Ordering::SeqCst);
    }

    fn receive(&mut self, now: u64) -> bool {
        let n = match self.link.recv_batch(&mut self.rx) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("receive failed: {e}");
                return false;
            }
        };
        let local = self.link.local_addr();
        let stats = &self.shared.stats;
        for i in 0..n {
            let (d, src) = self.rx.get(i);
            stats.rx_datagrams.inc();
            let Some(d) = d else {
                stats.rx_malformed("oversized");
                continue;
            };
            stats.rx_bytes.add(d.len() as u64);
            let v = match PacketView::parse(d) {
                Ok(v) => v,
                Err(e) => {
                    stats.rx_malformed(e.kind());
                    continue;
                }
            };
            if let Err(e) = PacketView::verify_icrc(d, src, local) {
                stats.rx_malformed(e.kind());
                continue;
            }
            let qpn = v.bth.dest_qp;
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                stats.rx_unknown_qp.inc();
                continue;
            };
            let mut s = slot.lock();
            if s.remote != Some(src) {
                stats.rx_wrong_source.inc();
                continue;
            }
            s.qp.handle_packet(now, &v, &self.shared.mrs);
            s.deliver_completions();
            self.active.insert(qpn);
        }
        n > 0
    }

    /// Runs due timers; returns the earliest future deadline.
    fn timers(&mut self, now: u64) -> Option<u64> {
        let mut next: Option<u64> = None;
        for (&qpn, slot) in self.shared.qps.read().iter() {
            let mut s = slot.lock();
            if let Some(t) = s.qp.poll_timeout() {
                if t <= now {
                    s.qp.handle_timeout(now);
                    s.deliver_completions();
                    self.active.insert(qpn);
                    if let Some(t2) = s.qp.poll_timeout() {
                        next = Some(next.map_or(t2, |n| n.min(t2)));
                    }
                } else {
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
        }
        next
    }

    fn transmit(&mut self, now: u64) -> bool {
        let mut sent_any = false;
        let active: Vec<u32> = self.active.iter().copied().collect();
        for qpn in active {
            let Some(slot) = self.shared.qps.read().get(&qpn).cloned() else {
                self.active.remove(&qpn);
                continue;
            };
            let mut s = slot.lock();
            let Some(dst) = s.remote else {
                self.active.remove(&qpn);
                continue;
            };
            while self.out.len() < BATCH {
                match s.qp.poll_transmit(now) {
                    Some(pkt) => {
                        self.out.push(self.finish(pkt, dst));
                    }
                    None => break,
                }
            }
            s.deliver_completions();
            if !s.qp.wants_transmit(now) {
                self.active.remove(&qpn);
            }
            drop(s);
            if self.out.len() >= BATCH {
                sent_any |= self.flush();
            }
        }
        sent_any |= self.flush();
        sent_any
    }

    /// Computes pad and ICRC over the header buffer and the payload in place (no copy).
    fn finish(&self, pkt: TxPacket, dst: SocketAddrV4) -> Outgoing {
        let pad = pkt.hdr.bth().pad as usize;
        let body = pkt.hdr.len() + pkt.payload_len() + pad;
        let mut c = icrc::Icrc::new(self.link.local_addr(), dst, body);
        c.update(pkt.hdr.as_bytes());
        for p in &pkt.payload {
            p.region.with_slice(p.off, p.len, |s| c.update(s));
        }
        c.update(&PAD_ZEROS[..pad]);
        let mut trailer = [0u8; 8];
        trailer[..pad].fill(0);
        trailer[pad..pad + 4].copy_from_slice(&c.finish().to_le_bytes());
        Outgoing {
            pkt,
            dst,
            trailer,
            trailer_len: pad + 4,
        }
    }

    fn flush(&mut self) -> bool {
        if self.out.is_empty() {
            return false;
        }
        let mut msgs: Vec<OutMsg> = self
            .out
            .iter()
            .map(|o| {
                let mut m = OutMsg::new(&o.dst);
                m.push(o.pkt.hdr.as_bytes().as_ptr(), o.pkt.hdr.len());
                for p in &o.pkt.payload {
                    m.push(p.region.ptr_at(p.off, p.len), p.len);
                }
                m.push(o.trailer.as_ptr(), o.trailer_len);
                m
            })
            .collect();
        let n = match self.link.send_batch(&mut msgs) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("send failed: {e}");
                self.shared.stats.tx_errors.inc();
                self.out.len() // drop the batch; the transport retransmits
            }
        };
        let stats = &self.shared.stats;
        for o in &self.out[..n] {
            stats.tx_packets.inc();
            stats
                .tx_bytes
                .add((o.pkt.hdr.len() + o.pkt.payload_len() + o.trailer_len) as u64);
        }
        // what the kernel did not take (socket buffer full) is kept for the next round
        self.out.drain(..n);
        n > 0
    }
}
