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
    pub endpoint: String,
    pub prefix: String,
    /// A shard's address is registered under a lease of this length, renewed by its server
    /// (every third of it): a server that dies drops out of the map within it.
    pub lease_ttl: Duration,
}

impl EtcdMap {
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

    /// Registers shard `shard` of `shards` at `cm` (again after a restart: the newest wins):
    /// the count as is, the address under a new lease, whose id is returned.
    pub async fn register(&self, shard: u32, shards: u32, cm: SocketAddr) -> Result<i64, KvError> {
        let mut c = self.client().await?;
        let e = |e: etcd_lite::EtcdError| KvError::Config(e.to_string());
        c.put(self.key("count"), shards.to_string()).await.map_err(e)?;
        let lease = c.grant_lease(self.lease_ttl.as_secs().max(1) as i64).await.map_err(e)?;
        c.put_leased(self.key(&format!("{shard:05}")), cm.to_string(), lease)
            .await
            .map_err(e)?;
        Ok(lease)
    }

    /// Keeps shard `shard`'s registration alive while the server runs (spawned on its
    /// runtime): renews the lease every third of its length, registers again if it expired
    /// (etcd unreachable for longer than the lease).
    pub async fn keep_registered(self, shard: u32, shards: u32, cm: SocketAddr, mut lease: i64) {
        // one connection, made again only after an error
        let mut conn: Option<etcd_lite::EtcdClient> = None;
        loop {
            tokio::time::sleep(self.lease_ttl / 3).await;
            let c = match conn.as_mut() {
                Some(c) => c,
                None => match self.client().await {
                    Ok(c) => conn.insert(c),
                    Err(e) => {
                        tracing::warn!("shard {shard}: renewing its registration: {e}");
                        continue;
                    }
                },
            };
            match c.keep_alive(lease).await {
                Ok(ttl) if ttl > 0 => {}
                Ok(_) => {
                    tracing::warn!("shard {shard}: its etcd lease expired; registering again");
                    match self.register(shard, shards, cm).await {
                        Ok(l) => lease = l,
                        Err(e) => tracing::warn!("shard {shard}: registering again: {e}"),
                    }
                }
                Err(e) => {
                    tracing::warn!("shard {shard}: renewing its registration: {e}");
                    conn = None;
                }
            }
        }
    }

    /// Reads the map; waits up to `wait` for every shard to have registered.
    pub async fn fetch(&self, wait: Duration) -> Result<Vec<SocketAddr>, KvError> {
        let mut c = self.client().await?;
        let start = self.key("");
        let until = Instant::now() + wait;
        loop {
            let kvs = c.get_prefix(&start).await.map_err(|e| KvError::Config(e.to_string()))?;
            let mut count = None;
            let mut shards = std::collections::BTreeMap::new();
            for (key, value) in kvs {
                let k = String::from_utf8_lossy(&key[start.len()..]).into_owned();
                let v = String::from_utf8_lossy(&value).into_owned();
                if k == "count" {
                    count = v.parse::<u32>().ok();
                } else if let (Ok(i), Ok(a)) = (k.parse::<u32>(), v.parse::<SocketAddr>()) {
                    shards.insert(i, a);
                }
            }
            if let Some(n) = count {
                if (0..n).all(|i| shards.contains_key(&i)) {
                    return Ok((0..n).map(|i| shards[&i]).collect());
                }
            }
            if Instant::now() > until {
                return Err(KvError::Config(format!(
                    "etcd at {}: the shard map under {:?} is incomplete (count {count:?}, shards {:?})",
                    self.endpoint,
                    self.prefix,
                    shards.keys().collect::<Vec<_>>()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
