//! [`Registration`]: a key that says a process is alive (a shard's address, a segment
//! descriptor, a storage node's or agent's addresses), kept under a lease the process renews.
//! When the process dies the renewals stop and etcd deletes the key within the lease's TTL.
//!
//! Every write of the key is an etcd transaction on the key's lease, so a process never takes
//! the key from another live one by accident: a process that was paused or cut off until its
//! lease expired (a zombie) finds its successor's key when it comes back, leaves it alone and
//! reports the loss ([`Registration::lost`], [`Registration::when_lost`]) instead of
//! overwriting it. Only [`Registration::take_over`] replaces a live holder, on purpose.

use crate::{EtcdClient, EtcdError, LeasedPut};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct State {
    value: Vec<u8>,
    lease: i64,
}

/// Why the key was lost, once it was: set once, never cleared.
type Lost = tokio::sync::watch::Sender<Option<EtcdError>>;

/// A leased key kept alive by a task on the tokio runtime it was started on. Dropping it stops
/// the renewals (the key then expires); [`Registration::revoke`] deletes it at once.
pub struct Registration {
    client: EtcdClient,
    key: Vec<u8>,
    state: Arc<tokio::sync::Mutex<State>>,
    lost: Arc<Lost>,
    task: tokio::task::JoinHandle<()>,
}

/// How [`Registration`]'s first put treats a key another lease holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// Wait out a holder whose lease is running out; refuse one that renews it.
    IfFree,
    /// Replace the holder (the newest registration wins).
    TakeOver,
}

/// How often [`Registration::start`] looks again at a key another lease holds.
const HELD_POLL: Duration = Duration::from_millis(250);

impl Registration {
    /// Puts `value` under `key` with a new lease of `ttl` (at least 1 s) and renews the lease
    /// every third of it. Must be called inside a tokio runtime.
    ///
    /// The key is only taken when no lease holds it. When another lease does, this waits for
    /// that lease to run out (a predecessor that died without revoking it: a restart after a
    /// crash waits at most the rest of its lease) and fails, with an error naming the key and
    /// the holder's lease, as soon as the holder renews it (another live process registered
    /// the same key) or when it outlives what it had left by 2 s.
    ///
    /// A lease that expired anyway (etcd unreachable for longer than `ttl`) is replaced and the
    /// key put again only if no other process registered it meanwhile; if one did, the key is
    /// left to it and this registration is lost (see [`Registration::lost`]).
    pub async fn start(
        endpoint: &str,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Result<Registration, EtcdError> {
        Self::begin(endpoint, key.into(), value.into(), ttl, Claim::IfFree).await
    }

    /// As [`Registration::start`], but puts the key even when another live process holds it:
    /// for keys whose newest registration is meant to win (a kv-store shard moved to another
    /// server). The process it was taken from sees its registration lost at its next renewal.
    pub async fn take_over(
        endpoint: &str,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Result<Registration, EtcdError> {
        Self::begin(endpoint, key.into(), value.into(), ttl, Claim::TakeOver).await
    }

    async fn begin(
        endpoint: &str,
        key: Vec<u8>,
        value: Vec<u8>,
        ttl: Duration,
        claim: Claim,
    ) -> Result<Registration, EtcdError> {
        let ttl_secs = ttl.as_secs().max(1) as i64;
        let mut client = EtcdClient::connect(endpoint).await?;
        let lease = client.grant_lease(ttl_secs).await?;
        let put = match claim {
            Claim::IfFree => claim_free(&mut client, &key, &value, lease).await,
            Claim::TakeOver => take(&mut client, &key, &value, lease).await,
        };
        if let Err(e) = put {
            let _ = client.revoke_lease(lease).await;
            return Err(e);
        }
        let state = Arc::new(tokio::sync::Mutex::new(State { value, lease }));
        let lost = Arc::new(tokio::sync::watch::Sender::new(None));
        let task = tokio::spawn(renew(
            client.clone(),
            key.clone(),
            state.clone(),
            lost.clone(),
            ttl_secs,
        ));
        Ok(Registration {
            client,
            key,
            state,
            lost,
            task,
        })
    }

    /// Puts a new value under the key (same lease); later re-registrations put this one. Fails,
    /// and the registration is lost, when another process holds the key now: its value stays.
    pub async fn update(&self, value: impl Into<Vec<u8>>) -> Result<(), EtcdError> {
        if let Some(e) = self.lost() {
            return Err(e);
        }
        let mut s = self.state.lock().await;
        s.value = value.into();
        let (v, lease) = (s.value.clone(), s.lease);
        let mut c = self.client.clone();
        let put = match c.put_leased_if_ours(self.key.clone(), v.clone(), lease).await? {
            // deleted (by hand): ours to put again while our lease lives
            LeasedPut::Absent => c.put_leased_if_free(self.key.clone(), v, lease).await?,
            other => other,
        };
        match put {
            LeasedPut::Written(_) => Ok(()),
            LeasedPut::Held { lease: holder, .. } => Err(lose(&self.lost, &c, &self.key, holder)),
            LeasedPut::Absent => Err(EtcdError {
                endpoint: c.endpoint().to_string(),
                what: "registration",
                message: format!("{}: the key vanished while it was put", name(&self.key)),
            }),
        }
    }

    /// The lease the key is held under now (a new one after an expired one was replaced).
    pub async fn lease(&self) -> i64 {
        self.state.lock().await.lease
    }

    /// Why this registration no longer holds its key, once it does not: another process's
    /// lease holds it (a successor registered it while this process's lease had expired, or
    /// took it over). The renewals have stopped then and the key is left to the other process.
    pub fn lost(&self) -> Option<EtcdError> {
        self.lost.borrow().clone()
    }

    /// Resolves when the registration is lost (see [`Registration::lost`]), with the reason;
    /// never while it holds its key. Owns what it needs: spawn it or select on it.
    pub fn when_lost(&self) -> impl std::future::Future<Output = EtcdError> + Send + 'static {
        let mut rx = self.lost.subscribe();
        async move {
            let lost = rx.wait_for(Option::is_some).await.ok().and_then(|e| e.clone());
            match lost {
                Some(e) => e,
                // the renewals and the registration are gone without a loss: never lost now
                None => std::future::pending().await,
            }
        }
    }

    /// Stops renewing and revokes the lease: etcd deletes the key now (a successor that put
    /// the key under its own lease keeps it). A lost registration's lease may be gone already:
    /// that is not an error.
    pub async fn revoke(self) -> Result<(), EtcdError> {
        self.task.abort();
        let lease = self.state.lock().await.lease;
        match self.client.clone().revoke_lease(lease).await {
            Err(_) if self.lost().is_some() => Ok(()),
            r => r,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn name(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

/// Records that `holder` holds the key now and returns (and logs) the reason.
fn lose(lost: &Lost, client: &EtcdClient, key: &[u8], holder: i64) -> EtcdError {
    let e = EtcdError {
        endpoint: client.endpoint().to_string(),
        what: "registration",
        message: format!(
            "{} is held by lease {holder:x} (hex) of another process: this process no longer \
             registers it and leaves it to that one",
            name(key)
        ),
    };
    tracing::warn!("{e}");
    lost.send_if_modified(|l| {
        let first = l.is_none();
        if first {
            *l = Some(e.clone());
        }
        first
    });
    e
}

/// Puts the key under `lease` if no lease holds it, waiting out a holder whose lease runs out.
async fn claim_free(client: &mut EtcdClient, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
    let refuse = |client: &EtcdClient, holder: i64, why: String| EtcdError {
        endpoint: client.endpoint().to_string(),
        what: "register",
        message: format!(
            "{} is held by lease {holder:x} (hex) of another process: {why}; not taking it over",
            name(key)
        ),
    };
    // the holder and the seconds its lease had left when last looked at
    let mut seen: Option<(i64, i64)> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        let holder = match client.put_leased_if_free(key.to_vec(), value.to_vec(), lease).await? {
            LeasedPut::Written(_) => return Ok(()),
            LeasedPut::Absent => continue, // gone between the compare and the read: try again
            LeasedPut::Held { lease: holder, .. } => holder,
        };
        let left = client.lease_time_to_live(holder).await?;
        match seen {
            Some((h, before)) if h == holder && left > before => {
                return Err(refuse(
                    client,
                    holder,
                    "it renews it (a live process registered it)".into(),
                ));
            }
            Some((h, _)) if h != holder => {
                return Err(refuse(client, holder, "it registered it while this one waited".into()));
            }
            _ => {}
        }
        let until = *deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(left.max(0) as u64 + 2));
        if Instant::now() > until {
            return Err(refuse(client, holder, format!("it outlived the {left} s it had left")));
        }
        if seen.is_none() {
            tracing::info!(
                "etcd key {}: held by lease {holder:x} with {left} s left; waiting for it to run out",
                name(key)
            );
        }
        seen = Some((holder, left));
        tokio::time::sleep(HELD_POLL).await;
        // our own lease must outlive the wait, which can be longer than it
        if client.keep_alive(lease).await? <= 0 {
            return Err(EtcdError {
                endpoint: client.endpoint().to_string(),
                what: "register",
                message: format!("{}: this process's new lease expired while it waited", name(key)),
            });
        }
    }
}

/// Puts the key under `lease` whoever holds it (the newest registration wins).
async fn take(client: &mut EtcdClient, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
    if let Some((holder, _)) = client.get_lease(key.to_vec()).await? {
        if holder != 0 {
            tracing::info!("etcd key {}: taking it over from lease {holder:x}", name(key));
        }
    }
    client.put_leased(key.to_vec(), value.to_vec(), lease).await
}

async fn renew(
    mut client: EtcdClient,
    key: Vec<u8>,
    state: Arc<tokio::sync::Mutex<State>>,
    lost: Arc<Lost>,
    ttl_secs: i64,
) {
    let name = name(&key);
    let every = Duration::from_millis(ttl_secs as u64 * 1000 / 3);
    loop {
        tokio::time::sleep(every).await;
        let mut s = state.lock().await;
        if lost.borrow().is_some() {
            // an update found the key taken: nothing of ours to keep alive
            let _ = client.revoke_lease(s.lease).await;
            return;
        }
        match client.keep_alive(s.lease).await {
            Ok(left) if left > 0 => {
                // still ours? a take-over (or a put by hand) moves the key to another lease
                match client.get_lease(key.clone()).await {
                    Ok(Some((holder, _))) if holder != s.lease => {
                        lose(&lost, &client, &key, holder);
                        let _ = client.revoke_lease(s.lease).await;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("etcd key {name}: reading its holder: {e}"),
                }
            }
            Ok(_) => {
                tracing::warn!(
                    "etcd key {name}: its lease expired (etcd was out of reach, or this process \
                     was paused); registering again unless another process did"
                );
                let lease = match client.grant_lease(ttl_secs).await {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::warn!("etcd key {name}: registering again: {e}");
                        continue;
                    }
                };
                match client.put_leased_if_free(key.clone(), s.value.clone(), lease).await {
                    Ok(LeasedPut::Written(_)) => s.lease = lease,
                    Ok(LeasedPut::Held { lease: holder, .. }) => {
                        lose(&lost, &client, &key, holder);
                        let _ = client.revoke_lease(lease).await;
                        return;
                    }
                    other => {
                        // an error (Absent cannot follow a failed compare on a free key) is
                        // retried at the next renewal, under a new lease then
                        let why = match other {
                            Err(e) => e.to_string(),
                            _ => "the key vanished while it was put".into(),
                        };
                        tracing::warn!("etcd key {name}: registering again: {why}; trying at the next renewal");
                        let _ = client.revoke_lease(lease).await;
                    }
                }
            }
            Err(e) => tracing::warn!("etcd key {name}: renewing its lease: {e}"),
        }
    }
}
