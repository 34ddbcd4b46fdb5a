//! The agent: the volumes attached to this host, exported over NBD, with one [`Link`] per
//! storage node shared by every volume that has a replica there. Links are keyed by the
//! node's stable id: when the node restarts on another address the same link follows it.

use crate::link::{Carrier, Link, LinkConfig, LinkError};
use crate::nbd::server::Exports;
use crate::volume::{NodeQueries, Volume, VolumeConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// Errors of attaching a volume.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// A replica address that is not `IP:PORT`.
    #[error("replica address {0:?} is not IP:PORT")]
    Address(String),
    /// A replica's storage node id is empty.
    #[error("replica node id {0:?} is empty")]
    Node(String),
    /// The volume (its id) lists no replicas.
    #[error("volume {0} has no replicas")]
    NoReplicas(u32),
    /// The volume size is not a positive multiple of 4096 bytes.
    #[error("volume size {0} is not a positive multiple of 4096")]
    Size(u64),
    /// The export name is empty.
    #[error("export name must not be empty")]
    Name,
    /// A link to a storage node could not be set up.
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// What an agent carries volumes over.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Solar over UDP, or the plain protocol over TCP.
    pub carrier: Carrier,
    /// Link settings template (the server address is filled in per storage node).
    pub link: LinkConfig,
    /// Settings of each attached volume (timeouts, queue depth).
    pub volume: VolumeConfig,
}

impl AgentConfig {
    /// Solar over UDP with `paths` paths, or TCP.
    pub fn new(carrier: Carrier) -> AgentConfig {
        AgentConfig {
            carrier,
            link: LinkConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), carrier),
            volume: VolumeConfig::default(),
        }
    }
}

/// A replica as the agent is told of it: the storage node's id, where it serves now, and its
/// admin address ("" when not known: no allocation maps, no reconciliation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaAt {
    /// The storage node's id.
    pub node: String,
    /// Where the node serves volumes now (`IP:PORT`).
    pub addr: String,
    /// The node's admin address (`""` when not known).
    pub admin: String,
}

/// An agent's state.
pub struct Agent {
    cfg: AgentConfig,
    exports: Arc<Exports>,
    /// One link per storage node, by node id.
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// How volumes ask storage nodes' admin services (set by the control plane).
    queries: Mutex<Option<Arc<dyn NodeQueries>>>,
}

impl Agent {
    /// An agent with no volumes attached yet.
    pub fn new(cfg: AgentConfig) -> Arc<Agent> {
        let a = Arc::new(Agent {
            cfg,
            exports: Exports::new(),
            links: Mutex::new(HashMap::new()),
            queries: Mutex::new(None),
        });
        let weak: std::sync::Weak<dyn netstack::telemetry::Collect> = Arc::downgrade(&a) as _;
        netstack::telemetry::register(weak);
        a
    }

    /// Sets how volumes ask the storage nodes' admin services: allocation maps for
    /// BLOCK_STATUS, and the comparison of replicas when a volume is attached anew.
    pub fn set_node_queries(&self, q: Arc<dyn NodeQueries>) {
        *self.queries.lock() = Some(q);
    }

    /// The exports (for the NBD server).
    pub fn exports(&self) -> &Arc<Exports> {
        &self.exports
    }

    /// What this agent carries volumes over.
    pub fn carrier(&self) -> Carrier {
        self.cfg.carrier
    }

    /// The link to storage node `node`, started or pointed at `addr`.
    fn link(&self, node: &str, addr: SocketAddr) -> Result<Arc<Link>, LinkError> {
        let mut links = self.links.lock();
        if let Some(l) = links.get(node) {
            l.retarget(addr);
            return Ok(l.clone());
        }
        let mut c = self.cfg.link.clone();
        c.server = addr;
        c.carrier = self.cfg.carrier;
        let l = Arc::new(Link::start(c)?);
        links.insert(node.to_string(), l.clone());
        Ok(l)
    }

    /// Exports volume `id` of `size` bytes on `replicas` as `name`. Attaching again what is
    /// already exported changes nothing but the replicas' addresses (a node that moved) and,
    /// for a grown volume, its size (the same [`Volume`] goes on: open connections and new ones
    /// share its range locks, dirty regions and QoS; NBD has no way to tell an open connection
    /// of a new size, so a client sees it when it connects again). A different volume or
    /// replica set replaces the export, and so does a new attachment epoch (the volume was
    /// attached again: the new export fences the replicas at it before its first I/O).
    ///
    /// `write_quorum`: the volume's own (0: the agent's configuration, else a majority).
    /// `epoch`: the attachment's, from the controller (0: none, no fencing).
    pub fn attach(
        &self,
        name: &str,
        id: u32,
        size: u64,
        replicas: &[ReplicaAt],
        write_quorum: usize,
        epoch: u32,
    ) -> Result<Arc<Volume>, AttachError> {
        if name.is_empty() {
            return Err(AttachError::Name);
        }
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(AttachError::Size(size));
        }
        if replicas.is_empty() {
            return Err(AttachError::NoReplicas(id));
        }
        let mut parsed = Vec::new();
        for r in replicas {
            if r.node.is_empty() {
                return Err(AttachError::Node(r.node.clone()));
            }
            let a: SocketAddr = r.addr.parse().map_err(|_| AttachError::Address(r.addr.clone()))?;
            parsed.push((r.node.as_str(), a));
        }
        let mut links = Vec::new();
        for (node, a) in parsed {
            links.push(self.link(node, a)?);
        }
        if let Some(v) = self.exports.get(name) {
            let cur = v.replicas();
            let changed: Vec<usize> = (0..cur.len().min(links.len()))
                .filter(|&k| !Arc::ptr_eq(&cur[k], &links[k]))
                .collect();
            let same = v.id() == id
                && v.size() <= size
                && cur.len() == links.len()
                && changed.len() < cur.len()
                && v.epoch() == epoch;
            if same {
                // replicas the controller replaced: rebuilt in place from the others
                for k in changed {
                    v.replace_replica(k, links[k].clone());
                }
                if v.size() < size {
                    tracing::info!("export {name:?}: volume {id} grew from {} to {size} bytes", v.size());
                    v.grow(size);
                }
                if let Some(q) = self.queries.lock().clone() {
                    v.set_admins(replicas.iter().map(|r| r.admin.clone()).collect(), q);
                }
                v.set_write_quorum(write_quorum);
                return Ok(v);
            }
        }
        let v = Volume::attached(id, size, links, self.cfg.volume.clone(), epoch);
        v.set_write_quorum(write_quorum);
        if let Some(q) = self.queries.lock().clone() {
            v.set_admins(replicas.iter().map(|r| r.admin.clone()).collect(), q);
            // before it is exported: no read reaches a replica not yet compared
            v.start_reconcile();
        }
        self.exports.insert(name, v.clone());
        tracing::info!(
            "attached volume {id} ({size} bytes, {} replicas) as export {name:?}, epoch {epoch}",
            replicas.len()
        );
        Ok(v)
    }

    /// Stops exporting `name` (open connections finish with the volume they have).
    pub fn detach(&self, name: &str) -> bool {
        self.exports.remove(name).is_some()
    }

    /// Stops exporting what the controller no longer attaches here: every export attached
    /// before `asked` (when the controller was asked for this agent's volumes) that is not in
    /// `assigned`. A volume moved to another agent while this one could not be told (`blkctl
    /// detach --force`) goes away at its next heartbeat; one attached after `asked` is newer
    /// than the answer and stays. Returns the names dropped.
    pub fn keep_only(&self, assigned: &[&str], asked: std::time::Instant) -> Vec<String> {
        let mut dropped = Vec::new();
        for name in self.exports.names() {
            let stale = self
                .exports
                .get(&name)
                .is_some_and(|v| v.attached_at() < asked && !assigned.contains(&name.as_str()));
            if stale && self.detach(&name) {
                tracing::warn!("export {name:?}: the controller attaches it elsewhere now; no longer exported here");
                dropped.push(name);
            }
        }
        dropped
    }
}

/// The agent's metrics: each storage-node link's health and Solar counters (`node` label) and
/// each exported volume's counters (`volume` label), copied once a second.
impl netstack::telemetry::Collect for Agent {
    fn collect(&self) {
        use metrics::{counter, gauge};
        let links: Vec<(String, Arc<Link>)> = self.links.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (node, l) in links {
            let st = l.status();
            let g = |name: &'static str, v: f64| gauge!(name, "node" => node.clone()).set(v);
            g("flexns_block_link_paths", st.paths as f64);
            g("flexns_block_link_paths_up", st.paths_up as f64);
            g("flexns_block_link_outstanding_requests", st.outstanding as f64);
            let c = |name: &'static str, v: u64| counter!(name, "node" => node.clone()).absolute(v);
            c("flexns_solar_blocks_sent_total", st.stats.blocks_sent);
            c("flexns_solar_blocks_resent_total", st.stats.blocks_resent);
            c("flexns_solar_timeouts_total", st.stats.timeouts);
            c("flexns_solar_crc_errors_total", st.stats.crc_errors);
            c("flexns_solar_path_downs_total", st.stats.path_downs);
            // accepted write blocks asked again: their deadline passed, or a later block's Ok
            // overtook them
            let by_order = st.stats.durable_resends_by_order;
            for (trigger, v) in [("deadline", st.stats.durable_resends - by_order), ("order", by_order)] {
                counter!("flexns_solar_durable_resends_total", "node" => node.clone(), "trigger" => trigger)
                    .absolute(v);
            }
        }
        for name in self.exports.names() {
            let Some(v) = self.exports.get(&name) else { continue };
            let k = v.counters();
            let c = |metric: &'static str, a: &std::sync::atomic::AtomicU64| {
                counter!(metric, "volume" => name.clone()).absolute(a.load(std::sync::atomic::Ordering::Relaxed))
            };
            c("flexns_volume_read_failovers_total", &k.read_failovers);
            c("flexns_volume_repairs_total", &k.repairs);
            c("flexns_volume_repair_failures_total", &k.repair_failures);
            c("flexns_volume_degraded_writes_total", &k.degraded_writes);
            c("flexns_volume_replica_downs_total", &k.replica_downs);
            c("flexns_volume_resynced_regions_total", &k.resynced_regions);
            c("flexns_volume_reconciled_blocks_total", &k.reconciled_blocks);
            for (i, n) in v.replica_write_failures().into_iter().enumerate() {
                counter!("flexns_volume_replica_write_failures_total", "volume" => name.clone(), "replica" => i.to_string())
                    .absolute(n);
            }
            let (_, throttled, waited) = v.qos();
            counter!("flexns_volume_qos_throttled_total", "volume" => name.clone()).absolute(throttled);
            counter!("flexns_volume_qos_throttled_microseconds_total", "volume" => name.clone())
                .absolute(waited.as_micros() as u64);
            let behind: usize = v.replica_states().iter().map(|&(_, n)| n).sum();
            gauge!("flexns_volume_regions_behind", "volume" => name.clone()).set(behind as f64);
            gauge!("flexns_volume_size_bytes", "volume" => name.clone()).set(v.size() as f64);
            gauge!("flexns_volume_replicas", "volume" => name.clone()).set(v.replicas().len() as f64);
        }
    }
}
