//! `nsperf`: verbs micro-benchmarks in the style of perftest (ib_write_bw, ib_read_bw,
//! ib_send_lat, ib_atomic_bw) between two processes, with `udp-raw` and `tcp` references.

pub mod args;
pub mod client;
pub mod completion;
pub mod offload_ops;
pub mod reference;
pub mod server;

use serde::{Deserialize, Serialize};

/// The operation a benchmark run exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    /// One-sided RDMA WRITE.
    Write,
    /// One-sided RDMA READ.
    Read,
    /// Two-sided SEND into the server's posted receives.
    Send,
    /// Atomic fetch-and-add.
    Atomic,
    /// The built-in batched-READ offload: `--batch` ranges of `--size` bytes per request.
    BatchRead,
    /// Look up the `--hops`-th node of a linked list: one offload request, or one READ per
    /// node from the client (`--mode`).
    ListWalk,
    /// The RedN hash get: one SEND, answered by a WRITE_WITH_IMM from a chain of work
    /// requests on the server.
    RednGet,
}

/// Where a list walk runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WalkMode {
    /// The server's offload handler walks the list (one round trip).
    Offload,
    /// The client READs node after node.
    Client,
}

/// Nodes of the server's linked list (keys 1..=LIST_NODES, node `j` holds key `j + 1`).
pub const LIST_NODES: u32 = 64;
/// Value bytes of list nodes and hash entries.
pub const VALUE_LEN: usize = 64;
/// Buckets of the server's RedN hash table (key `k` in bucket `k % TABLE_BUCKETS`).
pub const TABLE_BUCKETS: u64 = 4096;

/// The value the server stores for key `k` (list and table).
pub fn value_of(k: u64) -> [u8; VALUE_LEN] {
    std::array::from_fn(|i| crate::bench::pattern_byte(k * VALUE_LEN as u64 + i as u64, 0x7a11))
}

/// The system under test or the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    /// The flexns stack.
    Flexns,
    /// Plain UDP sockets (a reference without reliability).
    UdpRaw,
    /// Kernel TCP (the reference).
    Tcp,
}

impl System {
    /// The system's name as on the command line (`flexns`, `udp-raw`, `tcp`).
    pub fn name(self) -> &'static str {
        match self {
            System::Flexns => "flexns",
            System::UdpRaw => "udp-raw",
            System::Tcp => "tcp",
        }
    }
}

/// Private data a client sends with its connection request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// The operation the client will run.
    pub op: Op,
    /// Message size in bytes.
    pub size: u64,
    /// Work requests in flight per QP.
    pub depth: u32,
    /// SEND at depth 1: the server echoes each message (ping-pong latency).
    pub echo: bool,
    /// Use low-latency QPs (transmit from the posting thread) for the exchange.
    #[serde(default)]
    pub low_latency: bool,
    /// The ping-pong's SENDs are signaled: the server signals its echoes too.
    #[serde(default)]
    pub signaled: bool,
    /// RedN get: the client's buffer the answers are written to.
    #[serde(default)]
    pub resp_addr: u64,
    /// The rkey of that buffer.
    #[serde(default)]
    pub resp_rkey: u32,
    /// Bytes of the server's region this client writes (its QPs' slots); 0: the whole region.
    /// Each session gets a window of its own, so concurrent clients (the testbeds run two)
    /// never overwrite each other's slots and each one's read-back checks its own data.
    #[serde(default)]
    pub need: u64,
    /// The client run's id: its QPs share one window.
    #[serde(default)]
    pub session: u64,
}

/// Private data the server answers with: where the client may read and write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// The client's window of the region (`off` bytes into it), `len` bytes.
    pub addr: u64,
    /// The rkey of the region.
    pub rkey: u32,
    /// Length of the window in bytes.
    pub len: u64,
    /// Where the window starts in the region (the server's pattern is by region offset).
    #[serde(default)]
    pub off: u64,
    /// Seed of the pattern the server's region holds (READ verification).
    pub seed: u64,
    /// A second region the server registered with REMOTE_READ only (access-check tests).
    pub ro_addr: u64,
    /// The rkey of that region.
    pub ro_rkey: u32,
    /// Length of that region in bytes.
    pub ro_len: u64,
    /// The linked list (offload and client walks) and the RedN hash table.
    #[serde(default)]
    pub list_head: u64,
    /// The rkey of the region holding the list and the table.
    #[serde(default)]
    pub kv_rkey: u32,
    /// Address of the RedN hash table.
    #[serde(default)]
    pub table_addr: u64,
}
