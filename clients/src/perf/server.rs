//! The `nsperf server` process: a flexns context with one large memory region that clients
//! WRITE to, READ from and run atomics on, receive queues for SENDs (echoed for ping-pong), and
//! the `udp-raw` and `tcp` reference servers on their own sockets.

use super::args::{parse_recovery, DriveArg, PollModeArg};
use super::reference::Wait;
use super::{Hello, Op, Welcome};
use crate::bench::fill_pattern;
use anyhow::{Context as _, Result};
use netstack::cm::{self, Accepted, Acceptor};
use netstack::verbs::*;
use parking_lot::Mutex;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::Duration;

/// Server options. Stack settings come from `--config` (TOML) when given; a flag given
/// explicitly overrides the file, a flag left out leaves the file's value.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Serve this process's Prometheus metrics (its context's counters) on this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Connection-manager (gRPC) listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddrV4,
    /// Size of the memory region clients access.
    #[arg(long, default_value = "64MiB", value_parser = crate::bench::parse_size)]
    pub mr_size: u64,
    /// Loss recovery of the server's QPs (must match the client's) [config: qp.recovery].
    #[arg(long, value_parser = parse_recovery)]
    pub recovery: Option<Recovery>,
    /// Congestion control of the server's QPs; `none` adopts each client's (the receiver runs
    /// the algorithm's receiving half: DCQCN's CNPs, HPCC's INT echo, Homa's grants)
    /// [config: qp.cc].
    #[arg(long)]
    pub cc: Option<netstack::cc::CcKind>,
    /// Who runs the engine's cores: engine threads, or the threads that post and poll
    /// [config: drive].
    #[arg(long, value_enum)]
    pub drive: Option<DriveArg>,
    /// Engine poll mode [config: poll_mode].
    #[arg(long, value_enum)]
    pub poll_mode: Option<PollModeArg>,
    /// How the server's threads wait (completions to echo, the references' sockets): spin or
    /// block. A client that starts its server passes its own.
    #[arg(long, value_enum, default_value = "block")]
    pub wait: Wait,
    /// Context config (TOML); flags given explicitly override it.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Most QPs one caller (one IP address) of the connection manager may hold; more are
    /// refused. Clients on one host share its address: a run's --qps and --idle-qps count
    /// together, and QPs of clients that left count until they are found gone.
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_qps_per_caller: u64,
    /// Seconds a QP may go without receiving a packet: one that never received any is then
    /// reaped (its caller named an endpoint that never answers). Half-way, and every half
    /// of it while a QP stays quiet, the server probes it with a zero-length WRITE, which a
    /// live client's QP acknowledges and a client that left fails (its QP is dropped).
    #[arg(long, default_value = "10", value_parser = kv_store::cli::parse_unused_timeout)]
    pub unused_qp_timeout: Duration,
    /// The stack's flags (`--data`, `--data-cores`, `--link`, ...).
    #[command(flatten)]
    pub ctx: netstack::cli::ContextArgs,
}

impl ServerArgs {
    /// The connection manager's limits these flags set.
    pub fn door_limits(&self) -> cm::DoorLimits {
        cm::DoorLimits {
            max_batch: cm::CHUNK,
            max_qps_per_caller: self.max_qps_per_caller as usize,
            unused_timeout: self.unused_qp_timeout,
        }
    }

    /// The stack configuration: the file's (or the defaults), with the flags given applied.
    pub fn context_config(&self) -> Result<ContextConfig> {
        let mut cfg = match &self.config {
            Some(p) => ContextConfig::from_file(p).with_context(|| format!("config {}", p.display()))?,
            None => ContextConfig::default(),
        };
        if let Some(p) = self.poll_mode {
            cfg.poll_mode = p.into();
        }
        if let Some(d) = self.drive {
            cfg.drive = d.into();
        }
        if let Some(r) = self.recovery {
            cfg.qp.recovery = r;
        }
        if let Some(c) = self.cc {
            cfg.qp.cc = c;
        }
        self.ctx.apply(&mut cfg)?;
        Ok(cfg)
    }
}

/// Pattern seed of the server region.
pub const SEED: u64 = 0x5eed;

/// Where a QP's receive slots for SENDs live in the region, whether to echo, and whether the
/// echoes are signaled (the client's `--signaled`, as perftest's ib_send_lat on both sides).
#[derive(Debug, Clone, Copy)]
struct RecvSlots {
    size: u64,
    base: u64,
    echo: bool,
    signaled: bool,
}

type RecvTable = Arc<Mutex<std::collections::HashMap<u32, (Arc<Qp>, RecvSlots)>>>;

/// A RedN get connection: gets are served by the chains alone; this thread-free state only
/// keeps receives posted (each get consumes one).
struct RednConn {
    qp: Option<Arc<Qp>>,
    chains: netstack::redn::programs::HashGetServer,
    rcq: Cq,
    posted: u64,
}

/// How long a QP has received nothing (for the liveness probe, see [`PerfAcceptor::watch`]).
struct Quiet {
    rx: u64,
    since: std::time::Instant,
}

impl Quiet {
    fn new() -> Quiet {
        Quiet {
            rx: 0,
            since: std::time::Instant::now(),
        }
    }

    /// Probes `qp` with a zero-length WRITE (it needs no receive and names no memory, IBA
    /// 9.7.4.1.5) when it has received nothing for `every`: a live client's QP acknowledges
    /// it (so the door never reaps it, however idle), a client that left never does, and its
    /// QP fails and is dropped. Returns whether the QP is still worth keeping.
    fn check(&mut self, qp: &Qp, every: Duration) -> bool {
        if qp.state() == QpState::Err {
            return false;
        }
        let rx = qp.stats().rx_packets;
        if rx != self.rx {
            self.rx = rx;
            self.since = std::time::Instant::now();
        } else if self.since.elapsed() >= every {
            self.since = std::time::Instant::now();
            // unsignaled: success completes nothing, a failure is a completion the
            // completion thread skips (it echoes receives only)
            let _ = qp.post_send(SendWr::new(u64::MAX, WrOpcode::RdmaWrite).flags(SendFlags(0)));
        }
        true
    }
}

/// Receives kept posted on a RedN get QP.
const REDN_RECVS: u64 = 16384;

/// Layout of the `kv` region: the list's nodes, then the table's buckets, then its values.
pub const LIST_OFF: usize = 0;
/// Where the RedN hash table's 16-byte buckets start.
pub const TABLE_OFF: usize = 1 << 16;
/// Where the table's values start.
pub const VALUES_OFF: usize = TABLE_OFF + (super::TABLE_BUCKETS as usize) * 16;
/// Length of the `kv` region in bytes.
pub const KV_LEN: usize = VALUES_OFF + (super::TABLE_BUCKETS as usize) * super::VALUE_LEN;

/// Fills the `kv` region: a list of `LIST_NODES` nodes `{key, next, value}` and a table with
/// key `k` (1..=TABLE_BUCKETS) in bucket `k % TABLE_BUCKETS` as `{key, value address}`.
fn fill_kv(kv: &Mr) {
    let node = 16 + super::VALUE_LEN;
    for j in 0..super::LIST_NODES as usize {
        let off = LIST_OFF + j * node;
        let next = if j + 1 < super::LIST_NODES as usize {
            kv.addr() + (off + node) as u64
        } else {
            0
        };
        kv.write(off, &(j as u64 + 1).to_le_bytes());
        kv.write(off + 8, &next.to_le_bytes());
        kv.write(off + 16, &super::value_of(j as u64 + 1));
    }
    for k in 1..=super::TABLE_BUCKETS {
        let b = (k % super::TABLE_BUCKETS) as usize;
        let v = VALUES_OFF + b * super::VALUE_LEN;
        kv.write(TABLE_OFF + b * 16, &k.to_le_bytes());
        kv.write(TABLE_OFF + b * 16 + 8, &(kv.addr() + v as u64).to_le_bytes());
        kv.write(v, &super::value_of(k));
    }
}

struct PerfAcceptor {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    mr: Arc<Mr>,
    ro: Mr,
    /// The linked list and the RedN hash table with their values.
    kv: Mr,
    /// RedN get connections by QP number: the response QP, its chains, its receive CQ,
    /// receives posted.
    redn: Mutex<std::collections::HashMap<u32, RednConn>>,
    pending_redn: Mutex<std::collections::HashMap<u32, RednConn>>,
    /// Connected QPs by number, with how long each has been quiet.
    qps: Mutex<std::collections::HashMap<u32, (Arc<Qp>, Quiet)>>,
    /// Receive slots per QP, for SEND: (qp, slot size, slot base offset, echo)
    recv: RecvTable,
    next_recv_base: Mutex<u64>,
    /// Receive slots of accepted QPs until `connected` hands each QP over.
    pending: Mutex<std::collections::HashMap<u32, RecvSlots>>,
    /// Windows of the region by client session, and where the next one starts.
    windows: Mutex<Windows>,
}

/// Where the next window starts, and each session's window (offset, length).
type Windows = (u64, std::collections::HashMap<u64, (u64, u64)>);

/// Windows remembered (sessions beyond are forgotten, oldest first).
const WINDOWS: usize = 4096;

impl PerfAcceptor {
    /// The window of the region a client session gets: `need` bytes of its own (4 KiB
    /// aligned, allocated round the region), or the whole region for `need` 0.
    fn window(&self, session: u64, need: u64) -> Result<(u64, u64), String> {
        let len = self.mr.len() as u64;
        if need == 0 {
            return Ok((0, len));
        }
        if need > len {
            return Err(format!(
                "memory region of {len} bytes is smaller than the {need} bytes this client writes; start the server with a larger --mr-size"
            ));
        }
        let mut w = self.windows.lock();
        if let Some(&x) = w.1.get(&session) {
            return Ok(x);
        }
        let need = need.div_ceil(4096) * 4096;
        let start = if w.0 + need > len { 0 } else { w.0 };
        w.0 = start + need.min(len);
        if w.1.len() >= WINDOWS {
            w.1.clear();
        }
        w.1.insert(session, (start, need.min(len - start)));
        Ok((start, need.min(len - start)))
    }

    fn welcome(&self, (off, len): (u64, u64)) -> Welcome {
        Welcome {
            addr: self.mr.addr() + off,
            rkey: self.mr.rkey(),
            len,
            off,
            seed: SEED,
            ro_addr: self.ro.addr(),
            ro_rkey: self.ro.rkey(),
            ro_len: self.ro.len() as u64,
            list_head: self.kv.addr() + LIST_OFF as u64,
            kv_rkey: self.kv.rkey(),
            table_addr: self.kv.addr() + TABLE_OFF as u64,
        }
    }

    /// A RedN get connection: a managed response QP (a one-entry ring) and the hash-get chains
    /// that answer on it, with receives posted before the client can send.
    fn accept_redn(&self, hello: &Hello) -> Result<Accepted, String> {
        let e = |e: VerbsError| e.to_string();
        let qcq = self.ctx.create_cq_ignore_overrun(64).map_err(e)?;
        let rcq = self.ctx.create_cq_ignore_overrun(64).map_err(e)?;
        let qp = netstack::redn::programs::HashGetServer::response_qp(
            &self.ctx,
            &self.pd,
            &qcq,
            &rcq,
            2 * REDN_RECVS as u32,
        )
        .map_err(e)?;
        let chains = netstack::redn::programs::HashGetServer::new(
            &self.ctx,
            &self.pd,
            &[&qp],
            &rcq,
            self.kv.rkey(),
            self.kv.lkey(),
            super::VALUE_LEN as u32,
            netstack::redn::programs::ClientBuffer {
                addr: hello.resp_addr,
                rkey: hello.resp_rkey,
            },
        )
        .map_err(e)?;
        chains.post_recvs(&qp, REDN_RECVS as usize).map_err(e)?;
        self.pending_redn.lock().insert(
            qp.qp_num(),
            RednConn {
                qp: None,
                chains,
                rcq,
                posted: REDN_RECVS,
            },
        );
        Ok(Accepted {
            qp,
            private_data: serde_json::to_vec(&self.welcome((0, self.mr.len() as u64))).expect("serializable"),
        })
    }

    /// Tops up the receives of RedN get connections (an application-thread chore the gets
    /// themselves never wait for) and drops finished ones.
    fn refill_redn(&self) {
        let mut v = self.redn.lock();
        v.retain(|_, c| c.qp.as_ref().is_some_and(|q| q.state() == QpState::Rts));
        for c in v.values_mut() {
            let Some(qp) = c.qp.as_ref() else { continue };
            c.chains.top_up(qp, &c.rcq, &mut c.posted, REDN_RECVS);
        }
    }
}

impl PerfAcceptor {
    /// Drops QPs that failed (a client that left fails the probe) and probes those quiet for
    /// `every` (see [`Quiet::check`]), RedN response QPs excepted.
    fn watch(&self, every: Duration) {
        let mut gone = Vec::new();
        self.qps.lock().retain(|&n, (qp, quiet)| {
            let keep = quiet.check(qp, every);
            if !keep {
                gone.push(n);
            }
            keep
        });
        let mut recv = self.recv.lock();
        for n in gone {
            recv.remove(&n);
        }
        // RedN response QPs are managed (their send queue is the chains'): never probed;
        // `refill_redn` drops failed ones
    }
}

impl Acceptor for PerfAcceptor {
    fn accept(&self, _remote: &Endpoint, pd: &[u8]) -> Result<Accepted, String> {
        let hello: Hello = serde_json::from_slice(pd).map_err(|e| format!("bad hello: {e}"))?;
        if hello.op == Op::RednGet {
            return self.accept_redn(&hello);
        }
        let window = self.window(hello.session, hello.need)?;
        let qp = self
            .ctx
            .create_qp(
                &self.pd,
                &self.cq,
                &self.cq,
                QpInitAttr {
                    low_latency: hello.low_latency,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
        if hello.op == Op::Send {
            let slots = (hello.depth as u64 * 2).max(2);
            let need = hello.size.max(1) * slots;
            let mut nb = self.next_recv_base.lock();
            if *nb + need > self.mr.len() as u64 {
                *nb = 0;
            }
            let base = *nb;
            if base + need > self.mr.len() as u64 {
                return Err(format!(
                    "memory region of {} bytes is too small for {slots} receive slots of {} bytes",
                    self.mr.len(),
                    hello.size
                ));
            }
            *nb += need;
            for s in 0..slots {
                qp.post_recv(RecvWr {
                    wr_id: s,
                    sg_list: [self
                        .mr
                        .sge((base + s * hello.size.max(1)) as usize, hello.size as usize)]
                    .into_iter()
                    .collect(),
                })
                .map_err(|e| e.to_string())?;
            }
            self.pending.lock().insert(
                qp.qp_num(),
                RecvSlots {
                    size: hello.size.max(1),
                    base,
                    echo: hello.echo,
                    signaled: hello.signaled,
                },
            );
        }
        Ok(Accepted {
            qp,
            private_data: serde_json::to_vec(&self.welcome(window)).expect("serializable"),
        })
    }

    fn connected(&self, qp: Qp) {
        let qp = Arc::new(qp);
        if let Some(mut c) = self.pending_redn.lock().remove(&qp.qp_num()) {
            c.qp = Some(qp.clone());
            self.redn.lock().insert(qp.qp_num(), c);
            return;
        }
        if let Some(slots) = self.pending.lock().remove(&qp.qp_num()) {
            self.recv.lock().insert(qp.qp_num(), (qp.clone(), slots));
        }
        self.qps.lock().insert(qp.qp_num(), (qp, Quiet::new()));
    }

    fn rx_packets(&self, qpn: u32) -> Option<u64> {
        if let Some((qp, _)) = self.qps.lock().get(&qpn) {
            return Some(qp.stats().rx_packets);
        }
        let redn = self.redn.lock();
        Some(redn.get(&qpn)?.qp.as_ref()?.stats().rx_packets)
    }

    /// Drops a QP that never received a packet, with its receive slots or RedN chains.
    fn reap(&self, qpn: u32) {
        self.qps.lock().remove(&qpn);
        self.recv.lock().remove(&qpn);
        self.redn.lock().remove(&qpn);
    }
}

/// Runs the server until SIGTERM/SIGINT. Prints one banner line first:
/// `nsperf-server cm=ADDR data=ADDR udp=ADDR tcp=ADDR`.
pub fn run(args: ServerArgs) -> Result<()> {
    if let Some(addr) = args.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let cfg = args.context_config()?;
    let ctx = Context::open(cfg)?;
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1 << 16)?;
    let mr = Arc::new(pd.reg_mr(args.mr_size as usize, Access::ALL)?);
    // the region holds a known pattern so READs can be verified by the client
    fill_region(&mr, args.mr_size);
    let kv = pd.reg_mr(KV_LEN, Access::ALL)?;
    fill_kv(&kv);
    // offloads: batched READ over the main region, list walk over the list (read-only DMA)
    let off = ctx.offload();
    let _offloads = [
        off.register_inline(
            netstack::offload::builtin::BATCH_READ,
            netstack::offload::QpFilter::Any,
            netstack::offload::builtin::batch_read(),
        )?,
        off.register_inline(
            netstack::offload::builtin::LIST_WALK,
            netstack::offload::QpFilter::Any,
            netstack::offload::builtin::list_walk(netstack::offload::builtin::ListLayout::packed(super::VALUE_LEN)),
        )?,
    ];
    let _dma = [off.register_dma_region(&mr, false), off.register_dma_region(&kv, false)];
    let ro = pd.reg_mr(4096, Access::REMOTE_READ)?;
    let mut page = vec![0u8; 4096];
    fill_pattern(&mut page, 0, SEED ^ 1);
    ro.write(0, &page);
    let recv = Arc::new(Mutex::new(std::collections::HashMap::new()));
    let acc = Arc::new(PerfAcceptor {
        ctx: ctx.clone(),
        pd,
        cq: cq.clone(),
        mr: mr.clone(),
        ro,
        kv,
        redn: Mutex::new(Default::default()),
        pending_redn: Mutex::new(Default::default()),
        qps: Mutex::new(Default::default()),
        recv: recv.clone(),
        next_recv_base: Mutex::new(0),
        pending: Mutex::new(Default::default()),
        windows: Mutex::new((0, Default::default())),
    });

    let udp = super::reference::UdpServer::bind(SocketAddrV4::new(*ctx.local_addr().ip(), 0), args.wait)?;
    let tcp = std::net::TcpListener::bind(SocketAddrV4::new(*args.listen.ip(), 0))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind(args.listen))?;
    println!(
        "nsperf-server cm={} data={} udp={} tcp={}",
        listener.local_addr()?,
        ctx.local_addr(),
        udp.local_addr()?,
        tcp.local_addr()?
    );
    use std::io::Write;
    std::io::stdout().flush()?;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::spawn(move || udp.run());
    let wait = args.wait;
    std::thread::spawn(move || super::reference::tcp_serve(tcp, wait));
    {
        let acc = acc.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(20));
            acc.refill_redn();
        });
    }
    let limits = args.door_limits();
    {
        // QPs quiet for half the door's timeout are probed: a live client's answer before the
        // door reaps a QP that never received anything
        let (acc, every) = (acc.clone(), limits.unused_timeout / 2);
        std::thread::spawn(move || loop {
            std::thread::sleep((every / 4).max(Duration::from_millis(10)));
            acc.watch(every);
        });
    }
    // completion thread: repost receives, echo for ping-pong
    {
        let (stop, mr) = (stop.clone(), mr.clone());
        std::thread::spawn(move || serve_completions(&cq, &mr, &recv, wait, &stop));
    }
    rt.block_on(async move {
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
        };
        cm::serve_with(listener, acc, limits, shutdown).await
    })?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Writes the pattern READs are verified against into the first `len` bytes of `mr`.
fn fill_region(mr: &Mr, len: u64) {
    let mut chunk = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let n = ((len - off) as usize).min(chunk.len());
        fill_pattern(&mut chunk[..n], off, SEED);
        mr.write(off as usize, &chunk[..n]);
        off += n as u64;
    }
}

/// The completion thread until `stop`: reposts each receive, and echoes it on a ping-pong QP.
fn serve_completions(cq: &Cq, mr: &Mr, recv: &RecvTable, wait: Wait, stop: &std::sync::atomic::AtomicBool) {
    let mut wcs = [EMPTY_WC; 64];
    let mut last_work = std::time::Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let n = cq.poll(&mut wcs);
        if n == 0 {
            idle(cq, wait, last_work);
            continue;
        }
        last_work = std::time::Instant::now();
        for wc in &wcs[..n] {
            answer_recv(wc, mr, recv);
        }
    }
}

/// Waits for more completions: spin: poll again; block: sleep on the CQ (after a short spin
/// following work, less than one wake-up costs).
fn idle(cq: &Cq, wait: Wait, last_work: std::time::Instant) {
    match wait {
        // idle between runs: park, as the references' servers do
        Wait::Spin if last_work.elapsed() > super::reference::PARK_AFTER => {
            cq.wait(Duration::from_millis(100));
        }
        Wait::Spin => std::thread::yield_now(),
        Wait::Block if last_work.elapsed() < Duration::from_micros(20) => std::thread::yield_now(),
        Wait::Block => {
            cq.wait(Duration::from_millis(100));
        }
    }
}

/// Reposts the receive `wc` completed, after echoing it when its QP ping-pongs.
fn answer_recv(wc: &Wc, mr: &Mr, recv: &RecvTable) {
    if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
        return; // an echo's send completion (only a --signaled ping-pong has them)
    }
    let Some((
        qp,
        RecvSlots {
            size,
            base,
            echo,
            signaled,
        },
    )) = recv.lock().get(&wc.qp_num).cloned()
    else {
        return;
    };
    if wc.status != WcStatus::Success {
        recv.lock().remove(&wc.qp_num);
        return;
    }
    let off = (base + wc.wr_id * size) as usize;
    if echo && wc.opcode == WcOpcode::RecvRdmaWithImm {
        // echo a WRITE_WITH_IMM's immediate back in an empty SEND_WITH_IMM
        let imm = wc.imm_data.unwrap_or(0);
        let wr = SendWr::new(wc.wr_id, WrOpcode::SendWithImm).imm(imm);
        let _ = qp.post_send(wr.flags(SendFlags(0)));
    } else if echo {
        // small echoes travel INLINE (in the WQE slots, or straight out on a low-latency QP)
        let mut flags = if wc.byte_len <= 256 {
            SendFlags::INLINE
        } else {
            SendFlags(0)
        };
        if signaled {
            // its completion comes back to this thread, which skips it (above)
            flags = flags | SendFlags::SIGNALED;
        }
        let _ = qp.post_send(
            SendWr::new(wc.wr_id, WrOpcode::Send)
                .sge(mr.sge(off, wc.byte_len as usize))
                .flags(flags),
        );
    }
    let _ = qp.post_recv(RecvWr {
        wr_id: wc.wr_id,
        sg_list: [mr.sge(off, size as usize)].into_iter().collect(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServerArgs,
    }

    #[test]
    fn config_file_values_hold_unless_a_flag_is_given() {
        let p = std::env::temp_dir().join(format!("nsperf-config-{}.toml", std::process::id()));
        std::fs::write(
            &p,
            "data_cores = 2\nrx_delay_us = 7\npoll_mode = \"busy-poll\"\ndrive = \"application\"\n[qp]\nrecovery = \"selective-repeat\"\n",
        )
        .unwrap();
        let parse = |extra: &[&str]| {
            let mut a = vec!["nsperf-server", "--config", p.to_str().unwrap()];
            a.extend_from_slice(extra);
            Cli::parse_from(a).args.context_config().unwrap()
        };
        let c = parse(&[]);
        assert_eq!(c.data_cores, 2);
        assert_eq!(c.rx_delay_us, 7);
        assert_eq!(c.poll_mode, PollMode::BusyPoll);
        assert_eq!(c.drive, netstack::verbs::Drive::Application);
        assert_eq!(c.qp.recovery, Recovery::SelectiveRepeat);
        let c = parse(&[
            "--data-cores",
            "1",
            "--rx-delay-us",
            "0",
            "--poll-mode",
            "sleep",
            "--recovery",
            "go-back-n",
            "--drive",
            "threads",
        ]);
        assert_eq!(c.data_cores, 1);
        assert_eq!(c.rx_delay_us, 0);
        assert_eq!(c.poll_mode, PollMode::Sleep);
        assert_eq!(c.drive, netstack::verbs::Drive::Threads);
        assert_eq!(c.qp.recovery, Recovery::GoBackN);
        let _ = std::fs::remove_file(&p);
    }
}
