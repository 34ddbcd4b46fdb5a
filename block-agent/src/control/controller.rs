//! The control plane: gRPC services of the storage node (volume files), of the agent
//! (attachments) and of the controller (volumes, replica placement, attachments, with its
//! state in an embedded file or in etcd).
//!
//! Placement puts a volume's replicas on distinct registered storage nodes, the least loaded
//! first. A volume is attached to at most one agent (NBD has no reservations; a second writer
//! would corrupt a file system). Agents register at start; the controller then attaches again
//! what its records say belongs to them, so an agent restart needs no operator.

use crate::agent::Agent;
use crate::storage_node::{NodeError, StorageNode};
use etcd_lite::EtcdClient;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Generated protobuf types and services.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("flexns.block");
}

use pb::agent_admin_client::AgentAdminClient;
use pb::storage_node_admin_client::StorageNodeAdminClient;

fn node_status(e: NodeError) -> Status {
    match e {
        NodeError::Exists(_) => Status::already_exists(e.to_string()),
        NodeError::NoVolume(_) => Status::not_found(e.to_string()),
        NodeError::Size(_) | NodeError::NotIpv4(_) => Status::invalid_argument(e.to_string()),
        NodeError::Store(crate::store::StoreError::Invalid(..)) => Status::invalid_argument(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// The storage node's admin service.
pub struct NodeAdmin(pub Arc<StorageNode>);

impl NodeAdmin {
    /// Runs a volume-file operation (file creation, syncs) off the async threads.
    async fn on_node(
        &self,
        f: impl FnOnce(&StorageNode) -> Result<(), NodeError> + Send + 'static,
    ) -> Result<Response<pb::Empty>, Status> {
        let n = self.0.clone();
        tokio::task::spawn_blocking(move || f(&n))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(node_status)?;
        Ok(Response::new(pb::Empty {}))
    }
}

#[tonic::async_trait]
impl pb::storage_node_admin_server::StorageNodeAdmin for NodeAdmin {
    async fn create_volume(&self, r: Request<pb::CreateVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.create_volume(r.id, r.size)).await
    }

    async fn delete_volume(&self, r: Request<pb::DeleteVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.delete_volume(r.id)).await
    }

    async fn resize_volume(&self, r: Request<pb::ResizeVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.resize_volume(r.id, r.size)).await
    }

    async fn list_volumes(&self, _: Request<pb::ListVolumesRequest>) -> Result<Response<pb::ListVolumesReply>, Status> {
        let volumes = self
            .0
            .volumes()
            .into_iter()
            .map(|(id, blocks)| {
                let st = self.0.store(id).map(|s| s.stats()).unwrap_or_default();
                pb::NodeVolume {
                    id,
                    size: blocks * 4096,
                    writes: st.writes,
                    reads: st.reads,
                    corrupt_reads: st.corrupt_reads,
                }
            })
            .collect();
        Ok(Response::new(pb::ListVolumesReply {
            volumes,
            addr: self.0.addr().to_string(),
        }))
    }
}

/// The agent's admin service.
pub struct AgentAdmin {
    pub agent: Arc<Agent>,
    /// The NBD address clients use.
    pub nbd: String,
}

#[tonic::async_trait]
impl pb::agent_admin_server::AgentAdmin for AgentAdmin {
    async fn attach(&self, r: Request<pb::AttachRequest>) -> Result<Response<pb::Empty>, Status> {
        let v = r
            .into_inner()
            .volume
            .ok_or_else(|| Status::invalid_argument("volume is missing"))?;
        let name = if v.export_name.is_empty() {
            v.name.clone()
        } else {
            v.export_name.clone()
        };
        self.agent
            .attach(&name, v.id, v.size, &v.replicas)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn detach(&self, r: Request<pb::DetachRequest>) -> Result<Response<pb::Empty>, Status> {
        let name = r.into_inner().export_name;
        if !self.agent.detach(&name) {
            return Err(Status::not_found(format!("no export {name:?}")));
        }
        Ok(Response::new(pb::Empty {}))
    }

    async fn list_exports(&self, _: Request<pb::ListExportsRequest>) -> Result<Response<pb::ListExportsReply>, Status> {
        let ex = self.agent.exports();
        let exports = ex
            .names()
            .into_iter()
            .filter_map(|n| {
                let v = ex.get(&n)?;
                let c = v.counters();
                Some(pb::ExportInfo {
                    export_name: n,
                    volume: v.id(),
                    size: v.size(),
                    replicas: v.replicas().iter().map(|l| l.server().to_string()).collect(),
                    paths_up: v.replicas().iter().map(|l| l.status().paths_up as u32).collect(),
                    reads: c.reads.load(Ordering::Relaxed),
                    writes: c.writes.load(Ordering::Relaxed),
                    read_failovers: c.read_failovers.load(Ordering::Relaxed),
                    repairs: c.repairs.load(Ordering::Relaxed),
                })
            })
            .collect();
        let transport = match self.agent.carrier() {
            crate::link::Carrier::Udp { paths } => format!("solar/udp, {paths} paths"),
            crate::link::Carrier::Tcp => "tcp".to_string(),
        };
        Ok(Response::new(pb::ListExportsReply {
            exports,
            nbd: self.nbd.clone(),
            transport,
        }))
    }
}

/// A volume as the controller records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: u32,
    pub size: u64,
    pub replicas: Vec<String>,
    pub agent: Option<String>,
}

/// A registered agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentRecord {
    pub admin: String,
    pub nbd: String,
}

/// The controller's state (one document).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ControlState {
    pub next_id: u32,
    pub volumes: BTreeMap<String, VolumeRecord>,
    /// Storage node data address -> admin address.
    pub nodes: BTreeMap<String, String>,
    pub agents: BTreeMap<String, AgentRecord>,
}

/// Where the controller keeps its state.
pub enum MetaStore {
    /// A JSON file (written to a temporary file, synced, renamed).
    File(PathBuf),
    /// One key in etcd.
    Etcd {
        client: Box<tokio::sync::Mutex<EtcdClient>>,
        key: String,
    },
}

/// Errors of the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("state file {0}: {1}")]
    File(PathBuf, std::io::Error),
    #[error("state is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_lite::EtcdError),
}

impl MetaStore {
    /// The state in etcd at `endpoint` under `prefix`.
    pub async fn etcd(endpoint: &str, prefix: &str) -> Result<MetaStore, MetaError> {
        Ok(MetaStore::Etcd {
            client: Box::new(tokio::sync::Mutex::new(EtcdClient::connect(endpoint).await?)),
            key: format!("{}/block/state", prefix.trim_end_matches('/')),
        })
    }

    pub async fn load(&self) -> Result<ControlState, MetaError> {
        match self {
            MetaStore::File(p) => match std::fs::read(p) {
                Ok(b) => Ok(serde_json::from_slice(&b)?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ControlState::default()),
                Err(e) => Err(MetaError::File(p.clone(), e)),
            },
            MetaStore::Etcd { client, key } => match client.lock().await.get(key.as_bytes()).await? {
                Some(b) => Ok(serde_json::from_slice(&b)?),
                None => Ok(ControlState::default()),
            },
        }
    }

    pub async fn save(&self, s: &ControlState) -> Result<(), MetaError> {
        let b = serde_json::to_vec_pretty(s)?;
        match self {
            MetaStore::File(p) => {
                let err = |e| MetaError::File(p.clone(), e);
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d).map_err(err)?;
                }
                let tmp = p.with_extension("tmp");
                {
                    use std::io::Write;
                    let mut f = std::fs::File::create(&tmp).map_err(err)?;
                    f.write_all(&b).map_err(err)?;
                    f.sync_all().map_err(err)?;
                }
                std::fs::rename(&tmp, p).map_err(err)
            }
            MetaStore::Etcd { client, key } => Ok(client.lock().await.put(key.as_bytes(), b).await?),
        }
    }
}

/// The controller service.
pub struct Controller {
    state: tokio::sync::Mutex<ControlState>,
    meta: MetaStore,
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

async fn node_client(admin: &str) -> Result<StorageNodeAdminClient<tonic::transport::Channel>, Status> {
    StorageNodeAdminClient::connect(http(admin))
        .await
        .map_err(|e| Status::unavailable(format!("storage node admin {admin}: {e}")))
}

async fn agent_client(admin: &str) -> Result<AgentAdminClient<tonic::transport::Channel>, Status> {
    AgentAdminClient::connect(http(admin))
        .await
        .map_err(|e| Status::unavailable(format!("agent admin {admin}: {e}")))
}

fn spec(name: &str, v: &VolumeRecord, s: &ControlState) -> pb::VolumeSpec {
    pb::VolumeSpec {
        id: v.id,
        name: name.to_string(),
        size: v.size,
        replicas: v.replicas.clone(),
        agent: v.agent.clone().unwrap_or_default(),
        export_name: v
            .agent
            .as_ref()
            .and_then(|a| s.agents.get(a))
            .map(|_| name.to_string())
            .unwrap_or_default(),
    }
}

/// Volume names: what a URI path and a file name can hold.
fn check_name(n: &str) -> Result<(), Status> {
    if n.is_empty() || n.len() > 64 || !n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(Status::invalid_argument(format!(
            "volume name {n:?}: 1 to 64 characters of A-Z a-z 0-9 - _ ."
        )));
    }
    Ok(())
}

/// A recorded volume, or NOT_FOUND naming it.
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
        self.meta.save(&n).await.map_err(meta_status)?;
        *s = n;
        Ok(())
    }

    /// A controller with the state `meta` holds.
    pub async fn new(meta: MetaStore) -> Result<Controller, MetaError> {
        let state = meta.load().await?;
        Ok(Controller {
            state: tokio::sync::Mutex::new(state),
            meta,
        })
    }

    async fn attach_at(&self, s: &ControlState, name: &str, agent: &str) -> Result<String, Status> {
        let v = volume(s, name)?;
        let a = s
            .agents
            .get(agent)
            .ok_or_else(|| Status::not_found(format!("no agent {agent:?} is registered")))?;
        let mut sp = spec(name, v, s);
        sp.export_name = name.to_string();
        agent_client(&a.admin)
            .await?
            .attach(pb::AttachRequest { volume: Some(sp) })
            .await?;
        Ok(format!("nbd://{}/{}", a.nbd, name))
    }
}

#[tonic::async_trait]
impl pb::block_control_server::BlockControl for Controller {
    async fn register_node(&self, r: Request<pb::RegisterNodeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        r.addr
            .parse::<std::net::SocketAddr>()
            .map_err(|_| Status::invalid_argument(format!("node address {:?} is not IP:PORT", r.addr)))?;
        let mut s = self.state.lock().await;
        self.commit(&mut s, |n| {
            n.nodes.insert(r.addr.clone(), r.admin);
        })
        .await?;
        tracing::info!("storage node {} registered", r.addr);
        Ok(Response::new(pb::Empty {}))
    }

    async fn register_agent(&self, r: Request<pb::RegisterAgentRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        if r.name.is_empty() {
            return Err(Status::invalid_argument("agent name is empty"));
        }
        let mut s = self.state.lock().await;
        self.commit(&mut s, |n| {
            n.agents.insert(
                r.name.clone(),
                AgentRecord {
                    admin: r.admin,
                    nbd: r.nbd,
                },
            );
        })
        .await?;
        tracing::info!("agent {} registered", r.name);
        // attach again what belongs to it (the agent restarted)
        let mine: Vec<String> = s
            .volumes
            .iter()
            .filter(|(_, v)| v.agent.as_deref() == Some(r.name.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        let snapshot = s.clone();
        drop(s);
        for name in mine {
            if let Err(e) = self.attach_at(&snapshot, &name, &r.name).await {
                tracing::warn!("re-attaching {name} to {}: {}", r.name, e.message());
            }
        }
        Ok(Response::new(pb::Empty {}))
    }

    async fn create(&self, r: Request<pb::CreateRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let r = r.into_inner();
        check_name(&r.name)?;
        if r.size == 0 || !r.size.is_multiple_of(4096) {
            return Err(Status::invalid_argument(format!(
                "size {} is not a positive multiple of 4096",
                r.size
            )));
        }
        let want = r.replicas.max(1) as usize;
        let mut s = self.state.lock().await;
        if s.volumes.contains_key(&r.name) {
            return Err(Status::already_exists(format!("volume {:?} exists", r.name)));
        }
        if s.nodes.len() < want {
            return Err(Status::failed_precondition(format!(
                "{want} replicas need {want} storage nodes; {} are registered",
                s.nodes.len()
            )));
        }
        // least loaded nodes first
        let mut load: Vec<(usize, String)> = s
            .nodes
            .keys()
            .map(|n| (s.volumes.values().filter(|v| v.replicas.contains(n)).count(), n.clone()))
            .collect();
        load.sort();
        let chosen: Vec<String> = load.into_iter().take(want).map(|(_, n)| n).collect();
        let id = s.next_id.max(1);
        let mut made: Vec<(String, String)> = Vec::new();
        for n in &chosen {
            let admin = s.nodes[n].clone();
            let res = async {
                node_client(&admin)
                    .await?
                    .create_volume(pb::CreateVolumeRequest { id, size: r.size })
                    .await
            }
            .await;
            if let Err(e) = res {
                for (a, _) in &made {
                    if let Ok(mut c) = node_client(a).await {
                        let _ = c.delete_volume(pb::DeleteVolumeRequest { id }).await;
                    }
                }
                return Err(Status::new(
                    e.code(),
                    format!("creating on storage node {n}: {}", e.message()),
                ));
            }
            made.push((admin, n.clone()));
        }
        let rec = VolumeRecord {
            id,
            size: r.size,
            replicas: chosen,
            agent: None,
        };
        self.commit(&mut s, |n| {
            n.next_id = id + 1;
            n.volumes.insert(r.name.clone(), rec.clone());
        })
        .await?;
        tracing::info!(
            "created volume {} (id {id}, {} bytes) on {:?}",
            r.name,
            r.size,
            rec.replicas
        );
        Ok(Response::new(spec(&r.name, &rec, &s)))
    }

    async fn delete(&self, r: Request<pb::NameRequest>) -> Result<Response<pb::Empty>, Status> {
        let name = r.into_inner().name;
        let mut s = self.state.lock().await;
        let v = volume(&s, &name)?.clone();
        if let Some(a) = v.agent.as_ref().and_then(|a| s.agents.get(a)) {
            if let Ok(mut c) = agent_client(&a.admin).await {
                let _ = c
                    .detach(pb::DetachRequest {
                        export_name: name.clone(),
                    })
                    .await;
            }
        }
        for n in &v.replicas {
            let admin = s.nodes.get(n).cloned().unwrap_or_default();
            match node_client(&admin).await {
                Ok(mut c) => match c.delete_volume(pb::DeleteVolumeRequest { id: v.id }).await {
                    Ok(_) => {}
                    Err(e) if e.code() == tonic::Code::NotFound => {}
                    Err(e) => return Err(Status::new(e.code(), format!("deleting on {n}: {}", e.message()))),
                },
                Err(e) => return Err(e),
            }
        }
        self.commit(&mut s, |n| {
            n.volumes.remove(&name);
        })
        .await?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn resize(&self, r: Request<pb::ResizeRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let r = r.into_inner();
        let mut s = self.state.lock().await;
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
            let admin = s.nodes.get(n).cloned().unwrap_or_default();
            node_client(&admin)
                .await?
                .resize_volume(pb::ResizeVolumeRequest { id: v.id, size: r.size })
                .await
                .map_err(|e| Status::new(e.code(), format!("resizing on {n}: {}", e.message())))?;
        }
        self.commit(&mut s, |n| {
            n.volumes.get_mut(&r.name).expect("checked above").size = r.size;
        })
        .await?;
        if let Some(a) = v.agent.clone() {
            // new connections see the new size
            self.attach_at(&s, &r.name, &a).await?;
        }
        Ok(Response::new(spec(&r.name, &s.volumes[&r.name], &s)))
    }

    async fn describe(&self, r: Request<pb::NameRequest>) -> Result<Response<pb::VolumeSpec>, Status> {
        let name = r.into_inner().name;
        let s = self.state.lock().await;
        Ok(Response::new(spec(&name, volume(&s, &name)?, &s)))
    }

    async fn list(&self, _: Request<pb::ListRequest>) -> Result<Response<pb::ListReply>, Status> {
        let s = self.state.lock().await;
        Ok(Response::new(pb::ListReply {
            volumes: s.volumes.iter().map(|(k, v)| spec(k, v, &s)).collect(),
            nodes: s.nodes.keys().cloned().collect(),
            agents: s.agents.keys().cloned().collect(),
        }))
    }

    async fn attach(&self, r: Request<pb::AttachVolumeRequest>) -> Result<Response<pb::AttachVolumeReply>, Status> {
        let r = r.into_inner();
        let mut s = self.state.lock().await;
        let v = volume(&s, &r.name)?.clone();
        if let Some(a) = &v.agent {
            if a != &r.agent {
                return Err(Status::failed_precondition(format!(
                    "volume {:?} is attached to agent {a:?}; one writer only",
                    r.name
                )));
            }
        }
        let uri = self.attach_at(&s, &r.name, &r.agent).await?;
        self.commit(&mut s, |n| {
            n.volumes.get_mut(&r.name).expect("checked above").agent = Some(r.agent.clone());
        })
        .await?;
        Ok(Response::new(pb::AttachVolumeReply { uri }))
    }
}
