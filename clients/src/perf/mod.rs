//! `nsperf`: verbs micro-benchmarks in the style of perftest (ib_write_bw, ib_read_bw,
//! ib_send_lat, ib_atomic_bw) between two processes, with `udp-raw` and `tcp` references.

pub mod client;
pub mod reference;
pub mod server;

use serde::{Deserialize, Serialize};

/// The operation a benchmark run exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Write,
    Read,
    Send,
    Atomic,
}

/// The system under test or the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    Flexns,
    UdpRaw,
    Tcp,
}

impl System {
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
    pub op: Op,
    pub size: u64,
    pub depth: u32,
    /// SEND at depth 1: the server echoes each message (ping-pong latency).
    pub echo: bool,
    /// Use low-latency QPs (transmit from the posting thread) for the exchange.
    #[serde(default)]
    pub low_latency: bool,
}

/// Private data the server answers with: where the client may read and write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
    /// Seed of the pattern the server's region holds (READ verification).
    pub seed: u64,
    /// A second region the server registered with REMOTE_READ only (access-check tests).
    pub ro_addr: u64,
    pub ro_rkey: u32,
    pub ro_len: u64,
}
