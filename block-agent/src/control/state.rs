//! What the controller records, and where: volumes (their replicas by storage-node id),
//! storage nodes by id with their last registered addresses, agents; one JSON document in a
//! file or in one etcd key.
//!
//! State version 1 (before storage nodes had ids) recorded nodes and replicas by the data
//! address a node happened to bind. Such a state still loads: its replicas stay recorded by
//! address until a node that holds the volume registers, and the node's id takes the place of
//! one of them (the one at its address if there is one). See [`ControlState::claim_legacy`].

use etcd_lite::EtcdClient;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// The state format this controller writes.
pub const STATE_VERSION: u32 = 2;

/// A volume as the controller records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeRecord {
    /// The volume's id (also its NBD export and Solar volume number).
    pub id: u32,
    /// Size in bytes.
    pub size: u64,
    /// The storage nodes holding its replicas, by node id (a legacy state's entries are
    /// addresses until claimed).
    pub replicas: Vec<String>,
    /// The agent it is attached to, by agent name (`None`: detached).
    pub agent: Option<String>,
    /// Provisioned IOPS and bandwidth (none in states written before QoS).
    #[serde(default)]
    pub qos: crate::qos::QosLimits,
    /// Its snapshots, oldest first.
    #[serde(default)]
    pub snapshots: Vec<SnapshotRecord>,
    /// The number the next snapshot gets (the storage nodes know snapshots by number).
    #[serde(default)]
    pub next_snapshot: u32,
    /// A clone: the snapshot it was made from.
    #[serde(default)]
    pub parent: Option<ParentRecord>,
    /// Replicas a write needs durable before it is acknowledged (0: a majority).
    #[serde(default)]
    pub write_quorum: u32,
    /// The epoch of its latest attachment (raised by each attach to an agent that did not
    /// have it): its replicas refuse the requests of earlier attachments.
    #[serde(default)]
    pub epoch: u32,
}

/// A snapshot as the controller records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub name: String,
    pub id: u32,
    /// The volume's size when it was taken.
    pub size: u64,
    pub created_unix: u64,
}

/// The snapshot a clone was made from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ParentRecord {
    pub volume: String,
    pub snapshot: String,
}

/// A storage node: where it last registered.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeRecord {
    /// Solar (UDP) and TCP data address.
    pub data: String,
    /// gRPC admin address.
    pub admin: String,
}

/// A registered agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentRecord {
    /// The agent's admin (gRPC) address.
    pub admin: String,
    /// The agent's NBD address.
    pub nbd: String,
}

/// The controller's state (one document).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ControlState {
    /// Format version of the document.
    pub version: u32,
    /// The id the next created volume gets.
    pub next_id: u32,
    /// Volumes by name.
    pub volumes: BTreeMap<String, VolumeRecord>,
    /// Storage nodes by id.
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Registered agents by name.
    pub agents: BTreeMap<String, AgentRecord>,
}

/// Version 1: nodes by data address (to their admin address), replicas by data address.
#[derive(Deserialize)]
struct StateV1 {
    next_id: u32,
    volumes: BTreeMap<String, VolumeRecord>,
    agents: BTreeMap<String, AgentRecord>,
}

impl ControlState {
    /// Parses a stored state of either version.
    pub fn parse(b: &[u8]) -> Result<ControlState, serde_json::Error> {
        let v: serde_json::Value = serde_json::from_slice(b)?;
        if v.get("version").and_then(|x| x.as_u64()).unwrap_or(1) >= 2 {
            return serde_json::from_value(v);
        }
        let old: StateV1 = serde_json::from_value(v)?;
        tracing::info!(
            "controller state of version 1: replicas are recorded by address until their storage nodes register"
        );
        Ok(ControlState {
            version: STATE_VERSION,
            next_id: old.next_id,
            volumes: old.volumes,
            nodes: BTreeMap::new(),
            agents: old.agents,
        })
    }

    /// Version-1 replica entries (addresses, not node ids) that storage node `node`, now at
    /// `data` and holding `volumes`, takes over: at most one entry per volume it holds and is
    /// not yet a replica of, the entry equal to its address if any. Returns the volumes changed.
    pub fn claim_legacy(&mut self, node: &str, data: &str, volumes: &[u32]) -> Vec<String> {
        let mut changed = Vec::new();
        for (name, v) in self.volumes.iter_mut() {
            if !volumes.contains(&v.id) || v.replicas.iter().any(|r| r == node) {
                continue;
            }
            let legacy = |r: &String| !crate::storage_node::is_node_id(r);
            let at = v
                .replicas
                .iter()
                .position(|r| r == data)
                .or_else(|| v.replicas.iter().position(legacy));
            if let Some(i) = at {
                tracing::info!(
                    "volume {name}: replica {} is storage node {node} (at {data})",
                    v.replicas[i]
                );
                v.replicas[i] = node.to_string();
                changed.push(name.clone());
            }
        }
        changed
    }
}

/// Where the controller keeps its state.
pub enum MetaStore {
    /// A JSON file (written to a temporary file, synced, renamed).
    File(PathBuf),
    /// One key in etcd, written only if unchanged since this store last read or wrote it (a
    /// second controller's write makes this one's next save a [`MetaError::Conflict`], never a
    /// lost update).
    Etcd {
        /// The etcd client.
        client: Box<tokio::sync::Mutex<EtcdClient>>,
        /// The key the state document lives under.
        key: String,
        /// The key's modification revision as last read or written (0: absent).
        rev: std::sync::atomic::AtomicI64,
    },
}

/// Errors of the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The state file (its path) could not be read or written.
    #[error("state file {0}: {1}")]
    File(PathBuf, std::io::Error),
    /// The state is not valid JSON.
    #[error("state is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// etcd failed.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_lite::EtcdError),
    /// Another controller wrote the state since this one read it (nothing was written).
    #[error("{0} changed since this controller read it (another controller wrote it); nothing was written")]
    Conflict(String),
}

impl MetaStore {
    /// The state in etcd at `endpoint` under `prefix`.
    pub async fn etcd(endpoint: &str, prefix: &str) -> Result<MetaStore, MetaError> {
        Ok(MetaStore::Etcd {
            client: Box::new(tokio::sync::Mutex::new(EtcdClient::connect(endpoint).await?)),
            key: format!("{}/block/state", prefix.trim_end_matches('/')),
            rev: std::sync::atomic::AtomicI64::new(0),
        })
    }

    /// Reads the state (an empty one when none was saved yet), upgraded to the current version.
    pub async fn load(&self) -> Result<ControlState, MetaError> {
        let mut s = match self {
            MetaStore::File(p) => match std::fs::read(p) {
                Ok(b) => ControlState::parse(&b)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => ControlState::default(),
                Err(e) => return Err(MetaError::File(p.clone(), e)),
            },
            MetaStore::Etcd { client, key, rev } => match client.lock().await.get_revision(key.as_bytes()).await? {
                Some((b, r)) => {
                    let s = ControlState::parse(&b)?;
                    rev.store(r, Ordering::Relaxed);
                    s
                }
                None => {
                    rev.store(0, Ordering::Relaxed);
                    ControlState::default()
                }
            },
        };
        s.version = STATE_VERSION;
        Ok(s)
    }

    /// Writes the state (atomically for a file; only if unchanged since read, for etcd).
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
            MetaStore::Etcd { client, key, rev } => {
                let mut c = client.lock().await;
                match c
                    .put_if_unchanged(key.as_bytes(), b, rev.load(Ordering::Relaxed))
                    .await?
                {
                    Some(r) => {
                        rev.store(r, Ordering::Relaxed);
                        Ok(())
                    }
                    None => Err(MetaError::Conflict(format!("etcd key {key}"))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_one_state_loads_and_its_replicas_are_claimed_by_node_ids() {
        let v1 = br#"{"next_id": 3,
            "volumes": {
              "vol0": {"id": 1, "size": 4096, "replicas": ["127.0.0.1:1000", "127.0.0.1:1001"], "agent": "agent0"},
              "vol1": {"id": 2, "size": 4096, "replicas": ["127.0.0.1:1001"], "agent": null}},
            "nodes": {"127.0.0.1:1000": "127.0.0.1:2000", "127.0.0.1:1001": "127.0.0.1:2001"},
            "agents": {"agent0": {"admin": "127.0.0.1:3000", "nbd": "127.0.0.1:10809"}}}"#;
        let mut s = ControlState::parse(v1).unwrap();
        assert_eq!(s.version, STATE_VERSION);
        assert!(s.nodes.is_empty());
        assert_eq!(s.next_id, 3);
        // a node at a new address that holds volumes 1 and 2 takes one entry of each
        let a = "sn-00000000000000aa";
        let changed = s.claim_legacy(a, "127.0.0.1:5000", &[1, 2]);
        assert_eq!(changed, vec!["vol0".to_string(), "vol1".to_string()]);
        assert_eq!(s.volumes["vol0"].replicas, vec![a, "127.0.0.1:1001"]);
        assert_eq!(s.volumes["vol1"].replicas, vec![a]);
        // registering again claims nothing more
        assert!(s.claim_legacy(a, "127.0.0.1:5000", &[1, 2]).is_empty());
        // a node at a recorded address takes that entry; one without the volume takes none
        let b = "sn-00000000000000bb";
        assert!(s.claim_legacy(b, "127.0.0.1:1001", &[7]).is_empty());
        assert_eq!(s.claim_legacy(b, "127.0.0.1:1001", &[1]), vec!["vol0".to_string()]);
        assert_eq!(s.volumes["vol0"].replicas, vec![a, b]);
        // and the state round-trips in the new version
        let back = ControlState::parse(&serde_json::to_vec(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
