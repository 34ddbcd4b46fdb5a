//! The shard map in etcd: each `kv-server` registers its connection-manager address under
//! `PREFIX/shards/I` (and the count under `PREFIX/shards/count`); clients read the map from
//! there. The prefix keeps clusters (tenants) apart on one etcd. The embedded default needs
//! no etcd: servers are given the map (`--map`) and hand it to clients when they connect.

use crate::KvError;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("etcdserverpb");
}

/// Where the map lives: an etcd endpoint (`http://HOST:PORT`) and a key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdMap {
    pub endpoint: String,
    pub prefix: String,
}

fn err(endpoint: &str, what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Config(format!("etcd at {endpoint}: {what}: {e}"))
}

impl EtcdMap {
    pub fn new(endpoint: &str, prefix: &str) -> EtcdMap {
        let endpoint = if endpoint.contains("://") {
            endpoint.to_string()
        } else {
            format!("http://{endpoint}")
        };
        EtcdMap {
            endpoint,
            prefix: prefix.to_string(),
        }
    }

    fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}shards/{rest}", self.prefix).into_bytes()
    }

    async fn client(&self) -> Result<pb::kv_client::KvClient<tonic::transport::Channel>, KvError> {
        let ch = tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .map_err(|e| err(&self.endpoint, "bad endpoint", e))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| err(&self.endpoint, "connect", e))?;
        Ok(pb::kv_client::KvClient::new(ch))
    }

    /// Registers shard `shard` of `shards` at `cm` (again after a restart: the newest wins).
    pub async fn register(&self, shard: u32, shards: u32, cm: SocketAddr) -> Result<(), KvError> {
        let mut c = self.client().await?;
        for (k, v) in [
            (self.key("count"), shards.to_string()),
            (self.key(&format!("{shard:05}")), cm.to_string()),
        ] {
            c.put(pb::PutRequest {
                key: k,
                value: v.into_bytes(),
                ..Default::default()
            })
            .await
            .map_err(|e| err(&self.endpoint, "put", e.message()))?;
        }
        Ok(())
    }

    /// Reads the map; waits up to `wait` for every shard to have registered.
    pub async fn fetch(&self, wait: Duration) -> Result<Vec<SocketAddr>, KvError> {
        let mut c = self.client().await?;
        let start = self.key("");
        let mut end = start.clone();
        if let Some(last) = end.last_mut() {
            *last += 1; // the prefix's range: "…/shards/" up to "…/shards0"
        }
        let until = Instant::now() + wait;
        loop {
            let r = c
                .range(pb::RangeRequest {
                    key: start.clone(),
                    range_end: end.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|e| err(&self.endpoint, "range", e.message()))?
                .into_inner();
            let mut count = None;
            let mut shards = std::collections::BTreeMap::new();
            for kv in r.kvs {
                let k = String::from_utf8_lossy(&kv.key[start.len()..]).into_owned();
                let v = String::from_utf8_lossy(&kv.value).into_owned();
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
