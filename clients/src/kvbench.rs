//! `kvcache-bench`: prefill→decode KVCache transfer benchmark. A decode engine (a
//! `kvcache-bench serve` child process with a registered pool, or `--server SEGMENT`) receives
//! WRITEs of `--size` bytes from this process's prefill engine, one synchronous transfer after
//! another, as a prefill node pushes one request's KV cache. Each run reports throughput and
//! the latency of whole transfers, then reads the region back and compares it with the pattern
//! written (`verified`): every slot of the pool it wrote holds data of its own (the pattern with
//! the slot's number in its first bytes), and the check buffer is poisoned before each read, so
//! a READ that places nothing, or places another slot's data, is caught. References run interleaved in the same invocation (`--compare tcp`,
//! `--compare-paths 1`) and a ratio line gives the median of the pairs.

use crate::bench::{fill_pattern, histogram, median, parse_size, BenchResult, ChildServer, Meter, Proc, ProcUsage};
use anyhow::{bail, Context, Result};
use kvcache_engine::kvcache::{blocks_landed, BlockOrder, PagedKvLayout};
use kvcache_engine::{EngineConfig, Location, MetadataConfig, Opcode, TransferEngine, TransportKind};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags of a benchmark run.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The system measured: flexns or tcp.
    #[arg(long, default_value = "flexns")]
    pub system: TransportKind,
    /// A reference run interleaved with the system (tcp), or none.
    #[arg(long)]
    pub compare: Option<TransportKind>,
    /// Also run the system with this many paths per QP as a reference (e.g. 1 against --paths 16).
    #[arg(long)]
    pub compare_paths: Option<usize>,
    /// Transfer size (one request = one LLM request's KV cache).
    #[arg(long, default_value = "16MiB")]
    pub size: String,
    /// Sweep sizes 64KiB, 256KiB, 1MiB, 4MiB, 16MiB, 64MiB, 256MiB (ignores --size).
    #[arg(long)]
    pub sweep: bool,
    /// Request mode: move one LLM request's KV cache of this many tokens as paged blocks
    /// (geometry below, vLLM layer-major layout) into scattered blocks of the decode pool, with
    /// a notification naming them; replaces --size.
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Model layers (request mode; default: Llama-3-8B's geometry).
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// KV heads (request mode).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Head dimension (request mode).
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tokens per KV block (request mode).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Paths per queue pair (packet spraying; flexns).
    #[arg(long, default_value_t = 1)]
    pub paths: usize,
    /// Queue pairs per peer (flexns).
    #[arg(long, default_value_t = 2)]
    pub qps_per_peer: usize,
    /// Slice size: requests are cut into slices of this size spread over QPs / TCP lanes
    /// (default: each transport's own, 4 MiB flexns, 256 KiB tcp).
    #[arg(long)]
    pub slice: Option<String>,
    /// TCP connections per peer (tcp).
    #[arg(long, default_value_t = 4)]
    pub tcp_lanes: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Interleaved pairs (system, reference) per size.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// An existing decode engine (P2P segment IP:PORT) for --system; none starts a child.
    #[arg(long)]
    pub server: Option<String>,
    /// An existing decode engine for the --compare reference.
    #[arg(long)]
    pub compare_server: Option<String>,
    /// With --server: that decode engine's process id, when it runs on this host (in another
    /// network namespace, say); the runs account its CPU and memory as the decode process's,
    /// as they do for a decode engine they start.
    #[arg(long, requires = "server")]
    pub server_pid: Option<u32>,
    /// With --compare-server: that decode engine's process id (as --server-pid).
    #[arg(long, requires = "compare_server")]
    pub compare_server_pid: Option<u32>,
    /// Local address of this (prefill) engine; 127.0.0.1 when the decode engine is a child.
    #[arg(long)]
    pub bind: Option<Ipv4Addr>,
    /// flexns stack configuration (TOML) of the prefill engine and of decode engines started
    /// here (MTU, recovery, congestion control...).
    #[arg(long)]
    pub stack_config: Option<std::path::PathBuf>,
    /// flexns data cores of both engines.
    #[arg(long, default_value_t = 1)]
    pub data_cores: usize,
    /// What the flexns data path of both engines (this prefill engine and decode engines
    /// started here) runs over: `udp`, or `shm` (same host: WRITEs and READs by one copy into
    /// the decode engine's memory, the rest through shared-memory rings); overrides the
    /// `link` of --stack-config [config: link]. Default: the stack config's link, or the
    /// engine's default stack's (`shm`) without one. Result lines say the link and what the
    /// prefill engine's stack counted (`same_host_copy_bytes`, `tx_bytes`...).
    #[arg(long, value_parser = netstack::cli::parse_link)]
    pub link: Option<netstack::config::LinkMode>,
    /// Print the results as JSON lines.
    #[arg(long)]
    pub json: bool,
    /// Serve this (prefill) process's Prometheus metrics on this address while it runs.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// One measured configuration.
#[derive(Debug, Clone)]
struct Variant {
    label: String,
    transport: TransportKind,
    paths: usize,
    server: Option<String>,
    /// The process id of `server` on this host, accounted as the decode process.
    server_pid: Option<u32>,
}

struct Target {
    engine: TransferEngine,
    seg: kvcache_engine::SegmentHandle,
    remote_addr: u64,
    remote_len: u64,
    src: Arc<netstack::mem::Region>,
    check: Arc<netstack::mem::Region>,
    child: Option<ChildServer>,
    /// The decode engine's process id when this run did not start it (`--server-pid`).
    server_pid: Option<u32>,
    /// The link of this (prefill) engine's stack (flexns).
    link: Option<netstack::config::LinkMode>,
}

impl Target {
    /// Adds which path the run's bytes took to its line (flexns): the link, and what this
    /// prefill engine's stack counted since `before` (the run and its verifying reads): bytes
    /// moved by one copy into or out of the decode engine's memory (mapped, or by CMA), bytes
    /// and shm ring messages sent as packets.
    fn path(&self, r: &mut BenchResult, before: Option<&netstack::verbs::StatsSnapshot>) {
        let Some(l) = self.link else { return };
        r.extra.insert("link".into(), netstack::cli::link_name(l).into());
        let (Some(b), Some(a)) = (before, self.engine.stack_stats()) else {
            return;
        };
        for (k, a, b) in [
            ("same_host_copy_bytes", a.same_host_copy_bytes, b.same_host_copy_bytes),
            ("same_host_cma_bytes", a.same_host_cma_bytes, b.same_host_cma_bytes),
            ("tx_bytes", a.tx_bytes, b.tx_bytes),
            ("shm_tx_messages", a.shm_tx_messages, b.shm_tx_messages),
        ] {
            r.extra.insert(k.into(), a.saturating_sub(b).into());
        }
    }

    /// The processes a run on this target accounts for: this one, and its decode child (or the
    /// decode engine `--server-pid` names).
    fn procs(&self) -> Vec<Proc> {
        let mut v = vec![Proc::this("prefill")];
        if let Some(pid) = self.child.as_ref().and_then(|c| c.pid()).or(self.server_pid) {
            v.push(Proc::new("decode", pid));
        }
        v
    }
}

/// The smallest decode pool a benchmark starts: consecutive transfers land in different
/// slots of it, as different requests' KV blocks do, so the decode side writes memory that is
/// not already in its caches (a pool the size of one transfer rewrote one hot slot).
pub const MIN_POOL: u64 = 64 << 20;

const SWEEP: [u64; 7] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20];

fn engine_config(a: &BenchArgs, v: &Variant, name: &str) -> Result<EngineConfig> {
    let mut c = EngineConfig::new(name, v.transport);
    c.metadata = MetadataConfig::P2p;
    let ip = a.bind.unwrap_or(Ipv4Addr::LOCALHOST);
    c.bind_ip = Some(ip);
    c.advertise_ip = Some(ip);
    c.paths = v.paths;
    c.qps_per_peer = a.qps_per_peer;
    c.tcp_lanes = a.tcp_lanes;
    c.data_cores = a.data_cores;
    if let Some(p) = &a.stack_config {
        c.stack = Some(
            netstack::verbs::ContextConfig::from_file(p).with_context(|| format!("--stack-config {}", p.display()))?,
        );
    }
    if let Some(l) = a.link {
        c.set_link(l);
    }
    if let Some(sl) = &a.slice {
        c.slice_size = Some(parse_size(sl).map_err(|e| anyhow::anyhow!("--slice: {e}"))? as usize);
    }
    c.validate()?;
    Ok(c)
}

fn setup(a: &BenchArgs, v: &Variant, max: u64, exe: &std::path::Path, sub: &[String]) -> Result<Target> {
    if let Some(pid) = v.server_pid {
        if crate::bench::proc_cpu_secs(pid).is_none() {
            bail!("--server-pid/--compare-server-pid: no process {pid} on this host");
        }
    }
    let (segment, child) = match &v.server {
        Some(s) => (s.clone(), None),
        None => {
            let mut args: Vec<String> = sub
                .iter()
                .map(String::as_str)
                .chain([
                    "--transport",
                    &v.transport.to_string(),
                    "--metadata",
                    "P2PHANDSHAKE",
                    "--advertise",
                    "127.0.0.1",
                    "--pool",
                    &max.max(MIN_POOL).to_string(),
                    "--data-cores",
                    &a.data_cores.to_string(),
                ])
                .map(|s| s.to_string())
                .collect();
            if let Some(p) = &a.stack_config {
                args.extend(["--stack-config".to_string(), p.display().to_string()]);
            }
            if let Some(l) = a.link {
                args.extend(["--link".to_string(), netstack::cli::link_name(l).to_string()]);
            }
            args.extend(["--paths".to_string(), v.paths.max(a.paths).to_string()]);
            let c = ChildServer::start(exe, &args)?;
            let seg = c.field("segment").context("the decode engine printed no segment")?;
            (seg, Some(c))
        }
    };
    let cfg = engine_config(a, v, "prefill")?;
    let link = (v.transport == TransportKind::Flexns).then(|| cfg.stack_or_default().link);
    let engine = TransferEngine::new(cfg)?;
    let seg = engine
        .open_segment(&segment)
        .with_context(|| format!("opening the decode engine {segment}"))?;
    let d = engine.segment_descriptor(seg)?;
    let b = d
        .buffers
        .iter()
        .max_by_key(|b| b.len)
        .context("the decode engine registered no memory")?;
    if b.len < max {
        bail!("the decode engine's pool is {} B, smaller than {max}", b.len);
    }
    let src = engine.allocate_memory(max as usize, Location::Cpu(0))?;
    let check = engine.allocate_memory(max as usize, Location::Cpu(0))?;
    Ok(Target {
        remote_addr: b.addr,
        remote_len: b.len,
        engine,
        seg,
        src,
        check,
        child,
        server_pid: v.server_pid,
        link,
    })
}

/// What one run measured.
struct Run {
    bytes: u64,
    ops: u64,
    secs: f64,
    verified: bool,
    /// This (prefill) process first, then the decode process if this run started it.
    usage: Vec<ProcUsage>,
}

impl Run {
    /// The result line of a run of variant `v` (`msg_bytes` per transfer).
    fn result(&self, bench: &str, v: &Variant, msg_bytes: u64, h: &hdrhistogram::Histogram<u64>) -> BenchResult {
        let mut r = BenchResult {
            bench: bench.into(),
            system: v.label.clone(),
            transport: Some(v.transport.to_string()),
            msg_bytes,
            qps: 1,
            depth: 1,
            bytes: self.bytes,
            ops: self.ops,
            secs: self.secs,
            verified: self.verified,
            ..Default::default()
        };
        r.latencies(h);
        r.rates();
        r.account(&self.usage);
        r.extra.insert("paths".into(), v.paths.into());
        r
    }

    /// The result line of a run cut short by SIGINT/SIGTERM (not verified: the program stops).
    fn interrupted(&self, bench: &str, v: &Variant, msg_bytes: u64, h: &hdrhistogram::Histogram<u64>) -> BenchResult {
        let mut r = self.result(bench, v, msg_bytes, h);
        r.incomplete = true;
        r.note = Some("interrupted: stopped early, not verified".into());
        r
    }
}

/// The paged layout of request mode: pools of `blocks` blocks, fp16.
fn layout(a: &BenchArgs, blocks: usize) -> PagedKvLayout {
    PagedKvLayout {
        layers: a.layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        block_tokens: a.block_tokens,
        dtype_bytes: 2,
        num_blocks: blocks,
        order: BlockOrder::LayerMajor,
    }
}

/// One request-mode run: for `secs`, move one request's blocks (contiguous at the prefill
/// node, scattered over the decode pool as a block allocator leaves them) in one batch with its
/// notification; then read the last request's blocks back and compare.
fn run_request(t: &Target, v: &Variant, l: &PagedKvLayout, blocks: usize, secs: f64, seed: u64) -> Result<BenchResult> {
    let mut pat = vec![0u8; l.pool_bytes() as usize];
    fill_pattern(&mut pat, 0, seed);
    t.src.write(0, &pat);
    let from: Vec<u32> = (0..blocks as u32).collect();
    let pool = (l.num_blocks) as u32;
    let mut h = histogram();
    let meter = Meter::start(&t.procs());
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let (mut ops, mut bytes) = (0u64, 0u64);
    let mut to: Vec<u32>;
    loop {
        // destination blocks: a stride through the pool, different each request
        let stride = 7 + 2 * (ops as u32 % 5);
        to = (0..blocks as u32)
            .map(|i| (ops as u32 * 13 + i * stride) % pool)
            .collect();
        to.sort_unstable();
        to.dedup();
        if to.len() != blocks {
            to = (0..blocks as u32).collect();
        }
        let reqs = l.transfer_requests(Opcode::Write, t.src.addr(), &from, t.seg, t.remote_addr, &to)?;
        let note = blocks_landed(&format!("req-{ops}"), &to);
        let t0 = Instant::now();
        t.engine
            .transfer_sync(t.seg, &reqs, Some(&note))
            .map_err(|e| anyhow::anyhow!("{} request of {blocks} blocks: {e}", v.label))?;
        h.record(t0.elapsed().as_nanos() as u64).ok();
        ops += 1;
        bytes += reqs.iter().map(|r| r.length).sum::<u64>();
        if (Instant::now() >= until && ops >= 3) || crate::procs::stopping() {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let usage = meter.finish();
    if crate::procs::stopping() {
        let run = Run {
            bytes,
            ops,
            secs,
            verified: false,
            usage,
        };
        return Ok(run.interrupted("kvcache_request", v, bytes / ops.max(1), &h));
    }
    let back = l.transfer_requests(Opcode::Read, t.check.addr(), &to, t.seg, t.remote_addr, &to)?;
    // poison where the READ places data: an earlier run left matching bytes there
    for (s, d) in from.iter().zip(&to) {
        for ((so, len), (dof, _)) in l.chunks(*s).into_iter().zip(l.chunks(*d)) {
            let poison: Vec<u8> = pat[so as usize..][..len as usize].iter().map(|b| !b).collect();
            t.check.write(dof as usize, &poison);
        }
    }
    t.engine
        .transfer_sync(t.seg, &back, None)
        .map_err(|e| anyhow::anyhow!("{} verifying read: {e}", v.label))?;
    let mut verified = true;
    for (s, d) in from.iter().zip(&to) {
        for ((so, len), (dof, _)) in l.chunks(*s).into_iter().zip(l.chunks(*d)) {
            verified &= t.check.equals(dof as usize, &pat[so as usize..][..len as usize]);
        }
    }
    let run = Run {
        bytes,
        ops,
        secs,
        verified,
        usage,
    };
    let mut r = run.result("kvcache_request", v, bytes / ops, &h);
    r.extra.insert("tokens".into(), (blocks * l.block_tokens).into());
    r.extra.insert("blocks".into(), blocks.into());
    r.extra.insert("block_bytes".into(), l.block_bytes().into());
    Ok(r)
}

/// One run: synchronous WRITEs of `size` for `secs`, then a verifying READ of the region.
fn run_once(t: &Target, v: &Variant, size: u64, secs: f64, seed: u64) -> Result<BenchResult> {
    let mut pat = vec![0u8; size as usize];
    fill_pattern(&mut pat, 0, seed);
    t.src.write(0, &pat);
    let mut h = histogram();
    let meter = Meter::start(&t.procs());
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let mut ops = 0u64;
    // spread consecutive transfers over the pool like different requests' blocks
    let slots = (t.remote_len / size).max(1);
    loop {
        let slot = ops % slots;
        let off = slot * size;
        // the slot's own data: its number in the first bytes (8 B written, not timed apart)
        let (stamp, n) = slot_stamp(&pat, slot);
        t.src.write(0, &stamp[..n]);
        let t0 = Instant::now();
        t.engine
            .transfer_sync_write(t.seg, t.src.addr(), t.remote_addr + off, size)
            .map_err(|e| anyhow::anyhow!("{} write of {size} B: {e:?}", v.label))?;
        h.record(t0.elapsed().as_nanos() as u64).ok();
        ops += 1;
        if (Instant::now() >= until && ops >= 3) || crate::procs::stopping() {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let usage = meter.finish();
    if crate::procs::stopping() {
        let run = Run {
            bytes: ops * size,
            ops,
            secs,
            verified: false,
            usage,
        };
        return Ok(run.interrupted("kvcache_write", v, size, &h));
    }
    // verify: every slot written holds its own data
    let verified = verify_slots(&t.check, &pat, slots.min(ops), |s| {
        t.engine
            .transfer_sync_read(t.seg, t.check.addr(), t.remote_addr + s * size, size)
            .with_context(|| format!("{} verifying read of slot {s}", v.label))
    })?;
    let run = Run {
        bytes: ops * size,
        ops,
        secs,
        verified,
        usage,
    };
    Ok(run.result("kvcache_write", v, size, &h))
}

/// The first bytes (at most 8, the count is returned) of what slot `slot` of the pool is
/// written with: the pattern's, with the slot's number mixed in, so slots hold different data
/// and none the bare pattern.
fn slot_stamp(pat: &[u8], slot: u64) -> ([u8; 8], usize) {
    let n = pat.len().min(8);
    let k = (slot + 1).to_le_bytes();
    let mut st = [0u8; 8];
    for ((d, p), k) in st.iter_mut().zip(&pat[..n]).zip(k) {
        *d = p ^ k;
    }
    (st, n)
}

/// Reads back slots `0..slots` with `read` (which places slot `s`'s data at offset 0 of
/// `check`) and compares each with what was written there (`pat` with the slot's stamp).
/// Before each read the check buffer is poisoned, every byte the complement of the expected
/// one, so a read that places nothing (or only part) does not pass on what an earlier slot left.
fn verify_slots(
    check: &netstack::mem::Region,
    pat: &[u8],
    slots: u64,
    mut read: impl FnMut(u64) -> Result<()>,
) -> Result<bool> {
    let mut expect = pat.to_vec();
    let mut poison: Vec<u8> = pat.iter().map(|b| !b).collect();
    let mut verified = true;
    for s in 0..slots {
        let (stamp, n) = slot_stamp(pat, s);
        expect[..n].copy_from_slice(&stamp[..n]);
        for (p, e) in poison.iter_mut().zip(&stamp[..n]) {
            *p = !e;
        }
        check.write(0, &poison);
        read(s)?;
        verified &= check.equals(0, &expect);
    }
    Ok(verified)
}

/// Runs the benchmark; returns every result line (ratios included) as JSON values. Decode
/// engines are started as `exe sub...` (a `kvcache_engine::daemon` command line).
pub fn run(a: &BenchArgs, exe: &std::path::Path, sub: &[String]) -> Result<Vec<serde_json::Value>> {
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    // request mode: one size, the request's blocks; pools of 2× the request (scattered room)
    let req = match a.tokens {
        Some(0) => bail!("--tokens: must be > 0"),
        Some(n) => {
            let probe = layout(a, 1);
            probe.validate()?;
            let blocks = probe.blocks_for_tokens(n);
            Some((layout(a, blocks * 2), blocks))
        }
        None => None,
    };
    let sizes: Vec<u64> = if let Some((l, _)) = &req {
        vec![l.pool_bytes()]
    } else if a.sweep {
        SWEEP.to_vec()
    } else {
        vec![parse_size(&a.size).map_err(|e| anyhow::anyhow!("--size: {e}"))?]
    };
    if sizes.iter().any(|&s| s == 0 || s > 1 << 32) {
        bail!("--size: 1 B ..= 4 GiB");
    }
    if a.pairs == 0 || a.duration <= 0.0 {
        bail!("--pairs and --duration must be > 0");
    }
    let max = *sizes.iter().max().expect("non-empty");
    let label = |t: TransportKind, p: usize| {
        if t == TransportKind::Flexns && p > 1 {
            format!("flexns-{p}paths")
        } else {
            t.to_string()
        }
    };
    let mut variants = vec![Variant {
        label: label(a.system, a.paths),
        transport: a.system,
        paths: a.paths,
        server: a.server.clone(),
        server_pid: a.server_pid,
    }];
    if let Some(p) = a.compare_paths {
        variants.push(Variant {
            label: label(a.system, p),
            transport: a.system,
            paths: p,
            server: a.server.clone(),
            server_pid: a.server_pid,
        });
    }
    if let Some(t) = a.compare {
        variants.push(Variant {
            label: t.to_string(),
            transport: t,
            paths: 1,
            server: a.compare_server.clone(),
            server_pid: a.compare_server_pid,
        });
    }
    if a.link.is_some() && a.system != TransportKind::Flexns && a.compare != Some(TransportKind::Flexns) {
        bail!("--link: applies to the flexns transport, and neither --system nor --compare is flexns");
    }
    let targets: Vec<Target> = variants
        .iter()
        .map(|v| setup(a, v, max, exe, sub))
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    let progress = crate::progress::Progress::new("kvcache-bench", (sizes.len() * a.pairs * variants.len()) as u64);
    'sizes: for &size in &sizes {
        let mut gbps = vec![Vec::new(); variants.len()];
        let mut p50 = vec![Vec::new(); variants.len()];
        let mut cpus = vec![Vec::new(); variants.len()];
        for _ in 0..a.pairs {
            let mut row = Vec::new();
            for (v, t) in variants.iter().zip(&targets) {
                if crate::procs::stopping() {
                    break 'sizes;
                }
                // data of this run's own: an earlier run (or invocation) left other bytes there
                let seed = crate::bench::run_seed();
                progress.start(format!("{size} B"));
                let before = t.engine.stack_stats();
                let mut r = match &req {
                    Some((l, blocks)) => run_request(t, v, l, *blocks, a.duration, seed)?,
                    None => run_once(t, v, size, a.duration, seed)?,
                };
                t.path(&mut r, before.as_ref());
                progress.suspend(|| r.print(a.json));
                progress.finished_one();
                out.push(serde_json::to_value(&r)?);
                if r.incomplete {
                    break 'sizes;
                }
                if !r.verified {
                    bail!(
                        "{}: data read back from the decode engine differs from what was written",
                        v.label
                    );
                }
                let cpu = r
                    .extra
                    .get("cpu_us_per_op")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(f64::NAN);
                row.push((r.gbps, r.p50_us.unwrap_or(0.0), cpu));
            }
            for (i, (g, p, c)) in row.into_iter().enumerate() {
                gbps[i].push(g);
                p50[i].push(p);
                cpus[i].push(c);
            }
        }
        let shown = req.as_ref().map_or(size, |(l, b)| *b as u64 * l.block_bytes());
        for i in 1..variants.len() {
            let ratios: Vec<f64> = gbps[0].iter().zip(&gbps[i]).map(|(x, y)| x / y.max(1e-9)).collect();
            let lat: Vec<f64> = p50[0].iter().zip(&p50[i]).map(|(x, y)| x / y.max(1e-9)).collect();
            let cpu: Vec<f64> = cpus[0].iter().zip(&cpus[i]).map(|(x, y)| x / y).collect();
            let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
            let mut line = serde_json::json!({
                "bench": "ratio", "metric": "gbps", "system": variants[0].label, "reference": variants[i].label,
                "msg_bytes": shown, "pairs": ratios.len(), "ratio": r3(median(&mut ratios.clone())),
                "ratios": ratios.iter().map(|&x| r3(x)).collect::<Vec<_>>(),
                "p50_ratio": r3(median(&mut lat.clone())),
                "cpu_us_per_op_ratio": r3(median(&mut cpu.clone())),
            });
            if let Some(l) = targets[0].link {
                line["link"] = netstack::cli::link_name(l).into();
            }
            if a.json {
                println!("{line}");
            } else {
                println!(
                    "ratio {} / {} at {shown} B: throughput {} (median of {}), p50 latency {}, CPU per transfer {}",
                    variants[0].label,
                    variants[i].label,
                    line["ratio"],
                    ratios.len(),
                    line["p50_ratio"],
                    line["cpu_us_per_op_ratio"]
                );
            }
            out.push(line);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use netstack::mem::Region;

    /// A pool of `slots` slots written as `run_once` writes them.
    fn written_pool(pat: &[u8], slots: u64) -> Region {
        let size = pat.len();
        let pool = Region::alloc(size * slots as usize);
        for s in 0..slots {
            let (stamp, n) = slot_stamp(pat, s);
            pool.write(s as usize * size, pat);
            pool.write(s as usize * size, &stamp[..n]);
        }
        pool
    }

    #[test]
    fn verification_fails_on_a_read_that_places_nothing_or_the_wrong_slot() {
        let size = 4096;
        let mut pat = vec![0u8; size];
        fill_pattern(&mut pat, 0, 42);
        let pool = written_pool(&pat, 4);
        let check = Region::alloc(size);
        let copy = |from: u64| {
            let mut v = vec![0u8; size];
            pool.read(from as usize * size, &mut v);
            check.write(0, &v);
        };
        // a transport that reads right
        let ok = verify_slots(&check, &pat, 4, |s| {
            copy(s);
            Ok(())
        });
        assert!(ok.unwrap(), "the right data verifies");
        // one that reads slot 0 right, then places nothing: the check buffer still held slot 0's
        // data (and, before slots differed, the pattern every slot held)
        let r = verify_slots(&check, &pat, 4, |s| {
            if s == 0 {
                copy(0);
            }
            Ok(())
        });
        assert!(!r.unwrap(), "a READ that places nothing verified");
        // one that always reads slot 0
        assert!(!verify_slots(&check, &pat, 4, |_| {
            copy(0);
            Ok(())
        })
        .unwrap());
        // one that places nothing at all, after a correct run left the last slot's data
        copy(3);
        assert!(!verify_slots(&check, &pat, 1, |_| Ok(())).unwrap());
        // a failed read is an error, not a pass
        assert!(verify_slots(&check, &pat, 2, |_| anyhow::bail!("peer gone")).is_err());
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        Cli::parse_from(std::iter::once("kvcache-bench").chain(extra.iter().copied())).a
    }

    #[test]
    fn link_reaches_the_prefill_engine_and_is_refused_where_it_does_nothing() {
        use netstack::config::LinkMode;
        let v = Variant {
            label: "flexns".into(),
            transport: TransportKind::Flexns,
            paths: 1,
            server: None,
            server_pid: None,
        };
        for (flag, want) in [("shm", LinkMode::Shm), ("udp", LinkMode::Udp)] {
            let c = engine_config(&args(&["--link", flag]), &v, "prefill").unwrap();
            assert_eq!(c.stack_or_default().link, want);
        }
        // over a --stack-config: the file's other fields kept, its link overridden
        let user = std::env::temp_dir().join(format!("kvbench-link-test-{}.toml", std::process::id()));
        std::fs::write(&user, "link = \"shm\"\nspin_us = 7\n").unwrap();
        let c = engine_config(
            &args(&["--stack-config", user.to_str().unwrap(), "--link", "udp"]),
            &v,
            "prefill",
        )
        .unwrap();
        let _ = std::fs::remove_file(&user);
        let s = c.stack_or_default();
        assert_eq!((s.link, s.spin_us), (LinkMode::Udp, 7));
        // a link for no flexns engine does nothing: refused, naming the flag
        let e = run(
            &args(&["--system", "tcp", "--link", "shm"]),
            std::path::Path::new("/nonexistent"),
            &[],
        )
        .err()
        .unwrap();
        assert!(format!("{e:#}").contains("--link"), "{e:#}");
        // a bad value names the flag's choices
        let e = Cli::try_parse_from(["kvcache-bench", "--link", "rdma"]).err().unwrap();
        assert!(e.to_string().contains("expected udp or shm"), "{e}");
    }

    #[test]
    fn slots_hold_different_data_and_never_the_bare_pattern() {
        let mut pat = vec![0u8; 16];
        fill_pattern(&mut pat, 0, 7);
        let stamps: Vec<[u8; 8]> = (0..1000).map(|s| slot_stamp(&pat, s).0).collect();
        for (i, a) in stamps.iter().enumerate() {
            assert_ne!(&a[..], &pat[..8], "slot {i} holds the bare pattern");
            assert!(stamps[..i].iter().all(|b| b != a), "slot {i} repeats an earlier one");
        }
        // a transfer shorter than 8 bytes is stamped in what it has
        assert_eq!(slot_stamp(&pat[..3], 5).1, 3);
    }
}
