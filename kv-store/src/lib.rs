//! kv-store: a DrTM-style key-value store whose gets are served inside the network stack.
//!
//! Not built yet: this crate is a placeholder in the workspace so its name and place are fixed.
//! Its work is tracked by the kv-store issue (registered-memory index, four get paths, YCSB);
//! it will build on `netstack`'s offloading engine.
