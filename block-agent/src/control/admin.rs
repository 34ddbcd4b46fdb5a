//! The admin services the controller calls: the storage node's (volume files) and the agent's
//! (attachments).

use super::pb;
use crate::agent::{Agent, ReplicaAt};
use crate::storage_node::{NodeError, StorageNode};
use crate::store::{VolumeStore, ALLOC_DATA, BLOCK};
use crate::volume::{NodeQueries, ReplicaState};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tonic::{Request, Response, Status};

fn node_status(e: NodeError) -> Status {
    match e {
        NodeError::Exists(_) => Status::already_exists(e.to_string()),
        NodeError::NoVolume(_) | NodeError::NoSnapshot(..) => Status::not_found(e.to_string()),
        NodeError::InUse { .. } => Status::failed_precondition(e.to_string()),
        NodeError::Size(_) | NodeError::NotIpv4(_) => Status::invalid_argument(e.to_string()),
        NodeError::Store(crate::store::StoreError::Invalid(..)) => Status::invalid_argument(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// The storage node's admin service.
pub struct NodeAdmin(pub Arc<StorageNode>);

fn store_status(e: crate::store::StoreError) -> Status {
    match e {
        crate::store::StoreError::OutOfRange { .. } => Status::out_of_range(e.to_string()),
        e => Status::internal(e.to_string()),
    }
}

impl NodeAdmin {
    fn volume_store(&self, id: u32) -> Result<Arc<crate::store::VolumeStore>, Status> {
        self.0
            .store(id)
            .ok_or_else(|| Status::not_found(format!("volume {id} does not exist")))
    }

    /// Runs a volume-file operation (file creation, syncs) off the async threads.
    async fn on_node(
        &self,
        f: impl FnOnce(&StorageNode) -> Result<(), NodeError> + Send + 'static,
    ) -> Result<Response<pb::Empty>, Status> {
        let n = self.0.clone();
        tokio::task::spawn_blocking(move || f(&n))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(node_status)?;
        Ok(Response::new(pb::Empty {}))
    }

    /// [`pb::storage_node_admin_server::StorageNodeAdmin::copy_snapshots`]'s work: each
    /// snapshot's blocks from the source into the live volume (grown to the snapshot's size),
    /// then the snapshot taken here; last, the live blocks zeroed at version 0 and the size.
    /// The first snapshot is read whole, each later one only where it differs from the one
    /// before (the live volume holds that one already). A clone is made as a clone of its
    /// base, and only the blocks it wrote are copied; its live blocks are not zeroed.
    async fn copy_from(&self, r: &pb::CopySnapshotsRequest) -> Result<(), Status> {
        let mut src = super::controller::node_client(&r.source).await?;
        let id = r.volume;
        let ask = |snapshot, lba, blocks, since| pb::ReadSnapshotRequest {
            volume: id,
            snapshot,
            lba,
            blocks,
            since,
            own: r.clone,
        };
        let mut since = 0;
        for &snap in &r.snapshots {
            let size = src.read_snapshot(ask(snap, 0, 0, 0)).await?.into_inner().size_blocks;
            let bytes = size * BLOCK as u64;
            match self.0.store(id) {
                None if r.clone => {
                    let (parent, snapshot) = (r.parent, r.parent_snapshot);
                    self.on_node(move |n| n.create_clone(id, parent, snapshot)).await?;
                    if self.volume_store(id)?.blocks() < size {
                        self.on_node(move |n| n.resize_volume(id, bytes)).await?;
                    }
                }
                None => self.on_node(move |n| n.create_volume(id, bytes)).await.map(drop)?,
                Some(s) if s.blocks() < size => self.on_node(move |n| n.resize_volume(id, bytes)).await.map(drop)?,
                Some(_) => {}
            }
            let store = self.volume_store(id)?;
            let mut lba = 0;
            while lba < size {
                let n = (size - lba).min(SNAPSHOT_READ_BLOCKS);
                let rep = src.read_snapshot(ask(snap, lba, n, since)).await?.into_inner();
                let store = store.clone();
                tokio::task::spawn_blocking(move || place_snapshot_blocks(&store, lba, n, &rep))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))??;
                lba += n;
            }
            self.on_node(move |n| n.snapshot(id, snap)).await?;
            since = snap;
        }
        let store = self.volume_store(id)?;
        let blocks = store.blocks();
        // a clone's live blocks keep what the copy left: its own writes as of the last
        // snapshot over its base (zeroes would hide the base); the agent rewrites what the
        // clone wrote since
        if !r.clone {
            tokio::task::spawn_blocking(move || store.write_zeroes(0, blocks, 0))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(store_status)?;
        }
        if r.size > blocks * BLOCK as u64 {
            let size = r.size;
            self.on_node(move |n| n.resize_volume(id, size)).await?;
        }
        Ok(())
    }
}

/// Blocks a [`pb::ReadSnapshotRequest`] may ask for (1 MiB of data at most in a reply).
const SNAPSHOT_READ_BLOCKS: u64 = 256;

/// A [`pb::ReadSnapshotReply`] state: the block is the same in the request's `since` snapshot.
pub const SNAPSHOT_UNCHANGED: u8 = 0x80;

/// Writes what a [`pb::ReadSnapshotReply`] says of `n` blocks from `lba` into `store` at
/// version 0: runs of data blocks as one durable write each, runs of holes as zeroes; blocks
/// unchanged since the previous snapshot are already there.
fn place_snapshot_blocks(store: &VolumeStore, lba: u64, n: u64, rep: &pb::ReadSnapshotReply) -> Result<(), Status> {
    let states = &rep.states;
    let data_blocks = states.iter().filter(|&&s| s == ALLOC_DATA).count();
    if states.len() as u64 != n || rep.data.len() != data_blocks * BLOCK {
        return Err(Status::internal(format!(
            "snapshot source answered {} states and {} bytes for {n} blocks at {lba}",
            states.len(),
            rep.data.len()
        )));
    }
    let mut data = rep.data.chunks_exact(BLOCK);
    let mut k = 0;
    // runs of one kind: unchanged (already in place), data, or reads as zeros
    let kind = |s: u8| (s == SNAPSHOT_UNCHANGED, s == ALLOC_DATA);
    while k < states.len() {
        let run = states[k..].iter().take_while(|&&s| kind(s) == kind(states[k])).count();
        let at = lba + k as u64;
        match kind(states[k]) {
            (true, _) => {}
            (false, true) => {
                let blocks: Vec<(&[u8], u32)> = data.by_ref().take(run).map(|d| (d, crc32c::crc32c(d))).collect();
                store.write_blocks(at, &blocks, 0).map_err(store_status)?;
            }
            (false, false) => store.write_zeroes(at, run as u64, 0).map_err(store_status)?,
        }
        k += run;
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::storage_node_admin_server::StorageNodeAdmin for NodeAdmin {
    async fn create_volume(&self, r: Request<pb::CreateVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.create_volume(r.id, r.size)).await
    }

    async fn delete_volume(&self, r: Request<pb::DeleteVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.delete_volume(r.id)).await
    }

    async fn resize_volume(&self, r: Request<pb::ResizeVolumeRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.resize_volume(r.id, r.size)).await
    }

    async fn create_clone(&self, r: Request<pb::CreateCloneRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.create_clone(r.id, r.parent, r.snapshot)).await
    }

    async fn create_snapshot(&self, r: Request<pb::SnapshotRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.snapshot(r.volume, r.snapshot)).await
    }

    async fn delete_snapshot(&self, r: Request<pb::SnapshotRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        self.on_node(move |n| n.delete_snapshot(r.volume, r.snapshot)).await
    }

    async fn allocation(&self, r: Request<pb::AllocationRequest>) -> Result<Response<pb::AllocationReply>, Status> {
        let r = r.into_inner();
        if r.blocks > 65536 {
            return Err(Status::invalid_argument(format!(
                "{} blocks: at most 65536 per request",
                r.blocks
            )));
        }
        let store = self.volume_store(r.volume)?;
        let states = tokio::task::spawn_blocking(move || store.allocation(r.lba, r.blocks))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(store_status)?;
        Ok(Response::new(pb::AllocationReply { states }))
    }

    async fn region_digests(
        &self,
        r: Request<pb::RegionDigestsRequest>,
    ) -> Result<Response<pb::RegionDigestsReply>, Status> {
        let r = r.into_inner();
        if r.regions.saturating_mul(r.region_blocks) > 1 << 22 {
            return Err(Status::invalid_argument("at most 4194304 blocks per request"));
        }
        let store = self.volume_store(r.volume)?;
        let (digests, max_version) =
            tokio::task::spawn_blocking(move || store.region_digests(r.first, r.regions, r.region_blocks))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(store_status)?;
        Ok(Response::new(pb::RegionDigestsReply { digests, max_version }))
    }

    async fn block_versions(
        &self,
        r: Request<pb::BlockVersionsRequest>,
    ) -> Result<Response<pb::BlockVersionsReply>, Status> {
        let r = r.into_inner();
        if r.blocks > 65536 {
            return Err(Status::invalid_argument("at most 65536 blocks per request"));
        }
        let store = self.volume_store(r.volume)?;
        let versions = tokio::task::spawn_blocking(move || store.block_versions(r.lba, r.blocks))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(store_status)?;
        Ok(Response::new(pb::BlockVersionsReply { versions }))
    }

    async fn fence(&self, r: Request<pb::FenceRequest>) -> Result<Response<pb::FenceReply>, Status> {
        let r = r.into_inner();
        let epoch = self.0.fence(r.volume, r.epoch).await.map_err(|e| match e {
            NodeError::NoVolume(_) => Status::not_found(e.to_string()),
            e => Status::internal(e.to_string()),
        })?;
        Ok(Response::new(pb::FenceReply { epoch }))
    }

    async fn read_snapshot(
        &self,
        r: Request<pb::ReadSnapshotRequest>,
    ) -> Result<Response<pb::ReadSnapshotReply>, Status> {
        let r = r.into_inner();
        if r.blocks > SNAPSHOT_READ_BLOCKS {
            return Err(Status::invalid_argument(format!(
                "{} blocks: at most {SNAPSHOT_READ_BLOCKS} per request",
                r.blocks
            )));
        }
        let store = self.volume_store(r.volume)?;
        let size = store
            .snapshot_blocks(r.snapshot)
            .ok_or_else(|| Status::not_found(format!("volume {} has no snapshot {}", r.volume, r.snapshot)))?;
        if r.since != 0 && (r.since == r.snapshot || store.snapshot_blocks(r.since).is_none()) {
            return Err(Status::not_found(format!(
                "volume {} has no snapshot {} other than {} to compare with",
                r.volume, r.since, r.snapshot
            )));
        }
        let reply = tokio::task::spawn_blocking(move || {
            let end = r.lba.saturating_add(r.blocks).min(size);
            let mut states = Vec::with_capacity(end.saturating_sub(r.lba) as usize);
            let mut data = Vec::new();
            for lba in r.lba..end {
                if (r.since != 0 && store.snapshot_unchanged(r.snapshot, r.since, lba)? == Some(true))
                    || (r.own && store.snapshot_reads_base(r.snapshot, lba)?)
                {
                    states.push(SNAPSHOT_UNCHANGED);
                    continue;
                }
                let state = store.snapshot_allocation(r.snapshot, lba)?;
                if state == ALLOC_DATA {
                    data.extend_from_slice(&store.read_snapshot(r.snapshot, lba)?);
                }
                states.push(state);
            }
            Ok::<_, crate::store::StoreError>(pb::ReadSnapshotReply {
                states,
                data,
                size_blocks: size,
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(store_status)?;
        Ok(Response::new(reply))
    }

    async fn copy_snapshots(&self, r: Request<pb::CopySnapshotsRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        if r.snapshots.is_empty() || r.size == 0 || !r.size.is_multiple_of(BLOCK as u64) {
            return Err(Status::invalid_argument(
                "copy snapshots: name at least one snapshot and a size that is a multiple of 4096",
            ));
        }
        if self.0.store(r.volume).is_some() {
            return Err(Status::already_exists(format!("volume {} exists", r.volume)));
        }
        tracing::info!(
            "volume {}: copying snapshots {:?} from storage node {}",
            r.volume,
            r.snapshots,
            r.source
        );
        let t = std::time::Instant::now();
        let copied = self.copy_from(&r).await;
        match &copied {
            Ok(()) => tracing::info!("volume {}: copied its snapshots in {:?}", r.volume, t.elapsed()),
            Err(e) => tracing::warn!("volume {}: copying its snapshots failed: {}", r.volume, e.message()),
        }
        if copied.is_err() {
            // nothing half made stays behind
            let id = r.volume;
            let _ = self.on_node(move |n| n.delete_volume(id)).await;
        }
        copied.map(|_| Response::new(pb::Empty {}))
    }

    async fn list_volumes(&self, _: Request<pb::ListVolumesRequest>) -> Result<Response<pb::ListVolumesReply>, Status> {
        let volumes = self
            .0
            .volumes()
            .into_iter()
            .map(|(id, blocks)| {
                let store = self.0.store(id);
                let st = store.as_ref().map(|s| s.stats()).unwrap_or_default();
                let base = store.as_ref().and_then(|s| s.base());
                pb::NodeVolume {
                    id,
                    size: blocks * 4096,
                    writes: st.writes,
                    reads: st.reads,
                    corrupt_reads: st.corrupt_reads,
                    snapshots: store.as_ref().map(|s| s.snapshots()).unwrap_or_default(),
                    base_volume: base.map_or(0, |b| b.0),
                    base_snapshot: base.map_or(0, |b| b.1),
                    failed: store.as_ref().and_then(|s| s.poisoned()).unwrap_or_default(),
                }
            })
            .collect();
        Ok(Response::new(pb::ListVolumesReply {
            volumes,
            addr: self.0.addr().to_string(),
        }))
    }
}

/// Makes `agent` export what `v` describes (under its export name, else its name): attached
/// anew, or, when already exported, only its replicas' addresses followed.
pub fn attach_spec(agent: &Agent, v: &pb::VolumeSpec) -> Result<(), Status> {
    let name = if v.export_name.is_empty() {
        &v.name
    } else {
        &v.export_name
    };
    let replicas: Vec<ReplicaAt> = v
        .replicas
        .iter()
        .map(|r| ReplicaAt {
            node: r.node.clone(),
            addr: r.addr.clone(),
            admin: r.admin.clone(),
        })
        .collect();
    let vol = agent
        .attach(name, v.id, v.size, &replicas, v.write_quorum as usize, v.epoch)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    vol.set_qos(v.qos.as_ref().map(super::controller::qos_limits).unwrap_or_default());
    Ok(())
}

/// The storage nodes' admin services, for an agent's volumes.
pub fn node_queries() -> Arc<dyn NodeQueries> {
    Arc::new(NodeAdminQueries)
}

/// The storage nodes' admin services, asked by the agent's volumes (allocation maps, and
/// the digests and versions that reconcile replicas).
struct NodeAdminQueries;

/// Runs one admin call on node `admin`, bounded to 5 s.
fn ask_node<T: Send + 'static, F>(admin: &str, call: F) -> crate::volume::Answer<T>
where
    F: FnOnce(
            super::pb::storage_node_admin_client::StorageNodeAdminClient<tonic::transport::Channel>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, Status>> + Send>>
        + Send
        + 'static,
{
    let admin = admin.to_string();
    Box::pin(async move {
        let ask = async { call(super::controller::node_client(&admin).await?).await };
        match tokio::time::timeout(std::time::Duration::from_secs(5), ask).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(e.message().to_string()),
            Err(_) => Err("no answer within 5 s".into()),
        }
    })
}

impl NodeQueries for NodeAdminQueries {
    fn allocation(&self, admin: &str, volume: u32, lba: u64, blocks: u64) -> crate::volume::Answer<Vec<u8>> {
        ask_node(admin, move |mut c| {
            Box::pin(async move {
                let r = c.allocation(pb::AllocationRequest { volume, lba, blocks }).await?;
                Ok(r.into_inner().states)
            })
        })
    }

    fn region_digests(
        &self,
        admin: &str,
        volume: u32,
        first: u64,
        regions: u64,
        region_blocks: u64,
    ) -> crate::volume::Answer<(Vec<u64>, u64)> {
        ask_node(admin, move |mut c| {
            Box::pin(async move {
                let req = pb::RegionDigestsRequest {
                    volume,
                    first,
                    regions,
                    region_blocks,
                };
                let r = c.region_digests(req).await?.into_inner();
                Ok((r.digests, r.max_version))
            })
        })
    }

    fn block_versions(&self, admin: &str, volume: u32, lba: u64, blocks: u64) -> crate::volume::Answer<Vec<u64>> {
        ask_node(admin, move |mut c| {
            Box::pin(async move {
                let req = pb::BlockVersionsRequest { volume, lba, blocks };
                Ok(c.block_versions(req).await?.into_inner().versions)
            })
        })
    }

    fn fence(&self, admin: &str, volume: u32, epoch: u32) -> crate::volume::Answer<u32> {
        ask_node(admin, move |mut c| {
            Box::pin(async move { Ok(c.fence(pb::FenceRequest { volume, epoch }).await?.into_inner().epoch) })
        })
    }
}

/// The agent's admin service.
pub struct AgentAdmin {
    /// The agent it administers.
    pub agent: Arc<Agent>,
    /// The NBD address clients use.
    pub nbd: String,
}

#[tonic::async_trait]
impl pb::agent_admin_server::AgentAdmin for AgentAdmin {
    async fn attach(&self, r: Request<pb::AttachRequest>) -> Result<Response<pb::Empty>, Status> {
        let v = r
            .into_inner()
            .volume
            .ok_or_else(|| Status::invalid_argument("volume is missing"))?;
        attach_spec(&self.agent, &v)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn detach(&self, r: Request<pb::DetachRequest>) -> Result<Response<pb::Empty>, Status> {
        let name = r.into_inner().export_name;
        if !self.agent.detach(&name) {
            return Err(Status::not_found(format!("no export {name:?}")));
        }
        Ok(Response::new(pb::Empty {}))
    }

    async fn snapshot(&self, r: Request<pb::SnapshotExportRequest>) -> Result<Response<pb::Empty>, Status> {
        let r = r.into_inner();
        let v = self
            .agent
            .exports()
            .get(&r.export_name)
            .ok_or_else(|| Status::not_found(format!("no export {:?}", r.export_name)))?;
        if r.node_admins.len() != v.replicas().len() {
            return Err(Status::invalid_argument(format!(
                "{} node admin addresses for {} replicas",
                r.node_admins.len(),
                v.replicas().len()
            )));
        }
        let t = std::time::Instant::now();
        let id = v.id();
        v.quiesced(super::controller::snapshot_on_nodes(&r.node_admins, id, r.snapshot))
            .await
            .map_err(Status::failed_precondition)??;
        tracing::info!(
            "export {}: snapshot {} taken, writes held off for {:?}",
            r.export_name,
            r.snapshot,
            t.elapsed()
        );
        Ok(Response::new(pb::Empty {}))
    }

    async fn list_exports(&self, _: Request<pb::ListExportsRequest>) -> Result<Response<pb::ListExportsReply>, Status> {
        let ex = self.agent.exports();
        let exports = ex
            .names()
            .into_iter()
            .filter_map(|n| {
                let v = ex.get(&n)?;
                let c = v.counters();
                let states = v.replica_states();
                let qos = v.qos();
                let statuses: Vec<_> = v.replicas().iter().map(|l| l.status()).collect();
                Some(pb::ExportInfo {
                    export_name: n,
                    volume: v.id(),
                    size: v.size(),
                    replicas: v.replicas().iter().map(|l| l.server().to_string()).collect(),
                    paths_up: statuses.iter().map(|s| s.paths_up as u32).collect(),
                    reads: c.reads.load(Ordering::Relaxed),
                    writes: c.writes.load(Ordering::Relaxed),
                    read_failovers: c.read_failovers.load(Ordering::Relaxed),
                    repairs: c.repairs.load(Ordering::Relaxed),
                    replica_states: states
                        .iter()
                        .map(|(s, _)| {
                            match s {
                                ReplicaState::InSync => "in-sync",
                                ReplicaState::CatchingUp => "catching-up",
                                ReplicaState::Down => "down",
                            }
                            .to_string()
                        })
                        .collect(),
                    regions_behind: states.iter().map(|&(_, n)| n as u32).collect(),
                    write_quorum: v.write_quorum() as u32,
                    degraded_writes: c.degraded_writes.load(Ordering::Relaxed),
                    replica_downs: c.replica_downs.load(Ordering::Relaxed),
                    resynced_regions: c.resynced_regions.load(Ordering::Relaxed),
                    reconciled_blocks: c.reconciled_blocks.load(Ordering::Relaxed),
                    replica_paths: statuses
                        .iter()
                        .map(|s| pb::ReplicaPaths {
                            paths: s
                                .path_stats
                                .iter()
                                .map(|p| pb::PathHealth {
                                    up: p.up,
                                    sent: p.sent,
                                    delivered: p.delivered,
                                    lost: p.lost,
                                    srtt_ns: p.srtt_ns,
                                    port: p.port as u32,
                                    repaths: p.repaths,
                                })
                                .collect(),
                        })
                        .collect(),
                    qos: Some(super::controller::qos_pb(&qos.0)),
                    throttled: qos.1,
                    throttled_us: qos.2.as_micros() as u64,
                })
            })
            .collect();
        let transport = match self.agent.carrier() {
            crate::link::Carrier::Udp { paths } => format!("solar/udp, {paths} paths"),
            crate::link::Carrier::Tcp => "tcp".to_string(),
        };
        Ok(Response::new(pb::ListExportsReply {
            exports,
            nbd: self.nbd.clone(),
            transport,
        }))
    }
}
