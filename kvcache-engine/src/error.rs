//! The engine's error type.

/// Errors of the transfer engine. Messages name what to fix: the field, the segment, the peer
/// and its address, the path and the cause.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    /// A bad configuration value; the message names the field.
    #[error("config: {0}")]
    Config(String),
    /// A bad argument to an API call (an address outside registered memory, a freed batch...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Segment metadata could not be published or found.
    #[error("metadata: {0}")]
    Metadata(String),
    /// A peer could not be reached or refused; the message names it.
    #[error("peer {peer}: {message}")]
    Peer {
        /// The peer (segment name or address).
        peer: String,
        /// What went wrong.
        message: String,
    },
    /// The descriptor of a segment names an engine instance that is no longer the one running
    /// at its address (the engine restarted, or another took its name); refreshed, never used.
    #[error("segment {segment}: stale descriptor (published instance {published:#x}, live instance {live:#x})")]
    StaleDescriptor {
        /// The segment whose descriptor is stale.
        segment: String,
        /// The engine instance the descriptor names.
        published: u64,
        /// The engine instance running at the descriptor's address.
        live: u64,
    },
    /// A transfer failed; the message names the peer, the path and the cause.
    #[error("transfer failed: {0}")]
    Failed(String),
    /// A transfer did not finish within the timeout.
    #[error("transfer timed out: {0}")]
    TimedOut(String),
    /// GPU memory is unavailable (no `gpu` feature, no driver, no device).
    #[error("gpu: {0}")]
    Gpu(String),
    /// A local I/O error (binding a port, a socket).
    #[error("I/O: {0}")]
    Io(String),
}

impl From<std::io::Error> for TransferError {
    fn from(e: std::io::Error) -> Self {
        TransferError::Io(e.to_string())
    }
}

impl From<netstack::verbs::VerbsError> for TransferError {
    fn from(e: netstack::verbs::VerbsError) -> Self {
        TransferError::Io(format!("flexns: {e}"))
    }
}
