//! block-agent: cloud block volumes over the Solar storage transport, exported to NBD clients
//! and stored durably on storage nodes.
//!
//! Not built yet: this crate is a placeholder in the workspace so its name and place are fixed.
//! Its work is tracked by the block-agent issue (Solar transport, block-server, NBD export,
//! control plane); it will build on `netstack`.
