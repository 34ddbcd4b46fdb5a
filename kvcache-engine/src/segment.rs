//! Segment descriptors: what a peer needs to reach an engine and address its memory, as
//! published in the metadata store or handed out by the P2P handshake.

use crate::{TransferError, TransportKind};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Where a registered buffer lives (Mooncake's `cpu:N` / `cuda:N` location strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Location {
    /// Host memory on a NUMA node.
    Cpu(u32),
    /// GPU memory on a device (reached through a registered host mirror, see [`crate::gpu`]).
    Cuda(u32),
}

impl std::str::FromStr for Location {
    type Err = String;
    /// `cpu:N` or `cuda:N` (`cpu`, `cuda`: device 0). Mooncake's `"*"` (detect) is not a
    /// location: see [`Location::parse_requested`].
    fn from_str(s: &str) -> Result<Location, String> {
        let (kind, n) = s.split_once(':').unwrap_or((s, "0"));
        let n: u32 = n.parse().map_err(|_| format!("location {s:?}: bad device number"))?;
        match kind {
            "cpu" => Ok(Location::Cpu(n)),
            "cuda" => Ok(Location::Cuda(n)),
            "*" => Err(format!(
                "location {s:?}: \"*\" means detect, which only memory given by address can be \
                 (Location::parse_requested, hostmem::check_caller_memory)"
            )),
            _ => Err(format!("location {s:?}: expected cpu:N, cuda:N or \"*\" (detect)")),
        }
    }
}

impl Location {
    /// A location string as Mooncake's `register_memory` takes it: `"*"` (detect where the
    /// memory is, see [`crate::hostmem::check_caller_memory`]) is `None`, else `cpu:N` or
    /// `cuda:N`.
    pub fn parse_requested(s: &str) -> Result<Option<Location>, String> {
        if s == "*" {
            Ok(None)
        } else {
            s.parse().map(Some)
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Cpu(n) => write!(f, "cpu:{n}"),
            Location::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// One registered, remotely accessible buffer of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// Virtual address of the first byte (the `target_offset` of requests into it).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The flexns rkey (0 for the tcp transport).
    pub rkey: u32,
    /// Host or GPU memory (a GPU buffer is registered through its host mirror).
    pub location: Location,
}

/// A segment: one engine's remotely accessible memory and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// The segment's name (what peers open it by).
    pub name: String,
    /// The transport the engine serves its memory on.
    pub transport: TransportKind,
    /// The engine's RPC port (connection manager, descriptors).
    pub rpc: SocketAddr,
    /// The tcp transport's data port.
    #[serde(default)]
    pub data: Option<SocketAddr>,
    /// Random per engine start: a descriptor whose instance differs from the live engine's is
    /// stale (the engine restarted) and is refreshed, never used.
    pub instance: u64,
    /// Bumped on every (un)registration, so a newer descriptor is recognizable.
    pub version: u64,
    /// The registered buffers peers may address.
    pub buffers: Vec<BufferDesc>,
}

impl SegmentDesc {
    /// The buffer holding `[addr, addr+len)`, if one does.
    pub fn buffer_for(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.buffers
            .iter()
            .find(|b| addr >= b.addr && addr.checked_add(len).is_some_and(|e| e <= b.addr + b.len))
    }

    /// The descriptor as JSON (what the metadata store holds).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("descriptors serialize")
    }

    /// Parses and checks a descriptor (it came over the network or out of etcd).
    pub fn from_json(s: &str) -> Result<SegmentDesc, TransferError> {
        let d: SegmentDesc =
            serde_json::from_str(s).map_err(|e| TransferError::Metadata(format!("bad segment descriptor: {e}")))?;
        if d.buffers.len() > 1 << 20 {
            return Err(TransferError::Metadata(format!(
                "segment {}: {} buffers",
                d.name,
                d.buffers.len()
            )));
        }
        if let Some(b) = d.buffers.iter().find(|b| b.addr.checked_add(b.len).is_none()) {
            return Err(TransferError::Metadata(format!(
                "segment {}: buffer {:#x}+{} wraps",
                d.name, b.addr, b.len
            )));
        }
        if d.transport == TransportKind::Tcp && d.data.is_none() {
            return Err(TransferError::Metadata(format!(
                "segment {}: tcp transport without a data address",
                d.name
            )));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_find_buffers() {
        let d = SegmentDesc {
            name: "decode-0".into(),
            transport: TransportKind::Flexns,
            rpc: "10.0.0.2:15000".parse().unwrap(),
            data: None,
            instance: 7,
            version: 2,
            buffers: vec![BufferDesc {
                addr: 0x1000,
                len: 0x1000,
                rkey: 5,
                location: Location::Cuda(1),
            }],
        };
        let back = SegmentDesc::from_json(&d.to_json()).unwrap();
        assert_eq!(back, d);
        assert!(d.buffer_for(0x1800, 0x800).is_some());
        assert!(d.buffer_for(0x1800, 0x801).is_none());
        assert!(d.buffer_for(u64::MAX, 2).is_none());
        assert!(SegmentDesc::from_json("{").is_err());
        assert_eq!("cuda:3".parse::<Location>(), Ok(Location::Cuda(3)));
        // Mooncake's "*" means detect: not cpu:0
        assert!("*".parse::<Location>().unwrap_err().contains("detect"));
        assert_eq!(Location::parse_requested("*"), Ok(None));
        assert_eq!(Location::parse_requested("cpu:1"), Ok(Some(Location::Cpu(1))));
        assert!(Location::parse_requested("gpu").unwrap_err().contains("expected cpu:N"));
        assert!("tpu:0".parse::<Location>().is_err());
    }
}
