//! The `nsperf client`: runs one operation for a bounded time over one or more QPs, verifies the
//! data it moved, and reports per `docs/BENCHMARKS.md`; optionally interleaved with a reference system.

use super::args::{recovery_name, ClientArgs};
use super::completion::next_wc;
use super::reference::Wait;
use super::{reference, Hello, Op, System, Welcome};
use crate::bench::{histogram, median, pattern_byte, BenchResult, ChildServer, Meter, Proc};
use anyhow::{bail, Context as _, Result};
use netstack::cm;
use netstack::verbs::*;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How to start a server child: this executable and the subcommand words before its flags.
#[derive(Debug, Clone)]
pub struct ServerSpawn {
    /// The executable (this program).
    pub exe: PathBuf,
    /// Subcommand words before the server's flags.
    pub subcommand: Vec<String>,
}

struct Peers {
    cm: SocketAddr,
    udp: Option<SocketAddr>,
    tcp: Option<SocketAddr>,
    child: Option<ChildServer>,
}

fn peers(a: &ClientArgs, spawn: &ServerSpawn) -> Result<Peers> {
    if let Some(cm) = a.server {
        return Ok(Peers {
            cm,
            udp: a.udp,
            tcp: a.tcp,
            child: None,
        });
    }
    let mut args = spawn.subcommand.clone();
    args.extend([
        "--mr-size".to_string(),
        a.server_mr_size.to_string(),
        "--recovery".into(),
        recovery_name(a.recovery).into(),
        "--poll-mode".into(),
        a.poll_mode.name().into(),
        "--drive".into(),
        a.drive_mode().name().into(),
        "--wait".into(),
        a.wait_mode().name().into(),
    ]);
    // the stack's flags but the data-path address (the server binds its own)
    args.extend(a.ctx.without_data().to_args());
    let child = ChildServer::start(&spawn.exe, &args)?;
    let f = |k: &str| -> Result<SocketAddr> {
        child
            .field(k)
            .with_context(|| format!("server banner lacks {k}: {}", child.banner))?
            .parse()
            .context("bad address in banner")
    };
    Ok(Peers {
        cm: f("cm")?,
        udp: Some(f("udp")?),
        tcp: Some(f("tcp")?),
        child: Some(child),
    })
}

/// The processes a run accounts for: this client, and the server child if it started one (or
/// the server `--server-pid` names).
fn processes(p: &Peers, a: &ClientArgs) -> Result<Vec<Proc>> {
    let mut v = vec![Proc::this("client")];
    if let Some(pid) = p.child.as_ref().and_then(|c| c.pid()) {
        v.push(Proc::new("server", pid));
    } else if let Some(pid) = a.server_pid {
        if crate::bench::proc_cpu_secs(pid).is_none() {
            bail!("--server-pid: no process {pid} on this host");
        }
        v.push(Proc::new("server", pid));
    }
    Ok(v)
}

/// Width of the throughput timeline's bins.
const TIMELINE_BIN: Duration = Duration::from_millis(50);

/// Runs the client: every result line is printed as it is produced; returns them.
pub fn run(a: &ClientArgs, spawn: &ServerSpawn) -> Result<Vec<BenchResult>> {
    if a.size == 0 || a.depth == 0 || a.qps == 0 || a.duration <= 0.0 {
        bail!("--size, --depth, --qps and --duration must be positive");
    }
    if a.signaled && !(a.op == Op::Send && a.depth == 1) {
        bail!("--signaled: only the SEND ping-pong (--op send --depth 1) takes it");
    }
    if a.signaled && a.system != System::Flexns {
        bail!(
            "--signaled: the {} ping-pong has no send completions to wait for",
            a.system.name()
        );
    }
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    let mut p = peers(a, spawn)?;
    let procs = processes(&p, a)?;
    let wait = a.wait_mode();
    if matches!(a.op, Op::BatchRead | Op::ListWalk | Op::RednGet) {
        let cm = p.cm;
        let single = (1, netstack::path::SprayPolicy::Single);
        let out = super::offload_ops::run(a, cm, &procs, |ra| {
            flexns(ra, a.cc, single, cm, crate::bench::run_seed())
        })?;
        if let Some(mut c) = p.child.take() {
            c.stop();
        }
        return Ok(out);
    }
    let mut out = Vec::new();
    if a.paths == 0 || a.paths > netstack::path::MAX_PATHS {
        bail!("--paths: {} not in 1..={}", a.paths, netstack::path::MAX_PATHS);
    }
    let mine = (a.paths, a.spray);
    let runs = match (a.compare, a.compare_cc, a.compare_paths) {
        (Some(r), _, _) => (0..a.pairs)
            .flat_map(|_| [(a.system, a.cc, mine), (r, a.cc, mine)])
            .collect::<Vec<_>>(),
        (None, Some(c), _) => (0..a.pairs)
            .flat_map(|_| [(System::Flexns, a.cc, mine), (System::Flexns, c, mine)])
            .collect(),
        (None, None, Some(n)) => (0..a.pairs)
            .flat_map(|_| {
                [
                    (System::Flexns, a.cc, mine),
                    (System::Flexns, a.cc, (n, netstack::path::SprayPolicy::Single)),
                ]
            })
            .collect(),
        (None, None, None) => vec![(a.system, a.cc, mine)],
    };
    let echo = a.op == Op::Send && a.depth == 1;
    let progress = crate::progress::Progress::new("nsperf", runs.len() as u64);
    for (sys, cc, paths) in runs {
        if crate::procs::stopping() {
            break;
        }
        progress.start(format!("{sys:?}"));
        // every run writes data of its own, never what an earlier run left at the target
        let seed = crate::bench::run_seed();
        let meter = Meter::start(&procs);
        let mut r = match sys {
            System::Flexns => flexns(a, cc, paths, p.cm, seed)?,
            System::UdpRaw => {
                let s = p.udp.context("udp-raw needs --udp with --server")?;
                if echo {
                    reference::udp_lat(s, a.size as usize, a.duration, wait, seed)?
                } else {
                    let mut r = reference::udp_bw(s, (a.size as usize).min(a.mtu as usize), a.duration, seed)?;
                    r.bench = bench_name(a).into();
                    r
                }
            }
            System::Tcp => {
                let s = p.tcp.context("tcp needs --tcp with --server")?;
                if echo {
                    reference::tcp_lat(s, a.size as usize, a.duration, wait, seed)?
                } else {
                    let (streams, slots) = (a.qps as usize, a.depth as usize);
                    let mut r = reference::tcp_bw(s, a.size as usize, a.duration, streams, slots, seed)?;
                    r.bench = bench_name(a).into();
                    r
                }
            }
        };
        r.account(&meter.finish());
        r.extra.insert("wait".into(), wait.name().into());
        if sys == System::Flexns {
            r.extra.insert("drive".into(), a.drive_mode().name().into());
            if a.signaled {
                r.extra.insert("signaled".into(), true.into());
            }
        }
        if a.idle_qps > 0 {
            r.extra.insert("idle_qps".into(), a.idle_qps.into());
        }
        r.incomplete |= crate::procs::stopping();
        progress.suspend(|| r.print(a.json));
        progress.finished_one();
        out.push(r);
    }
    drop(progress);
    let reference = match (a.compare, a.compare_cc, a.compare_paths) {
        (Some(r), _, _) => Some(r.name().to_string()),
        (None, Some(c), _) => Some(format!("flexns cc={c}")),
        (None, None, Some(n)) => Some(format!("flexns paths={n}")),
        (None, None, None) => None,
    };
    if let Some(reference) = reference {
        let system = match (a.compare_cc, a.compare_paths) {
            (Some(_), _) => format!("flexns cc={}", a.cc),
            (None, Some(_)) => format!("flexns paths={} spray={}", a.paths, a.spray),
            (None, None) => a.system.name().to_string(),
        };
        let Some(line) = ratio_line(&out, echo, &system, &reference, wait) else {
            return Ok(out); // interrupted before a whole pair
        };
        let mut line = line;
        for (k, v) in [
            ("op", serde_json::to_value(a.op)?),
            ("msg_bytes", a.size.into()),
            ("depth", a.depth.into()),
            ("qps", a.qps.into()),
        ] {
            line[k] = v;
        }
        if a.json {
            println!("{line}");
        } else {
            let cpu = match cpu_ratio(&line, line["metric"].as_str().unwrap_or("")) {
                Some((r, unit)) => format!("CPU {unit} {r}"),
                None => "CPU -".into(),
            };
            println!(
                "ratio {system} / {reference} ({}), median of {} pairs: {}; {cpu}",
                line["metric"], line["pairs"], line["ratio"]
            );
        }
    }
    Ok(out)
}

/// The CPU comparison to show for a ratio line of `metric` ([`ratio_line`]'s `metric`, or a
/// reader's own), with its unit: per byte for throughput (`gbps`: a reference counts its own
/// units of work, e.g. udp-raw's 4 KiB datagrams against 64 KiB WRITEs, so CPU per operation
/// would compare different amounts of work), per operation otherwise (latency runs ping-pong
/// one size on both sides). A throughput line without a per-byte figure falls back to per
/// operation, labelled so. `None` when the line has neither.
pub fn cpu_ratio(line: &serde_json::Value, metric: &str) -> Option<(f64, &'static str)> {
    let per_byte = match metric {
        "gbps" => line["cpu_per_byte_ratio"].as_f64().map(|r| (r, "per byte")),
        _ => None,
    };
    per_byte.or_else(|| line["cpu_us_per_op_ratio"].as_f64().map(|r| (r, "per operation")))
}

/// The ratio line of interleaved runs (system, reference, system, ...): the median over whole
/// pairs of the headline metric (p50 for latency, Gbit/s otherwise) and of the CPU per
/// operation of all processes together; None without a whole pair.
pub fn ratio_line(
    out: &[BenchResult],
    lat: bool,
    system: &str,
    reference: &str,
    wait: Wait,
) -> Option<serde_json::Value> {
    let metric = if lat { "p50_us" } else { "gbps" };
    let val = |r: &BenchResult| {
        if lat {
            r.p50_us.unwrap_or(f64::NAN)
        } else {
            r.gbps
        }
    };
    let cpu = |r: &BenchResult| {
        r.extra
            .get("cpu_us_per_op")
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN)
    };
    // per byte: the references count their own units (udp-raw datagrams, not 64 KiB WRITEs)
    let per_byte = |r: &BenchResult| {
        1.0 / r
            .extra
            .get("bytes_per_cpu_sec")
            .and_then(|v| v.as_f64())
            .unwrap_or(f64::NAN)
    };
    // whole pairs only: an interrupted run has no partner
    let pairs: Vec<&[BenchResult]> = out
        .chunks(2)
        .filter(|c| c.len() == 2 && !c[0].incomplete && !c[1].incomplete)
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let mut ratios: Vec<f64> = pairs.iter().map(|c| r3(val(&c[0]) / val(&c[1]))).collect();
    let mut cpu_ratios: Vec<f64> = pairs.iter().map(|c| r3(cpu(&c[0]) / cpu(&c[1]))).collect();
    let mut byte_ratios: Vec<f64> = pairs.iter().map(|c| r3(per_byte(&c[0]) / per_byte(&c[1]))).collect();
    let runs = ratios.clone();
    // the system's share of one core's memcpy (bulk runs carry it, BenchResult::rates)
    let mut of_memcpy: Vec<f64> = pairs
        .iter()
        .filter_map(|c| c[0].extra.get("of_memcpy").and_then(|v| v.as_f64()))
        .collect();
    let of_memcpy = (!of_memcpy.is_empty()).then(|| r3(median(&mut of_memcpy)));
    Some(serde_json::json!({
        "bench": "ratio", "metric": metric, "system": system, "reference": reference,
        "pairs": pairs.len(), "ratio": r3(median(&mut ratios)), "ratios": runs,
        "cpu_us_per_op_ratio": r3(median(&mut cpu_ratios)), "cpu_per_byte_ratio": r3(median(&mut byte_ratios)), "wait": wait.name(),
        "verified": pairs.iter().all(|c| c[0].verified && c[1].verified),
        "system_of_memcpy": of_memcpy,
    }))
}

fn bench_name(a: &ClientArgs) -> &'static str {
    match (a.op, a.depth) {
        (Op::Write, _) => "write_bw",
        (Op::Read, _) => "read_bw",
        (Op::Send, 1) => "send_lat",
        (Op::Send, _) => "send_bw",
        (Op::Atomic, _) => "atomic_bw",
        (Op::BatchRead, _) => "batch_read_rate",
        (Op::ListWalk, _) => "list_walk_lat",
        (Op::RednGet, _) => "redn_get_lat",
    }
}

/// One flexns run: connect, move data for the run's time, verify it, report.
fn flexns(
    a: &ClientArgs,
    cc: netstack::cc::CcKind,
    (npaths, spray): (usize, netstack::path::SprayPolicy),
    cm_addr: SocketAddr,
    seed: u64,
) -> Result<BenchResult> {
    let wait = a.wait_mode();
    let c = Conns::open(a, cc, (npaths, spray), cm_addr, seed)?;
    let mut wcs = [EMPTY_WC; 64];
    // atomics: the counters' starting values (earlier runs may have moved them)
    let start_counters = if a.op == Op::Atomic {
        c.read_counters(&mut wcs, wait)?
    } else {
        Vec::new()
    };
    let start = Instant::now();
    let start_mono = netstack::link::sys::monotonic_ns();
    // with --bytes, the run ends when that much was posted (the duration is then a bound)
    let end = start
        + if a.bytes.is_some() {
            Duration::from_secs(3600)
        } else {
            Duration::from_secs_f64(a.duration)
        };
    let limit = end + Duration::from_secs(30);
    let mut m = Measured::new(start);
    if a.op == Op::Send && a.depth == 1 {
        c.ping_pong(end, limit, wait, a.signaled, &mut m)?;
    } else {
        c.stream(a, end, limit, wait, &mut m)?;
    }
    let secs = start.elapsed().as_secs_f64();
    // end-to-end verification (not of a run cut short: the program has to stop now)
    let interrupted = crate::procs::stopping();
    let note = c.verify(a, &mut m, &start_counters, limit, wait, interrupted)?;
    let mut r = BenchResult {
        bench: bench_name(a).into(),
        system: "flexns".into(),
        transport: Some("rc".into()),
        msg_bytes: a.size,
        qps: a.qps,
        depth: a.depth,
        bytes: m.ops * a.size,
        ops: m.ops,
        secs,
        verified: m.verified,
        incomplete: interrupted,
        note,
        ..Default::default()
    };
    r.latencies(&m.h);
    r.rates();
    stack_extras(&mut r, &c.ctx.stats());
    qp_extras(&mut r, &c);
    if !(a.op == Op::Send && a.depth == 1) {
        timeline_extras(&mut r, &m, start_mono)?;
    }
    if npaths > 1 {
        multipath_extra(&mut r, &c.qps, npaths, spray);
    }
    cc_extra(&mut r, &c.qps);
    r.extra.insert("recovery".into(), serde_json::to_value(a.recovery)?);
    // the ICRC mode the connections run (negotiated: `none` only if both ends offered it)
    r.extra.insert("icrc".into(), c.qps[0].icrc_mode().name().into());
    if a.signaled {
        // counted where the ping-pong took them, not copied from the flag
        r.extra.insert("send_completions".into(), m.sends_completed.into());
    }
    Ok(r)
}

/// A flexns run's context, memory and connected QPs: `--qps` that carry the traffic and
/// `--idle-qps` that stay connected and silent until the run ends. Fields drop in declaration
/// order, as the run's locals did: the QPs before the memory, the context last.
struct Conns {
    _idle: Vec<Qp>,
    _rt: tokio::runtime::Runtime,
    qps: Vec<Qp>,
    /// Where read-backs land (WRITE verification, atomic counters, echoed SENDs).
    check: Mr,
    /// The source (and READ destination) slots, `unit` bytes each.
    mr: Mr,
    cq: Cq,
    _pd: Pd,
    ctx: Context,
    /// What `mr` was filled with (a WRITE run reads it back from the server).
    buf: Vec<u8>,
    /// The server's answer: this run's window of its region.
    w: Welcome,
    /// The operation, bytes per slot (8 for atomics), slots per QP, QPs.
    op: Op,
    size: usize,
    unit: usize,
    depth: usize,
    nq: usize,
    /// Seconds creating and connecting the traffic QPs took (both ends).
    setup_secs: f64,
}

impl Conns {
    /// Opens the run's context, registers its memory, creates every QP and connects them all
    /// to the server at `cm_addr` in batched exchanges.
    fn open(
        a: &ClientArgs,
        cc: netstack::cc::CcKind,
        (npaths, spray): (usize, netstack::path::SprayPolicy),
        cm_addr: SocketAddr,
        seed: u64,
    ) -> Result<Conns> {
        let qcfg = RcConfig {
            mtu: a.mtu,
            recovery: a.recovery,
            cc,
            ..Default::default()
        };
        // spare source ports: a path that looks cut moves to one (a fresh ECMP hash)
        let path_ports = netstack::path::with_spares(npaths.div_ceil(1 + a.ctx.extra_addrs.len())).max(8) as u8;
        let ctx = Context::open(a.context_config(qcfg, path_ports)?)?;
        let pd = ctx.alloc_pd();
        let (size, depth, nq) = (a.size as usize, a.depth as usize, a.qps as usize);
        let slots = depth * nq;
        let cq = ctx.create_cq(slots * 2 + 64)?;
        let unit = if a.op == Op::Atomic { 8 } else { size };
        let mr = pd.reg_mr(unit * slots, Access::LOCAL_WRITE)?;
        let check = pd.reg_mr(unit * slots, Access::LOCAL_WRITE)?;
        let mut buf = vec![0u8; unit * slots];
        crate::bench::fill_pattern(&mut buf, 0, seed);
        mr.write(0, &buf);
        let echo = a.op == Op::Send && a.depth == 1;
        let low_latency = echo && !a.standard_qp;
        let hello = serde_json::to_vec(&Hello {
            op: a.op,
            size: a.size,
            depth: a.depth,
            echo,
            low_latency,
            signaled: a.signaled,
            resp_addr: 0,
            resp_rkey: 0,
            // SEND receive slots are the server's own business; everything else writes its slots
            need: if a.op == Op::Send { 0 } else { (unit * slots) as u64 },
            session: seed,
        })?;
        // set-up: create every QP, then connect them all in batched exchanges
        let setup = Instant::now();
        let mut qps = Vec::with_capacity(nq);
        for _ in 0..nq {
            let qp = ctx.create_qp(
                &pd,
                &cq,
                &cq,
                QpInitAttr {
                    low_latency,
                    ..Default::default()
                },
            )?;
            if npaths > 1 {
                qp.set_paths(npaths, spray)?;
            }
            qps.push(qp);
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let replies = connect_all(&rt, cm_addr, &qps, &hello)?;
        let setup_secs = setup.elapsed().as_secs_f64();
        let mut remote = None;
        for (i, reply) in replies.into_iter().enumerate() {
            let reply = reply.with_context(|| format!("connecting QP {i} of {nq}"))?;
            let w: Welcome = serde_json::from_slice(&reply).context("bad welcome from server")?;
            if (unit * slots) as u64 > w.len {
                bail!("server memory region ({} bytes) is smaller than {} QPs x depth {} x {} bytes; start the server with a larger --mr-size", w.len, nq, depth, unit);
            }
            remote = Some(w);
        }
        if let Some(r) = a.rate_limit {
            for qp in &qps {
                qp.set_rate_limit(Some(r), 64 << 10);
            }
        }
        // idle connections, held (connected, silent) until the run ends
        let idle: Vec<Qp> = (0..a.idle_qps)
            .map(|_| ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()))
            .collect::<Result<_, _>>()?;
        if !idle.is_empty() {
            for (i, r) in connect_all(&rt, cm_addr, &idle, &hello)?.into_iter().enumerate() {
                r.with_context(|| format!("connecting idle QP {i} of {}", a.idle_qps))?;
            }
        }
        let w = remote.context("no QP")?;
        Ok(Conns {
            _idle: idle,
            _rt: rt,
            qps,
            check,
            mr,
            cq,
            _pd: pd,
            ctx,
            buf,
            w,
            op: a.op,
            size,
            unit,
            depth,
            nq,
            setup_secs,
        })
    }

    /// Slots of the run: `depth` per QP.
    fn slots(&self) -> usize {
        self.depth * self.nq
    }

    /// The server's address of a slot.
    fn raddr(&self, slot: usize) -> u64 {
        self.w.addr + (slot * self.unit) as u64
    }

    /// The work request of the run's operation on `slot`.
    fn wr_for(&self, slot: usize, id: u64) -> SendWr {
        let (w, unit) = (&self.w, self.unit);
        let sge = self.mr.sge(slot * unit, unit);
        match self.op {
            Op::Write => SendWr::new(id, WrOpcode::RdmaWrite)
                .sge(sge)
                .remote(self.raddr(slot), w.rkey),
            Op::Read => SendWr::new(id, WrOpcode::RdmaRead)
                .sge(sge)
                .remote(self.raddr(slot), w.rkey),
            Op::Send => SendWr::new(id, WrOpcode::Send).sge(sge),
            Op::Atomic => SendWr::new(id, WrOpcode::AtomicFetchAndAdd)
                .sge(sge)
                .remote(w.addr + (id as usize % self.nq * 8) as u64, w.rkey)
                .atomic(1, 0),
            // handled by offload_ops
            Op::BatchRead | Op::ListWalk | Op::RednGet => SendWr::new(id, WrOpcode::Noop),
        }
    }

    /// READs every QP's atomic counter (counter `q` at 8 x `q` bytes into the window).
    fn read_counters(&self, wcs: &mut [Wc], wait: Wait) -> Result<Vec<u64>> {
        for (q, qp) in self.qps.iter().enumerate() {
            qp.post_send(
                SendWr::new(q as u64, WrOpcode::RdmaRead)
                    .sge(self.check.sge(q * 8, 8))
                    .remote(self.w.addr + (q * 8) as u64, self.w.rkey),
            )?;
        }
        for _ in 0..self.nq {
            next_wc(&self.cq, &mut wcs[..1], Instant::now() + Duration::from_secs(30), wait)?;
        }
        Ok((0..self.nq).map(|q| self.check.load_u64(q * 8).unwrap_or(0)).collect())
    }

    /// Ping-pong until `end`: SEND, wait for the echo (and, `signaled`, for the SEND's own
    /// completion too); half the round trip is the latency, as perftest; each echo is
    /// compared with what was sent.
    fn ping_pong(&self, end: Instant, limit: Instant, wait: Wait, signaled: bool, m: &mut Measured) -> Result<()> {
        let (qp, size) = (&self.qps[0], self.size);
        let mut wcs = [EMPTY_WC; 1];
        let mut n = 0u64;
        while crate::procs::running_until(end) {
            self.mr.write(0, &n.to_le_bytes()[..size.min(8)]);
            qp.post_recv(RecvWr {
                wr_id: 1,
                sg_list: [self.check.sge(0, size)].into_iter().collect(),
            })?;
            let t = Instant::now();
            let mut flags = if size <= 256 { SendFlags::INLINE } else { SendFlags(0) };
            if signaled {
                flags = flags | SendFlags::SIGNALED;
            }
            qp.post_send(SendWr::new(0, WrOpcode::Send).sge(self.mr.sge(0, size)).flags(flags))?;
            // the echo, and a signaled SEND's own completion (it comes once the peer ACKed it)
            let (mut echoed, mut sent) = (false, !signaled);
            while !(echoed && sent) {
                let k = next_wc(&self.cq, &mut wcs, limit, wait)?;
                let wc = wcs[0];
                if wc.status != WcStatus::Success {
                    bail!("work completion {:?} on QP {:#x}", wc.status, wc.qp_num);
                }
                match (k, wc.opcode) {
                    (1, WcOpcode::Recv) => echoed = true,
                    (1, WcOpcode::Send) => {
                        sent = true;
                        m.sends_completed += 1;
                    }
                    _ => {}
                }
            }
            m.h.record((t.elapsed().as_nanos() as u64 / 2).max(1))?;
            let (mut x, mut y) = (vec![0u8; size], vec![0u8; size]);
            self.mr.read(0, &mut x);
            self.check.read(0, &mut y);
            m.verified &= x == y;
            n += 1;
        }
        m.ops = n;
        Ok(())
    }

    /// Keeps every slot's work request in flight until `end` (or `--bytes` posted): each
    /// completion records its latency and timeline bin and reposts its slot.
    fn stream(&self, a: &ClientArgs, end: Instant, limit: Instant, wait: Wait, m: &mut Measured) -> Result<()> {
        let (depth, unit, start) = (self.depth, self.unit, m.start);
        let mut wcs = [EMPTY_WC; 64];
        let mut posted_bytes = (self.slots() * unit) as u64;
        let mut posted_at = vec![start; self.slots()];
        let mut outstanding = 0usize;
        for (q, qp) in self.qps.iter().enumerate() {
            let batch: Vec<SendWr> = (0..depth)
                .map(|s| self.wr_for(q * depth + s, (q * depth + s) as u64))
                .collect();
            qp.post_send_batch(batch)?;
            outstanding += depth;
        }
        while outstanding > 0 {
            let n = next_wc(&self.cq, &mut wcs, limit, wait)?;
            let now = Instant::now();
            for wc in &wcs[..n] {
                if wc.status != WcStatus::Success {
                    if let Some(f) = self.qps.iter().find_map(|q| q.cc_fault()) {
                        bail!("congestion control stopped the QP: {f}");
                    }
                    bail!(
                        "work completion {:?} for wr {} on QP {:#x}",
                        wc.status,
                        wc.wr_id,
                        wc.qp_num
                    );
                }
                let slot = wc.wr_id as usize;
                m.completed(now, now - posted_at[slot], unit as u64)?;
                let more = a.bytes.is_none_or(|b| posted_bytes < b);
                if now < end && more && !crate::procs::stopping() {
                    posted_bytes += unit as u64;
                    posted_at[slot] = now;
                    self.qps[slot / depth].post_send(self.wr_for(slot, wc.wr_id))?;
                } else {
                    outstanding -= 1;
                }
            }
        }
        Ok(())
    }

    /// Checks the run's data end to end (WRITE: reads every slot back; READ: the server's
    /// pattern; atomics: the counters advanced by the completed operations); returns a note
    /// when the run is not verified for a reason of its own.
    fn verify(
        &self,
        a: &ClientArgs,
        m: &mut Measured,
        start_counters: &[u64],
        limit: Instant,
        wait: Wait,
        interrupted: bool,
    ) -> Result<Option<String>> {
        let (unit, slots) = (self.unit, self.slots());
        let echo = a.op == Op::Send && a.depth == 1;
        let mut wcs = [EMPTY_WC; 64];
        let mut note = None;
        if interrupted {
            m.verified = false;
            note = Some("interrupted: stopped early, not verified".into());
        }
        match a.op {
            _ if interrupted => {}
            Op::Write => {
                // read every remote slot back and compare with what was written
                for (q, qp) in self.qps.iter().enumerate() {
                    for s in 0..self.depth {
                        let slot = q * self.depth + s;
                        qp.post_send(
                            SendWr::new(slot as u64, WrOpcode::RdmaRead)
                                .sge(self.check.sge(slot * unit, unit))
                                .remote(self.raddr(slot), self.w.rkey),
                        )?;
                    }
                }
                for _ in 0..slots {
                    let n = next_wc(&self.cq, &mut wcs[..1], limit, wait)?;
                    m.verified &= n == 1 && wcs[0].status == WcStatus::Success;
                }
                let mut got = vec![0u8; unit * slots];
                self.check.read(0, &mut got);
                m.verified &= got == self.buf;
            }
            Op::Read => {
                let mut got = vec![0u8; unit * slots];
                self.mr.read(0, &mut got);
                m.verified = got
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == pattern_byte(self.w.off + i as u64, self.w.seed));
            }
            Op::Atomic => {
                // each completed FETCH_ADD added 1 to counter (wr_id % qps)
                let end_counters = self.read_counters(&mut wcs, wait)?;
                let total: u64 = end_counters
                    .iter()
                    .zip(start_counters)
                    .map(|(e, s)| e.wrapping_sub(*s))
                    .sum();
                m.verified = total == m.ops;
                if !m.verified {
                    note = Some(format!(
                        "remote counters advanced by {total}, {} FETCH_ADDs completed",
                        m.ops
                    ));
                }
            }
            Op::Send if !echo => {
                m.verified = false;
                note = Some("SEND bandwidth mode: the server does not check payloads".into());
            }
            Op::Send | Op::BatchRead | Op::ListWalk | Op::RednGet => {}
        }
        Ok(note)
    }
}

/// Connects `qps` to the server at `cm_addr` in batched exchanges, each with `hello`; the
/// server's replies, in order.
fn connect_all(
    rt: &tokio::runtime::Runtime,
    cm_addr: SocketAddr,
    qps: &[Qp],
    hello: &[u8],
) -> Result<Vec<Result<Vec<u8>, cm::CmError>>> {
    let reqs: Vec<(&Qp, Vec<u8>)> = qps.iter().map(|q| (q, hello.to_vec())).collect();
    Ok(rt.block_on(async {
        let mut connector = cm::Connector::new(cm_addr).await?;
        connector.connect_many(&reqs).await
    })?)
}

/// What a run measured: latencies, operations, completed bytes per timeline bin, the longest
/// time without a completion, and whether every check so far passed.
struct Measured {
    start: Instant,
    h: hdrhistogram::Histogram<u64>,
    ops: u64,
    timeline: Vec<u64>,
    last_done: Instant,
    max_gap: Duration,
    verified: bool,
    /// Send completions a `--signaled` ping-pong waited for (one per round trip).
    sends_completed: u64,
}

impl Measured {
    fn new(start: Instant) -> Measured {
        Measured {
            start,
            h: histogram(),
            ops: 0,
            sends_completed: 0,
            timeline: Vec::new(),
            last_done: start,
            max_gap: Duration::ZERO,
            verified: true,
        }
    }

    /// Records one completion at `now` of `bytes` that took `latency`.
    fn completed(&mut self, now: Instant, latency: Duration, bytes: u64) -> Result<()> {
        self.h.record(latency.as_nanos() as u64)?;
        self.ops += 1;
        let bin = ((now - self.start).as_nanos() / TIMELINE_BIN.as_nanos()) as usize;
        if self.timeline.len() <= bin {
            self.timeline.resize(bin + 1, 0);
        }
        self.timeline[bin] += bytes;
        self.max_gap = self.max_gap.max(now - self.last_done);
        self.last_done = now;
        Ok(())
    }
}

/// The client context's copies (the server's are its own), its staging, and which path the
/// payload took: one copy into the peer's memory (mapped or CMA), or packets (UDP datagrams
/// or shm rings).
fn stack_extras(r: &mut BenchResult, st: &StatsSnapshot) {
    for (k, v) in [
        ("tx_payload_copy_bytes", st.tx_payload_copy_bytes),
        ("rx_payload_copy_bytes", st.rx_payload_copy_bytes),
        ("staging_bytes", st.staging_bytes),
        ("staging_bytes_peak", st.staging_bytes_peak),
        ("same_host_copy_bytes", st.same_host_copy_bytes),
        ("same_host_cma_bytes", st.same_host_cma_bytes),
        ("tx_bytes", st.tx_bytes),
        ("shm_tx_messages", st.shm_tx_messages),
    ] {
        r.extra.insert(k.into(), v.into());
    }
}

/// QP set-up (creating and connecting every QP of the run, both ends), QP state, and the
/// retransmissions of the traffic QPs.
fn qp_extras(r: &mut BenchResult, c: &Conns) {
    r.extra
        .insert("setup_secs".into(), ((c.setup_secs * 1e4).round() / 1e4).into());
    r.extra.insert(
        "qp_connects_per_sec".into(),
        ((c.nq as f64 / c.setup_secs).round()).into(),
    );
    r.extra.insert(
        "qp_state_bytes".into(),
        c.qps.iter().map(|q| q.state_bytes()).max().unwrap_or(0).into(),
    );
    let retx: u64 = c.qps.iter().map(|q| q.stats().retransmitted_packets).sum();
    r.extra.insert("retransmitted_packets".into(), retx.into());
    let spurious: u64 = c.qps.iter().map(|q| q.stats().spurious_retransmissions).sum();
    r.extra.insert("spurious_retransmissions".into(), spurious.into());
    let timeouts: u64 = c.qps.iter().map(|q| q.stats().timeouts).sum();
    r.extra.insert("timeouts".into(), timeouts.into());
}

/// The throughput timeline (Mbit/s per bin) and the longest gap between completions.
fn timeline_extras(r: &mut BenchResult, m: &Measured, start_mono: u64) -> Result<()> {
    let mbps: Vec<f64> = m
        .timeline
        .iter()
        .map(|&b| (b as f64 * 8.0 / TIMELINE_BIN.as_secs_f64() / 1e4).round() / 100.0)
        .collect();
    r.extra
        .insert("timeline_bin_ms".into(), (TIMELINE_BIN.as_millis() as u64).into());
    // CLOCK_MONOTONIC at the timeline's start, so a script can place its own events on it
    r.extra.insert("timeline_start_monotonic_ns".into(), start_mono.into());
    r.extra.insert("timeline_mbps".into(), serde_json::to_value(mbps)?);
    r.extra.insert(
        "max_gap_ms".into(),
        ((m.max_gap.as_secs_f64() * 1e6).round() / 1e3).into(),
    );
    Ok(())
}

/// The paths of the first QP (multipath runs).
fn multipath_extra(r: &mut BenchResult, qps: &[Qp], npaths: usize, spray: netstack::path::SprayPolicy) {
    let stats = qps[0].path_stats();
    let paths: Vec<serde_json::Value> = stats
        .iter()
        .map(|p| {
            serde_json::json!({"up": p.up, "sent": p.sent, "lost": p.lost, "srtt_us": p.srtt_ns / 1000,
                "downs": p.downs, "ups": p.ups, "probes_sent": p.probes_sent})
        })
        .collect();
    r.extra.insert(
        "multipath".into(),
        serde_json::json!({"paths": npaths, "spray": spray.to_string(),
            "path_downs": qps.iter().map(|q| q.stats().path_downs).sum::<u64>(), "per_path": paths}),
    );
}

/// The congestion control's counters and control-loop times (when the QPs run one).
fn cc_extra(r: &mut BenchResult, qps: &[Qp]) {
    let Some((name, bytes)) = qps[0].cc_info() else {
        return;
    };
    let sum = |f: fn(&netstack::transport::rc::RcStats) -> u64| qps.iter().map(|q| f(&q.stats())).sum::<u64>();
    let mut loops: Vec<u32> = qps.iter().flat_map(|q| q.take_control_loop_samples()).collect();
    loops.sort_unstable();
    let p = |q: f64| {
        loops
            .get(((loops.len().max(1) - 1) as f64 * q) as usize)
            .map(|&v| v as f64 / 1000.0)
    };
    let cc = serde_json::json!({
        "algorithm": name,
        "context_bytes": bytes,
        "cnps_received": sum(|s| s.cnps_received),
        "grants_received": sum(|s| s.grants_received),
        "cc_deferred": sum(|s| s.cc_deferred),
        "control_loop_samples": loops.len(),
        "control_loop_p50_us": p(0.5),
        "control_loop_p99_us": p(0.99),
        "fault": qps.iter().find_map(|q| q.cc_fault()),
    });
    r.extra.insert("cc".into(), cc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::ProcUsage;

    /// A finished run of `ops` operations of `size` bytes that took `cpu` seconds of CPU.
    fn run(system: &str, size: u64, ops: u64, cpu: f64) -> BenchResult {
        let mut r = BenchResult {
            system: system.into(),
            msg_bytes: size,
            ops,
            bytes: ops * size,
            secs: 1.0,
            gbps: (ops * size * 8) as f64 / 1e9,
            verified: true,
            ..Default::default()
        };
        r.account(&[ProcUsage {
            role: "client".into(),
            pid: 1,
            cpu_secs: cpu,
            peak_rss_kib: 0,
            peak_rss_since_start: false,
        }]);
        r
    }

    /// The demo's first step: 64 KiB WRITEs against 4 KiB datagrams, moving the same bytes
    /// for the same CPU. Per operation that reads 16 times costlier; per byte it is even.
    #[test]
    fn a_throughput_comparison_of_different_sizes_reports_cpu_per_byte() {
        let out = [
            run("flexns", 64 << 10, 10_000, 0.5),
            run("udp-raw", 4 << 10, 160_000, 0.5),
        ];
        let line = ratio_line(&out, false, "flexns", "udp-raw", Wait::Spin).unwrap();
        assert_eq!(line["cpu_us_per_op_ratio"].as_f64(), Some(16.0));
        assert_eq!(cpu_ratio(&line, "gbps"), Some((1.0, "per byte")));
    }

    /// Latency rows ping-pong one size on both sides: per operation is the figure.
    #[test]
    fn a_latency_comparison_reports_cpu_per_operation() {
        let out = [run("flexns", 64, 10_000, 0.2), run("udp-raw", 64, 10_000, 0.4)];
        let line = ratio_line(&out, true, "flexns", "udp-raw", Wait::Spin).unwrap();
        assert_eq!(cpu_ratio(&line, "p50_us"), Some((0.5, "per operation")));
    }

    /// A throughput line without a per-byte figure (no bytes counted) says per operation.
    #[test]
    fn a_throughput_line_without_bytes_falls_back_to_per_operation() {
        let line = serde_json::json!({"metric": "gbps", "cpu_us_per_op_ratio": 2.5, "cpu_per_byte_ratio": null});
        assert_eq!(cpu_ratio(&line, "gbps"), Some((2.5, "per operation")));
        assert_eq!(cpu_ratio(&serde_json::json!({}), "gbps"), None);
    }
}
