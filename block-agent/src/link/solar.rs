//! The Solar link: a Solar client endpoint ([`SolarAgent`]) on a netstack context's data core.
//! The links of one process toward storage nodes share a context per local address and path
//! count, so one engine core carries all of them, with the stack's batching (GSO,
//! `sendmmsg`/`recvmmsg`) and polling; each path is one of the core's source ports (its own
//! ECMP flow). Read blocks are placed into the request's buffer by the core as they arrive.

use super::{Carrier, LinkConfig, LinkError, LinkStatus, Target};
use netstack::cc::CcParams;
use netstack::verbs::solar::{SolarAgent, SolarError};
use netstack::verbs::{Context, ContextConfig, Drive, PollMode};
use parking_lot::Mutex;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Weak};
use tokio::sync::oneshot;

/// A context shared by the links that use it; dropped with the last of them.
struct Shared(Context);

/// The contexts of this process by (local address, paths).
static CONTEXTS: Mutex<Vec<(Ipv4Addr, u16, Weak<Shared>)>> = Mutex::new(Vec::new());

/// A Solar link; dropping it closes its client (requests in flight fail).
pub(super) struct SolarLink {
    agent: SolarAgent,
    _ctx: Arc<Shared>,
}

/// The local address the host routes toward `server` from (no packet is sent).
fn local_toward(server: SocketAddrV4) -> std::io::Result<Ipv4Addr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
    s.connect(server)?;
    match s.local_addr()? {
        SocketAddr::V4(a) => Ok(*a.ip()),
        SocketAddr::V6(_) => Err(std::io::Error::other("no IPv4 route")),
    }
}

fn v4(server: SocketAddr) -> Result<SocketAddrV4, LinkError> {
    match server {
        SocketAddr::V4(a) => Ok(a),
        SocketAddr::V6(_) => Err(LinkError::Setup(server, "Solar runs over IPv4 only".into())),
    }
}

impl SolarLink {
    /// Opens the link's client on a shared context (a new one if none fits).
    pub(super) fn start(cfg: LinkConfig) -> Result<SolarLink, LinkError> {
        let server = v4(cfg.server)?;
        let setup = |what: &str, e: &dyn std::fmt::Display| LinkError::Setup(cfg.server, format!("{what}: {e}"));
        let paths = match cfg.carrier {
            Carrier::Udp { paths } => paths.clamp(1, 64),
            Carrier::Tcp => 1,
        };
        let local = local_toward(server).map_err(|e| setup("route", &e))?;
        let mut ccfg = cfg.client.clone();
        ccfg.paths = paths;
        // spare source ports: a path whose port ECMP hashed onto a cut link moves to one (all
        // of a run's ports on the one link that fails is then no 2 s stall, but a few probes)
        let ports = netstack::path::with_spares(paths as usize) as u16;
        ccfg.source_ports = ports;
        let mut p = CcParams::default();
        p.swift.base_target_ns = cfg.cc_target_ns;
        p.swift.min_cwnd = cfg.cc_min_window;
        p.swift.fs_min_cwnd = p.swift.fs_min_cwnd.max(cfg.cc_min_window);
        let env = netstack::cc::host_env(&p);
        let mut pool = CONTEXTS.lock();
        pool.retain(|(_, _, w)| w.strong_count() > 0);
        // a context that has no client toward this server yet
        for (ip, n, w) in pool.iter() {
            if (*ip, *n) != (local, paths) {
                continue;
            }
            let Some(shared) = w.upgrade() else { continue };
            if let Ok(agent) = shared.0.solar_client(server, ccfg.clone(), cfg.cc.build(&env)) {
                return Ok(SolarLink { agent, _ctx: shared });
            }
        }
        // a core that spins (`--poll-mode adaptive|busy`) needs a thread of its own: a task
        // on the runtime waits in the runtime's epoll only
        let drive = match cfg.drive {
            Drive::Runtime if cfg.poll_mode != PollMode::Sleep => Drive::Threads,
            Drive::Runtime if tokio::runtime::Handle::try_current().is_err() => Drive::Threads,
            d => d,
        };
        let ctx = Context::open(ContextConfig {
            bind: SocketAddrV4::new(local, 0),
            path_ports: ports as u8,
            poll_mode: cfg.poll_mode,
            drive,
            ..ContextConfig::default()
        })
        .map_err(|e| setup("context", &e))?;
        let shared = Arc::new(Shared(ctx));
        let agent = shared
            .0
            .solar_client(server, ccfg, cfg.cc.build(&env))
            .map_err(|e| setup("client", &e))?;
        pool.push((local, paths, Arc::downgrade(&shared)));
        Ok(SolarLink { agent, _ctx: shared })
    }

    /// Writes whole blocks, or zeroes `blocks` blocks when `data` is None (header-only
    /// packets), as `version`; answered by the core once durable on the node.
    pub(super) fn write(
        &self,
        target: Target,
        data: Option<Arc<[u8]>>,
        blocks: u16,
        fua: bool,
        version: u64,
    ) -> oneshot::Receiver<Result<(), SolarError>> {
        self.agent.write_versioned(target, data, blocks, fua, version)
    }

    /// Reads blocks, each checked against its stored CRC.
    pub(super) fn read(&self, target: Target, blocks: u16) -> oneshot::Receiver<Result<Vec<u8>, SolarError>> {
        self.agent.read_at(target, blocks)
    }

    /// Follows the storage node to `addr`.
    pub(super) fn retarget(&self, addr: SocketAddr) {
        match v4(addr) {
            Ok(a) => {
                if let Err(e) = self.agent.retarget(a) {
                    tracing::warn!("link: pointing it at {addr}: {e:#}");
                }
            }
            Err(e) => tracing::warn!("link: {e}"),
        }
    }

    /// Counters and path health (refreshed every few milliseconds by the core).
    pub(super) fn status(&self) -> LinkStatus {
        let s = self.agent.status();
        LinkStatus {
            stats: s.stats,
            paths: s.paths,
            paths_up: s.paths_up,
            path_stats: s.path_stats,
            outstanding: s.outstanding,
        }
    }
}
