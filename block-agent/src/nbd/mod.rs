//! NBD export of volumes: [`proto`] holds the wire format and request checks, [`server`] the
//! negotiation and transmission phases over TCP or a unix socket.

pub mod client;
pub mod proto;
pub mod server;
