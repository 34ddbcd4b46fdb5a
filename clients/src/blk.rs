//! The block service from the command line: the daemons hosted by this executable, a local
//! cluster (controller, storage nodes, agent as processes on this machine), the control-plane
//! client calls, and the NBD benchmark against qemu-nbd and the agent's TCP mode.

use anyhow::{bail, Context as _, Result};
use block_agent::control::pb;
use block_agent::control::pb::block_control_client::BlockControlClient;
use block_agent::daemon::{AgentArgs, ControlArgs, NodeArgs};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
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
    /// The executable.
    pub exe: PathBuf,
    /// Arguments before the role (e.g. a subcommand).
    pub prefix: Vec<String>,
}

/// A daemon process with its log file; stopped on drop unless detached.
pub struct Daemon {
    /// The daemon's name (its log is `NAME.log`).
    pub name: String,
    /// `node`, `agent` or `control`, and its arguments (what starts it again).
    pub role: String,
    /// Its arguments.
    pub args: Vec<String>,
    child: Option<Child>,
    /// Its process id.
    pub pid: u32,
    /// The first line it printed (its banner: addresses it serves on).
    pub banner: String,
    /// Its log file (stdout and stderr).
    pub log: PathBuf,
}

impl Daemon {
    /// Starts `role args` with stdout and stderr in `dir/name.log`, waits for its banner.
    /// `detached` puts it in its own session (it outlives this process and the terminal).
    pub fn start(sp: &Spawner, dir: &Path, name: &str, role: &str, args: &[String], detached: bool) -> Result<Daemon> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = if detached {
            crate::procs::detached_command(&sp.exe)
        } else {
            crate::procs::command(&sp.exe)
        };
        cmd.args(&sp.prefix).arg(role).args(args);
        cmd.stdin(Stdio::null()).stdout(f.try_clone()?).stderr(f);
        let started = if detached {
            cmd.spawn()
        } else {
            crate::procs::spawn(&mut cmd)
        };
        let mut child = started.with_context(|| format!("starting {} {role}", sp.exe.display()))?;
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
                    role: role.to_string(),
                    args: args.to_vec(),
                    child: (!detached).then_some(child),
                    pid,
                    banner,
                    log,
                });
            }
            if let Ok(Some(st)) = child.try_wait() {
                crate::procs::reaped(pid);
                bail!("{name} exited ({st}) before it was ready:\n{}", tail(&text, 20));
            }
            if Instant::now() > deadline {
                crate::procs::kill9(child);
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
        match self.child.take() {
            Some(c) => crate::procs::kill9(c),
            None => signal(self.pid, libc::SIGKILL),
        }
    }

    /// SIGTERM, then SIGKILL after 5 s; returns CPU seconds and peak RSS of a child it waited for.
    pub fn stop(&mut self) -> Option<(f64, u64)> {
        crate::procs::terminate(self.child.take()?, Duration::from_secs(5))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    crate::procs::signal(pid, sig);
}

fn tail(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(n)..].join("\n")
}

/// What a local cluster is made of.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Directory of the daemons' logs, data and state.
    pub dir: PathBuf,
    /// Storage nodes to start.
    pub nodes: usize,
    /// Replicas of the volume.
    pub replicas: usize,
    /// The volume's size in bytes.
    pub size: u64,
    /// The volume's name.
    pub volume: String,
    /// The agent's transport: `solar` or `tcp`.
    pub transport: String,
    /// Solar paths (UDP source ports) per link.
    pub paths: u16,
    /// The agent's Solar congestion control (swift or none).
    pub cc: String,
    /// How the agent's and the nodes' Solar data cores wait: sleep, adaptive or busy.
    pub poll_mode: String,
    /// Who runs the agent's Solar data core: runtime or threads (`--engine-drive`).
    pub engine_drive: String,
    /// The agent's NBD listen address.
    pub nbd: String,
    /// The etcd endpoint the controller keeps its state in and the daemons register in (`None`: a state file in `dir`).
    pub etcd: Option<String>,
    /// Start the daemons in their own sessions, so they outlive this process.
    pub detached: bool,
    /// Heartbeat period of the storage nodes and the agent.
    pub heartbeat_ms: u64,
    /// The controller's node timeout.
    pub node_timeout_ms: u64,
    /// The controller's `--replace-after-ms` (0: never).
    pub replace_after_ms: u64,
    /// With etcd: the lease (seconds) the storage nodes and the agent register themselves
    /// under (`PREFIX/block/live/...`); a node that dies leaves etcd within it and the
    /// controller marks it down then.
    pub etcd_lease_ttl_s: u64,
    /// Prometheus metrics on 127.0.0.1: the controller on this port, storage node `i` on
    /// `+1+i`, the agent after the nodes (see [`ClusterSpec::metrics_addrs`]).
    pub metrics_base: Option<u16>,
    /// The volume's write quorum, also the agent's `--write-quorum` (0: a majority).
    pub write_quorum: usize,
}

impl ClusterSpec {
    /// The defaults: 3 nodes, 3 replicas, a 1 GiB volume `vol0` over Solar with 4 paths, in `dir`.
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
            poll_mode: "sleep".into(),
            engine_drive: "runtime".into(),
            nbd: "127.0.0.1:0".into(),
            etcd: None,
            detached: false,
            heartbeat_ms: 1000,
            node_timeout_ms: 3000,
            replace_after_ms: 60_000,
            etcd_lease_ttl_s: 10,
            metrics_base: None,
            write_quorum: 0,
        }
    }

    /// `(daemon, address)` of every metrics endpoint: control, node0.., agent0.
    pub fn metrics_addrs(&self) -> Vec<(String, String)> {
        let Some(base) = self.metrics_base else {
            return Vec::new();
        };
        let at = |k: usize| format!("127.0.0.1:{}", base as usize + k);
        let mut v = vec![("control".to_string(), at(0))];
        v.extend((0..self.nodes).map(|i| (format!("node{i}"), at(1 + i))));
        v.push(("agent0".to_string(), at(1 + self.nodes)));
        v
    }

    fn metrics_flag(&self, daemon: &str) -> Vec<String> {
        self.metrics_addrs()
            .into_iter()
            .find(|(d, _)| d == daemon)
            .map(|(_, a)| vec!["--metrics-addr".to_string(), a])
            .unwrap_or_default()
    }
}

/// A controller, storage nodes and one agent on this machine, with one volume attached.
pub struct LocalCluster {
    /// The controller.
    pub control: Daemon,
    /// The storage nodes.
    pub nodes: Vec<Daemon>,
    /// The agent.
    pub agent: Daemon,
    /// The controller's gRPC address.
    pub control_addr: String,
    /// The NBD URI of the attached volume.
    pub uri: String,
    /// The size of the volume when the kept state already had it (its data served again).
    pub reused: Option<u64>,
    /// What the cluster was started from.
    pub spec: ClusterSpec,
    spawner: Spawner,
}

/// What `blkctl cluster up` leaves for `down` and the other commands.
#[derive(Debug, Serialize, Deserialize)]
pub struct ClusterState {
    /// The controller's gRPC address.
    pub control: String,
    /// The NBD URI of the attached volume.
    pub uri: String,
    /// Each daemon's name and pid.
    pub pids: Vec<(String, u32)>,
    /// The cluster's directory.
    pub dir: PathBuf,
    /// Each pid's start time (clock ticks after boot, from /proc): a pid and its start time
    /// name one process, so `down` never signals a process that reused a daemon's pid.
    #[serde(default)]
    pub starts: Vec<u64>,
    /// Each daemon's role and arguments, as `pids` (`blkctl cluster restart`).
    #[serde(default)]
    pub argv: Vec<(String, Vec<String>)>,
}

/// A process's start time in clock ticks after boot (field 22 of /proc/PID/stat), if it runs.
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = st.rsplit_once(") ")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.first() == Some(&"Z") {
        return None;
    }
    // after the command: state is field 3, start time field 22
    f.get(19)?.parse().ok()
}

/// Whether a cluster's recorded daemon still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alive {
    /// The daemon still runs.
    Yes,
    /// No process has the pid any more.
    Gone,
    /// The pid runs, but it is another process (it started at another time, or is not one of
    /// this cluster's daemons).
    Other,
}

/// Whether daemon `i` of `state` runs: its pid started when recorded (or, for a state without
/// start times, its command line names this cluster's directory).
pub fn daemon_alive(state: &ClusterState, i: usize) -> Alive {
    let pid = state.pids[i].1;
    let Some(start) = proc_start_time(pid) else {
        return Alive::Gone;
    };
    match state.starts.get(i) {
        Some(&s) if s == start => Alive::Yes,
        Some(_) => Alive::Other,
        None => {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(" daemon ") && cmd.contains(&*state.dir.to_string_lossy()) {
                Alive::Yes
            } else {
                Alive::Other
            }
        }
    }
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

/// The etcd key prefix of a cluster kept in `dir`: the same on every `cluster up` there.
pub fn etcd_prefix(dir: &Path) -> String {
    // FNV-1a of the directory's path
    let h = dir.to_string_lossy().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("/flexns-cluster-{h:016x}")
}

fn control_args(spec: &ClusterSpec, listen: &str) -> Vec<String> {
    let mut a = vec![
        "--listen".to_string(),
        listen.into(),
        "--node-timeout-ms".into(),
        spec.node_timeout_ms.to_string(),
        "--replace-after-ms".into(),
        spec.replace_after_ms.to_string(),
    ];
    match &spec.etcd {
        Some(e) => a.extend(["--etcd".into(), e.clone(), "--prefix".into(), etcd_prefix(&spec.dir)]),
        None => a.extend(["--state".into(), spec.dir.join("control.json").display().to_string()]),
    }
    a.extend(spec.metrics_flag("control"));
    a
}

fn node_args(spec: &ClusterSpec, control: &str, i: usize, listen: &str) -> Vec<String> {
    let mut a = vec![
        "--dir".to_string(),
        spec.dir.join(format!("node{i}")).display().to_string(),
        "--listen".into(),
        listen.into(),
        "--control".into(),
        control.into(),
        "--heartbeat-ms".into(),
        spec.heartbeat_ms.to_string(),
        "--poll-mode".into(),
        spec.poll_mode.clone(),
    ];
    a.extend(spec.metrics_flag(&format!("node{i}")));
    a.extend(live_args(spec));
    a
}

/// Where a storage node or the agent registers itself when the metadata is in etcd.
fn live_args(spec: &ClusterSpec) -> Vec<String> {
    match &spec.etcd {
        Some(e) => vec![
            "--etcd".into(),
            e.clone(),
            "--etcd-prefix".into(),
            etcd_prefix(&spec.dir),
            "--etcd-lease-ttl".into(),
            spec.etcd_lease_ttl_s.to_string(),
        ],
        None => Vec::new(),
    }
}

fn agent_args(spec: &ClusterSpec, name: &str, control: &str, nbd: &str) -> Vec<String> {
    let sock = if name == "agent0" {
        "nbd.sock".to_string()
    } else {
        format!("nbd-{name}.sock")
    };
    let mut a = vec![
        "--name".to_string(),
        name.into(),
        "--nbd".into(),
        nbd.into(),
        "--unix".into(),
        spec.dir.join(sock).display().to_string(),
        "--control".into(),
        control.into(),
        "--transport".into(),
        spec.transport.clone(),
        "--paths".into(),
        spec.paths.to_string(),
        "--cc".into(),
        spec.cc.clone(),
        "--poll-mode".into(),
        spec.poll_mode.clone(),
        "--engine-drive".into(),
        spec.engine_drive.clone(),
        "--heartbeat-ms".into(),
        spec.heartbeat_ms.to_string(),
        "--write-quorum".into(),
        spec.write_quorum.to_string(),
    ];
    a.extend(spec.metrics_flag(name));
    a.extend(live_args(spec));
    a
}

/// Starts storage node `i` on a port below the kernel's ephemeral range, as a deployment
/// would: a node restarted on its old address (`restart_node(i, true)`) then cannot find it
/// taken by some outgoing connection's ephemeral port, which CI's parallel tests once did.
/// Another test may have picked the same port meanwhile: then another one is tried.
fn start_node(sp: &Spawner, spec: &ClusterSpec, control: &str, i: usize) -> Result<Daemon> {
    let mut tries = 0;
    loop {
        let listen = format!("127.0.0.1:{}", fixed_port()?);
        let args = node_args(spec, control, i, &listen);
        match Daemon::start(sp, &spec.dir, &format!("node{i}"), "node", &args, spec.detached) {
            Err(e) if tries < 8 && format!("{e:#}").contains("Address already in use") => tries += 1,
            r => return r,
        }
    }
}

/// A port on 127.0.0.1 below the ephemeral range (`ip_local_port_range`) that is free for
/// both TCP and UDP now.
fn fixed_port() -> Result<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
        .unwrap_or(32768);
    let floor = 10_000u16;
    anyhow::ensure!(
        low > floor + 1_000,
        "ip_local_port_range starts at {low}: no room below it"
    );
    for _ in 0..64 {
        let port = rand::random_range(floor..low);
        let tcp = std::net::TcpListener::bind(("127.0.0.1", port));
        let udp = std::net::UdpSocket::bind(("127.0.0.1", port));
        if tcp.is_ok() && udp.is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port between {floor} and {low} on 127.0.0.1")
}

impl LocalCluster {
    /// Starts the processes; creates the volume unless the kept state has it (then its data,
    /// on the storage nodes' directories, serves again); attaches it to the agent.
    pub fn start(sp: &Spawner, spec: ClusterSpec) -> Result<LocalCluster> {
        let d = &spec.dir;
        let control = Daemon::start(
            sp,
            d,
            "control",
            "control",
            &control_args(&spec, "127.0.0.1:0"),
            spec.detached,
        )?;
        let caddr = control.field("control").context("controller banner")?;
        let mut nodes = Vec::new();
        for i in 0..spec.nodes {
            nodes.push(start_node(sp, &spec, &caddr, i)?);
        }
        let agent = Daemon::start(
            sp,
            d,
            "agent0",
            "agent",
            &agent_args(&spec, "agent0", &caddr, &spec.nbd),
            spec.detached,
        )?;
        let rt = runtime()?;
        let (uri, reused) = rt.block_on(async {
            let mut c = self::control(&caddr).await?;
            let kept = c
                .describe(pb::NameRequest {
                    name: spec.volume.clone(),
                })
                .await
                .ok()
                .map(|v| v.into_inner().size);
            if kept.is_none() {
                c.create(pb::CreateRequest {
                    name: spec.volume.clone(),
                    size: spec.size,
                    replicas: spec.replicas as u32,
                    qos: None,
                    write_quorum: spec.write_quorum as u32,
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
            anyhow::Ok((r.into_inner().uri, kept))
        })?;
        Ok(LocalCluster {
            control,
            nodes,
            agent,
            control_addr: caddr,
            uri,
            reused,
            spec,
            spawner: sp.clone(),
        })
    }

    /// Starts storage node `i` again on its directory (after [`Daemon::kill9`] or
    /// [`Daemon::stop`]): on its old data address, or on a new one (`same_port` false), which
    /// the controller and the agent then follow.
    pub fn restart_node(&mut self, i: usize, same_port: bool) -> Result<()> {
        self.nodes[i] = if same_port {
            let listen = self.nodes[i].field("data").context("node banner")?;
            let args = node_args(&self.spec, &self.control_addr, i, &listen);
            Daemon::start(
                &self.spawner,
                &self.spec.dir,
                &format!("node{i}"),
                "node",
                &args,
                self.spec.detached,
            )?
        } else {
            start_node(&self.spawner, &self.spec, &self.control_addr, i)?
        };
        Ok(())
    }

    /// Starts the agent again (after [`Daemon::kill9`]) on its NBD address: the controller's
    /// answer to its registration brings its volumes back.
    pub fn restart_agent(&mut self) -> Result<()> {
        let nbd = self.agent.field("nbd").context("agent banner")?;
        let args = agent_args(&self.spec, "agent0", &self.control_addr, &nbd);
        self.agent = Daemon::start(
            &self.spawner,
            &self.spec.dir,
            "agent0",
            "agent",
            &args,
            self.spec.detached,
        )?;
        Ok(())
    }

    /// Starts another agent, `name`, on any NBD port (a host the volume can move to).
    pub fn start_agent(&self, name: &str) -> Result<Daemon> {
        let args = agent_args(&self.spec, name, &self.control_addr, "127.0.0.1:0");
        Daemon::start(&self.spawner, &self.spec.dir, name, "agent", &args, self.spec.detached)
    }

    /// Starts the controller again (after [`Daemon::kill9`]) on its address and state.
    pub fn restart_control(&mut self) -> Result<()> {
        let args = control_args(&self.spec, &self.control_addr);
        self.control = Daemon::start(
            &self.spawner,
            &self.spec.dir,
            "control",
            "control",
            &args,
            self.spec.detached,
        )?;
        Ok(())
    }

    /// The state `blkctl cluster down` needs (for a detached cluster).
    pub fn state(&self) -> ClusterState {
        let mut daemons = vec![&self.agent];
        daemons.extend(self.nodes.iter());
        daemons.push(&self.control);
        let pids: Vec<(String, u32)> = daemons.iter().map(|d| (d.name.clone(), d.pid)).collect();
        let starts = pids.iter().map(|(_, p)| proc_start_time(*p).unwrap_or(0)).collect();
        ClusterState {
            control: self.control_addr.clone(),
            uri: self.uri.clone(),
            pids,
            dir: self.spec.dir.clone(),
            starts,
            argv: daemons
                .iter()
                .map(|d| {
                    let mut args = d.args.clone();
                    if d.role == "control" {
                        // restarted, it must come back where the others know it
                        set_listen(&mut args, &self.control_addr);
                    }
                    (d.role.clone(), args)
                })
                .collect(),
        }
    }
}

/// Starts daemon `name` of a detached cluster again (after it died or was killed) with the
/// arguments it was started with, and records its new pid in `state`. A storage node that
/// listened on port 0 gets a new port, which the controller and the agent follow; the agent
/// keeps its NBD address unless it was port 0 (then `state.uri` changes); the controller comes
/// back on its recorded address `state.control` (waiting a few seconds while that is still in
/// use). Returns the pid.
pub fn restart_daemon(sp: &Spawner, state: &mut ClusterState, name: &str) -> Result<u32> {
    let i = state.pids.iter().position(|(n, _)| n == name).with_context(|| {
        let names: Vec<&str> = state.pids.iter().map(|(n, _)| n.as_str()).collect();
        format!("no daemon {name:?} in this cluster (it has {})", names.join(", "))
    })?;
    if daemon_alive(state, i) == Alive::Yes {
        bail!("{name} is running (pid {})", state.pids[i].1);
    }
    let (role, mut args) = state.argv.get(i).cloned().with_context(|| {
        format!("the cluster's state has no arguments for {name} (it was started by an older blkctl)")
    })?;
    let d = if role == "control" {
        // the nodes, the agent and the state know the controller by the address it bound
        // when it first started; a state written before that was recorded says port 0 here
        set_listen(&mut args, &state.control);
        start_on_old_address(sp, &state.dir, name, &role, &args, &state.control)?
    } else {
        Daemon::start(sp, &state.dir, name, &role, &args, true)?
    };
    state.pids[i].1 = d.pid;
    if let Some(s) = state.starts.get_mut(i) {
        *s = proc_start_time(d.pid).unwrap_or(0);
    }
    if role == "agent" {
        if let (Some(nbd), Some(path)) = (d.field("nbd"), state.uri.strip_prefix("nbd://")) {
            let export = path.split_once('/').map_or("", |(_, e)| e);
            state.uri = format!("nbd://{nbd}/{export}");
        }
    }
    Ok(d.pid)
}

/// How long a restarted controller waits for its old address to be free.
const REBIND_WAIT: Duration = Duration::from_secs(5);

/// Sets the value of `--listen` in `args` to `addr` (adds the flag when it is missing).
fn set_listen(args: &mut Vec<String>, addr: &str) {
    match args.iter().position(|a| a == "--listen") {
        Some(p) if p + 1 < args.len() => args[p + 1] = addr.to_string(),
        _ => args.extend(["--listen".to_string(), addr.to_string()]),
    }
}

/// Starts a detached daemon that must listen on `addr`: while the address is in use (a
/// process that has not quite exited yet), tries again for [`REBIND_WAIT`], then fails
/// naming the address.
fn start_on_old_address(
    sp: &Spawner,
    dir: &Path,
    name: &str,
    role: &str,
    args: &[String],
    addr: &str,
) -> Result<Daemon> {
    let deadline = Instant::now() + REBIND_WAIT;
    loop {
        match Daemon::start(sp, dir, name, role, args, true) {
            Ok(d) => return Ok(d),
            Err(e) if format!("{e:#}").contains("in use") => {
                if Instant::now() > deadline {
                    bail!(
                        "{name} cannot listen on its address {addr} again: it is still in use after {} s \
                         (another process holds it; `ss -ltnp` shows which):\n{e:#}",
                        REBIND_WAIT.as_secs()
                    );
                }
                tracing::debug!(%addr, "{name}'s address is still in use; trying again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Stops a detached cluster's processes (agent first, controller last); a pid that is no
/// longer the daemon it was is left alone.
pub fn cluster_down(state: &ClusterState) {
    for (i, (name, pid)) in state.pids.iter().enumerate() {
        match daemon_alive(state, i) {
            Alive::Yes => {}
            Alive::Gone => {
                eprintln!("{name} (pid {pid}) is not running");
                continue;
            }
            Alive::Other => {
                eprintln!("{name}: pid {pid} is another process now; not signalled");
                continue;
            }
        }
        signal(*pid, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        // a zombie (stopped, not yet reaped by its parent) counts as stopped
        while daemon_alive(state, i) == Alive::Yes {
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
    while t.elapsed().as_secs_f64() < duration && !crate::procs::stopping() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let lba = (x >> 33) % blocks;
        ops += 1;
        let s = Instant::now();
        cl.write(lba * 4096, &block(lba, ops), false)?;
        h.record(s.elapsed().as_nanos() as u64).ok();
        written.insert(lba, ops);
    }
    let secs = t.elapsed().as_secs_f64();
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
        ..Default::default()
    };
    if crate::procs::stopping() {
        r.incomplete = true;
        r.note = Some("interrupted: stopped early, not verified".into());
        r.latencies(&h);
        r.rates();
        return Ok(vec![r]);
    }
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
    r.verified = ok;
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
