//! The agent: the volumes attached to this host, exported over NBD, with one [`Link`] per
//! storage node shared by every volume that has a replica there.

use crate::link::{Carrier, Link, LinkConfig, LinkError};
use crate::nbd::server::Exports;
use crate::volume::{Volume, VolumeConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// Errors of attaching a volume.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("replica address {0:?} is not IP:PORT")]
    Address(String),
    #[error("volume {0} has no replicas")]
    NoReplicas(u32),
    #[error("volume size {0} is not a positive multiple of 4096")]
    Size(u64),
    #[error("export name must not be empty")]
    Name,
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// What an agent carries volumes over.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub carrier: Carrier,
    /// Link settings template (the server address is filled in per storage node).
    pub link: LinkConfig,
    pub volume: VolumeConfig,
}

impl AgentConfig {
    /// Solar over UDP with `paths` paths, or TCP.
    pub fn new(carrier: Carrier) -> AgentConfig {
        AgentConfig {
            carrier,
            link: LinkConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), carrier),
            volume: VolumeConfig::default(),
        }
    }
}

/// An agent's state.
pub struct Agent {
    cfg: AgentConfig,
    exports: Arc<Exports>,
    links: Mutex<HashMap<SocketAddr, Arc<Link>>>,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Arc<Agent> {
        Arc::new(Agent {
            cfg,
            exports: Exports::new(),
            links: Mutex::new(HashMap::new()),
        })
    }

    /// The exports (for the NBD server).
    pub fn exports(&self) -> &Arc<Exports> {
        &self.exports
    }

    pub fn carrier(&self) -> Carrier {
        self.cfg.carrier
    }

    fn link(&self, addr: SocketAddr) -> Result<Arc<Link>, LinkError> {
        let mut links = self.links.lock();
        if let Some(l) = links.get(&addr) {
            return Ok(l.clone());
        }
        let mut c = self.cfg.link.clone();
        c.server = addr;
        c.carrier = self.cfg.carrier;
        let l = Arc::new(Link::start(c)?);
        links.insert(addr, l.clone());
        Ok(l)
    }

    /// Exports volume `id` of `size` bytes on `replicas` as `name` (replacing an export of
    /// that name: a resized volume is attached again; open connections keep the old size).
    pub fn attach(&self, name: &str, id: u32, size: u64, replicas: &[String]) -> Result<Arc<Volume>, AttachError> {
        if name.is_empty() {
            return Err(AttachError::Name);
        }
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(AttachError::Size(size));
        }
        if replicas.is_empty() {
            return Err(AttachError::NoReplicas(id));
        }
        let mut links = Vec::new();
        for r in replicas {
            let a: SocketAddr = r.parse().map_err(|_| AttachError::Address(r.clone()))?;
            links.push(self.link(a)?);
        }
        let v = Volume::new(id, size, links, self.cfg.volume.clone());
        self.exports.insert(name, v.clone());
        tracing::info!(
            "attached volume {id} ({size} bytes, {} replicas) as export {name:?}",
            replicas.len()
        );
        Ok(v)
    }

    /// Stops exporting `name` (open connections finish with the volume they have).
    pub fn detach(&self, name: &str) -> bool {
        self.exports.remove(name).is_some()
    }
}
