//! The controller service: volumes, replica placement, storage-node identity and liveness,
//! attachments.
//!
//! - Storage nodes are known by the id kept in their data directories. A node registers at
//!   start and every heartbeat with its current addresses and the volumes it holds; the
//!   controller records where it serves now and tells the agents of its volumes when that
//!   changed, so a node restarted on another port serves its replicas again with no operator.
//!   A node not heard from within the node timeout is `down` (shown as such, never placed on);
//!   a heartbeat of a process that a newer start of the same node id replaced is refused.
//! - Placement puts a volume's replicas on distinct storage nodes that are up, the least
//!   loaded first.
//! - A volume is attached to at most one agent (NBD has no reservations; a second writer would
//!   corrupt a file system). Agents register at start and every heartbeat; the reply lists
//!   their volumes with the replicas' current addresses, so an agent that restarted exports them
//!   again, and one that missed a node's move catches up.

use super::pb;
use super::pb::agent_admin_client::AgentAdminClient;
use super::pb::storage_node_admin_client::StorageNodeAdminClient;
use super::state::{
    AgentRecord, ControlState, MetaError, MetaStore, NodeRecord, ParentRecord, SnapshotRecord, VolumeRecord,
};
use crate::storage_node::is_node_id;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// Settings of a controller.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// A storage node not heard from in this long is down.
    pub node_timeout: Duration,
    /// A replica whose node has been silent this long is replaced on another node (None:
    /// never).
    pub replace_after: Option<Duration>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            node_timeout: Duration::from_secs(3),
            replace_after: Some(Duration::from_secs(60)),
        }
    }
}

/// What the controller knows of a running storage node (not stored: heartbeats rebuild it).
struct Live {
    incarnation: u64,
    last_seen: Instant,
    volumes: Vec<u32>,
    /// Whether its going down was logged.
    down_logged: bool,
    /// Its live registration left etcd (it stopped, or died and its lease expired): down
    /// without waiting for the heartbeat timeout.
    left_etcd: bool,
}

/// The controller service.
pub struct Controller {
    state: tokio::sync::Mutex<ControlState>,
    meta: MetaStore,
    cfg: ControllerConfig,
    live: parking_lot::Mutex<HashMap<String, Live>>,
    started: Instant,
}

fn meta_status(e: MetaError) -> Status {
    Status::unavailable(format!("metadata store: {e}"))
}

fn http(addr: &str) -> String {
    if addr.starts_with("http://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

pub(crate) async fn node_client(admin: &str) -> Result<StorageNodeAdminClient<tonic::transport::Channel>, Status> {
    StorageNodeAdminClient::connect(http(admin))
        .await
        .map_err(|e| Status::unavailable(format!("storage node admin {admin}: {e}")))
}

async fn agent_client(admin: &str) -> Result<AgentAdminClient<tonic::transport::Channel>, Status> {
    AgentAdminClient::connect(http(admin))
        .await
        .map_err(|e| Status::unavailable(format!("agent admin {admin}: {e}")))
}

/// Volume and snapshot names: what a URI path and a file name can hold.
fn check_name(what: &str, n: &str) -> Result<(), Status> {
    if n.is_empty() || n.len() > 64 || !n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(Status::invalid_argument(format!(
            "{what} name {n:?}: 1 to 64 characters of A-Z a-z 0-9 - _ ."
        )));
    }
    Ok(())
}

/// Takes snapshot `snapshot` of volume `volume` on the storage nodes at `admins`, all at once;
/// when one fails, the others' are deleted again and the error names that node.
pub(crate) async fn snapshot_on_nodes(admins: &[String], volume: u32, snapshot: u32) -> Result<(), Status> {
    let req = pb::SnapshotRequest { volume, snapshot };
    let take = admins.iter().map(|a| async move {
        let r = async { node_client(a).await?.create_snapshot(req).await }.await;
        (
            a,
            r.map_err(|e| Status::new(e.code(), format!("storage node {a}: {}", e.message()))),
        )
    });
    let results = futures_util::future::join_all(take).await;
    let Some(err) = results.iter().find_map(|(_, r)| r.as_ref().err()).cloned() else {
        return Ok(());
    };
    for (a, _) in results.iter().filter(|(_, r)| r.is_ok()) {
        if let Ok(mut c) = node_client(a).await {
            if let Err(e) = c.delete_snapshot(req).await {
                tracing::warn!("undoing snapshot {snapshot} of volume {volume} on {a}: {}", e.message());
            }
        }
    }
    Err(err)
}

/// Makes volume `id` on each of `nodes` with `make` (a create or a clone call). When one
/// fails, the volume is deleted again where it was made and the error names the node.
async fn make_on_nodes<F, Fut>(s: &ControlState, nodes: &[String], id: u32, what: &str, make: F) -> Result<(), Status>
where
    F: Fn(StorageNodeAdminClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<Response<pb::Empty>, Status>>,
{
    let mut made: Vec<String> = Vec::new();
    for n in nodes {
        let admin = node_admin(s, n)?;
        let res = async { make(node_client(&admin).await?).await }.await;
        if let Err(e) = res {
            for a in &made {
                if let Ok(mut cl) = node_client(a).await {
                    let _ = cl.delete_volume(pb::DeleteVolumeRequest { id }).await;
                }
            }
            return Err(Status::new(
                e.code(),
                format!("{what} on storage node {n}: {}", e.message()),
            ));
        }
        made.push(admin);
    }
    Ok(())
}

/// A snapshot as the services see it.
fn snapshot_info(s: &ControlState, volume: &str, r: &SnapshotRecord) -> pb::SnapshotInfo {
    pb::SnapshotInfo {
        name: r.name.clone(),
        id: r.id,
        size: r.size,
        created_unix: r.created_unix,
        clones: clones_of(s, volume, Some(&r.name)),
        volume: volume.to_string(),
    }
}

/// The volumes made from `volume`'s snapshots (from snapshot `snapshot` only, when given).
fn clones_of(s: &ControlState, volume: &str, snapshot: Option<&str>) -> Vec<String> {
    s.volumes
        .iter()
        .filter(|(_, v)| {
            v.parent
                .as_ref()
                .is_some_and(|p| p.volume == volume && snapshot.is_none_or(|x| x == p.snapshot))
        })
        .map(|(k, _)| k.clone())
        .collect()
}

/// A recorded volume, or NOT_FOUND naming it.
/// QoS limits on the wire.
pub(super) fn qos_pb(q: &crate::qos::QosLimits) -> pb::Qos {
    pb::Qos {
        iops: q.iops,
        bytes_per_sec: q.bytes_per_sec,
        burst_ms: q.burst_ms,
    }
}

/// QoS limits from the wire.
pub(super) fn qos_limits(q: &pb::Qos) -> crate::qos::QosLimits {
    crate::qos::QosLimits {
        iops: q.iops,
        bytes_per_sec: q.bytes_per_sec,
        burst_ms: q.burst_ms,
    }
}

fn volume<'a>(s: &'a ControlState, name: &str) -> Result<&'a VolumeRecord, Status> {
    s.volumes
        .get(name)
        .ok_or_else(|| Status::not_found(format!("no volume {name:?}")))
}

impl Controller {
    /// Applies `change` to a copy of the state, stores it, and only then makes it the state: a
    /// failed store leaves the controller as it was.
    async fn commit(&self, s: &mut ControlState, change: impl FnOnce(&mut ControlState)) -> Result<(), Status> {
        let mut n = s.clone();
        change(&mut n);
        self.store(s, n).await
    }

    /// Stores `n` and makes it the state. When another controller changed the stored state
    /// since this one read it, nothing is written: the stored state is read again (so the next
    /// request sees the other's changes) and the caller gets ABORTED, to retry.
    async fn store(&self, s: &mut ControlState, n: ControlState) -> Result<(), Status> {
        match self.meta.save(&n).await {
            Ok(()) => {
                *s = n;
                Ok(())
            }
            Err(e @ MetaError::Conflict(_)) => {
                tracing::warn!("{e}; reading it again");
                match self.meta.load().await {
                    Ok(fresh) => *s = fresh,
                    Err(l) => return Err(meta_status(l)),
                }
                Err(Status::aborted(format!("{e}; the controller has read it again: retry")))
            }
            Err(e) => Err(meta_status(e)),
        }
    }

    /// A controller with the state `meta` holds.
    pub async fn new(meta: MetaStore, cfg: ControllerConfig) -> Result<Controller, MetaError> {
        let state = meta.load().await?;
        Ok(Controller {
            state: tokio::sync::Mutex::new(state),
            meta,
            cfg,
            live: parking_lot::Mutex::new(HashMap::new()),
            started: Instant::now(),
        })
    }

    /// `up`, `down`, or `unknown` (not heard from since this controller started, which was
    /// less than a node timeout ago).
    fn node_state(&self, live: &HashMap<String, Live>, id: &str) -> &'static str {
        match live.get(id) {
            Some(l) if l.left_etcd => "down",
            Some(l) if l.last_seen.elapsed() <= self.cfg.node_timeout => "up",
            Some(_) => "down",
            None if self.started.elapsed() <= self.cfg.node_timeout => "unknown",
            None => "down",
        }
    }

    /// A volume as the services see it: replicas with their nodes' current addresses and
    /// states (`missing`: the node is up and does not hold it; `unregistered`: an entry of a
    /// version-1 state that no node has claimed yet).
    fn spec(&self, name: &str, v: &VolumeRecord, s: &ControlState) -> pb::VolumeSpec {
        let live = self.live.lock();
        let replicas = v
            .replicas
            .iter()
            .map(|r| match s.nodes.get(r) {
                Some(n) => {
                    let mut state = self.node_state(&live, r);
                    if state == "up" && live.get(r).is_some_and(|l| !l.volumes.contains(&v.id)) {
                        state = "missing";
                    }
                    pb::Replica {
                        node: r.clone(),
                        addr: n.data.clone(),
                        state: state.into(),
                        admin: n.admin.clone(),
                    }
                }
                None => pb::Replica {
                    node: String::new(),
                    addr: r.clone(),
                    state: "unregistered".into(),
                    admin: String::new(),
                },
            })
            .collect();
        pb::VolumeSpec {
            id: v.id,
            name: name.to_string(),
            size: v.size,
            replicas,
            agent: v.agent.clone().unwrap_or_default(),
            export_name: v
                .agent
                .as_ref()
                .and_then(|a| s.agents.get(a))
                .map(|_| name.to_string())
                .unwrap_or_default(),
            export: None,
            qos: Some(qos_pb(&v.qos)),
            parent: v
                .parent
                .as_ref()
                .map(|p| format!("{}@{}", p.volume, p.snapshot))
                .unwrap_or_default(),
            write_quorum: v.write_quorum,
            epoch: v.epoch,
        }
    }

    async fn attach_at(&self, s: &ControlState, name: &str, agent: &str) -> Result<String, Status> {
        let v = volume(s, name)?;
        let a = s
            .agents
            .get(agent)
            .ok_or_else(|| Status::not_found(format!("no agent {agent:?} is registered")))?;
        let mut sp = self.spec(name, v, s);
        sp.export_name = name.to_string();
        if let Some(r) = sp.replicas.iter().find(|r| r.node.is_empty()) {
            return Err(Status::failed_precondition(format!(
                "volume {name:?}: replica {} has not registered since the upgrade to node ids; start its storage node",
                r.addr
            )));
        }
        agent_client(&a.admin)
            .await?
            .attach(pb::AttachRequest { volume: Some(sp) })
            .await?;
        Ok(format!("nbd://{}/{}", a.nbd, name))
    }

    /// Tells the agents of the volumes on storage node `node` where it serves now (in the
    /// background: a registration does not wait on agents; their heartbeats catch up anyway).
    fn tell_agents(self: &Arc<Self>, s: &ControlState, node: &str) {
        let mine: Vec<(String, String)> = s
            .volumes
            .iter()
            .filter(|(_, v)| v.replicas.iter().any(|r| r == node))
            .filter_map(|(k, v)| Some((k.clone(), v.agent.clone()?)))
            .collect();
        if mine.is_empty() {
            return;
        }
        let (me, snapshot) = (self.clone(), s.clone());
        tokio::spawn(async move {
            for (name, agent) in mine {
                if let Err(e) = me.attach_at(&snapshot, &name, &agent).await {
                    tracing::warn!("telling agent {agent} about {name}: {}", e.message());
                }
            }
        });
    }

    /// Notes that `nodes` hold volume `id` now (their next heartbeat says so too).
    fn note_holds(&self, nodes: &[String], id: u32) {
        let mut live = self.live.lock();
        for n in nodes {
            if let Some(l) = live.get_mut(n) {
                l.volumes.push(id);
            }
        }
    }

    /// How long storage node `id` has been silent (None: it is not down).
    fn silent_for(&self, live: &HashMap<String, Live>, id: &str) -> Option<Duration> {
        if self.node_state(live, id) != "down" {
            return None;
        }
        Some(live.get(id).map_or(self.started.elapsed(), |l| l.last_seen.elapsed()))
    }

    /// Replaces each replica whose node has been silent past `replace_after` by a new, empty
    /// volume on the least loaded node that is up and holds none of the volume's replicas,
    /// records it, and tells the volume's agent, which rebuilds it from the other replicas in
    /// the background. A volume with snapshots gets them first: the new node copies each from
    /// a replica that is up, oldest first (`CopySnapshots`), before the agent rebuilds the
    /// live blocks. A clone's replica goes to the node its parent's replica of the same index
    /// moved to (parents are moved first), made there as a fresh clone of the parent's
    /// snapshot, with the clone's own snapshots copied into it (`CopySnapshots` as a clone:
    /// only the blocks the clone wrote). A volume with no node to move to waits for one.
    ///
    /// The control state is locked to choose each move and to record it, not while the new
    /// replica is made: a copy of large snapshots does not hold up the other control calls.
    /// A move whose volume changed in between (deleted, snapshotted, its replica moved) is
    /// dropped, its new copy deleted, and chosen again at the next pass.
    async fn replace_down_replicas(self: &Arc<Self>, after: Duration) {
        // (volume, replica index, its silent node, seconds silent), and the nodes that are up
        type Todo = Vec<(String, usize, String, u64)>;
        let (mut todo, up): (Todo, Vec<String>) = {
            let s = self.state.lock().await;
            let live = self.live.lock();
            let mut todo: Todo = s
                .volumes
                .iter()
                .flat_map(|(name, v)| {
                    v.replicas.iter().enumerate().filter_map(|(k, r)| {
                        let silent = self.silent_for(&live, r)?;
                        (silent >= after && s.nodes.contains_key(r))
                            .then(|| (name.clone(), k, r.clone(), silent.as_secs()))
                    })
                })
                .collect();
            // parents first: a clone's replica k goes where its parent's replica k went
            todo.sort_by_key(|(name, ..)| s.volumes.get(name).is_some_and(|v| v.parent.is_some()));
            let up = s
                .nodes
                .keys()
                .filter(|n| self.node_state(&live, n) == "up")
                .cloned()
                .collect();
            (todo, up)
        };
        for (name, k, old, silent) in todo.drain(..) {
            let Some(m) = self.plan_move(&name, k, &old, &up).await else {
                tracing::debug!(
                    "volume {name}: replica on {old} silent for {silent} s; no node is up to take it \
                     (a clone waits for its parent's replica to move)"
                );
                continue;
            };
            let made = m.make().await;
            match made {
                Ok(_) => {}
                // an old copy of it (a replica replaced before): the agent rewrites all of it
                Err(e) if e.code() == tonic::Code::AlreadyExists => {
                    if let Ok(mut c) = node_client(&m.admin).await {
                        let _ = c
                            .resize_volume(pb::ResizeVolumeRequest {
                                id: m.v.id,
                                size: m.v.size,
                            })
                            .await;
                    }
                }
                Err(e) => {
                    tracing::warn!("volume {name}: creating a replica on {}: {}", m.new, e.message());
                    continue;
                }
            }
            let mut s = self.state.lock().await;
            // what was copied must still be what the volume is
            let now = s.volumes.get(&name);
            let same = now.is_some_and(|cur| {
                cur.id == m.v.id
                    && cur.replicas.get(k) == Some(&old)
                    && cur.snapshots == m.v.snapshots
                    && cur.parent == m.v.parent
            });
            if !same {
                let holds = now.is_some_and(|cur| cur.id == m.v.id && cur.replicas.contains(&m.new));
                drop(s);
                tracing::warn!(
                    "volume {name}: changed while its new replica on {} was made; made again at the next pass",
                    m.new
                );
                if !holds {
                    if let Ok(mut c) = node_client(&m.admin).await {
                        let _ = c.delete_volume(pb::DeleteVolumeRequest { id: m.v.id }).await;
                    }
                }
                continue;
            }
            let new = m.new.clone();
            let r = self
                .commit(&mut s, |n| {
                    n.volumes.get_mut(&name).expect("checked above").replicas[k] = new.clone();
                })
                .await;
            if let Err(e) = r {
                tracing::warn!("volume {name}: recording its new replica: {}", e.message());
                continue;
            }
            self.note_holds(std::slice::from_ref(&new), m.v.id);
            tracing::warn!(
                "volume {name}: replica {k} on storage node {old} silent for {silent} s: replaced by a new one on {new}, \
                 rebuilt from the others by the agent"
            );
            if let Some(a) = m.v.agent.clone() {
                if let Err(e) = self.attach_at(&s, &name, &a).await {
                    tracing::warn!("telling agent {a} about {name}'s new replica: {}", e.message());
                }
            }
        }
    }

    /// Chooses where replica `k` of volume `name`, on the silent node `old`, moves (see
    /// [`Controller::replace_down_replicas`]); `None` when no node can take it now.
    async fn plan_move(&self, name: &str, k: usize, old: &str, up: &[String]) -> Option<Move> {
        let s = self.state.lock().await;
        let v = s.volumes.get(name)?.clone();
        if v.replicas.get(k).map(String::as_str) != Some(old) {
            return None;
        }
        // a clone reads through to its parent's snapshot on the same node
        let base = v.parent.as_ref().and_then(|p| {
            let pv = s.volumes.get(&p.volume)?;
            let snap = pv.snapshots.iter().find(|x| x.name == p.snapshot)?;
            Some((pv.id, snap.id, pv.replicas.get(k)?.clone()))
        });
        let new = match &base {
            Some((_, _, at)) if at != old && up.contains(at) && !v.replicas.contains(at) => at.clone(),
            Some(_) => return None,
            None if v.parent.is_some() => return None,
            None => {
                let mut load: Vec<(usize, String)> = up
                    .iter()
                    .filter(|n| !v.replicas.contains(n))
                    .map(|n| (s.volumes.values().filter(|x| x.replicas.contains(n)).count(), n.clone()))
                    .collect();
                load.sort();
                load.into_iter().next()?.1
            }
        };
        // where the snapshots come from: a replica on a node that is up
        let source = v
            .replicas
            .iter()
            .find(|r| r.as_str() != old && up.contains(r))
            .map(|r| s.nodes[r].admin.clone());
        Some(Move {
            admin: s.nodes.get(&new)?.admin.clone(),
            new,
            base: base.map(|(parent, snapshot, _)| (parent, snapshot)),
            source,
            v,
        })
    }

    /// Logs storage nodes going down (a node's state is derived when asked; this only says so
    /// when it happens) and replaces replicas on nodes silent past `replace_after`. Runs
    /// until the runtime stops.
    pub async fn watch(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.cfg.node_timeout / 4);
        loop {
            tick.tick().await;
            if let Some(after) = self.cfg.replace_after {
                self.replace_down_replicas(after).await;
            }
            let s = self.state.lock().await;
            let mut live = self.live.lock();
            for (id, l) in live.iter_mut() {
                let down = l.last_seen.elapsed() > self.cfg.node_timeout;
                if down && !l.down_logged {
                    let at = s.nodes.get(id).map_or("?", |n| n.data.as_str());
                    tracing::warn!(
                        "storage node {id} (at {at}) is down: no heartbeat for {:?}",
                        l.last_seen.elapsed()
                    );
                }
                l.down_logged = down;
            }
        }
    }

    /// Follows the storage nodes' live registrations in etcd (`PREFIX/block/live/nodes/ID`,
    /// under each node's lease): a node whose key leaves is down at once, without waiting for
    /// the heartbeat timeout; one whose key comes back is up again at its next heartbeat. Runs
    /// until the runtime stops.
    pub async fn follow_live(self: Arc<Self>, view: etcd_lite::PrefixView) {
        let mut rx = view.receiver();
        drop(view);
        let mut before = std::collections::BTreeSet::new();
        loop {
            let snap = rx.borrow_and_update().clone();
            if snap.synced {
                let now: std::collections::BTreeSet<String> = snap
                    .entries
                    .keys()
                    .filter_map(|k| String::from_utf8_lossy(k).rsplit('/').next().map(str::to_string))
                    .collect();
                let mut live = self.live.lock();
                for id in before.difference(&now) {
                    if let Some(l) = live.get_mut(id) {
                        tracing::warn!("storage node {id} left etcd (it stopped, or died and its lease expired): down");
                        l.left_etcd = true;
                    }
                }
                for id in now.difference(&before) {
                    if let Some(l) = live.get_mut(id) {
                        l.left_etcd = false;
                    }
                }
                before = now;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Handles a storage node's registration or heartbeat.
    pub async fn node_heartbeat(self: &Arc<Self>, r: pb::RegisterNodeRequest) -> Result<(), Status> {
        if !is_node_id(&r.node_id) {
            return Err(Status::invalid_argument(format!(
                "node id {:?} is not sn- and 16 hex digits",
                r.node_id
            )));
        }
        for (what, a) in [("node", &r.addr), ("admin", &r.admin)] {
            a.parse::<std::net::SocketAddr>()
                .map_err(|_| Status::invalid_argument(format!("{what} address {a:?} is not IP:PORT")))?;
        }
        let id = r.node_id.clone();
        // registrations take turns on the state, and the incarnation is checked in this one's
        // turn: checked before it, a heartbeat of the process a new one replaces could pass,
        // wait behind the new one's first registration and then put its own incarnation back,
        // so the new process would be the one refused
        let mut s = self.state.lock().await;
        {
            let live = self.live.lock();
            if let Some(l) = live.get(&id) {
                if l.incarnation != r.incarnation && !r.first {
                    return Err(Status::failed_precondition(format!(
                        "storage node {id}: superseded: another process started with this node id (the same data directory) and serves it now"
                    )));
                }
            }
        }
        let rec = NodeRecord {
            data: r.addr.clone(),
            admin: r.admin.clone(),
        };
        let before = s.nodes.get(&id).cloned();
        let mut n = s.clone();
        n.nodes.insert(id.clone(), rec);
        let claimed = n.claim_legacy(&id, &r.addr, &r.volumes);
        if n != *s {
            self.store(&mut s, n).await?;
        }
        let restarted = {
            let mut live = self.live.lock();
            // a process whose registration left etcd stays down until it registers there again
            let left_etcd = live
                .get(&id)
                .is_some_and(|p| p.incarnation == r.incarnation && p.left_etcd);
            let prev = live.insert(
                id.clone(),
                Live {
                    incarnation: r.incarnation,
                    last_seen: Instant::now(),
                    volumes: r.volumes.clone(),
                    down_logged: false,
                    left_etcd,
                },
            );
            prev.is_none_or(|p| p.incarnation != r.incarnation || p.down_logged)
        };
        let moved = before.as_ref().is_some_and(|b| b.data != r.addr);
        if restarted || moved || before.is_none() {
            match &before {
                Some(b) if moved => tracing::info!("storage node {id} registered at {} (was {})", r.addr, b.data),
                _ => tracing::info!("storage node {id} registered at {}", r.addr),
            }
            for (name, v) in &s.volumes {
                if v.replicas.contains(&id) && !r.volumes.contains(&v.id) {
                    tracing::warn!(
                        "storage node {id} does not hold volume {name} (id {}), a replica of which it should",
                        v.id
                    );
                }
            }
            // copies of volumes whose replica on this node was replaced while it was away
            let stale: Vec<(String, u32)> = s
                .volumes
                .iter()
                .filter(|(_, v)| r.volumes.contains(&v.id) && !v.replicas.contains(&id))
                .filter(|(_, v)| v.replicas.iter().all(|x| is_node_id(x)))
                .map(|(name, v)| (name.clone(), v.id))
                .collect();
            if !stale.is_empty() {
                let (admin, id) = (r.admin.clone(), id.clone());
                tokio::spawn(async move {
                    for (name, vid) in stale {
                        tracing::warn!(
                            "storage node {id} holds a stale copy of volume {name} (id {vid}), whose replica there was \
                             replaced while it was away: deleting it"
                        );
                        let del = async {
                            node_client(&admin)
                                .await?
                                .delete_volume(pb::DeleteVolumeRequest { id: vid })
                                .await
                        };
                        if let Err(e) = del.await {
                            tracing::warn!("deleting the stale copy of {name} on {id}: {}", e.message());
                        }
                    }
                });
            }
        }
        if moved || !claimed.is_empty() {
            self.tell_agents(&s, &id);
        }
        Ok(())
    }
}

/// The gRPC face of a shared controller (heartbeats spawn work that outlives a call).
/// The controller's metrics: volumes, agents, and storage nodes by state (`up`, `down`,
/// `unknown`), refreshed once a second (a round is skipped while a request holds the state).
impl netstack::telemetry::Collect for Controller {
    fn collect(&self) {
        let Ok(st) = self.state.try_lock() else { return };
        let ids: Vec<String> = st.nodes.keys().cloned().collect();
        metrics::gauge!("flexns_control_volumes").set(st.volumes.len() as f64);
        metrics::gauge!("flexns_control_agents").set(st.agents.len() as f64);
        drop(st);
        let live = self.live.lock();
        let mut by = [("up", 0u32), ("down", 0), ("unknown", 0)];
        for id in &ids {
            let s = self.node_state(&live, id);
            if let Some(e) = by.iter_mut().find(|(k, _)| *k == s) {
                e.1 += 1;
            }
        }
        for (state, n) in by {
            metrics::gauge!("flexns_control_storage_nodes", "state" => state).set(n as f64);
        }
    }
}

/// The controller as the `BlockControl` gRPC service.
pub struct ControllerService(pub Arc<Controller>);

#[tonic::async_trait]
impl pb::block_control_server::BlockControl for ControllerService {
    async fn register_node(&self, r: Request<pb::RegisterNodeRequest>) -> Result<Response<pb::Empty>, Status> {
        self.0.node_heartbeat(r.into_inner()).await?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn register_agent(
        &self,
        r: Request<pb::RegisterAgentRequest>,
    ) -> Result<Response<pb::RegisterAgentReply>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        if r.name.is_empty() {
            return Err(Status::invalid_argument("agent name is empty"));
        }
        let mut s = c.state.lock().await;
        let rec = AgentRecord {
            admin: r.admin,
            nbd: r.nbd,
        };
        if s.agents.get(&r.name) != Some(&rec) {
            c.commit(&mut s, |n| {
                n.agents.insert(r.name.clone(), rec);
            })
            .await?;
            tracing::info!("agent {} registered", r.name);
        }
        if r.first {
            // a new process of this agent: a new attachment of its volumes, at a higher epoch
            // (its versions start above the last process's, and that process is fenced out)
            let mine: Vec<String> = s
                .volumes
                .iter()
                .filter(|(_, v)| v.agent.as_deref() == Some(r.name.as_str()))
                .map(|(k, _)| k.clone())
                .collect();
            if !mine.is_empty() {
                c.commit(&mut s, |n| {
                    for k in &mine {
                        let v = n.volumes.get_mut(k).expect("listed above");
                        v.epoch = v.epoch.saturating_add(1);
                    }
                })
                .await?;
                tracing::info!("agent {} started: epochs raised for {}", r.name, mine.join(", "));
            }
        }
        // what belongs to it, with the replicas' current addresses (claimed replicas only)
        let volumes = s
            .volumes
            .iter()
            .filter(|(_, v)| v.agent.as_deref() == Some(r.name.as_str()))
            .map(|(k, v)| {
                let mut sp = c.spec(k, v, &s);
                sp.export_name = k.clone();
                sp
            })
            .filter(|sp| sp.replicas.iter().all(|x| !x.node.is_empty()))
            .collect();
        Ok(Response::new(pb::RegisterAgentReply { volumes }))
    }

    async fn create(&self, r: Request<pb::CreateRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        check_name("volume", &r.name)?;
        if r.size == 0 || !r.size.is_multiple_of(4096) {
            return Err(Status::invalid_argument(format!(
                "size {} is not a positive multiple of 4096",
                r.size
            )));
        }
        let want = r.replicas.max(1) as usize;
        if r.write_quorum as usize > want {
            return Err(Status::invalid_argument(format!(
                "write quorum {} is more than the {want} replicas",
                r.write_quorum
            )));
        }
        let mut s = c.state.lock().await;
        if s.volumes.contains_key(&r.name) {
            return Err(Status::already_exists(format!("volume {:?} exists", r.name)));
        }
        let up: Vec<String> = {
            let live = c.live.lock();
            s.nodes
                .keys()
                .filter(|n| c.node_state(&live, n) == "up")
                .cloned()
                .collect()
        };
        if up.len() < want {
            return Err(Status::failed_precondition(format!(
                "{want} replicas need {want} storage nodes; {} are up ({} registered)",
                up.len(),
                s.nodes.len()
            )));
        }
        // least loaded nodes first
        let mut load: Vec<(usize, String)> = up
            .into_iter()
            .map(|n| (s.volumes.values().filter(|v| v.replicas.contains(&n)).count(), n))
            .collect();
        load.sort();
        let chosen: Vec<String> = load.into_iter().take(want).map(|(_, n)| n).collect();
        let id = s.next_id.max(1);
        let size = r.size;
        make_on_nodes(&s, &chosen, id, "creating", |mut c| async move {
            c.create_volume(pb::CreateVolumeRequest { id, size }).await
        })
        .await?;
        let rec = VolumeRecord {
            id,
            size: r.size,
            replicas: chosen,
            agent: None,
            qos: r.qos.as_ref().map(qos_limits).unwrap_or_default(),
            snapshots: Vec::new(),
            next_snapshot: 1,
            parent: None,
            write_quorum: r.write_quorum,
            epoch: 0,
        };
        c.commit(&mut s, |n| {
            n.next_id = id + 1;
            n.volumes.insert(r.name.clone(), rec.clone());
        })
        .await?;
        c.note_holds(&rec.replicas, id);
        tracing::info!(
            "created volume {} (id {id}, {} bytes) on {:?}",
            r.name,
            r.size,
            rec.replicas
        );
        Ok(Response::new(c.spec(&r.name, &rec, &s)))
    }

    async fn delete(&self, r: Request<pb::NameRequest>) -> Result<Response<pb::Empty>, Status> {
        let c = &self.0;
        let name = r.into_inner().name;
        let mut s = c.state.lock().await;
        let v = volume(&s, &name)?.clone();
        let clones = clones_of(&s, &name, None);
        if !clones.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {name:?} has clones made from its snapshots ({}): delete them first",
                clones.join(", ")
            )));
        }
        if let Some(a) = v.agent.as_ref().and_then(|a| s.agents.get(a)) {
            if let Ok(mut cl) = agent_client(&a.admin).await {
                let _ = cl
                    .detach(pb::DetachRequest {
                        export_name: name.clone(),
                    })
                    .await;
            }
        }
        for n in &v.replicas {
            let admin = node_admin(&s, n)?;
            match node_client(&admin)
                .await?
                .delete_volume(pb::DeleteVolumeRequest { id: v.id })
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(Status::new(e.code(), format!("deleting on {n}: {}", e.message()))),
            }
        }
        c.commit(&mut s, |n| {
            n.volumes.remove(&name);
        })
        .await?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn resize(&self, r: Request<pb::ResizeRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.name)?.clone();
        if r.size < v.size {
            return Err(Status::invalid_argument(format!(
                "volumes only grow: {} is below the current {} bytes",
                r.size, v.size
            )));
        }
        if !r.size.is_multiple_of(4096) {
            return Err(Status::invalid_argument(format!(
                "size {} is not a multiple of 4096",
                r.size
            )));
        }
        for n in &v.replicas {
            let admin = node_admin(&s, n)?;
            node_client(&admin)
                .await?
                .resize_volume(pb::ResizeVolumeRequest { id: v.id, size: r.size })
                .await
                .map_err(|e| Status::new(e.code(), format!("resizing on {n}: {}", e.message())))?;
        }
        c.commit(&mut s, |n| {
            n.volumes.get_mut(&r.name).expect("checked above").size = r.size;
        })
        .await?;
        if let Some(a) = v.agent.clone() {
            // new connections see the new size
            c.attach_at(&s, &r.name, &a).await?;
        }
        Ok(Response::new(c.spec(&r.name, &s.volumes[&r.name], &s)))
    }

    async fn set_qos(&self, r: Request<pb::SetQosRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        let limits = r.qos.as_ref().map(qos_limits).unwrap_or_default();
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.name)?.clone();
        c.commit(&mut s, |n| {
            n.volumes.get_mut(&r.name).expect("checked above").qos = limits;
        })
        .await?;
        tracing::info!("volume {}: QoS {limits:?}", r.name);
        if let Some(a) = v.agent {
            // the agent applies it now (its next heartbeat would too)
            c.attach_at(&s, &r.name, &a).await?;
        }
        Ok(Response::new(c.spec(&r.name, &s.volumes[&r.name], &s)))
    }

    async fn create_snapshot(&self, r: Request<pb::SnapshotName>) -> Result<Response<pb::SnapshotInfo>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        check_name("snapshot", &r.name)?;
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.volume)?.clone();
        if v.snapshots.iter().any(|x| x.name == r.name) {
            return Err(Status::already_exists(format!(
                "volume {:?} has a snapshot {:?}",
                r.volume, r.name
            )));
        }
        let sid = v.next_snapshot.max(1);
        let admins = v
            .replicas
            .iter()
            .map(|n| node_admin(&s, n))
            .collect::<Result<Vec<_>, _>>()?;
        let agent = v.agent.as_ref().and_then(|a| s.agents.get(a)).map(|a| a.admin.clone());
        let t = Instant::now();
        let taken = match &agent {
            // the agent holds the volume's writes off while the nodes take it
            Some(a) => agent_client(a)
                .await?
                .snapshot(pb::SnapshotExportRequest {
                    export_name: r.volume.clone(),
                    snapshot: sid,
                    node_admins: admins.clone(),
                })
                .await
                .map(|_| ()),
            // no agent: nothing writes to it
            None => snapshot_on_nodes(&admins, v.id, sid).await,
        };
        taken.map_err(|e| {
            Status::new(
                e.code(),
                format!("snapshot {:?} of {:?}: {}", r.name, r.volume, e.message()),
            )
        })?;
        let rec = SnapshotRecord {
            name: r.name.clone(),
            id: sid,
            size: v.size,
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let recorded = c
            .commit(&mut s, |n| {
                let v = n.volumes.get_mut(&r.volume).expect("checked above");
                v.snapshots.push(rec.clone());
                v.next_snapshot = sid + 1;
            })
            .await;
        if let Err(e) = recorded {
            for a in &admins {
                if let Ok(mut cl) = node_client(a).await {
                    let _ = cl
                        .delete_snapshot(pb::SnapshotRequest {
                            volume: v.id,
                            snapshot: sid,
                        })
                        .await;
                }
            }
            return Err(e);
        }
        tracing::info!(
            "volume {}: snapshot {} (number {sid}) taken in {:?}",
            r.volume,
            r.name,
            t.elapsed()
        );
        Ok(Response::new(snapshot_info(&s, &r.volume, &rec)))
    }

    async fn delete_snapshot(&self, r: Request<pb::SnapshotName>) -> Result<Response<pb::Empty>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.volume)?.clone();
        let snap = v
            .snapshots
            .iter()
            .find(|x| x.name == r.name)
            .ok_or_else(|| Status::not_found(format!("volume {:?} has no snapshot {:?}", r.volume, r.name)))?;
        let clones = clones_of(&s, &r.volume, Some(&r.name));
        if !clones.is_empty() {
            return Err(Status::failed_precondition(format!(
                "snapshot {}@{} has clones ({}): delete them first",
                r.volume,
                r.name,
                clones.join(", ")
            )));
        }
        for n in &v.replicas {
            let admin = node_admin(&s, n)?;
            match node_client(&admin)
                .await?
                .delete_snapshot(pb::SnapshotRequest {
                    volume: v.id,
                    snapshot: snap.id,
                })
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(Status::new(e.code(), format!("deleting on {n}: {}", e.message()))),
            }
        }
        c.commit(&mut s, |n| {
            let v = n.volumes.get_mut(&r.volume).expect("checked above");
            v.snapshots.retain(|x| x.name != r.name);
        })
        .await?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn list_snapshots(&self, r: Request<pb::NameRequest>) -> Result<Response<pb::ListSnapshotsReply>, Status> {
        let c = &self.0;
        let name = r.into_inner().name;
        let s = c.state.lock().await;
        if !name.is_empty() {
            volume(&s, &name)?;
        }
        let snapshots = s
            .volumes
            .iter()
            .filter(|(k, _)| name.is_empty() || **k == name)
            .flat_map(|(k, v)| v.snapshots.iter().map(|x| snapshot_info(&s, k, x)))
            .collect();
        Ok(Response::new(pb::ListSnapshotsReply { snapshots }))
    }

    async fn clone_snapshot(&self, r: Request<pb::CloneRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        check_name("volume", &r.name)?;
        let mut s = c.state.lock().await;
        if s.volumes.contains_key(&r.name) {
            return Err(Status::already_exists(format!("volume {:?} exists", r.name)));
        }
        let v = volume(&s, &r.volume)?.clone();
        let snap = v
            .snapshots
            .iter()
            .find(|x| x.name == r.snapshot)
            .ok_or_else(|| Status::not_found(format!("volume {:?} has no snapshot {:?}", r.volume, r.snapshot)))?
            .clone();
        // on the snapshot's nodes: each clone replica reads through to its node's copy
        let id = s.next_id.max(1);
        let (parent, snapshot) = (v.id, snap.id);
        make_on_nodes(&s, &v.replicas, id, "cloning", |mut c| async move {
            c.create_clone(pb::CreateCloneRequest { id, parent, snapshot }).await
        })
        .await?;
        let rec = VolumeRecord {
            id,
            size: snap.size,
            replicas: v.replicas.clone(),
            agent: None,
            qos: r.qos.as_ref().map(qos_limits).unwrap_or(v.qos),
            snapshots: Vec::new(),
            next_snapshot: 1,
            parent: Some(ParentRecord {
                volume: r.volume.clone(),
                snapshot: r.snapshot.clone(),
            }),
            write_quorum: v.write_quorum,
            epoch: 0,
        };
        c.commit(&mut s, |n| {
            n.next_id = id + 1;
            n.volumes.insert(r.name.clone(), rec.clone());
        })
        .await?;
        c.note_holds(&rec.replicas, id);
        tracing::info!("cloned {}@{} as volume {} (id {id})", r.volume, r.snapshot, r.name);
        Ok(Response::new(c.spec(&r.name, &rec, &s)))
    }

    async fn describe(&self, r: Request<pb::NameRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let name = r.into_inner().name;
        let (mut spec, admin) = {
            let s = c.state.lock().await;
            let v = volume(&s, &name)?;
            let admin = v.agent.as_ref().and_then(|a| s.agents.get(a)).map(|a| a.admin.clone());
            (c.spec(&name, v, &s), admin)
        };
        // the agent's view (replica sync state, paths), asked without holding the state, and
        // given up on after a second: describe answers even when the agent does not
        if let Some(admin) = admin.filter(|_| !spec.export_name.is_empty()) {
            let ask = async {
                let mut cl = agent_client(&admin).await.ok()?;
                cl.list_exports(pb::ListExportsRequest {}).await.ok()
            };
            if let Ok(Some(r)) = tokio::time::timeout(std::time::Duration::from_secs(1), ask).await {
                spec.export = r
                    .into_inner()
                    .exports
                    .into_iter()
                    .find(|e| e.export_name == spec.export_name);
            }
        }
        Ok(Response::new(spec))
    }

    async fn list(&self, _: Request<pb::ListRequest>) -> Result<Response<pb::ListReply>, Status> {
        let c = &self.0;
        let s = c.state.lock().await;
        let volumes = s.volumes.iter().map(|(k, v)| c.spec(k, v, &s)).collect();
        let live = c.live.lock();
        let nodes = s
            .nodes
            .iter()
            .map(|(id, n)| {
                let l = live.get(id);
                pb::NodeInfo {
                    id: id.clone(),
                    data: n.data.clone(),
                    admin: n.admin.clone(),
                    state: c.node_state(&live, id).into(),
                    volumes: l.map(|l| l.volumes.clone()).unwrap_or_default(),
                    last_seen_secs: l.map_or(-1.0, |l| l.last_seen.elapsed().as_secs_f64()),
                }
            })
            .collect();
        Ok(Response::new(pb::ListReply {
            volumes,
            nodes,
            agents: s.agents.keys().cloned().collect(),
        }))
    }

    async fn attach(&self, r: Request<pb::AttachVolumeRequest>) -> Result<Response<pb::AttachVolumeReply>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.name)?.clone();
        if let Some(a) = &v.agent {
            if a != &r.agent {
                return Err(Status::failed_precondition(format!(
                    "volume {:?} is attached to agent {a:?}; one writer only: detach it first (with --force when \
                     that agent is gone)",
                    r.name
                )));
            }
        }
        if v.agent.is_none() {
            // a new attachment: a higher epoch, recorded before any agent sees it (the agent
            // fences the replicas at it, shutting out whoever had the volume before)
            let epoch = v
                .epoch
                .checked_add(1)
                .ok_or_else(|| Status::resource_exhausted(format!("volume {:?}: attachment epochs used up", r.name)))?;
            c.commit(&mut s, |n| {
                n.volumes.get_mut(&r.name).expect("checked above").epoch = epoch;
            })
            .await?;
        }
        let uri = c.attach_at(&s, &r.name, &r.agent).await?;
        c.commit(&mut s, |n| {
            n.volumes.get_mut(&r.name).expect("checked above").agent = Some(r.agent.clone());
        })
        .await?;
        Ok(Response::new(pb::AttachVolumeReply { uri }))
    }

    async fn detach(&self, r: Request<pb::DetachVolumeRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let c = &self.0;
        let r = r.into_inner();
        let mut s = c.state.lock().await;
        let v = volume(&s, &r.name)?.clone();
        if let Some(agent) = &v.agent {
            let told = async {
                let admin = s
                    .agents
                    .get(agent)
                    .map(|a| a.admin.clone())
                    .ok_or_else(|| Status::not_found(format!("agent {agent:?} is not registered")))?;
                let call = async {
                    agent_client(&admin)
                        .await?
                        .detach(pb::DetachRequest {
                            export_name: r.name.clone(),
                        })
                        .await
                };
                tokio::time::timeout(Duration::from_secs(5), call)
                    .await
                    .map_err(|_| Status::unavailable(format!("agent {agent:?} at {admin} did not answer within 5 s")))?
            }
            .await;
            match told {
                Ok(_) => tracing::info!("volume {}: detached from agent {agent}", r.name),
                Err(e) if r.force => tracing::warn!(
                    "volume {}: agent {agent} was not told ({}); detached anyway: the next attachment fences it out",
                    r.name,
                    e.message()
                ),
                Err(e) => {
                    return Err(Status::new(
                        e.code(),
                        format!(
                            "volume {:?}: agent {agent:?} did not detach it: {}; --force detaches it anyway (the next \
                             attachment fences that agent out)",
                            r.name,
                            e.message()
                        ),
                    ))
                }
            }
            c.commit(&mut s, |n| {
                n.volumes.get_mut(&r.name).expect("checked above").agent = None;
            })
            .await?;
        }
        let rec = volume(&s, &r.name)?.clone();
        Ok(Response::new(c.spec(&r.name, &rec, &s)))
    }
}

/// The admin address of replica `r`'s storage node.
fn node_admin(s: &ControlState, r: &str) -> Result<String, Status> {
    s.nodes.get(r).map(|n| n.admin.clone()).ok_or_else(|| {
        Status::failed_precondition(format!(
            "replica {r} has not registered since the upgrade to node ids; start its storage node"
        ))
    })
}

/// A replica's move, chosen under the control state's lock and carried out without it.
struct Move {
    /// The volume as it was when the move was chosen.
    v: VolumeRecord,
    /// The node taking the replica, and its admin address.
    new: String,
    admin: String,
    /// For a clone: its parent volume's id and the snapshot's id.
    base: Option<(u32, u32)>,
    /// The admin address of a replica that is up, to copy snapshots from.
    source: Option<String>,
}

impl Move {
    /// Makes the new replica on its node: a fresh clone of the parent's snapshot, a volume
    /// with the snapshots copied from the source, or an empty volume. An old copy of the
    /// volume there (a replica replaced before) is deleted and made anew.
    async fn make(&self) -> Result<Response<pb::Empty>, Status> {
        let v = &self.v;
        let mut c = node_client(&self.admin).await?;
        if let Some((parent, snapshot)) = self.base.filter(|_| v.snapshots.is_empty()) {
            // its unwritten blocks read through to the parent's snapshot there; the agent
            // rewrites the blocks written since
            let req = pb::CreateCloneRequest {
                id: v.id,
                parent,
                snapshot,
            };
            return match c.create_clone(req).await {
                Err(e) if e.code() == tonic::Code::AlreadyExists => {
                    c.delete_volume(pb::DeleteVolumeRequest { id: v.id }).await?;
                    c.create_clone(req).await
                }
                r => r,
            };
        }
        if v.snapshots.is_empty() {
            return c
                .create_volume(pb::CreateVolumeRequest { id: v.id, size: v.size })
                .await;
        }
        let Some(source) = self.source.clone() else {
            return Err(Status::unavailable("no replica with its snapshots is up"));
        };
        // a clone's own snapshots go into a fresh clone of its base, as the clone wrote them
        let (parent, parent_snapshot) = self.base.unwrap_or_default();
        let req = pb::CopySnapshotsRequest {
            volume: v.id,
            source,
            snapshots: v.snapshots.iter().map(|r| r.id).collect(),
            size: v.size,
            clone: self.base.is_some(),
            parent,
            parent_snapshot,
        };
        match c.copy_snapshots(req.clone()).await {
            Err(e) if e.code() == tonic::Code::AlreadyExists => {
                c.delete_volume(pb::DeleteVolumeRequest { id: v.id }).await?;
                c.copy_snapshots(req).await
            }
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(incarnation: u64, first: bool, port: u16) -> pb::RegisterNodeRequest {
        pb::RegisterNodeRequest {
            addr: format!("127.0.0.1:{port}"),
            admin: "127.0.0.1:1".into(),
            node_id: "sn-0123456789abcdef".into(),
            incarnation,
            first,
            volumes: Vec::new(),
        }
    }

    /// A heartbeat of the old process that arrives while the new process's first registration
    /// waits for the state, and gets the state after it, is refused: the new process serves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_old_process_loses_a_heartbeat_that_races_the_new_ones_registration() {
        let path = std::env::temp_dir().join(format!("flexns-ctl-race-{}.json", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let ctl = Arc::new(
            Controller::new(MetaStore::File(path.clone()), ControllerConfig::default())
                .await
                .unwrap(),
        );
        ctl.node_heartbeat(beat(1, true, 1000)).await.unwrap();
        let held = ctl.state.lock().await;
        // the new process (incarnation 2) queues for the state first, then the old one's beat
        let c = ctl.clone();
        let new = tokio::spawn(async move { c.node_heartbeat(beat(2, true, 2000)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = ctl.clone();
        let old = tokio::spawn(async move { c.node_heartbeat(beat(1, false, 1000)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        new.await.unwrap().unwrap();
        let e = old.await.unwrap().unwrap_err();
        assert!(e.message().contains("superseded"), "{e:?}");
        // the new process keeps serving the id, at its address
        ctl.node_heartbeat(beat(2, false, 2000)).await.unwrap();
        assert_eq!(
            ctl.state.lock().await.nodes["sn-0123456789abcdef"].data,
            "127.0.0.1:2000"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
