//! The engine's RPC port: the segment descriptor service (P2P handshake) beside netstack's
//! connection manager, one tonic server.

use crate::segment::SegmentDesc;
use parking_lot::RwLock;
use std::sync::Arc;

/// Generated protobuf types and gRPC stubs.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("flexns.kvcache.v1");
}

/// Hands out the live descriptor.
pub(crate) struct DescService(pub Arc<RwLock<SegmentDesc>>);

#[tonic::async_trait]
impl pb::transfer_rpc_server::TransferRpc for DescService {
    async fn get_segment(
        &self,
        req: tonic::Request<pb::GetSegmentRequest>,
    ) -> Result<tonic::Response<pb::SegmentReply>, tonic::Status> {
        let d = self.0.read().clone();
        let want = req.into_inner().name;
        if !want.is_empty() && want != d.name {
            return Err(tonic::Status::not_found(format!(
                "this engine is segment {}, not {want}",
                d.name
            )));
        }
        Ok(tonic::Response::new(pb::SegmentReply {
            descriptor_json: d.to_json(),
        }))
    }
}
