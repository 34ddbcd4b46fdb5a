//! kvcache-engine: Mooncake-style KVCache transfer between LLM prefill and decode nodes.
//!
//! Not built yet: this crate is a placeholder in the workspace so its name and place are fixed.
//! Its work is tracked by the kvcache-engine issue (TransferEngine API, segments, metadata,
//! spraying); it will build on `netstack`.
