//! [`Registration`]: a key that says a process is alive (a shard's address, a segment
//! descriptor, a storage node's or agent's addresses), kept under a lease the process renews.
//! When the process dies the renewals stop and etcd deletes the key within the lease's TTL.

use crate::{EtcdClient, EtcdError};
use std::sync::Arc;
use std::time::Duration;

struct State {
    value: Vec<u8>,
    lease: i64,
}

/// A leased key kept alive by a task on the tokio runtime it was started on. Dropping it stops
/// the renewals (the key then expires); [`Registration::revoke`] deletes it at once.
pub struct Registration {
    client: EtcdClient,
    key: Vec<u8>,
    state: Arc<tokio::sync::Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Puts `value` under `key` with a new lease of `ttl` (at least 1 s) and renews the lease
    /// every third of it. A lease that expired anyway (etcd unreachable for longer than `ttl`)
    /// is replaced and the key put again. Must be called inside a tokio runtime.
    pub async fn start(
        endpoint: &str,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Result<Registration, EtcdError> {
        let (key, value) = (key.into(), value.into());
        let ttl_secs = ttl.as_secs().max(1) as i64;
        let mut client = EtcdClient::connect(endpoint).await?;
        let lease = client.grant_lease(ttl_secs).await?;
        client.put_leased(key.clone(), value.clone(), lease).await?;
        let state = Arc::new(tokio::sync::Mutex::new(State { value, lease }));
        let task = tokio::spawn(renew(client.clone(), key.clone(), state.clone(), ttl_secs));
        Ok(Registration {
            client,
            key,
            state,
            task,
        })
    }

    /// Puts a new value under the key (same lease); later re-registrations put this one.
    pub async fn update(&self, value: impl Into<Vec<u8>>) -> Result<(), EtcdError> {
        let mut s = self.state.lock().await;
        s.value = value.into();
        let (v, lease) = (s.value.clone(), s.lease);
        self.client.clone().put_leased(self.key.clone(), v, lease).await
    }

    /// Stops renewing and revokes the lease: etcd deletes the key now (a successor that put
    /// the key under its own lease keeps it).
    pub async fn revoke(self) -> Result<(), EtcdError> {
        self.task.abort();
        let lease = self.state.lock().await.lease;
        self.client.clone().revoke_lease(lease).await
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn renew(mut client: EtcdClient, key: Vec<u8>, state: Arc<tokio::sync::Mutex<State>>, ttl_secs: i64) {
    let name = String::from_utf8_lossy(&key).into_owned();
    let every = Duration::from_millis(ttl_secs as u64 * 1000 / 3);
    loop {
        tokio::time::sleep(every).await;
        let mut s = state.lock().await;
        match client.keep_alive(s.lease).await {
            Ok(left) if left > 0 => {}
            Ok(_) => {
                tracing::warn!("etcd key {name}: its lease expired (etcd was out of reach); registering again");
                let again = async {
                    let lease = client.grant_lease(ttl_secs).await?;
                    client.put_leased(key.clone(), s.value.clone(), lease).await?;
                    Ok::<i64, EtcdError>(lease)
                };
                match again.await {
                    Ok(lease) => s.lease = lease,
                    Err(e) => tracing::warn!("etcd key {name}: registering again: {e}"),
                }
            }
            Err(e) => tracing::warn!("etcd key {name}: renewing its lease: {e}"),
        }
    }
}
