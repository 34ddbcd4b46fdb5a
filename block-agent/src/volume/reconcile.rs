//! Reconciling a volume's replicas when an agent attaches it anew (after its own restart, the
//! dirty regions it kept in memory are gone).
//!
//! First every replica is fenced at the attachment's epoch: from then on its node refuses the
//! requests of any earlier attachment, so what the replicas hold can only change through this
//! one. A replica is compared only once fenced.
//!
//! Every copy of a write carries the same version, drawn from one increasing sequence
//! ([`Volume::next_versions`]), and each storage node stores a block's version with it. So the
//! replicas can be compared without reading data: first a digest per 1 MiB region (written
//! flags and versions), then, where the digests differ, each block's version; the newest copy
//! of each block is written, with its version, to the replicas that lack it. An acknowledged
//! write is on a quorum of replicas, so once `replicas - quorum + 1` of them have answered the
//! newest copy of every acknowledged write is among them: with fewer, reconciling waits.
//! Until it is done reads wait and writes wait at the volume's gate, which it holds.
//!
//! A replica that does not answer is down and *unverified*: no read goes to it, and when it
//! answers again the resync fences it, compares its region digests with a clean replica's and
//! rewrites the regions that differ. A node fenced at a higher epoch than this attachment's
//! (the volume was attached elsewhere since) fences this attachment out: all its I/O fails.

use super::{Volume, BLOCK, REGION_BLOCKS};
use std::collections::hash_map::{Entry, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A boxed future of a node query's answer.
pub type Answer<T> = Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'static>>;

/// What a volume asks a storage node's admin service (by its address) about volume `volume`.
/// The control plane provides it.
pub trait NodeQueries: Send + Sync {
    /// The allocation state of each of `blocks` blocks from `lba`
    /// ([`crate::store::ALLOC_DATA`] or [`crate::store::ALLOC_HOLE`]).
    fn allocation(&self, admin: &str, volume: u32, lba: u64, blocks: u64) -> Answer<Vec<u8>>;
    /// Digests of `regions` regions of `region_blocks` blocks from region `first`, and the
    /// highest version in them ([`crate::store::VolumeStore::region_digests`]).
    fn region_digests(
        &self,
        admin: &str,
        volume: u32,
        first: u64,
        regions: u64,
        region_blocks: u64,
    ) -> Answer<(Vec<u64>, u64)>;
    /// The stored version of each of `blocks` blocks from `lba`.
    fn block_versions(&self, admin: &str, volume: u32, lba: u64, blocks: u64) -> Answer<Vec<u64>>;
    /// Fences the volume at attachment epoch `epoch` on the node, durably: it refuses the
    /// requests of lower epochs from when this answers. The answer is the fence in effect,
    /// higher than `epoch` when the volume was attached elsewhere since.
    fn fence(&self, admin: &str, volume: u32, epoch: u32) -> Answer<u32>;
}

/// [`NodeQueries`] answered from stores in this process, by name (the "admin address" a
/// volume is given): for an agent in the same process as its storage nodes, as the
/// in-process tests run them. A name with no store answers as a node that is down. A fence
/// is kept in the store only: a storage node's Solar server takes a store's fence when the
/// node starts or through [`crate::storage_node::StorageNode::fence`], so in process a
/// fenced request is refused on the wire only after that.
#[derive(Default)]
pub struct LocalStores(parking_lot::Mutex<std::collections::HashMap<String, Arc<crate::store::VolumeStore>>>);

impl LocalStores {
    /// Answers for `name` from `store` (replacing what answered before).
    pub fn set(&self, name: &str, store: Arc<crate::store::VolumeStore>) {
        self.0.lock().insert(name.to_string(), store);
    }

    /// `name` answers no more (its node stopped).
    pub fn remove(&self, name: &str) {
        self.0.lock().remove(name);
    }

    fn ask<T: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce(&crate::store::VolumeStore) -> Result<T, crate::store::StoreError>,
    ) -> Answer<T> {
        let r = match self.0.lock().get(name).cloned() {
            Some(s) => f(&s).map_err(|e| e.to_string()),
            None => Err(format!("{name}: no such storage node here")),
        };
        Box::pin(async move { r })
    }
}

impl NodeQueries for LocalStores {
    fn allocation(&self, admin: &str, _volume: u32, lba: u64, blocks: u64) -> Answer<Vec<u8>> {
        self.ask(admin, |s| s.allocation(lba, blocks))
    }

    fn region_digests(
        &self,
        admin: &str,
        _volume: u32,
        first: u64,
        regions: u64,
        region_blocks: u64,
    ) -> Answer<(Vec<u64>, u64)> {
        self.ask(admin, |s| s.region_digests(first, regions, region_blocks))
    }

    fn block_versions(&self, admin: &str, _volume: u32, lba: u64, blocks: u64) -> Answer<Vec<u64>> {
        self.ask(admin, |s| s.block_versions(lba, blocks))
    }

    fn fence(&self, admin: &str, _volume: u32, epoch: u32) -> Answer<u32> {
        self.ask(admin, |s| s.fence(epoch))
    }
}

/// Regions asked for in one digest query.
const DIGEST_BATCH: u64 = 4096;
/// How long a query may take before its replica counts as not answering.
const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

async fn bounded<T>(f: Answer<T>) -> Result<T, String> {
    tokio::time::timeout(QUERY_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {QUERY_TIMEOUT:?}")))
}

impl Volume {
    /// Reconciles the replicas in the background before the volume serves (see the module's
    /// doc); the agent calls it when it attaches a volume anew. Nothing to do without
    /// [`Volume::set_admins`]; one replica is fenced, and its digests raise the versions.
    pub fn start_reconcile(self: &Arc<Self>) {
        if self.admins.lock().1.is_none() {
            return;
        }
        let Ok(gate) = self.gate.clone().try_write_owned() else {
            return; // in use: not a new volume
        };
        self.reconciled.store(false, Ordering::Release);
        let v = Arc::downgrade(self);
        tokio::spawn(async move {
            let _gate = gate;
            let t = std::time::Instant::now();
            let mut tries = 0u32;
            loop {
                let Some(vol) = v.upgrade() else { return };
                match vol.reconcile().await {
                    Ok(copied) => {
                        tracing::info!(
                            "volume {}: replicas reconciled in {:?} ({copied} blocks copied)",
                            vol.id,
                            t.elapsed()
                        );
                        vol.reconciled.store(true, Ordering::Release);
                        vol.reconciled_cv.notify_waiters();
                        return;
                    }
                    Err(_) if vol.is_fenced() => {
                        // I/O fails from now on: let the waiting reads see it
                        vol.reconciled.store(true, Ordering::Release);
                        vol.reconciled_cv.notify_waiters();
                        return;
                    }
                    Err(e) => {
                        if tries.is_multiple_of(10) {
                            tracing::warn!("volume {}: reconciling its replicas: {e}; I/O waits", vol.id);
                        }
                        tries += 1;
                    }
                }
                drop(vol);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    /// Replica `i`'s storage-node admin address and the way to ask it.
    pub(super) fn node(&self, i: usize) -> Result<(String, Arc<dyn NodeQueries>), String> {
        let (admins, q) = self.admins.lock().clone();
        let q = q.ok_or("no node queries")?;
        let admin = admins.get(i).filter(|a| !a.is_empty()).ok_or("no admin address")?;
        Ok((admin.clone(), q))
    }

    /// Digests of every region of replica `i`.
    async fn digests(&self, i: usize) -> Result<Vec<u64>, String> {
        let (admin, q) = self.node(i)?;
        let regions = (self.size() / BLOCK).div_ceil(REGION_BLOCKS);
        let mut out = Vec::with_capacity(regions as usize);
        let mut first = 0;
        while first < regions {
            let n = DIGEST_BATCH.min(regions - first);
            let (d, highest) = bounded(q.region_digests(&admin, self.id, first, n, REGION_BLOCKS)).await?;
            // new writes must be newer than any a replica holds, even if this host's clock
            // is behind the one that wrote them
            self.raise_versions(highest.saturating_add(1));
            if d.len() as u64 != n {
                return Err(format!("{admin} answered {} digests for {n} regions", d.len()));
            }
            out.extend(d);
            first += n;
        }
        Ok(out)
    }

    /// Fences replica `i`'s node at this attachment's epoch. Err when it does not answer, or
    /// when it was fenced at a higher epoch (then this attachment is fenced too).
    async fn fence_replica(&self, i: usize) -> Result<(), String> {
        let (admin, q) = self.node(i)?;
        let epoch = self.epoch();
        let fence = bounded(q.fence(&admin, self.id, epoch)).await?;
        if fence > epoch {
            let why = format!("replica {i}'s node {admin} is fenced at epoch {fence}, above this attachment's {epoch}");
            self.mark_fenced(&why);
            return Err(why);
        }
        Ok(())
    }

    /// One reconciliation; the number of blocks copied.
    async fn reconcile(self: &Arc<Self>) -> Result<u64, String> {
        let n = self.replicas.len();
        let need = n - self.write_quorum() + 1;
        let mut digests: Vec<Option<Vec<u64>>> = Vec::with_capacity(n);
        for i in 0..n {
            let fenced = self.fence_replica(i).await;
            if self.is_fenced() {
                return Err(fenced.err().unwrap_or_default());
            }
            // even one replica is asked: its digests raise the versions above what it holds
            digests.push(match fenced {
                Ok(()) => self.digests(i).await.ok(),
                Err(_) => None,
            });
        }
        let up: Vec<usize> = (0..n).filter(|&i| digests[i].is_some()).collect();
        if up.len() < need {
            return Err(format!(
                "{} of {n} replicas answered; {need} must, to hold every acknowledged write",
                up.len()
            ));
        }
        {
            let mut h = self.health.lock();
            for i in (0..n).filter(|i| !up.contains(i)) {
                tracing::warn!(
                    "volume {}: replica {i} ({}) did not answer: down until it does and is compared",
                    self.id,
                    self.link(i).server()
                );
                h[i].down = true;
                h[i].unverified = true;
                self.counters.replica_downs.fetch_add(1, Ordering::Relaxed);
            }
            if up.len() < n && !self.resyncing.swap(true, Ordering::Relaxed) {
                tokio::spawn(super::resync(Arc::downgrade(self)));
            }
        }
        let d0 = digests[up[0]].clone().expect("answered");
        let mut copied = 0;
        for g in 0..d0.len() as u64 {
            let differ = up[1..]
                .iter()
                .any(|&i| digests[i].as_ref().expect("answered")[g as usize] != d0[g as usize]);
            if differ {
                copied += self.reconcile_region(g, &up).await?;
            }
        }
        Ok(copied)
    }

    /// Makes region `g` equal on replicas `up`: each block's newest copy (highest version)
    /// is written, with its version, to those that lack it.
    async fn reconcile_region(&self, g: u64, up: &[usize]) -> Result<u64, String> {
        let (admins, q) = self.admins.lock().clone();
        let q = q.ok_or("no node queries")?;
        let lba = g * REGION_BLOCKS;
        let count = REGION_BLOCKS.min(self.size() / BLOCK - lba);
        let mut versions = Vec::new();
        for &i in up {
            let v = bounded(q.block_versions(&admins[i], self.id, lba, count)).await?;
            if v.len() as u64 != count {
                return Err(format!(
                    "{} answered {} versions for {count} blocks",
                    admins[i],
                    v.len()
                ));
            }
            versions.push(v);
        }
        // the holes (zeroed or never written) of the replicas copied from, by replica: a hole
        // is copied as a hole
        let mut holes: HashMap<usize, Option<Vec<u8>>> = HashMap::new();
        let mut copied = 0;
        for k in 0..count as usize {
            let (best, newest) = versions
                .iter()
                .enumerate()
                .max_by_key(|(_, v)| v[k])
                .map(|(j, v)| (up[j], v[k]))
                .expect("replicas answered");
            let behind: Vec<usize> = (0..up.len())
                .filter(|&j| versions[j][k] < newest)
                .map(|j| up[j])
                .collect();
            if behind.is_empty() {
                continue;
            }
            let at = lba + k as u64;
            if let Entry::Vacant(e) = holes.entry(best) {
                e.insert(self.node_allocation(best, lba, count).await);
            }
            let hole = holes[&best].as_ref().is_some_and(|h| h[k] == crate::store::ALLOC_HOLE);
            let data: Option<Arc<[u8]>> = if hole {
                None
            } else {
                match self.link(best).read(self.at(at), 1).await {
                    Ok(Ok(d)) => Some(Arc::from(d)),
                    Ok(Err(e)) => return Err(format!("reading block {at} from replica {best}: {e}")),
                    Err(_) => return Err(format!("reading block {at} from replica {best}: the link stopped")),
                }
            };
            for i in behind {
                let copy = match &data {
                    Some(d) => self.link(i).write(self.at(at), d.clone(), true, newest),
                    None => self.link(i).write_zeroes(self.at(at), 1, newest),
                };
                match copy.await {
                    Ok(Ok(())) => {
                        copied += 1;
                        self.counters.reconciled_blocks.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(e)) => return Err(format!("copying block {at} to replica {i}: {e}")),
                    Err(_) => return Err(format!("copying block {at} to replica {i}: the link stopped")),
                }
            }
        }
        if copied > 0 {
            tracing::info!(
                "volume {}: region {g}: {copied} blocks copied to replicas that lacked them",
                self.id
            );
        }
        Ok(copied)
    }

    /// For the resync: an unverified replica `i` that answers again is compared with a clean
    /// replica, region by region; the regions that differ are marked missed (the resync
    /// rewrites them) and it is verified. Ok(false) while it does not answer.
    pub(super) async fn verify_returned(&self, i: usize) -> Result<bool, String> {
        let clean = {
            let h = self.health.lock();
            (0..h.len()).find(|&j| j != i && !h[j].down && !h[j].unverified && h[j].missed.is_empty())
        };
        let Some(c) = clean else {
            return Err("no clean replica to compare with".into());
        };
        // fenced first: what it holds changes only through this attachment from then on
        if let Err(e) = self.fence_replica(i).await {
            return if self.is_fenced() { Err(e) } else { Ok(false) };
        }
        if self.digests(i).await.is_err() {
            return Ok(false);
        }
        // compared under the whole range lock: no write changes either meanwhile
        let _all = self.locks.lock(0, u64::MAX).await;
        let theirs = self.digests(c).await?;
        let mine = self.digests(i).await?;
        let differ: Vec<u64> = (0..mine.len() as u64)
            .filter(|&g| mine.get(g as usize) != theirs.get(g as usize))
            .collect();
        let mut h = self.health.lock();
        tracing::info!(
            "volume {}: replica {i} answers again: {} of {} regions differ from replica {c}'s",
            self.id,
            differ.len(),
            mine.len()
        );
        h[i].missed.extend(differ);
        h[i].unverified = false;
        Ok(true)
    }
}
