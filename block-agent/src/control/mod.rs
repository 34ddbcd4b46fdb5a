//! The control plane: gRPC services of the storage node (volume files), of the agent
//! (attachments) and of the controller (volumes, replica placement, storage-node identity and
//! liveness, attachments), with the controller's state in an embedded file or in etcd.
//!
//! - `state`: what the controller records (volumes, nodes by id, agents) and where.
//! - `admin`: the storage node's and the agent's admin services.
//! - `controller`: the controller service.

mod admin;
mod controller;
mod state;

/// Generated protobuf types and services.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("flexns.block");
}

pub use admin::{attach_spec, node_queries, AgentAdmin, NodeAdmin, SNAPSHOT_UNCHANGED};
pub use controller::{Controller, ControllerConfig, ControllerService};
pub use state::{AgentRecord, ControlState, MetaError, MetaStore, NodeRecord, VolumeRecord, STATE_VERSION};
