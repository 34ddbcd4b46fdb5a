//! `nsperf`: verbs micro-benchmarks in the style of perftest (ib_write_bw, ib_read_bw,
//! ib_send_lat, ib_atomic_bw) between two processes, with `udp-raw` and `tcp` references.

pub mod client;
pub mod offload_ops;
pub mod reference;
pub mod server;

use serde::{Deserialize, Serialize};

/// Data-path and congestion-control settings both ends take (the testbed's knobs).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NetArgs {
    /// Line rate the congestion-control algorithms assume (`200mbit`, `10gbit`, bytes/s).
    #[arg(long, value_parser = netstack::cc::params::parse_rate)]
    pub line_rate: Option<u64>,
    /// An algorithm parameter, `ALG.FIELD=VALUE` (e.g. `dcqcn.g=0.0078125`); repeatable.
    #[arg(long = "cc-param", value_name = "ALG.FIELD=VALUE")]
    pub cc_params: Vec<String>,
    /// Emulated one-way propagation delay added to received packets, microseconds
    /// [config: rx_delay_us].
    #[arg(long)]
    pub rx_delay_us: Option<u64>,
    /// Send every packet on its own (no UDP GSO), as a NIC does: what a shaped bottleneck needs.
    #[arg(long)]
    pub no_gso: bool,
    /// Receive datagrams one by one (no UDP GRO).
    #[arg(long)]
    pub no_gro: bool,
    /// Send UDP checksum 0 so a switch may rewrite the CC header (the testbed's INT stamper).
    #[arg(long)]
    pub no_udp_checksum: bool,
    /// Bytes a congestion-controlled QP may send back to back above its rate.
    #[arg(long, value_parser = crate::bench::parse_size)]
    pub pacing_burst: Option<u64>,
    /// Multipath: new packets a QP sends on one path before its spray policy picks again.
    #[arg(long)]
    pub spray_burst: Option<u32>,
    /// Another local address of this host for address-pair paths (repeatable; paired by
    /// position with the peer's).
    #[arg(long = "extra-addr")]
    pub extra_addrs: Vec<std::net::Ipv4Addr>,
    /// What the data path runs over: `udp`, or `shm` (same-host peers through shared memory:
    /// WRITEs and READs by one copy into the peer's memory, the rest through rings)
    /// [config: link].
    #[arg(long, value_parser = parse_link)]
    pub link: Option<netstack::config::LinkMode>,
    /// With `--link shm`: WRITEs and READs go through the rings as packets instead of one copy
    /// [config: same_host_copy = false].
    #[arg(long)]
    pub no_same_host_copy: bool,
    /// ICRC mode the QPs offer: `icrc`, or `none` for flexns peers on a trusted link (no CRC
    /// pass; the UDP checksum protects the bytes). A connection runs `none` only when both ends
    /// offer it and send UDP checksums; the JSON says which it ran [config: qp.icrc].
    #[arg(long, value_parser = parse_icrc)]
    pub icrc: Option<netstack::transport::rc::IcrcMode>,
}

/// Parses an `--icrc` value, `icrc` or `none`.
pub fn parse_icrc(s: &str) -> Result<netstack::transport::rc::IcrcMode, String> {
    s.parse()
}

/// The `--link` value (and config spelling) of a link mode.
pub fn link_name(l: netstack::config::LinkMode) -> &'static str {
    match l {
        netstack::config::LinkMode::Udp => "udp",
        netstack::config::LinkMode::Shm => "shm",
    }
}

/// Parses a `--link` value, `udp` or `shm` (the flag of nsperf and kvcache-bench).
pub fn parse_link(s: &str) -> Result<netstack::config::LinkMode, String> {
    match s {
        "udp" => Ok(netstack::config::LinkMode::Udp),
        "shm" => Ok(netstack::config::LinkMode::Shm),
        o => Err(format!("{o:?}: expected udp or shm")),
    }
}

impl NetArgs {
    /// Applies these settings to a context configuration; the error names the bad flag.
    pub fn apply(&self, cfg: &mut netstack::verbs::ContextConfig) -> anyhow::Result<()> {
        let mut p = cfg.cc.clone();
        if let Some(r) = self.line_rate {
            p.set_line_rate(r);
        }
        cfg.cc = p
            .with_overrides(&self.cc_params)
            .map_err(|e| anyhow::anyhow!("--cc-param: {e}"))?;
        if let Some(d) = self.rx_delay_us {
            cfg.rx_delay_us = d;
        }
        if let Some(l) = self.link {
            cfg.link = l;
        }
        cfg.same_host_copy &= !self.no_same_host_copy;
        cfg.gso &= !self.no_gso;
        cfg.gro &= !self.no_gro;
        cfg.udp_checksum &= !self.no_udp_checksum;
        if let Some(m) = self.icrc {
            cfg.qp.icrc = m;
        }
        if let Some(b) = self.pacing_burst {
            cfg.qp.pacing_burst = u32::try_from(b).map_err(|_| anyhow::anyhow!("--pacing-burst: {b} is too large"))?;
        }
        if !self.extra_addrs.is_empty() {
            cfg.extra_addrs = self.extra_addrs.clone();
        }
        if let Some(b) = self.spray_burst {
            if b == 0 {
                anyhow::bail!("--spray-burst: must be at least 1 packet");
            }
            cfg.paths.burst_packets = b;
        }
        cfg.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(())
    }

    /// The same settings as command-line words (for a server child process).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(r) = self.line_rate {
            v.extend(["--line-rate".into(), r.to_string()]);
        }
        for p in &self.cc_params {
            v.extend(["--cc-param".into(), p.clone()]);
        }
        if let Some(d) = self.rx_delay_us {
            v.extend(["--rx-delay-us".into(), d.to_string()]);
        }
        for (on, flag) in [
            (self.no_gso, "--no-gso"),
            (self.no_gro, "--no-gro"),
            (self.no_udp_checksum, "--no-udp-checksum"),
            (self.no_same_host_copy, "--no-same-host-copy"),
        ] {
            if on {
                v.push(flag.into());
            }
        }
        if let Some(b) = self.pacing_burst {
            v.extend(["--pacing-burst".into(), b.to_string()]);
        }
        if let Some(b) = self.spray_burst {
            v.extend(["--spray-burst".into(), b.to_string()]);
        }
        for a in &self.extra_addrs {
            v.extend(["--extra-addr".into(), a.to_string()]);
        }
        if let Some(l) = self.link {
            v.extend(["--link".into(), link_name(l).into()]);
        }
        if let Some(m) = self.icrc {
            v.extend(["--icrc".into(), m.name().into()]);
        }
        v
    }
}

/// The operation a benchmark run exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    Write,
    Read,
    Send,
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
    /// RedN get: the client's buffer the answers are written to.
    #[serde(default)]
    pub resp_addr: u64,
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
    pub rkey: u32,
    pub len: u64,
    /// Where the window starts in the region (the server's pattern is by region offset).
    #[serde(default)]
    pub off: u64,
    /// Seed of the pattern the server's region holds (READ verification).
    pub seed: u64,
    /// A second region the server registered with REMOTE_READ only (access-check tests).
    pub ro_addr: u64,
    pub ro_rkey: u32,
    pub ro_len: u64,
    /// The linked list (offload and client walks) and the RedN hash table.
    #[serde(default)]
    pub list_head: u64,
    #[serde(default)]
    pub kv_rkey: u32,
    #[serde(default)]
    pub table_addr: u64,
}
