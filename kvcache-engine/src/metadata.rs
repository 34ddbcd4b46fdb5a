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
        /// The descriptor under a lease this engine renews (made at the first publish): a
        /// process that dies stops renewing it and etcd deletes the descriptor within `ttl`.
        registration: Box<tokio::sync::Mutex<Option<etcd_lite::Registration>>>,
        ttl: Duration,
        /// Every published descriptor, kept current by a watch (started at the first fetch:
        /// an engine that opens no peer needs none).
        view: std::sync::OnceLock<etcd_lite::PrefixView>,
        /// The instance each watched descriptor names, by segment, with the revision it was
        /// parsed at: requests check the instance without parsing JSON each time.
        instances: Mutex<HashMap<String, (i64, u64)>>,
    },
}

impl MetaStore {
    pub(crate) fn new(c: &MetadataConfig, ttl: Duration) -> MetaStore {
        match c {
            MetadataConfig::Embedded => MetaStore::Embedded,
            MetadataConfig::P2p => MetaStore::P2p,
            MetadataConfig::Etcd { endpoint, prefix } => MetaStore::Etcd {
                endpoint: endpoint.clone(),
                prefix: prefix.clone(),
                client: Box::new(tokio::sync::Mutex::new(None)),
                registration: Box::new(tokio::sync::Mutex::new(None)),
                ttl,
                view: std::sync::OnceLock::new(),
                instances: Mutex::new(HashMap::new()),
            },
        }
    }

    /// What the etcd watch last saw of segment `name`: `Some(Some(d))` published, `Some(None)`
    /// not published (so its engine is gone: stopped, or its lease expired); `None` when unknown
    /// (no etcd, no watch started yet, or etcd out of reach).
    pub(crate) fn watched(&self, name: &str) -> Option<Option<SegmentDesc>> {
        let MetaStore::Etcd { prefix, view, .. } = self else {
            return None;
        };
        let snap = view.get()?.current();
        if !snap.synced {
            return None;
        }
        Some(
            snap.entries
                .get(Self::key(prefix, name).as_bytes())
                .and_then(|v| SegmentDesc::from_json(&String::from_utf8_lossy(v)).ok()),
        )
    }

    /// [`Self::watched`], only the engine instance the descriptor names (parsed once per
    /// revision of the descriptor: this is asked for every request).
    pub(crate) fn watched_instance(&self, name: &str) -> Option<Option<u64>> {
        let MetaStore::Etcd {
            prefix,
            view,
            instances,
            ..
        } = self
        else {
            return None;
        };
        let snap = view.get()?.current();
        if !snap.synced {
            return None;
        }
        let key = Self::key(prefix, name);
        let Some(&rev) = snap.revisions.get(key.as_bytes()) else {
            return Some(None);
        };
        if let Some(&(at, instance)) = instances.lock().get(name) {
            if at == rev {
                return Some(Some(instance));
            }
        }
        let d = snap
            .entries
            .get(key.as_bytes())
            .and_then(|v| SegmentDesc::from_json(&String::from_utf8_lossy(v)).ok())?;
        instances.lock().insert(name.to_string(), (rev, d.instance));
        Some(Some(d.instance))
    }

    /// Starts the descriptor watch if it is not running; waits up to 3 s for its first read.
    async fn ensure_view(endpoint: &str, prefix: &str, view: &std::sync::OnceLock<etcd_lite::PrefixView>) {
        if view.get().is_some() {
            return;
        }
        let v = match etcd_lite::PrefixView::start(endpoint, format!("{prefix}segments/").as_bytes()) {
            Ok(v) => v,
            Err(e) => return tracing::warn!("watching segment descriptors in etcd {endpoint}: {e}"),
        };
        let mut rx = v.receiver();
        let synced = async {
            while !rx.borrow_and_update().synced {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(3), synced).await.is_err() {
            tracing::warn!("watching segment descriptors in etcd {endpoint}: no first read in 3 s");
        }
        let _ = view.set(v);
    }

    pub(crate) fn describe(&self) -> String {
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
    pub(crate) async fn publish(&self, d: &SegmentDesc) -> Result<(), TransferError> {
        match self {
            MetaStore::Embedded => {
                embedded().lock().insert(d.name.clone(), d.clone());
                Ok(())
            }
            MetaStore::P2p => Ok(()), // served live on the RPC port
            MetaStore::Etcd {
                endpoint,
                prefix,
                registration,
                ttl,
                ..
            } => {
                let meta = |e: etcd_lite::EtcdError| TransferError::Metadata(e.to_string());
                let mut r = registration.lock().await;
                match r.as_ref() {
                    Some(r) => r.update(d.to_json()).await.map_err(meta),
                    None => {
                        let key = Self::key(prefix, &d.name);
                        *r = Some(
                            etcd_lite::Registration::start(endpoint, key, d.to_json(), *ttl)
                                .await
                                .map_err(meta)?,
                        );
                        Ok(())
                    }
                }
            }
        }
    }

    /// Finds the descriptor of segment `name`.
    pub(crate) async fn fetch(&self, name: &str) -> Result<SegmentDesc, TransferError> {
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
                view,
                ..
            } => {
                Self::ensure_view(endpoint, prefix, view).await;
                if let Some(Some(d)) = self.watched(name) {
                    return Ok(d);
                }
                // not in the view: maybe published a moment ago; ask etcd itself
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
    pub(crate) async fn remove(&self, name: &str, instance: u64) {
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
                registration,
                ..
            } => {
                // the lease dies with this engine, and the keys under it (a successor has its own)
                let held = registration.lock().await.take();
                if let Some(r) = held {
                    let _ = r.revoke().await;
                }
                let Ok(mut c) = Self::etcd(endpoint, client).await else {
                    return;
                };
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
