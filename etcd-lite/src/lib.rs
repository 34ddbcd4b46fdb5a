//! A client for the part of etcd's v3 API that the flexns services keep metadata in, over gRPC
//! (tonic) against a real `etcd` server: put, get, prefix range, delete and compare-and-put
//! transactions; leases ([`Registration`] keeps a live process's key alive, and never takes
//! it from another live process); watches
//! ([`Watch`], and [`PrefixView`], a prefix's current contents kept by a watch).
//!
//! The protobuf subset is compiled with protox (pure Rust), so building needs no `protoc`.
//! Every error names the endpoint and the operation, so "etcd at http://10.0.0.5:2379: put:
//! connection refused" says where to look.

use std::time::Duration;

mod registration;
mod view;
pub use registration::Registration;
pub use view::{PrefixSnapshot, PrefixView, Watch, WatchEvent};

#[allow(clippy::all, missing_docs)]
mod pb {
    tonic::include_proto!("etcdserverpb");
}

/// An etcd request failed; the message names the endpoint and the operation.
#[derive(Debug, Clone, thiserror::Error)]
#[error("etcd at {endpoint}: {what}: {message}")]
pub struct EtcdError {
    /// The endpoint (`http://HOST:PORT`).
    pub endpoint: String,
    /// The operation (connect, put, range, delete, txn).
    pub what: &'static str,
    /// The cause.
    pub message: String,
}

/// The outcome of a conditional leased put ([`EtcdClient::put_leased_if_free`],
/// [`EtcdClient::put_leased_if_ours`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeasedPut {
    /// Written, at this store revision.
    Written(i64),
    /// Not written: the key holds `value` under lease `lease` (0: a key put without a lease).
    Held {
        /// The holder's lease.
        lease: i64,
        /// The value the key holds.
        value: Vec<u8>,
    },
    /// Not written: the key is absent.
    Absent,
}

/// A connected client of one etcd endpoint. Cheap to clone (one gRPC channel).
#[derive(Clone)]
pub struct EtcdClient {
    endpoint: String,
    kv: pb::kv_client::KvClient<tonic::transport::Channel>,
    lease: pb::lease_client::LeaseClient<tonic::transport::Channel>,
    watch: pb::watch_client::WatchClient<tonic::transport::Channel>,
}

/// `http://HOST:PORT` for `HOST:PORT`, `etcd://HOST:PORT` or an `http(s)://` URL.
pub fn normalize_endpoint(endpoint: &str) -> String {
    if let Some(rest) = endpoint.strip_prefix("etcd://") {
        format!("http://{rest}")
    } else if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

/// The end of the key range holding every key that starts with `prefix` (etcd's convention).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.last_mut() {
        if *last < 0xff {
            *last += 1;
            return end;
        }
        end.pop();
    }
    vec![0] // every key
}

impl EtcdClient {
    /// Connects to `endpoint` (see [`normalize_endpoint`]); fails after 3 s if nothing answers.
    pub async fn connect(endpoint: &str) -> Result<EtcdClient, EtcdError> {
        let endpoint = normalize_endpoint(endpoint);
        let err = |what, e: &dyn std::fmt::Display| EtcdError {
            endpoint: endpoint.clone(),
            what,
            message: e.to_string(),
        };
        let ch = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .map_err(|e| err("bad endpoint", &e))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| err("connect", &e))?;
        Ok(EtcdClient {
            kv: pb::kv_client::KvClient::new(ch.clone()),
            lease: pb::lease_client::LeaseClient::new(ch.clone()),
            watch: pb::watch_client::WatchClient::new(ch),
            endpoint,
        })
    }

    /// The endpoint this client talks to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn err(&self, what: &'static str, s: tonic::Status) -> EtcdError {
        EtcdError {
            endpoint: self.endpoint.clone(),
            what,
            message: s.message().to_string(),
        }
    }

    /// Stores `value` under `key` (replacing what was there).
    pub async fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Result<(), EtcdError> {
        self.kv
            .put(pb::PutRequest {
                key: key.into(),
                value: value.into(),
                ..Default::default()
            })
            .await
            .map_err(|s| self.err("put", s))?;
        Ok(())
    }

    /// The value under `key`, if any.
    pub async fn get(&mut self, key: impl Into<Vec<u8>>) -> Result<Option<Vec<u8>>, EtcdError> {
        Ok(self.get_revision(key).await?.map(|(v, _)| v))
    }

    /// The key-value record under `key` (value, revisions, lease); `None` when it is absent.
    async fn first_kv(&mut self, key: impl Into<Vec<u8>>) -> Result<Option<pb::KeyValue>, EtcdError> {
        let r = self
            .kv
            .range(pb::RangeRequest {
                key: key.into(),
                ..Default::default()
            })
            .await
            .map_err(|s| self.err("range", s))?
            .into_inner();
        Ok(r.kvs.into_iter().next())
    }

    /// The value under `key` and its modification revision (the revision of the write that set
    /// it), for a later [`EtcdClient::put_if_unchanged`]; `None` when the key is absent.
    pub async fn get_revision(&mut self, key: impl Into<Vec<u8>>) -> Result<Option<(Vec<u8>, i64)>, EtcdError> {
        Ok(self.first_kv(key).await?.map(|kv| (kv.value, kv.mod_revision)))
    }

    /// Stores `value` under `key` only if the key's modification revision is still
    /// `mod_revision` (0: only if the key is absent), in one etcd transaction. Returns the new
    /// revision, or `None` when someone else wrote the key since (nothing is written then).
    pub async fn put_if_unchanged(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        mod_revision: i64,
    ) -> Result<Option<i64>, EtcdError> {
        let key = key.into();
        let r = self
            .kv
            .txn(pb::TxnRequest {
                compare: vec![pb::Compare {
                    result: pb::compare::CompareResult::Equal as i32,
                    target: pb::compare::CompareTarget::Mod as i32,
                    key: key.clone(),
                    target_union: Some(pb::compare::TargetUnion::ModRevision(mod_revision)),
                    range_end: Vec::new(),
                }],
                success: vec![pb::RequestOp {
                    request: Some(pb::request_op::Request::RequestPut(pb::PutRequest {
                        key,
                        value: value.into(),
                        ..Default::default()
                    })),
                }],
                failure: Vec::new(),
            })
            .await
            .map_err(|s| self.err("txn", s))?
            .into_inner();
        Ok(r.succeeded.then(|| r.header.map_or(0, |h| h.revision)))
    }

    /// Every `(key, value)` whose key starts with `prefix`, in key order.
    pub async fn get_prefix(&mut self, prefix: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>, EtcdError> {
        let (kvs, _) = self.get_prefix_at(prefix).await?;
        Ok(kvs.into_iter().map(|(k, v, _)| (k, v)).collect())
    }

    /// Every `(key, value, mod_revision)` whose key starts with `prefix`, and the store's
    /// revision they were read at: a [`Self::watch_prefix`] from the revision after it sees
    /// every later change and none before.
    pub async fn get_prefix_at(&mut self, prefix: &[u8]) -> Result<(Vec<(Vec<u8>, Vec<u8>, i64)>, i64), EtcdError> {
        let r = self
            .kv
            .range(pb::RangeRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                ..Default::default()
            })
            .await
            .map_err(|s| self.err("range", s))?
            .into_inner();
        let rev = r.header.map_or(0, |h| h.revision);
        Ok((
            r.kvs
                .into_iter()
                .map(|kv| (kv.key, kv.value, kv.mod_revision))
                .collect(),
            rev,
        ))
    }

    /// Deletes `key`; returns whether it existed.
    pub async fn delete(&mut self, key: impl Into<Vec<u8>>) -> Result<bool, EtcdError> {
        let r = self
            .kv
            .delete_range(pb::DeleteRangeRequest {
                key: key.into(),
                ..Default::default()
            })
            .await
            .map_err(|s| self.err("delete", s))?
            .into_inner();
        Ok(r.deleted > 0)
    }

    /// Grants a lease of `ttl_secs` seconds; returns its id. Keys put under it
    /// ([`Self::put_leased`]) are deleted when it expires unless [`Self::keep_alive`] renews it.
    pub async fn grant_lease(&mut self, ttl_secs: i64) -> Result<i64, EtcdError> {
        let r = self
            .lease
            .lease_grant(pb::LeaseGrantRequest { ttl: ttl_secs, id: 0 })
            .await
            .map_err(|s| self.err("lease grant", s))?
            .into_inner();
        if !r.error.is_empty() {
            return Err(EtcdError {
                endpoint: self.endpoint.clone(),
                what: "lease grant",
                message: r.error,
            });
        }
        Ok(r.id)
    }

    /// Renews lease `id` once; returns its TTL in seconds, 0 when it has expired (its keys are
    /// gone: grant another and put them again).
    pub async fn keep_alive(&mut self, id: i64) -> Result<i64, EtcdError> {
        let mut stream = self
            .lease
            .lease_keep_alive(tokio_stream::once(pb::LeaseKeepAliveRequest { id }))
            .await
            .map_err(|s| self.err("lease keepalive", s))?
            .into_inner();
        match stream.message().await.map_err(|s| self.err("lease keepalive", s))? {
            Some(r) => Ok(r.ttl),
            None => Err(EtcdError {
                endpoint: self.endpoint.clone(),
                what: "lease keepalive",
                message: "the stream ended without an answer".into(),
            }),
        }
    }

    /// Revokes lease `id`: its keys are deleted now.
    pub async fn revoke_lease(&mut self, id: i64) -> Result<(), EtcdError> {
        self.lease
            .lease_revoke(pb::LeaseRevokeRequest { id })
            .await
            .map_err(|s| self.err("lease revoke", s))?;
        Ok(())
    }

    /// The seconds lease `id` has left, -1 when it has expired or was revoked (etcd's
    /// LeaseTimeToLive). A lease its holder renews jumps back up; a dead holder's only falls.
    pub async fn lease_time_to_live(&mut self, id: i64) -> Result<i64, EtcdError> {
        let r = self
            .lease
            .lease_time_to_live(pb::LeaseTimeToLiveRequest { id, keys: false })
            .await
            .map_err(|s| self.err("lease time-to-live", s))?
            .into_inner();
        Ok(r.ttl)
    }

    /// The lease `key` is attached to (0: none) and its value; `None` when the key is absent.
    pub async fn get_lease(&mut self, key: impl Into<Vec<u8>>) -> Result<Option<(i64, Vec<u8>)>, EtcdError> {
        Ok(self.first_kv(key).await?.map(|kv| (kv.lease, kv.value)))
    }

    /// Stores `value` under `key` attached to `lease`, in one etcd transaction, only if no
    /// lease holds the key (it is absent, or was put without a lease): a key another process
    /// keeps under its live lease is left alone. See [`LeasedPut`] for the outcome.
    pub async fn put_leased_if_free(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<LeasedPut, EtcdError> {
        self.put_leased_if_lease(key.into(), value.into(), lease, 0).await
    }

    /// Stores `value` under `key` attached to `lease`, in one etcd transaction, only if the key
    /// is held under `lease` now (it was not taken over, nor deleted, since).
    pub async fn put_leased_if_ours(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<LeasedPut, EtcdError> {
        self.put_leased_if_lease(key.into(), value.into(), lease, lease).await
    }

    /// Puts `value` under `key` with `lease` if the key's lease is `expect` (etcd compares an
    /// absent key's lease as 0); otherwise reads who holds it, in the same transaction.
    async fn put_leased_if_lease(
        &mut self,
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
        expect: i64,
    ) -> Result<LeasedPut, EtcdError> {
        let r = self
            .kv
            .txn(pb::TxnRequest {
                compare: vec![pb::Compare {
                    result: pb::compare::CompareResult::Equal as i32,
                    target: pb::compare::CompareTarget::Lease as i32,
                    key: key.clone(),
                    target_union: Some(pb::compare::TargetUnion::Lease(expect)),
                    range_end: Vec::new(),
                }],
                success: vec![pb::RequestOp {
                    request: Some(pb::request_op::Request::RequestPut(pb::PutRequest {
                        key: key.clone(),
                        value,
                        lease,
                        ..Default::default()
                    })),
                }],
                failure: vec![pb::RequestOp {
                    request: Some(pb::request_op::Request::RequestRange(pb::RangeRequest {
                        key,
                        ..Default::default()
                    })),
                }],
            })
            .await
            .map_err(|s| self.err("txn", s))?
            .into_inner();
        if r.succeeded {
            return Ok(LeasedPut::Written(r.header.map_or(0, |h| h.revision)));
        }
        let held = r.responses.into_iter().find_map(|op| match op.response {
            Some(pb::response_op::Response::ResponseRange(rr)) => rr.kvs.into_iter().next(),
            _ => None,
        });
        Ok(match held {
            Some(kv) => LeasedPut::Held {
                lease: kv.lease,
                value: kv.value,
            },
            None => LeasedPut::Absent,
        })
    }

    /// Stores `value` under `key`, attached to lease `lease` (deleted when the lease expires).
    pub async fn put_leased(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<(), EtcdError> {
        self.kv
            .put(pb::PutRequest {
                key: key.into(),
                value: value.into(),
                lease,
                ..Default::default()
            })
            .await
            .map_err(|s| self.err("put", s))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_follows_etcd() {
        assert_eq!(prefix_end(b"a/b/"), b"a/b0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn endpoints_are_normalized() {
        assert_eq!(normalize_endpoint("127.0.0.1:2379"), "http://127.0.0.1:2379");
        assert_eq!(normalize_endpoint("etcd://h:1"), "http://h:1");
        assert_eq!(normalize_endpoint("https://h:1"), "https://h:1");
    }

    #[tokio::test]
    async fn an_unreachable_etcd_is_named_in_the_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = EtcdClient::connect(&format!("127.0.0.1:{port}"))
            .await
            .err()
            .expect("no etcd there");
        let m = e.to_string();
        assert!(m.contains(&format!("127.0.0.1:{port}")) && m.contains("connect"), "{m}");
    }
}

pub mod local {
    //! A throwaway local `etcd` server process (Debian's etcd-server) for tests and the
    //! one-machine cluster: a free client port, a temporary data directory, removed on drop.

    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    /// A running local etcd; killed and its data removed on drop.
    pub struct LocalEtcd {
        child: Child,
        dir: std::path::PathBuf,
        /// The client URL (`http://127.0.0.1:PORT`).
        pub url: String,
    }

    impl Drop for LocalEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn free_port() -> std::io::Result<u16> {
        Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
    }

    /// Whether an `etcd` binary is on the PATH.
    pub fn installed() -> bool {
        Command::new("etcd").arg("--version").output().is_ok()
    }

    impl LocalEtcd {
        /// Starts etcd on free ports and waits (up to 20 s) until it answers as itself. A port
        /// another process took between choosing and binding it (tests start several etcds at
        /// once) makes this one exit, or another etcd answer there: it is started again on
        /// other ports (up to 5 times).
        pub fn start(tag: &str) -> std::io::Result<LocalEtcd> {
            let mut last = String::new();
            for attempt in 0..5 {
                match Self::try_start(tag, attempt) {
                    Ok(e) => return Ok(e),
                    Err(e) => last = e.to_string(),
                }
            }
            Err(std::io::Error::other(format!(
                "etcd did not start in 5 attempts: {last}"
            )))
        }

        fn try_start(tag: &str, attempt: u32) -> std::io::Result<LocalEtcd> {
            let (cp, pp) = (free_port()?, free_port()?);
            let dir = std::env::temp_dir().join(format!("etcd-{tag}-{}-{cp}", std::process::id()));
            // a name no other etcd has: the readiness check asks for it
            let name = format!("{tag}-{}-{cp}-{attempt}", std::process::id()).replace(' ', "_");
            let url = format!("http://127.0.0.1:{cp}");
            let peer = format!("http://127.0.0.1:{pp}");
            let child = Command::new("etcd")
                .args(["--name", &name, "--data-dir"])
                .arg(&dir)
                .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
                .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &format!("{name}={peer}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            let mut e = LocalEtcd { child, dir, url };
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                if let Some(st) = e.child.try_wait()? {
                    return Err(std::io::Error::other(format!("etcd on {cp} exited: {st}")));
                }
                if answers_as(cp, &name) {
                    return Ok(e);
                }
                if Instant::now() > until {
                    return Err(std::io::Error::other(format!(
                        "etcd did not answer on {cp} within 20 s"
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Whether the etcd answering on `port` has a member named `name` (etcd's JSON gateway).
    fn answers_as(port: u16, name: &str) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = "POST /v3/cluster/member/list HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                   Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
        let mut body = String::new();
        s.write_all(req.as_bytes()).is_ok()
            && s.read_to_string(&mut body).is_ok()
            && body.contains(&format!("\"{name}\""))
    }

    /// Checks a leased key's life against the process that renews it: `key` must exist, still
    /// exist after more than twice `ttl` (the lease is renewed), and be gone within `ttl` plus
    /// 3 s once `kill` has killed the process (it could not clean up). Returns how long after
    /// the kill the key was gone; `Err` says which step failed.
    pub fn check_lease_expiry(url: &str, key: &str, ttl: Duration, kill: impl FnOnce()) -> Result<Duration, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let mut kv = rt
            .block_on(crate::EtcdClient::connect(url))
            .map_err(|e| e.to_string())?;
        let mut present = || rt.block_on(kv.get(key)).map(|v| v.is_some()).map_err(|e| e.to_string());
        if !present()? {
            return Err(format!("{key} was not published"));
        }
        std::thread::sleep(ttl * 2 + Duration::from_secs(1));
        if !present()? {
            return Err(format!(
                "{key} was gone while its process ran: the lease was not renewed"
            ));
        }
        kill();
        let t0 = Instant::now();
        while present()? {
            if t0.elapsed() > ttl + Duration::from_secs(3) {
                return Err(format!("{key} outlived its {ttl:?} lease after the kill"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(t0.elapsed())
    }
}
