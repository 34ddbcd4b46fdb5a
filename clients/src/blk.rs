//! The block service from the command line: the daemons hosted by this executable, a local
//! cluster (controller, storage nodes, agent as processes on this machine), the control-plane
//! client calls, and the NBD benchmark against qemu-nbd and the agent's TCP mode.

use anyhow::{bail, Context as _, Result};
use block_agent::control::pb;
use block_agent::control::pb::block_control_client::BlockControlClient;
use block_agent::daemon::{AgentArgs, ControlArgs, NodeArgs};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The daemons, hosted by `blkctl daemon ...` (and `flexns blk-daemon ...`).
#[derive(clap::Subcommand, Debug, Clone)]
pub enum DaemonCmd {
    /// A storage node (`block-server`).
    Node(NodeArgs),
    /// An agent exporting volumes over NBD (`block-agent`).
    Agent(AgentArgs),
    /// The controller (`block-control`).
    Control(ControlArgs),
}

/// Runs a daemon until SIGTERM.
pub fn run_daemon(cmd: DaemonCmd) -> Result<()> {
    let threads = match &cmd {
        DaemonCmd::Agent(a) => a.threads.max(1),
        _ => 2,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cmd {
            DaemonCmd::Node(a) => block_agent::daemon::run_node(a).await,
            DaemonCmd::Agent(a) => block_agent::daemon::run_agent(a).await,
            DaemonCmd::Control(a) => block_agent::daemon::run_control(a).await,
        }
    })?;
    Ok(())
}

/// How this executable starts its daemons: `exe PREFIX... node|agent|control ARGS`.
#[derive(Debug, Clone)]
pub struct Spawner {
    pub exe: PathBuf,
    pub prefix: Vec<String>,
}

/// A daemon process with its log file; stopped on drop unless detached.
pub struct Daemon {
    pub name: String,
    child: Option<Child>,
    pub pid: u32,
    pub banner: String,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts `role args` with stdout and stderr in `dir/name.log`, waits for its banner.
    /// `detached` puts it in its own session (it outlives this process and the terminal).
    pub fn start(sp: &Spawner, dir: &Path, name: &str, role: &str, args: &[String], detached: bool) -> Result<Daemon> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&sp.exe);
        cmd.args(&sp.prefix).arg(role).args(args);
        cmd.stdin(Stdio::null()).stdout(f.try_clone()?).stderr(f);
        if detached {
            use std::os::unix::process::CommandExt;
            // SAFETY: setsid in the child between fork and exec touches no memory of ours.
            unsafe {
                cmd.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} {role}", sp.exe.display()))?;
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        let prefix = match role {
            "node" => "block-server ",
            "agent" => "block-agent ",
            _ => "block-control ",
        };
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(l) = text.lines().find(|l| l.starts_with(prefix)) {
                let banner = l.to_string();
                return Ok(Daemon {
                    name: name.to_string(),
                    child: (!detached).then_some(child),
                    pid,
                    banner,
                    log,
                });
            }
            if let Ok(Some(st)) = child.try_wait() {
                bail!("{name} exited ({st}) before it was ready:\n{}", tail(&text, 20));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("{name} was not ready in 30 s:\n{}", tail(&text, 20));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A `key=value` field of the banner.
    pub fn field(&self, key: &str) -> Option<String> {
        self.banner.split_whitespace().find_map(|kv| {
            kv.strip_prefix(key)
                .and_then(|r| r.strip_prefix('='))
                .map(str::to_string)
        })
    }

    /// SIGKILL (a crash, for tests and benchmarks).
    pub fn kill9(&mut self) {
        signal(self.pid, libc::SIGKILL);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL after 5 s; returns CPU seconds and peak RSS of a child it waited for.
    pub fn stop(&mut self) -> Option<(f64, u64)> {
        let c = self.child.take()?;
        let pid = c.id() as libc::pid_t;
        signal(c.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut status = 0;
        // SAFETY: wait4 on our own child with valid out-pointers.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: as above, without blocking.
            let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
            if r == pid {
                let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
                return Some((t(ru.ru_utime) + t(ru.ru_stime), ru.ru_maxrss as u64));
            }
            if r < 0 {
                return None;
            }
            if Instant::now() > deadline {
                signal(c.id(), libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: sending a signal to a process id; no memory is involved.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

fn tail(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(n)..].join("\n")
}

/// What a local cluster is made of.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub dir: PathBuf,
    pub nodes: usize,
    pub replicas: usize,
    pub size: u64,
    pub volume: String,
    pub transport: String,
    pub paths: u16,
    /// The agent's Solar congestion control (swift or none).
    pub cc: String,
    pub nbd: String,
    pub etcd: Option<String>,
    pub detached: bool,
}

impl ClusterSpec {
    pub fn new(dir: PathBuf) -> ClusterSpec {
        ClusterSpec {
            dir,
            nodes: 3,
            replicas: 3,
            size: 1 << 30,
            volume: "vol0".into(),
            transport: "solar".into(),
            paths: 4,
            cc: "swift".into(),
            nbd: "127.0.0.1:0".into(),
            etcd: None,
            detached: false,
        }
    }
}

/// A controller, storage nodes and one agent on this machine, with one volume attached.
pub struct LocalCluster {
    pub control: Daemon,
    pub nodes: Vec<Daemon>,
    pub agent: Daemon,
    pub control_addr: String,
    pub uri: String,
    pub spec: ClusterSpec,
    spawner: Spawner,
}

/// What `blkctl cluster up` leaves for `down` and the other commands.
#[derive(Debug, Serialize, Deserialize)]
pub struct ClusterState {
    pub control: String,
    pub uri: String,
    pub pids: Vec<(String, u32)>,
    pub dir: PathBuf,
}

/// A runtime for the control-plane calls of a command.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// A controller client.
pub async fn control(addr: &str) -> Result<BlockControlClient<tonic::transport::Channel>> {
    let url = format!("http://{}", addr.trim_start_matches("http://"));
    BlockControlClient::connect(url)
        .await
        .with_context(|| format!("connecting to the controller at {addr} (is a cluster up? `blkctl cluster up`)"))
}

fn status(e: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}", e.message())
}

impl LocalCluster {
    /// Starts the processes, creates the volume and attaches it to the agent.
    pub fn start(sp: &Spawner, spec: ClusterSpec) -> Result<LocalCluster> {
        let d = &spec.dir;
        let mut cargs = vec!["--listen".to_string(), "127.0.0.1:0".into()];
        match &spec.etcd {
            Some(e) => cargs.extend([
                "--etcd".into(),
                e.clone(),
                "--prefix".into(),
                format!("/flexns-{}", std::process::id()),
            ]),
            None => cargs.extend(["--state".into(), d.join("control.json").display().to_string()]),
        }
        let control = Daemon::start(sp, d, "control", "control", &cargs, spec.detached)?;
        let caddr = control.field("control").context("controller banner")?;
        let mut nodes = Vec::new();
        for i in 0..spec.nodes {
            let args = vec![
                "--dir".to_string(),
                d.join(format!("node{i}")).display().to_string(),
                "--control".into(),
                caddr.clone(),
            ];
            nodes.push(Daemon::start(sp, d, &format!("node{i}"), "node", &args, spec.detached)?);
        }
        let aargs = vec![
            "--name".to_string(),
            "agent0".into(),
            "--nbd".into(),
            spec.nbd.clone(),
            "--unix".into(),
            d.join("nbd.sock").display().to_string(),
            "--control".into(),
            caddr.clone(),
            "--transport".into(),
            spec.transport.clone(),
            "--paths".into(),
            spec.paths.to_string(),
            "--cc".into(),
            spec.cc.clone(),
        ];
        let agent = Daemon::start(sp, d, "agent0", "agent", &aargs, spec.detached)?;
        let rt = runtime()?;
        let uri = rt.block_on(async {
            let mut c = self::control(&caddr).await?;
            let exists = c
                .describe(pb::NameRequest {
                    name: spec.volume.clone(),
                })
                .await
                .is_ok();
            if !exists {
                c.create(pb::CreateRequest {
                    name: spec.volume.clone(),
                    size: spec.size,
                    replicas: spec.replicas as u32,
                })
                .await
                .map_err(status)?;
            }
            let r = c
                .attach(pb::AttachVolumeRequest {
                    name: spec.volume.clone(),
                    agent: "agent0".into(),
                })
                .await
                .map_err(status)?;
            anyhow::Ok(r.into_inner().uri)
        })?;
        Ok(LocalCluster {
            control,
            nodes,
            agent,
            control_addr: caddr,
            uri,
            spec,
            spawner: sp.clone(),
        })
    }

    /// Restarts storage node `i` on its address and directory (after [`Daemon::kill9`]).
    pub fn restart_node(&mut self, i: usize) -> Result<()> {
        let data = self.nodes[i].field("data").context("node banner")?;
        let args = vec![
            "--dir".to_string(),
            self.spec.dir.join(format!("node{i}")).display().to_string(),
            "--listen".into(),
            data,
            "--control".into(),
            self.control_addr.clone(),
        ];
        self.nodes[i] = Daemon::start(
            &self.spawner,
            &self.spec.dir,
            &format!("node{i}"),
            "node",
            &args,
            self.spec.detached,
        )?;
        Ok(())
    }

    /// The state `blkctl cluster down` needs (for a detached cluster).
    pub fn state(&self) -> ClusterState {
        let mut pids = vec![(self.agent.name.clone(), self.agent.pid)];
        pids.extend(self.nodes.iter().map(|n| (n.name.clone(), n.pid)));
        pids.push((self.control.name.clone(), self.control.pid));
        ClusterState {
            control: self.control_addr.clone(),
            uri: self.uri.clone(),
            pids,
            dir: self.spec.dir.clone(),
        }
    }
}

/// Stops a detached cluster's processes (agent first, controller last).
pub fn cluster_down(state: &ClusterState) {
    for (name, pid) in &state.pids {
        signal(*pid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        // SAFETY: signal 0 only checks that the process exists.
        while unsafe { libc::kill(*pid as libc::pid_t, 0) } == 0 {
            if Instant::now() > deadline {
                signal(*pid, libc::SIGKILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("stopped {name} (pid {pid})");
    }
}

/// The demo's block step: a local cluster (controller, three storage nodes, agent) as child
/// processes, a 3-replica volume, 4 KiB and 1 MiB writes of random data through NBD with
/// `duration` seconds of mixed 4 KiB writes, then every written byte read back and compared.
/// Returns the result lines (IOPS of each phase, verified).
pub fn demo_step(sp: &Spawner, duration: f64) -> Result<Vec<crate::bench::BenchResult>> {
    use block_agent::nbd::client::NbdClient;
    let dir = std::env::temp_dir().join(format!("flexns-demo-block-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut spec = ClusterSpec::new(dir.clone());
    spec.size = 64 << 20;
    let c = LocalCluster::start(sp, spec)?;
    let rest = c.uri.strip_prefix("nbd://").context("URI")?;
    let (hp, name) = rest.split_once('/').context("URI")?;
    let mut cl = NbdClient::connect(hp, name)?;
    let blocks = cl.size() / 4096;
    let mut written: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let block = |lba: u64, v: u64| -> Vec<u8> {
        let mut x = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v | 1;
        let mut b = vec![0u8; 4096];
        for ch in b.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ch.copy_from_slice(&x.to_le_bytes());
        }
        b
    };
    let mut out = Vec::new();
    // random 4 KiB writes for `duration` seconds
    let t = Instant::now();
    let mut ops = 0u64;
    let mut h = crate::bench::histogram();
    let mut x = 12345u64;
    while t.elapsed().as_secs_f64() < duration {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let lba = (x >> 33) % blocks;
        ops += 1;
        let s = Instant::now();
        cl.write(lba * 4096, &block(lba, ops), false)?;
        h.record(s.elapsed().as_nanos() as u64).ok();
        written.insert(lba, ops);
    }
    let secs = t.elapsed().as_secs_f64();
    // one 1 MiB write
    let big: Vec<u8> = (0..256u64).flat_map(|i| block(1_000_000 + i, 7)).collect();
    cl.write(32 << 20, &big, true)?;
    // read everything back
    let mut ok = true;
    let mut buf = vec![0u8; 4096];
    for (&lba, &v) in &written {
        let big_first = (32u64 << 20) / 4096;
        if (big_first..big_first + 256).contains(&lba) {
            continue; // overwritten by the 1 MiB write
        }
        cl.read(lba * 4096, &mut buf)?;
        ok &= buf == block(lba, v);
    }
    let mut back = vec![0u8; big.len()];
    cl.read(32 << 20, &mut back)?;
    ok &= back == big;
    cl.disconnect();
    let mut r = crate::bench::BenchResult {
        bench: "volume_write_read".into(),
        system: "flexns".into(),
        transport: Some("nbd + solar/udp, 3 replicas".into()),
        msg_bytes: 4096,
        qps: 1,
        depth: 1,
        bytes: ops * 4096,
        ops,
        secs,
        verified: ok,
        ..Default::default()
    };
    r.latencies(&h);
    r.rates();
    r.extra.insert("iops".into(), ((ops as f64 / secs).round()).into());
    r.extra
        .insert("blocks_checked".into(), (written.len() as u64 + 256).into());
    out.push(r);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}
