//! Publishing and finding segment descriptors: the embedded registry, the P2P handshake (ask
//! the engine itself at `IP:RPC_PORT`) and etcd (under `PREFIX/segments/NAME`).

use crate::rpc::pb;
use crate::segment::SegmentDesc;
use crate::{MetadataConfig, TransferError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

fn embedded() -> &'static Mutex<HashMap<String, SegmentDesc>> {
    static REG: OnceLock<Mutex<HashMap<String, SegmentDesc>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// The metadata store of one engine.
pub(crate) enum MetaStore {
    Embedded,
    P2p,
    Etcd {
        endpoint: String,
        prefix: String,
        client: Box<tokio::sync::Mutex<Option<etcd_lite::EtcdClient>>>,
        /// The lease the descriptor is put under (granted at the first publish): a process
        /// that dies stops renewing it and etcd deletes the descriptor within `ttl`.
        lease: Mutex<Option<i64>>,
        ttl: Duration,
    },
}

impl MetaStore {
    pub fn new(c: &MetadataConfig, ttl: Duration) -> MetaStore {
        match c {
            MetadataConfig::Embedded => MetaStore::Embedded,
            MetadataConfig::P2p => MetaStore::P2p,
            MetadataConfig::Etcd { endpoint, prefix } => MetaStore::Etcd {
                endpoint: endpoint.clone(),
                prefix: prefix.clone(),
                client: Box::new(tokio::sync::Mutex::new(None)),
                lease: Mutex::new(None),
                ttl,
            },
        }
    }

    /// How often [`Self::keep_alive`] should run (a third of the lease), if there is a lease.
    pub fn keep_alive_every(&self) -> Option<Duration> {
        match self {
            MetaStore::Etcd { ttl, .. } => Some(*ttl / 3),
            _ => None,
        }
    }

    /// Renews the descriptor's lease. `Ok(false)` when it had expired (the descriptor is gone:
    /// publish again, which grants a new one).
    pub async fn keep_alive(&self) -> Result<bool, TransferError> {
        let MetaStore::Etcd {
            endpoint,
            client,
            lease,
            ..
        } = self
        else {
            return Ok(true);
        };
        let Some(id) = *lease.lock() else {
            return Ok(true);
        };
        let mut c = Self::etcd(endpoint, client).await?;
        let ttl = c
            .keep_alive(id)
            .await
            .map_err(|e| TransferError::Metadata(e.to_string()))?;
        if ttl <= 0 {
            *lease.lock() = None;
            return Ok(false);
        }
        Ok(true)
    }

    pub fn describe(&self) -> String {
        match self {
            MetaStore::Embedded => "embedded".into(),
            MetaStore::P2p => "P2PHANDSHAKE".into(),
            MetaStore::Etcd { endpoint, prefix, .. } => format!("etcd {endpoint} prefix {prefix:?}"),
        }
    }

    fn key(prefix: &str, name: &str) -> String {
        format!("{prefix}segments/{name}")
    }

    async fn etcd(
        endpoint: &str,
        client: &tokio::sync::Mutex<Option<etcd_lite::EtcdClient>>,
    ) -> Result<etcd_lite::EtcdClient, TransferError> {
        let mut c = client.lock().await;
        if c.is_none() {
            *c = Some(
                etcd_lite::EtcdClient::connect(endpoint)
                    .await
                    .map_err(|e| TransferError::Metadata(e.to_string()))?,
            );
        }
        Ok(c.clone().expect("set above"))
    }

    /// Publishes (or re-publishes) this engine's descriptor.
    pub async fn publish(&self, d: &SegmentDesc) -> Result<(), TransferError> {
        match self {
            MetaStore::Embedded => {
                embedded().lock().insert(d.name.clone(), d.clone());
                Ok(())
            }
            MetaStore::P2p => Ok(()), // served live on the RPC port
            MetaStore::Etcd {
                endpoint,
                prefix,
                client,
                lease,
                ttl,
            } => {
                let mut c = Self::etcd(endpoint, client).await?;
                let meta = |e: etcd_lite::EtcdError| TransferError::Metadata(e.to_string());
                let current = *lease.lock();
                let id = match current {
                    Some(id) => id,
                    None => {
                        let id = c.grant_lease(ttl.as_secs().max(1) as i64).await.map_err(meta)?;
                        *lease.lock() = Some(id);
                        id
                    }
                };
                c.put_leased(Self::key(prefix, &d.name), d.to_json(), id)
                    .await
                    .map_err(meta)
            }
        }
    }

    /// Finds the descriptor of segment `name`.
    pub async fn fetch(&self, name: &str) -> Result<SegmentDesc, TransferError> {
        match self {
            MetaStore::Embedded => embedded().lock().get(name).cloned().ok_or_else(|| {
                TransferError::Metadata(format!(
                    "segment {name} is not in the embedded registry (engines in other processes need \
                     P2PHANDSHAKE or etcd metadata)"
                ))
            }),
            MetaStore::P2p => {
                let addr: std::net::SocketAddr = name
                    .parse()
                    .map_err(|_| TransferError::Metadata(format!("P2P segment names are IP:RPC_PORT, not {name:?}")))?;
                let fetch = async {
                    let mut c = pb::transfer_rpc_client::TransferRpcClient::connect(format!("http://{addr}"))
                        .await
                        .map_err(|e| e.to_string())?;
                    c.get_segment(pb::GetSegmentRequest { name: String::new() })
                        .await
                        .map_err(|s| s.message().to_string())
                        .map(|r| r.into_inner().descriptor_json)
                };
                let json = tokio::time::timeout(Duration::from_secs(3), fetch)
                    .await
                    .map_err(|_| "no answer within 3 s".to_string())
                    .and_then(|r| r)
                    .map_err(|e| TransferError::Peer {
                        peer: name.to_string(),
                        message: format!("P2P handshake: {e}"),
                    })?;
                SegmentDesc::from_json(&json)
            }
            MetaStore::Etcd {
                endpoint,
                prefix,
                client,
                ..
            } => {
                let mut c = Self::etcd(endpoint, client).await?;
                let v = c
                    .get(Self::key(prefix, name))
                    .await
                    .map_err(|e| TransferError::Metadata(e.to_string()))?
                    .ok_or_else(|| {
                        TransferError::Metadata(format!(
                            "segment {name} is not published in etcd {endpoint} under {prefix:?}"
                        ))
                    })?;
                SegmentDesc::from_json(&String::from_utf8_lossy(&v))
            }
        }
    }

    /// Removes this engine's descriptor if it is still the published one (a successor with the
    /// same name keeps its own).
    pub async fn remove(&self, name: &str, instance: u64) {
        match self {
            MetaStore::Embedded => {
                let mut r = embedded().lock();
                if r.get(name).is_some_and(|d| d.instance == instance) {
                    r.remove(name);
                }
            }
            MetaStore::P2p => {}
            MetaStore::Etcd {
                endpoint,
                prefix,
                client,
                lease,
                ..
            } => {
                let Ok(mut c) = Self::etcd(endpoint, client).await else {
                    return;
                };
                // the lease dies with this engine (a successor has its own)
                let held = lease.lock().take();
                if let Some(id) = held {
                    let _ = c.revoke_lease(id).await;
                }
                let key = Self::key(prefix, name);
                let ours = match c.get(key.clone()).await {
                    Ok(Some(v)) => {
                        SegmentDesc::from_json(&String::from_utf8_lossy(&v)).is_ok_and(|d| d.instance == instance)
                    }
                    _ => false,
                };
                if ours {
                    let _ = c.delete(key).await;
                }
            }
        }
    }
}
