//! `ycsb`: YCSB core workloads against kv-store (each get path) and redis-server, interleaved
//! in one run (docs/BENCHMARKS.md), every get checked against what was written.
//!
//! Method: `--threads` client threads, each a closed loop of batches of `--depth` requests
//! (pipelined on its connections; a request's latency is its batch's). Writes to one record
//! never overlap: a thread that draws an update of a record another write is in flight for
//! turns it into a read (`write_conflicts`), so every completed write of a record is ordered
//! and a get must return the last completed one or a newer one (`stale` otherwise); a value
//! that is not one whole written value is `torn`.

pub mod redis;
pub mod workload;

use crate::bench::{histogram, median, BenchResult, ChildServer};
use anyhow::{bail, Context as _, Result};
use kv_store::client::{ClientConfig, GetPath, KvClient, Op, OpResult};
use netstack::verbs::{Context, ContextConfig};
use rand::SeedableRng;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use workload::{check, key, value, Distribution, KeyChooser, OpKind, Workload};

/// The systems `ycsb` drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum System {
    /// The flexns kv-store.
    Flexns,
    /// redis-server (the reference).
    Redis,
}

/// `ycsb` options.
#[derive(Debug, Clone, clap::Args)]
pub struct YcsbArgs {
    /// The YCSB core workload (its read/update/insert mix).
    #[arg(long, value_enum, default_value = "c")]
    pub workload: Workload,
    /// Records loaded before the run.
    #[arg(long, default_value_t = 100_000)]
    pub records: u64,
    /// Value bytes (at least 16: record number and write sequence lead every value).
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// How records are chosen.
    #[arg(long, value_enum, default_value = "zipfian")]
    pub dist: Distribution,
    /// Zipfian constant.
    #[arg(long, default_value_t = 0.99)]
    pub theta: f64,
    /// Systems to run, interleaved (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "flexns")]
    pub system: Vec<System>,
    /// kv-store get paths to run, interleaved (comma-separated): a1, offload, redn, rpc,
    /// hybrid.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "offload")]
    pub get_path: Vec<GetPath>,
    /// Client threads (each with its own connections).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Who runs the client's flexns engine: the client threads that post and poll (run to
    /// completion), or engine threads. Run to completion measured faster on 2 cores (YCSB-C
    /// offloaded gets over redis, 3 pairs: 1.51x against 1.22x on engine threads).
    #[arg(long, value_enum, default_value = "application")]
    pub drive: crate::perf::args::DriveArg,
    /// Requests in flight per thread (its batch).
    #[arg(long, default_value_t = 8)]
    pub depth: u32,
    /// Offloaded gets: keys per multi-get request (the client library's batching; 1 sends each
    /// get alone). redis gets the same requests pipelined on one connection.
    #[arg(long, default_value_t = 8)]
    pub batch: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// Stop a run after this many operations (all threads).
    #[arg(long)]
    pub ops: Option<u64>,
    /// Runs of each configuration, interleaved (A B A B ...).
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// kv-server connection-manager addresses (every shard, or one that knows the map);
    /// without, `ycsb` starts `--shards` kv-server processes itself.
    #[arg(long, value_delimiter = ',')]
    pub servers: Vec<SocketAddr>,
    /// kv-server processes to start (without --servers).
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// The shard map in etcd (`http://HOST:PORT`): the kv-servers `ycsb` starts register there
    /// and its clients read the map from there (without, the servers hand it out).
    #[arg(long)]
    pub etcd: Option<String>,
    /// A redis-server to use; without, `ycsb` starts one.
    #[arg(long)]
    pub redis: Option<SocketAddr>,
    /// Skip the load phase (the records are there from an earlier run).
    #[arg(long)]
    pub no_load: bool,
    /// JSON lines (docs/BENCHMARKS.md).
    #[arg(long)]
    pub json: bool,
    /// Serve this (client) process's Prometheus metrics on this address while it runs (get
    /// latency per path: `flexns_kv_get_duration_seconds`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The stack's flags (`--data`, `--data-cores`, `--link`, ...) of this client's context
    /// (the kv-servers `ycsb` starts keep their defaults).
    #[command(flatten)]
    pub ctx: netstack::cli::ContextArgs,
}

/// What each system's records look like to the verifier: the last acknowledged write sequence
/// per record, whether a write is in flight, how many records exist.
struct Truth {
    acked: Vec<AtomicU64>,
    writing: Vec<AtomicBool>,
    inserted: AtomicU64,
    seq: AtomicU64,
    /// This invocation's tag, in the high bits of every sequence number it writes: a value
    /// with another tag was left by an earlier run.
    tag: u64,
}

/// Bits of a value's sequence number below the run tag.
const TAG_SHIFT: u32 = 40;

impl Truth {
    fn new(records: u64, extra: u64, tag: u64) -> Truth {
        let n = (records + extra) as usize;
        let base = tag << TAG_SHIFT;
        Truth {
            acked: (0..n).map(|_| AtomicU64::new(base)).collect(),
            writing: (0..n).map(|_| AtomicBool::new(false)).collect(),
            inserted: AtomicU64::new(records),
            seq: AtomicU64::new(base + 1),
            tag,
        }
    }

    /// The sequence number of the load's values.
    fn base(&self) -> u64 {
        self.tag << TAG_SHIFT
    }
}

/// A backend of one client thread.
enum Backend {
    Flexns(Box<KvClient>),
    Redis(redis::RedisConn),
}

impl Backend {
    fn execute(&mut self, ops: Vec<Op>) -> Vec<OpResult> {
        match self {
            Backend::Flexns(c) => c.execute(ops),
            Backend::Redis(c) => c.execute(ops),
        }
    }
}

/// Counters of one run.
#[derive(Default, Debug, Clone)]
struct Tally {
    reads: u64,
    updates: u64,
    inserts: u64,
    rmws: u64,
    errors: u64,
    torn: u64,
    stale: u64,
    /// Values written by an earlier run (this run's load or writes never landed).
    foreign: u64,
    missing: u64,
    write_conflicts: u64,
    first_error: Option<String>,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.reads += o.reads;
        self.updates += o.updates;
        self.inserts += o.inserts;
        self.rmws += o.rmws;
        self.errors += o.errors;
        self.torn += o.torn;
        self.stale += o.stale;
        self.foreign += o.foreign;
        self.missing += o.missing;
        self.write_conflicts += o.write_conflicts;
        if self.first_error.is_none() {
            self.first_error = o.first_error.clone();
        }
    }
}

enum Pending {
    Read { n: u64, floor: u64 },
    Write { n: u64, seq: u64 },
}

/// One thread's closed loop.
fn client_loop(
    b: &mut Backend,
    a: &YcsbArgs,
    truth: &Truth,
    chooser: &KeyChooser,
    end: Instant,
    budget: &AtomicU64,
    seed: u64,
) -> (Tally, hdrhistogram::Histogram<u64>) {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = Tally::default();
    let mut h = histogram();
    let cap = truth.acked.len() as u64;
    while crate::procs::running_until(end) {
        let want = a.depth as u64;
        let got = budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some(b.saturating_sub(want)))
            .unwrap_or(0)
            .min(want);
        if got == 0 {
            break;
        }
        let mut ops = Vec::with_capacity(got as usize * 2);
        let mut pend = Vec::with_capacity(got as usize * 2);
        let mut user_ops = 0u64;
        let read = |n: u64, ops: &mut Vec<Op>, pend: &mut Vec<Pending>| {
            pend.push(Pending::Read {
                n,
                floor: truth.acked[n as usize].load(Ordering::Acquire),
            });
            ops.push(Op::Get(key(n).to_vec()));
        };
        let write = |n: u64, ops: &mut Vec<Op>, pend: &mut Vec<Pending>, insert: bool| -> bool {
            if !insert
                && truth.writing[n as usize]
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                return false;
            }
            let seq = truth.seq.fetch_add(1, Ordering::Relaxed);
            let v = value(n, seq, a.value_size);
            ops.push(if insert {
                Op::Insert(key(n).to_vec(), v)
            } else {
                Op::Put(key(n).to_vec(), v)
            });
            pend.push(Pending::Write { n, seq });
            true
        };
        for _ in 0..got {
            user_ops += 1;
            let inserted = truth.inserted.load(Ordering::Relaxed);
            let kind = a.workload.pick(&mut r);
            let n = chooser.next(&mut r, inserted, a.workload.latest());
            match kind {
                OpKind::Read => {
                    t.reads += 1;
                    read(n, &mut ops, &mut pend);
                }
                OpKind::Update => {
                    if write(n, &mut ops, &mut pend, false) {
                        t.updates += 1;
                    } else {
                        t.write_conflicts += 1;
                        t.reads += 1;
                        read(n, &mut ops, &mut pend);
                    }
                }
                OpKind::Insert => {
                    let n = truth.inserted.fetch_add(1, Ordering::Relaxed);
                    if n >= cap {
                        truth.inserted.fetch_sub(1, Ordering::Relaxed);
                        t.reads += 1;
                        read(n % a.records, &mut ops, &mut pend);
                        continue;
                    }
                    truth.writing[n as usize].store(true, Ordering::Release);
                    write(n, &mut ops, &mut pend, true);
                    t.inserts += 1;
                }
                OpKind::ReadModifyWrite => {
                    t.rmws += 1;
                    read(n, &mut ops, &mut pend);
                    if !write(n, &mut ops, &mut pend, false) {
                        t.write_conflicts += 1;
                    }
                }
            }
        }
        let t0 = Instant::now();
        let res = b.execute(ops);
        let ns = t0.elapsed().as_nanos() as u64;
        for _ in 0..user_ops {
            let _ = h.record(ns.max(1));
        }
        for (p, r) in pend.into_iter().zip(res) {
            match (p, r) {
                (Pending::Read { n, floor }, Ok(Some(v))) => match check(n, &v, a.value_size) {
                    None => {
                        t.torn += 1;
                        t.first_error
                            .get_or_insert_with(|| format!("torn value for record {n}"));
                    }
                    Some(seq) if !a.no_load && seq >> TAG_SHIFT != truth.tag => {
                        t.foreign += 1;
                        t.first_error
                            .get_or_insert_with(|| format!("record {n} holds a value of another run"));
                    }
                    Some(seq) if seq < floor => {
                        t.stale += 1;
                        t.first_error
                            .get_or_insert_with(|| format!("stale value for record {n}: write {seq} < {floor}"));
                    }
                    Some(_) => {}
                },
                (Pending::Read { n, .. }, Ok(None)) => {
                    // an insert of a latest record may not have landed yet
                    if n < a.records {
                        t.missing += 1;
                        t.first_error.get_or_insert_with(|| format!("record {n} missing"));
                    }
                }
                (Pending::Write { n, seq }, r) => {
                    match r {
                        Ok(_) => {
                            truth.acked[n as usize].fetch_max(seq, Ordering::AcqRel);
                        }
                        Err(e) => {
                            t.errors += 1;
                            t.first_error.get_or_insert_with(|| format!("write of record {n}: {e}"));
                        }
                    }
                    truth.writing[n as usize].store(false, Ordering::Release);
                }
                (_, Err(e)) => {
                    t.errors += 1;
                    t.first_error.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }
    (t, h)
}

/// One configuration: a system, and for flexns a get path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Config {
    system: System,
    path: Option<GetPath>,
}

impl Config {
    fn name(&self) -> String {
        match self.path {
            Some(p) => format!("flexns-{p}"),
            None => "redis".into(),
        }
    }
}

/// Started servers and the addresses to use.
struct Servers {
    kv: Vec<SocketAddr>,
    etcd: Option<kv_store::shardmap::EtcdMap>,
    kv_children: Vec<ChildServer>,
    redis: Option<SocketAddr>,
    _redis_child: Option<redis::RedisServer>,
}

impl Servers {
    /// The processes a run of `system` accounts for: this client first, then the servers it
    /// started for that system.
    fn procs(&self, system: System) -> Vec<crate::bench::Proc> {
        let mut v = vec![crate::bench::Proc::this("client")];
        match system {
            System::Flexns => {
                for (i, c) in self.kv_children.iter().enumerate() {
                    if let Some(pid) = c.pid() {
                        v.push(crate::bench::Proc::new(format!("kv-server{i}"), pid));
                    }
                }
            }
            System::Redis => {
                if let Some(pid) = self._redis_child.as_ref().and_then(|r| r.server.pid()) {
                    v.push(crate::bench::Proc::new("redis-server", pid));
                }
            }
        }
        v
    }
}

fn start_servers(a: &YcsbArgs, exe: &std::path::Path, sub: &[String]) -> Result<Servers> {
    let prefix = format!("/flexns/ycsb-{}/", std::process::id());
    let mut s = Servers {
        kv: a.servers.clone(),
        etcd: a.etcd.as_deref().map(|e| kv_store::shardmap::EtcdMap::new(e, &prefix)),
        kv_children: Vec::new(),
        redis: a.redis,
        _redis_child: None,
    };
    if a.system.contains(&System::Flexns) && s.kv.is_empty() {
        let ports: Vec<u16> = (0..a.shards)
            .map(|_| Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()))
            .collect::<Result<_>>()?;
        let map: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let per_shard = a.records / a.shards as u64 + 1;
        let capacity = (per_shard * 2 + 1024).to_string();
        let entry = kv_store::layout::class_for(8, a.value_size)
            .map(kv_store::layout::class_len)
            .unwrap_or(128) as u64;
        let data = ((per_shard * 2 + 1024) * entry).max(1 << 20).to_string();
        for (i, cm) in map.iter().enumerate() {
            let mut args = sub.to_vec();
            args.extend(
                [
                    "--cm",
                    cm,
                    "--shard",
                    &i.to_string(),
                    "--shards",
                    &a.shards.to_string(),
                    "--map",
                    &map.join(","),
                    "--capacity",
                    &capacity,
                    "--data-size",
                    &data,
                    "--redn-value-len",
                    &a.value_size.to_string(),
                    "--resp",
                    "off",
                ]
                .iter()
                .map(|s| s.to_string()),
            );
            if let Some(e) = &a.etcd {
                args.extend(["--etcd".to_string(), e.clone(), "--etcd-prefix".into(), prefix.clone()]);
            }
            let c = ChildServer::start(exe, &args).context("starting kv-server")?;
            s.kv_children.push(c);
        }
        // clients fetch the map from the first shard, or from etcd
        s.kv = if a.etcd.is_some() {
            Vec::new()
        } else {
            vec![map[0].parse()?]
        };
    }
    if a.system.contains(&System::Redis) && s.redis.is_none() {
        let r = redis::RedisServer::start()?;
        s.redis = Some(r.addr);
        s._redis_child = Some(r);
    }
    Ok(s)
}

fn backend(cfg: Config, a: &YcsbArgs, ctx: &Context, s: &Servers) -> Result<Backend> {
    Ok(match cfg.system {
        System::Flexns => Backend::Flexns(Box::new(KvClient::connect(
            ctx,
            ClientConfig {
                servers: s.kv.clone(),
                depth: a.depth.max(2),
                get_path: cfg.path.unwrap_or(GetPath::Offload),
                batch: a.batch.max(1),
                etcd: s.etcd.clone(),
                ..Default::default()
            },
        )?)),
        System::Redis => Backend::Redis(redis::RedisConn::connect(s.redis.context("no redis address")?)?),
    })
}

fn load(cfg: Config, a: &YcsbArgs, ctx: &Context, s: &Servers, truth: &Truth) -> Result<()> {
    let mut b = backend(
        Config {
            system: cfg.system,
            path: Some(GetPath::Rpc),
        },
        a,
        ctx,
        s,
    )?;
    let batch = 256u64;
    let mut n = 0;
    while n < a.records {
        let hi = (n + batch).min(a.records);
        let ops = (n..hi)
            .map(|i| Op::Put(key(i).to_vec(), value(i, truth.base(), a.value_size)))
            .collect();
        for (i, r) in (n..hi).zip(b.execute(ops)) {
            r.with_context(|| format!("loading record {i} into {}", cfg.name()))?;
            truth.acked[i as usize].store(truth.base(), Ordering::Relaxed);
        }
        n = hi;
    }
    Ok(())
}

/// Runs the benchmark; `exe` and `sub` start a kv-server (`exe sub... --cm ...`).
pub fn run(a: YcsbArgs, exe: &std::path::Path, sub: &[String]) -> Result<()> {
    if let Some(addr) = a.metrics_addr {
        netstack::telemetry::serve_prometheus(addr)?;
    }
    check_args(&a)?;
    let configs = configs(&a);
    let servers = start_servers(&a, exe, sub)?;
    let mut cfg = ContextConfig {
        drive: a.drive.into(),
        ..ContextConfig::default()
    };
    a.ctx.apply(&mut cfg)?;
    let ctx = Context::open(cfg)?;
    let extra = if a.workload == Workload::D {
        a.records / 2 + 100_000
    } else {
        0
    };
    // values carry this invocation's tag: a get of a value an earlier run left counts against it
    let tag = (crate::bench::run_seed() >> 8) & 0xFF_FFFF | 1;
    let truth_flexns = Truth::new(a.records, extra, tag);
    let truth_redis = Truth::new(a.records, extra, tag);
    let truth = |c: Config| {
        if c.system == System::Flexns {
            &truth_flexns
        } else {
            &truth_redis
        }
    };
    if !a.no_load {
        for sys in [System::Flexns, System::Redis] {
            if let Some(&c) = configs.iter().find(|c| c.system == sys) {
                let t = Instant::now();
                load(c, &a, &ctx, &servers, truth(c))?;
                if !a.json {
                    eprintln!("loaded {} records into {} in {:.2?}", a.records, c.name(), t.elapsed());
                }
            }
        }
    }
    let chooser = KeyChooser::new(a.dist, a.records, a.theta);
    let mut results: Vec<(Config, BenchResult)> = Vec::new();
    let progress = crate::progress::Progress::new("ycsb", a.pairs as u64 * configs.len() as u64);
    'pairs: for pair in 0..a.pairs {
        for &cfg in &configs {
            if crate::procs::stopping() {
                break 'pairs;
            }
            progress.start(format!("{:?} pair {}", cfg.system, pair + 1));
            let world = RunCtx {
                a: &a,
                ctx: &ctx,
                servers: &servers,
                chooser: &chooser,
            };
            let (r, first_error) = one_run(&world, cfg, pair, truth(cfg))?;
            progress.suspend(|| {
                r.print(a.json);
                if !a.json && !r.verified {
                    eprintln!("  NOT verified: {}", first_error.as_deref().unwrap_or("no operations"));
                }
            });
            progress.finished_one();
            results.push((cfg, r));
        }
    }
    drop(progress);
    ratios(&a, &configs, &results);
    redis_cross_check(&a, &servers, &results);
    crate::procs::finish()?;
    let all_ok = results.iter().all(|(_, r)| r.verified);
    if !all_ok {
        bail!("some runs were not verified (see the lines above)");
    }
    Ok(())
}

/// Refuses options a run cannot use, naming them.
fn check_args(a: &YcsbArgs) -> Result<()> {
    if a.value_size < 16 {
        bail!("--value-size: at least 16 bytes (record number and write sequence lead every value)");
    }
    if a.threads == 0 || a.depth == 0 || a.records == 0 || a.pairs == 0 {
        bail!("--threads, --depth, --records and --pairs must be at least 1");
    }
    if a.depth > 64 {
        bail!("--depth {}: at most 64 requests in flight per thread", a.depth);
    }
    Ok(())
}

/// The configurations a pair runs, in order: every get path of flexns, then redis.
fn configs(a: &YcsbArgs) -> Vec<Config> {
    let mut configs = Vec::new();
    for &sys in &a.system {
        match sys {
            System::Flexns => configs.extend(a.get_path.iter().map(|&p| Config {
                system: sys,
                path: Some(p),
            })),
            System::Redis => configs.push(Config {
                system: sys,
                path: None,
            }),
        }
    }
    configs
}

/// What every run of an invocation shares: its options, the client context, the servers and
/// the key chooser.
struct RunCtx<'a> {
    a: &'a YcsbArgs,
    ctx: &'a Context,
    servers: &'a Servers,
    chooser: &'a KeyChooser,
}

/// One run of `cfg`: `--threads` client loops for `--duration` (or `--ops`), checked against
/// `tr`; its result line and the first failed check.
fn one_run(w: &RunCtx, cfg: Config, pair: usize, tr: &Truth) -> Result<(BenchResult, Option<String>)> {
    let (a, ctx, servers, chooser) = (w.a, w.ctx, w.servers, w.chooser);
    let mut backends = (0..a.threads)
        .map(|_| backend(cfg, a, ctx, servers))
        .collect::<Result<Vec<_>>>()?;
    let meter = crate::bench::Meter::start(&servers.procs(cfg.system));
    let budget = AtomicU64::new(a.ops.unwrap_or(u64::MAX));
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.duration);
    let outs: Vec<(Tally, hdrhistogram::Histogram<u64>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = backends
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let budget = &budget;
                sc.spawn(move || client_loop(b, a, tr, chooser, end, budget, (pair * 1000 + i) as u64))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client thread")).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let usage = meter.finish();
    let mut t = Tally::default();
    let mut h = histogram();
    for (ti, hi) in &outs {
        t.add(ti);
        let _ = h.add(hi);
    }
    let flexns_stats = backends.iter().find_map(|b| match b {
        Backend::Flexns(c) => Some(c.stats()),
        _ => None,
    });
    let ops = t.reads + t.updates + t.inserts + t.rmws;
    let mut r = BenchResult {
        bench: format!("ycsb-{:?}", a.workload).to_lowercase(),
        system: cfg.name(),
        msg_bytes: a.value_size as u64,
        qps: a.threads as u32,
        depth: a.depth,
        bytes: ops * a.value_size as u64,
        ops,
        secs,
        verified: ops > 0 && t.torn == 0 && t.stale == 0 && t.foreign == 0 && t.errors == 0 && t.missing == 0,
        note: t.first_error.clone(),
        ..Default::default()
    };
    r.rates();
    r.latencies(&h);
    r.account(&usage);
    r.incomplete = crate::procs::stopping();
    extras(&mut r, a, cfg, &t, ops, flexns_stats)?;
    Ok((r, t.first_error))
}

/// The counters of a ycsb run's line: operations by kind, failed checks, the server's CPU per
/// operation, the flexns client's round trips and fallbacks.
fn extras(
    r: &mut BenchResult,
    a: &YcsbArgs,
    cfg: Config,
    t: &Tally,
    ops: u64,
    flexns_stats: Option<kv_store::client::ClientStats>,
) -> Result<()> {
    let x = &mut r.extra;
    let j = |v: u64| serde_json::Value::from(v);
    x.insert("reads".into(), j(t.reads));
    x.insert("updates".into(), j(t.updates));
    x.insert("inserts".into(), j(t.inserts));
    x.insert("rmws".into(), j(t.rmws));
    x.insert("torn".into(), j(t.torn));
    x.insert("stale".into(), j(t.stale));
    x.insert("foreign".into(), j(t.foreign));
    x.insert("errors".into(), j(t.errors));
    x.insert("write_conflicts".into(), j(t.write_conflicts));
    x.insert("records".into(), j(a.records));
    if cfg.path == Some(GetPath::Offload) {
        x.insert("batch".into(), j(a.batch as u64));
    }
    x.insert("dist".into(), serde_json::to_value(a.dist)?);
    if let (Some(c), true) = (r.server_cpu_secs, ops > 0) {
        x.insert(
            "server_cpu_us_per_op".into(),
            serde_json::Value::from((c / ops as f64 * 1e6 * 100.0).round() / 100.0),
        );
    }
    if let Some(cs) = flexns_stats {
        if cs.gets > 0 {
            x.insert(
                "round_trips_per_get".into(),
                serde_json::Value::from((cs.get_round_trips as f64 / cs.gets as f64 * 100.0).round() / 100.0),
            );
            x.insert("fallbacks".into(), j(cs.fallbacks));
            x.insert("torn_copies_reread".into(), j(cs.torn));
            x.insert("hot_hits".into(), j(cs.hot_hits));
        }
    }
    Ok(())
}

/// Runs redis-benchmark against the redis-server of the runs, and prints how ycsb's redis
/// client compares with it (a run's figures are only as good as its client).
fn redis_cross_check(a: &YcsbArgs, servers: &Servers, results: &[(Config, BenchResult)]) {
    let redis_runs: Vec<&BenchResult> = results
        .iter()
        .filter(|(c, r)| c.system == System::Redis && !r.incomplete)
        .map(|(_, r)| r)
        .collect();
    if let (Some(addr), false, false) = (servers.redis, redis_runs.is_empty(), crate::procs::stopping()) {
        match redis_benchmark_check(a, addr, servers.procs(System::Redis), &redis_runs) {
            Ok(Some(line)) => {
                if a.json {
                    println!("{line}");
                } else {
                    println!(
                        "redis-benchmark GET (-c {} -P {}): {} Mop/s, client {} us CPU per op; ycsb's redis client: {} Mop/s, {} us ({}x redis-benchmark's rate)",
                        a.threads, a.depth, line["mops"], line["client_cpu_us_per_op"], line["ycsb_redis_mops"],
                        line["ycsb_client_cpu_us_per_op"], line["ycsb_vs_redis_benchmark"]
                    );
                }
            }
            Ok(None) => {}
            Err(e) => eprintln!("the redis-benchmark cross-check failed: {e:#}"),
        }
    }
}

/// Ratio lines: every flexns path against redis (throughput) and against A1 (p50 latency),
/// median of the per-pair ratios.
fn ratios(a: &YcsbArgs, configs: &[Config], results: &[(Config, BenchResult)]) {
    // an interrupted run has no partner
    let per = |c: Config| -> Vec<&BenchResult> {
        results
            .iter()
            .filter(|(x, r)| *x == c && !r.incomplete)
            .map(|(_, r)| r)
            .collect()
    };
    let mut lines = Vec::new();
    for &c in configs.iter().filter(|c| c.system == System::Flexns) {
        for (refc, what) in [
            (
                Config {
                    system: System::Redis,
                    path: None,
                },
                "throughput",
            ),
            (
                Config {
                    system: System::Flexns,
                    path: Some(GetPath::A1),
                },
                "p50",
            ),
        ] {
            if refc == c || !configs.contains(&refc) {
                continue;
            }
            let (x, y) = (per(c), per(refc));
            let mut v: Vec<f64> = x
                .iter()
                .zip(&y)
                .filter_map(|(p, q)| match what {
                    "throughput" if q.mops > 0.0 => Some(p.mops / q.mops),
                    "p50" => Some(p.p50_us? / q.p50_us?),
                    _ => None,
                })
                .collect();
            if v.is_empty() {
                continue;
            }
            let pairs = v.clone();
            let m = median(&mut v);
            let cpu = |r: &BenchResult| {
                r.extra
                    .get("cpu_us_per_op")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(f64::NAN)
            };
            let mut cpu_ratios: Vec<f64> = x.iter().zip(&y).map(|(p, q)| cpu(p) / cpu(q)).collect();
            let cpu_ratio = (median(&mut cpu_ratios) * 1000.0).round() / 1000.0;
            lines.push(serde_json::json!({
                "bench": format!("ycsb-{:?}-ratio", a.workload).to_lowercase(),
                "what": format!("{what} {} / {}", c.name(), refc.name()),
                "ratio": (m * 1000.0).round() / 1000.0,
                "pairs": pairs.iter().map(|r| (r * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
                "cpu_us_per_op_ratio": cpu_ratio,
                "verified": x.iter().chain(&y).all(|r| r.verified),
            }));
        }
    }
    for l in lines {
        if a.json {
            println!("{l}");
        } else {
            println!(
                "ratio  {:<40} {:>7}  pairs {}",
                l["what"].as_str().unwrap_or(""),
                l["ratio"],
                l["pairs"]
            );
        }
    }
}

/// Runs redis-benchmark against the same redis-server with the same clients, pipeline depth
/// and value size (GETs of a keyspace it loads first), and compares its rate and client CPU
/// with ycsb's redis runs: the reference client must be at least as efficient as the tool
/// redis users measure with. None (with a message) when redis-benchmark is not installed.
fn redis_benchmark_check(
    a: &YcsbArgs,
    addr: SocketAddr,
    procs: Vec<crate::bench::Proc>,
    runs: &[&BenchResult],
) -> Result<Option<serde_json::Value>> {
    let Some(tool) = redis::which("redis-benchmark") else {
        eprintln!("redis-benchmark is not installed (redis-tools): no cross-check of the redis client");
        return Ok(None);
    };
    let common = |t: &str, n: u64| {
        let mut c = crate::procs::command(&tool);
        c.args(["-h", &addr.ip().to_string(), "-p", &addr.port().to_string(), "-t", t])
            .args(["-n", &n.to_string(), "-r", &a.records.to_string()])
            .args(["-d", &a.value_size.to_string(), "-P", &a.depth.to_string()])
            .args(["-c", &a.threads.to_string(), "--csv"]);
        c
    };
    let load = crate::procs::output(&mut common("set", a.records), libc::SIGINT)?;
    if !load.status.success() {
        bail!("redis-benchmark -t set: {}", String::from_utf8_lossy(&load.stderr));
    }
    let mut mops: Vec<f64> = runs.iter().map(|r| r.mops).collect();
    let mut cpu: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.extra.get("processes")?.get(0)?.get("cpu_us_per_op")?.as_f64())
        .collect();
    let ycsb_mops = median(&mut mops);
    let n = ((ycsb_mops * 1e6 * a.duration) as u64).clamp(10_000, 5_000_000);
    let (c0, _) = crate::bench::rusage(true);
    let meter = crate::bench::Meter::start(&procs[1..]);
    let o = crate::procs::output(&mut common("get", n), libc::SIGINT)?;
    let server = meter.finish();
    let (c1, _) = crate::bench::rusage(true);
    if !o.status.success() {
        bail!("redis-benchmark -t get: {}", String::from_utf8_lossy(&o.stderr));
    }
    let out = String::from_utf8_lossy(&o.stdout);
    let rps: f64 = out
        .lines()
        .find(|l| l.starts_with("\"GET\""))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|v| v.trim_matches('"').parse().ok())
        .with_context(|| format!("no GET rate in redis-benchmark's output: {out}"))?;
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let client_cpu = (c1 - c0) * 1e6 / n as f64;
    let server_cpu = server.first().map(|u| u.cpu_secs * 1e6 / n as f64);
    Ok(Some(serde_json::json!({
        "bench": "redis-benchmark", "system": "redis-benchmark", "test": "get", "clients": a.threads,
        "pipeline": a.depth, "value_size": a.value_size, "ops": n, "mops": r3(rps / 1e6),
        "client_cpu_us_per_op": r3(client_cpu), "server_cpu_us_per_op": server_cpu.map(r3),
        "ycsb_redis_mops": r3(ycsb_mops), "ycsb_client_cpu_us_per_op": (!cpu.is_empty()).then(|| r3(median(&mut cpu))),
        "ycsb_vs_redis_benchmark": r3(ycsb_mops / (rps / 1e6)),
    })))
}
