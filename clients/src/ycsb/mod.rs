//! `ycsb`: YCSB core workloads against kv-store (each get path) and redis-server, interleaved
//! in one run (BENCH.md), every get checked against what was written.
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
    Flexns,
    Redis,
}

/// `ycsb` options.
#[derive(Debug, Clone, clap::Args)]
pub struct YcsbArgs {
    #[arg(long, value_enum, default_value = "c")]
    pub workload: Workload,
    /// Records loaded before the run.
    #[arg(long, default_value_t = 100_000)]
    pub records: u64,
    /// Value bytes (at least 16: record number and write sequence lead every value).
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
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
    /// JSON lines (BENCH.md).
    #[arg(long)]
    pub json: bool,
}

/// What each system's records look like to the verifier: the last acknowledged write sequence
/// per record, whether a write is in flight, how many records exist.
struct Truth {
    acked: Vec<AtomicU64>,
    writing: Vec<AtomicBool>,
    inserted: AtomicU64,
    seq: AtomicU64,
}

impl Truth {
    fn new(records: u64, extra: u64) -> Truth {
        let n = (records + extra) as usize;
        Truth {
            acked: (0..n).map(|_| AtomicU64::new(0)).collect(),
            writing: (0..n).map(|_| AtomicBool::new(false)).collect(),
            inserted: AtomicU64::new(records),
            seq: AtomicU64::new(1),
        }
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

/// CPU seconds a child has used so far (from /proc; 0 when unknown).
fn child_cpu(c: &ChildServer) -> f64 {
    let Some(pid) = c.pid() else { return 0.0 };
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // fields after the command name (which may contain spaces): utime is the 12th, stime 13th
    let rest = s.rsplit_once(") ").map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
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
            .map(|i| Op::Put(key(i).to_vec(), value(i, 0, a.value_size)))
            .collect();
        for (i, r) in (n..hi).zip(b.execute(ops)) {
            r.with_context(|| format!("loading record {i} into {}", cfg.name()))?;
            truth.acked[i as usize].store(0, Ordering::Relaxed);
        }
        n = hi;
    }
    Ok(())
}

/// Runs the benchmark; `exe` and `sub` start a kv-server (`exe sub... --cm ...`).
pub fn run(a: YcsbArgs, exe: &std::path::Path, sub: &[String]) -> Result<()> {
    if a.value_size < 16 {
        bail!("--value-size: at least 16 bytes (record number and write sequence lead every value)");
    }
    if a.threads == 0 || a.depth == 0 || a.records == 0 || a.pairs == 0 {
        bail!("--threads, --depth, --records and --pairs must be at least 1");
    }
    if a.depth > 64 {
        bail!("--depth {}: at most 64 requests in flight per thread", a.depth);
    }
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
    let servers = start_servers(&a, exe, sub)?;
    let ctx = Context::open(ContextConfig::default())?;
    let extra = if a.workload == Workload::D {
        a.records / 2 + 100_000
    } else {
        0
    };
    let truth_flexns = Truth::new(a.records, extra);
    let truth_redis = Truth::new(a.records, extra);
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
    'pairs: for pair in 0..a.pairs {
        for &cfg in &configs {
            if crate::procs::stopping() {
                break 'pairs;
            }
            let mut backends = (0..a.threads)
                .map(|_| backend(cfg, &a, &ctx, &servers))
                .collect::<Result<Vec<_>>>()?;
            let cpu0: f64 = servers.kv_children.iter().map(child_cpu).sum::<f64>()
                + servers._redis_child.as_ref().map_or(0.0, |r| child_cpu(&r.server));
            let (my0, _) = crate::bench::rusage(false);
            let budget = AtomicU64::new(a.ops.unwrap_or(u64::MAX));
            let start = Instant::now();
            let end = start + Duration::from_secs_f64(a.duration);
            let tr = truth(cfg);
            let outs: Vec<(Tally, hdrhistogram::Histogram<u64>)> = std::thread::scope(|sc| {
                let hs: Vec<_> = backends
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| {
                        let (a, chooser, budget) = (&a, &chooser, &budget);
                        sc.spawn(move || client_loop(b, a, tr, chooser, end, budget, (pair * 1000 + i) as u64))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("client thread")).collect()
            });
            let secs = start.elapsed().as_secs_f64();
            let server_cpu = servers.kv_children.iter().map(child_cpu).sum::<f64>()
                + servers._redis_child.as_ref().map_or(0.0, |r| child_cpu(&r.server))
                - cpu0;
            let (my1, rss) = crate::bench::rusage(false);
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
                verified: ops > 0 && t.torn == 0 && t.stale == 0 && t.errors == 0 && t.missing == 0,
                cpu_secs: my1 - my0,
                peak_rss_kib: rss,
                server_cpu_secs: Some((server_cpu * 1000.0).round() / 1000.0),
                note: t.first_error.clone(),
                ..Default::default()
            };
            r.rates();
            r.latencies(&h);
            r.incomplete = crate::procs::stopping();
            let x = &mut r.extra;
            let j = |v: u64| serde_json::Value::from(v);
            x.insert("reads".into(), j(t.reads));
            x.insert("updates".into(), j(t.updates));
            x.insert("inserts".into(), j(t.inserts));
            x.insert("rmws".into(), j(t.rmws));
            x.insert("torn".into(), j(t.torn));
            x.insert("stale".into(), j(t.stale));
            x.insert("errors".into(), j(t.errors));
            x.insert("write_conflicts".into(), j(t.write_conflicts));
            x.insert("records".into(), j(a.records));
            if cfg.path == Some(GetPath::Offload) {
                x.insert("batch".into(), j(a.batch as u64));
            }
            x.insert("dist".into(), serde_json::to_value(a.dist)?);
            if ops > 0 {
                x.insert(
                    "server_cpu_us_per_op".into(),
                    serde_json::Value::from((server_cpu / ops as f64 * 1e6 * 100.0).round() / 100.0),
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
            r.print(a.json);
            if !a.json && !r.verified {
                eprintln!(
                    "  NOT verified: {}",
                    t.first_error.as_deref().unwrap_or("no operations")
                );
            }
            results.push((cfg, r));
        }
    }
    ratios(&a, &configs, &results);
    crate::procs::finish()?;
    let all_ok = results.iter().all(|(_, r)| r.verified);
    if !all_ok {
        bail!("some runs were not verified (see the lines above)");
    }
    Ok(())
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
            lines.push(serde_json::json!({
                "bench": format!("ycsb-{:?}-ratio", a.workload).to_lowercase(),
                "what": format!("{what} {} / {}", c.name(), refc.name()),
                "ratio": (m * 1000.0).round() / 1000.0,
                "pairs": pairs.iter().map(|r| (r * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
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
