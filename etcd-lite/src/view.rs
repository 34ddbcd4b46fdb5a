//! Watches: the changes etcd makes to a key prefix, as it makes them ([`Watch`]), and
//! [`PrefixView`], a prefix's current contents kept up to date by a watch on a thread of its
//! own. Clients follow shard maps and segment descriptors this way instead of polling etcd.

use crate::{pb, prefix_end, EtcdClient, EtcdError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::StreamExt;

/// One change to one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// `key` now holds `value` (written at store revision `revision`).
    Put {
        /// The key written.
        key: Vec<u8>,
        /// Its new value.
        value: Vec<u8>,
        /// The store revision of the write.
        revision: i64,
    },
    /// `key` was deleted (by a delete, or because its lease expired).
    Delete {
        /// The key deleted.
        key: Vec<u8>,
        /// The store revision of the delete.
        revision: i64,
    },
}

/// An open watch on a key prefix; dropping it cancels the watch (the gRPC stream closes).
pub struct Watch {
    endpoint: String,
    responses: tonic::Streaming<pb::WatchResponse>,
}

impl EtcdClient {
    /// Watches every key that starts with `prefix`, from store revision `from_revision` on (0:
    /// from now). Pair it with [`EtcdClient::get_prefix_at`] and watch from the revision after
    /// the read to miss nothing.
    pub async fn watch_prefix(&mut self, prefix: &[u8], from_revision: i64) -> Result<Watch, EtcdError> {
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(pb::WatchCreateRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                start_revision: from_revision,
                ..Default::default()
            })),
        };
        // the request stream stays open (pending) for as long as the watch lives
        let requests = tokio_stream::once(create).chain(tokio_stream::pending());
        let mut responses = self
            .watch
            .watch(requests)
            .await
            .map_err(|s| self.err("watch", s))?
            .into_inner();
        let fail = |message: String| EtcdError {
            endpoint: self.endpoint.clone(),
            what: "watch",
            message,
        };
        match responses.message().await {
            Ok(Some(r)) if r.created && !r.canceled => {}
            Ok(Some(r)) if r.compact_revision != 0 => {
                return Err(fail(format!(
                    "revision {from_revision} is compacted (the oldest kept is {})",
                    r.compact_revision
                )))
            }
            Ok(Some(r)) => return Err(fail(format!("etcd did not create the watch: {}", r.cancel_reason))),
            Ok(None) => return Err(fail("the stream ended before etcd answered".into())),
            Err(s) => return Err(self.err("watch", s)),
        }
        Ok(Watch {
            endpoint: self.endpoint.clone(),
            responses,
        })
    }
}

impl Watch {
    /// The next changes, in revision order (one or more); an error when the watch ended
    /// (etcd canceled it, the history it needs was compacted, or the connection broke). Watch
    /// again after reading the prefix afresh.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>, EtcdError> {
        let fail = |message: String| EtcdError {
            endpoint: self.endpoint.clone(),
            what: "watch",
            message,
        };
        loop {
            let r = match self.responses.message().await {
                Ok(Some(r)) => r,
                Ok(None) => return Err(fail("the stream ended".into())),
                Err(s) => return Err(fail(s.message().to_string())),
            };
            if r.canceled || r.compact_revision != 0 {
                return Err(fail(format!(
                    "etcd canceled the watch (compacted at {}): {}",
                    r.compact_revision, r.cancel_reason
                )));
            }
            if r.events.is_empty() {
                continue; // a progress notification
            }
            return Ok(r
                .events
                .into_iter()
                .filter_map(|e| {
                    let kv = e.kv?;
                    Some(if e.r#type == pb::event::EventType::Delete as i32 {
                        WatchEvent::Delete {
                            key: kv.key,
                            revision: kv.mod_revision,
                        }
                    } else {
                        WatchEvent::Put {
                            key: kv.key,
                            value: kv.value,
                            revision: kv.mod_revision,
                        }
                    })
                })
                .collect());
        }
    }
}

/// A prefix's contents at one store revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixSnapshot {
    /// The store revision these contents are as of (0 before the first read).
    pub revision: i64,
    /// Every key with the prefix (the whole key) and its value.
    pub entries: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The revision each key in `entries` was last written at: a key put again with the same
    /// value (a process that registered again) has a new one.
    pub revisions: BTreeMap<Vec<u8>, i64>,
    /// Whether the view follows etcd now: false before the first read and while the
    /// connection is broken (the entries are then the last known ones, maybe old).
    pub synced: bool,
    /// Why the view is not synced, when it was once.
    pub error: Option<String>,
}

/// A prefix's current contents, read once and then kept current by a watch, on a thread of its
/// own with its own runtime (so synchronous code can use it). After an error it reconnects,
/// reads the prefix again and watches from there (backing off up to 2 s). The thread ends when
/// every clone of the view is dropped.
#[derive(Clone)]
pub struct PrefixView {
    rx: tokio::sync::watch::Receiver<Arc<PrefixSnapshot>>,
}

impl PrefixView {
    /// Starts following `prefix` in the etcd at `endpoint` (see [`crate::normalize_endpoint`]).
    pub fn start(endpoint: &str, prefix: &[u8]) -> std::io::Result<PrefixView> {
        let (tx, rx) = tokio::sync::watch::channel(Arc::new(PrefixSnapshot::default()));
        let (endpoint, prefix) = (crate::normalize_endpoint(endpoint), prefix.to_vec());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new()
            .name("etcd-watch".into())
            .spawn(move || rt.block_on(follow(endpoint, prefix, tx)))?;
        Ok(PrefixView { rx })
    }

    /// The contents as last seen.
    pub fn current(&self) -> Arc<PrefixSnapshot> {
        self.rx.borrow().clone()
    }

    /// The contents if they changed since this view's last `changed` (or `wait_synced`);
    /// never blocks, so a client can ask before every request.
    pub fn changed(&mut self) -> Option<Arc<PrefixSnapshot>> {
        match self.rx.has_changed() {
            Ok(true) => Some(self.rx.borrow_and_update().clone()),
            _ => None,
        }
    }

    /// Waits (blocking) up to `timeout` for the first complete read of the prefix.
    pub fn wait_synced(&mut self, timeout: Duration) -> Result<Arc<PrefixSnapshot>, String> {
        let until = std::time::Instant::now() + timeout;
        loop {
            let s = self.rx.borrow_and_update().clone();
            if s.synced {
                return Ok(s);
            }
            if std::time::Instant::now() > until {
                return Err(s
                    .error
                    .clone()
                    .unwrap_or_else(|| format!("no answer from etcd in {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A receiver of every new snapshot, for async code (`changed().await`).
    pub fn receiver(&self) -> tokio::sync::watch::Receiver<Arc<PrefixSnapshot>> {
        self.rx.clone()
    }
}

async fn follow(endpoint: String, prefix: Vec<u8>, tx: tokio::sync::watch::Sender<Arc<PrefixSnapshot>>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let e = tokio::select! {
            Err(e) = follow_once(&endpoint, &prefix, &tx, &mut backoff) => e,
            _ = tx.closed() => return,
        };
        tracing::warn!(
            "following {:?} in etcd: {e}; reading it again",
            String::from_utf8_lossy(&prefix)
        );
        tx.send_modify(|s| {
            let s = Arc::make_mut(s);
            s.synced = false;
            s.error = Some(e.to_string());
        });
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = tx.closed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Reads the prefix, publishes it, and applies the watch's changes until an error.
async fn follow_once(
    endpoint: &str,
    prefix: &[u8],
    tx: &tokio::sync::watch::Sender<Arc<PrefixSnapshot>>,
    backoff: &mut Duration,
) -> Result<std::convert::Infallible, EtcdError> {
    let mut c = EtcdClient::connect(endpoint).await?;
    let (kvs, rev) = c.get_prefix_at(prefix).await?;
    let mut snap = PrefixSnapshot {
        revision: rev,
        revisions: kvs.iter().map(|(k, _, r)| (k.clone(), *r)).collect(),
        entries: kvs.into_iter().map(|(k, v, _)| (k, v)).collect(),
        synced: true,
        error: None,
    };
    let mut w = c.watch_prefix(prefix, rev + 1).await?;
    tx.send_replace(Arc::new(snap.clone()));
    *backoff = Duration::from_millis(50);
    loop {
        for e in w.next().await? {
            match e {
                WatchEvent::Put { key, value, revision } => {
                    snap.revisions.insert(key.clone(), revision);
                    snap.entries.insert(key, value);
                    snap.revision = revision;
                }
                WatchEvent::Delete { key, revision } => {
                    snap.revisions.remove(&key);
                    snap.entries.remove(&key);
                    snap.revision = revision;
                }
            }
        }
        tx.send_replace(Arc::new(snap.clone()));
    }
}
