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
}

impl EtcdMap {
    pub fn new(endpoint: &str, prefix: &str) -> EtcdMap {
        EtcdMap {
            endpoint: etcd_lite::normalize_endpoint(endpoint),
            prefix: prefix.to_string(),
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

    /// Registers shard `shard` of `shards` at `cm` (again after a restart: the newest wins).
    pub async fn register(&self, shard: u32, shards: u32, cm: SocketAddr) -> Result<(), KvError> {
        let mut c = self.client().await?;
        for (k, v) in [
            (self.key("count"), shards.to_string()),
            (self.key(&format!("{shard:05}")), cm.to_string()),
        ] {
            c.put(k, v).await.map_err(|e| KvError::Config(e.to_string()))?;
        }
        Ok(())
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
