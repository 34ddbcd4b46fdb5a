//! The shard map in etcd: each `kv-server` registers its connection-manager address under
//! `PREFIX/shards/I` (and the count under `PREFIX/shards/count`); clients read the map from
//! there. The prefix keeps clusters (tenants) apart on one etcd. The embedded default needs
//! no etcd: servers are given the map (`--map`) and hand it to clients when they connect.

use crate::KvError;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Where the map lives: an etcd endpoint (`http://HOST:PORT`) and a key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdMap {
    /// The etcd endpoint (`http://HOST:PORT`).
    pub endpoint: String,
    /// The key prefix the map lives under.
    pub prefix: String,
    /// A shard's address is registered under a lease of this length, renewed by its server
    /// (every third of it): a server that dies drops out of the map within it.
    pub lease_ttl: Duration,
}

impl EtcdMap {
    /// A map at `endpoint` (normalized to a URL) under `prefix`, registered with a 10 s lease.
    pub fn new(endpoint: &str, prefix: &str) -> EtcdMap {
        EtcdMap {
            endpoint: etcd_lite::normalize_endpoint(endpoint),
            prefix: prefix.to_string(),
            lease_ttl: Duration::from_secs(10),
        }
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}shards/{rest}", self.prefix).into_bytes()
    }

    async fn client(&self) -> Result<etcd_lite::EtcdClient, KvError> {
        etcd_lite::EtcdClient::connect(&self.endpoint)
            .await
            .map_err(|e| KvError::Config(e.to_string()))
    }

    /// Registers shard `shard` of `shards` at `cm` (again after a restart, or on another
    /// server to move the shard: the newest wins, and running clients follow it): the count as
    /// is, the address under a lease its server keeps renewing while the returned
    /// registration lives (a take-over: the server it was taken from sees its registration
    /// lost and no longer registers it). Must run inside a tokio runtime (the renewals run on it).
    pub async fn register(&self, shard: u32, shards: u32, cm: SocketAddr) -> Result<etcd_lite::Registration, KvError> {
        let mut c = self.client().await?;
        let e = |e: etcd_lite::EtcdError| KvError::Config(e.to_string());
        c.put(self.key("count"), shards.to_string()).await.map_err(e)?;
        etcd_lite::Registration::take_over(&self.endpoint, self.shard_key(shard), cm.to_string(), self.lease_ttl)
            .await
            .map_err(e)
    }

    /// The key prefix of the shard map (for a [`etcd_lite::PrefixView`]).
    pub fn shards_prefix(&self) -> Vec<u8> {
        self.key("")
    }

    /// The key shard `shard`'s address is registered under.
    pub fn shard_key(&self, shard: u32) -> Vec<u8> {
        self.key(&format!("{shard:05}"))
    }

    /// Every shard's address, in order, when `entries` (the keys under
    /// [`Self::shards_prefix`]) hold a complete map; otherwise an error saying what is missing.
    pub fn complete(&self, entries: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>) -> Result<Vec<SocketAddr>, KvError> {
        let (count, shards) = self.parse(entries);
        match count {
            Some(n) if (0..n).all(|i| shards.contains_key(&i)) => Ok((0..n).map(|i| shards[&i]).collect()),
            _ => Err(KvError::Config(format!(
                "etcd at {}: the shard map under {:?} is incomplete (count {count:?}, shards {:?})",
                self.endpoint,
                self.prefix,
                shards.keys().collect::<Vec<_>>()
            ))),
        }
    }

    /// The map in a snapshot of [`Self::shards_prefix`]: the shard count, if registered, and the
    /// address of each shard registered now (a shard whose server died is absent).
    pub fn parse(
        &self,
        entries: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
    ) -> (Option<u32>, std::collections::BTreeMap<u32, SocketAddr>) {
        let start = self.key("");
        let mut count = None;
        let mut shards = std::collections::BTreeMap::new();
        for (key, value) in entries {
            let Some(k) = key.strip_prefix(&start[..]) else {
                continue;
            };
            let (k, v) = (String::from_utf8_lossy(k), String::from_utf8_lossy(value));
            if k == "count" {
                count = v.parse::<u32>().ok();
            } else if let (Ok(i), Ok(a)) = (k.parse::<u32>(), v.parse::<SocketAddr>()) {
                shards.insert(i, a);
            }
        }
        (count, shards)
    }

    /// Reads the map; waits up to `wait` for every shard to have registered.
    pub async fn fetch(&self, wait: Duration) -> Result<Vec<SocketAddr>, KvError> {
        let mut c = self.client().await?;
        let start = self.key("");
        let until = Instant::now() + wait;
        loop {
            let kvs = c.get_prefix(&start).await.map_err(|e| KvError::Config(e.to_string()))?;
            match self.complete(&kvs.into_iter().collect()) {
                Ok(addrs) => return Ok(addrs),
                Err(e) if Instant::now() > until => return Err(e),
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
