//! Engine configuration: the transport, where segment metadata lives, the addresses to bind
//! and advertise, slicing and timeouts. Every validation error names the field.

use crate::TransferError;
use netstack::path::SprayPolicy;
use std::net::Ipv4Addr;
use std::str::FromStr;
use std::time::Duration;

/// The data transport an engine uses. Exactly the configured one is used: there is no silent
/// fallback, and a peer that speaks another transport is an error that says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// RoCEv2 over UDP through the flexns stack: one-sided READ/WRITE on RC queue pairs.
    Flexns,
    /// Kernel TCP: request headers and payload streamed over pooled connections ("lanes").
    Tcp,
}

impl FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "flexns" | "rdma" => Ok(TransportKind::Flexns),
            "tcp" => Ok(TransportKind::Tcp),
            o => Err(format!("unknown transport {o:?} (flexns, tcp)")),
        }
    }
}

impl TransportKind {
    /// The transport's name: `flexns` or `tcp`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Flexns => "flexns",
            TransportKind::Tcp => "tcp",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where segment descriptors are published and looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataConfig {
    /// An in-memory registry shared by the engines of this process (the one-machine default:
    /// the demo, tests, a prefill and a decode engine in one server process).
    Embedded,
    /// No metadata service: a segment is named `IP:RPC_PORT` and its descriptor is fetched from
    /// that engine's RPC port on `open_segment` (Mooncake's `P2PHANDSHAKE`).
    P2p,
    /// A real etcd cluster; descriptors live under `PREFIX/segments/NAME`, so tenants with
    /// different prefixes share one etcd without seeing each other.
    Etcd {
        /// The etcd endpoint URL (`http://HOST:PORT`).
        endpoint: String,
        /// The key prefix of this tenant's descriptors.
        prefix: String,
    },
}

impl MetadataConfig {
    /// Parses Mooncake-style connection strings: `embedded`, `P2PHANDSHAKE` (or `p2p`),
    /// `etcd://HOST:PORT` or bare `HOST:PORT` (etcd); the etcd prefix defaults to `flexns/kvcache/`.
    pub fn parse(s: &str, etcd_prefix: Option<&str>) -> Result<MetadataConfig, TransferError> {
        let prefix = etcd_prefix.unwrap_or("flexns/kvcache/").to_string();
        match s {
            "embedded" | "" => Ok(MetadataConfig::Embedded),
            "P2PHANDSHAKE" | "p2p" => Ok(MetadataConfig::P2p),
            o if o.starts_with("etcd://") || o.starts_with("http://") || o.contains(':') => Ok(MetadataConfig::Etcd {
                endpoint: o.to_string(),
                prefix,
            }),
            o => Err(TransferError::Config(format!(
                "metadata: {o:?} is not embedded, P2PHANDSHAKE, etcd://HOST:PORT or HOST:PORT"
            ))),
        }
    }
}

/// Configuration of a [`crate::TransferEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The segment name other engines open this one by (cluster-unique). In P2P mode it is
    /// replaced by `ADVERTISE_IP:RPC_PORT`.
    pub name: String,
    /// The data path peers reach this engine on (flexns or kernel TCP).
    pub transport: TransportKind,
    /// Where segment descriptors are published and looked up.
    pub metadata: MetadataConfig,
    /// Local IPv4 address the RPC port and the data path bind; `None` binds the advertised
    /// address (a port on every address would accept peers the descriptor never names).
    pub bind_ip: Option<Ipv4Addr>,
    /// The address published in this engine's descriptor. `None` picks one deliberately:
    /// 127.0.0.1 with embedded metadata (one machine); otherwise the source address of the
    /// default route, never loopback or a container bridge (see [`crate::netaddr`]).
    pub advertise_ip: Option<Ipv4Addr>,
    /// RPC port (connection manager and descriptors); 0 picks a free one.
    pub rpc_port: u16,
    /// flexns engine threads (data cores).
    pub data_cores: usize,
    /// RC queue pairs per peer; slices are spread over them.
    pub qps_per_peer: usize,
    /// Paths per queue pair (packet spraying over UDP source ports and `extra_addrs`); 1 = one path.
    pub paths: usize,
    /// How a multipath QP spreads packets over its paths.
    pub spray: SprayPolicy,
    /// More local addresses (NICs) to stripe over: QPs pair them with the peer's.
    pub extra_addrs: Vec<Ipv4Addr>,
    /// Requests longer than this are cut into slices that travel independently (spread over
    /// queue pairs or lanes, retried one by one). `None`: the transport's default, measured
    /// best on loopback: 4 MiB for flexns (fewer work requests and completions per byte; packets
    /// are sprayed over paths within a slice anyway), 256 KiB for tcp (enough slices to keep
    /// every lane streaming).
    pub slice_size: Option<usize>,
    /// Slices in flight per queue pair (or per TCP lane: one).
    pub slices_in_flight: usize,
    /// TCP connections per peer (the tcp transport).
    pub tcp_lanes: usize,
    /// A request not done after this is TimedOut, with the peer, path and cause named.
    pub transfer_timeout: Duration,
    /// With etcd metadata: the lease the descriptor is published under (renewed every third of
    /// it); a crashed engine's descriptor disappears within this.
    pub lease_ttl: Duration,
    /// Attempts per slice (the first included) before its request fails. A slice is retried
    /// when its queue pair fails (its retry budget spent) or its TCP lane breaks; a slice that is
    /// merely slow is left to the transport's own retransmission, and a request not done within
    /// `transfer_timeout` fails.
    pub slice_attempts: u32,
    /// Most queue pairs one caller (one IP address) of this engine's connection manager may
    /// hold (flexns); more are refused, so one host cannot take every QP with phantoms. Engines
    /// on one host share its address: each holds `qps_per_peer` (at most 64) of this engine's
    /// QPs, and the QPs of a peer that left count until they are found gone.
    pub max_qps_per_caller: usize,
    /// A queue pair accepted from a peer that receives no packet within this is reaped with its
    /// receive buffers (flexns; its caller named an endpoint that never answers) and counted in
    /// `flexns_cm_qps_reaped_total`. A QP quiet for half of it is probed with a zero-length
    /// WRITE, which a live peer's QP acknowledges however idle it is (a decode node between
    /// requests is never reaped), and which fails on the QP of a peer that left: it is dropped.
    pub unused_qp_timeout: Duration,
    /// Overrides of the flexns stack (MTU, recovery, congestion control, poll mode, drive,
    /// link...). `None`: [`EngineConfig::default_stack`], whose link is `shm`, so a peer engine
    /// on the same host (on `shm` too) is written and read by one copy into its registered
    /// memory (`netstack::samehost`) and every other peer over UDP. A stack given here is used
    /// as it is: its `link` is netstack's default, `udp`, unless it says `link = "shm"`.
    /// Engine threads drive it by default: measured on 2 cores, run to completion
    /// (`drive = "application"`) halves 4 KiB latency but loses 16 MiB throughput (see
    /// docs/BENCHMARKS.md, "who runs the engine").
    pub stack: Option<netstack::verbs::ContextConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: String::new(),
            transport: TransportKind::Flexns,
            metadata: MetadataConfig::Embedded,
            bind_ip: None,
            advertise_ip: None,
            rpc_port: 0,
            data_cores: 1,
            qps_per_peer: 2,
            paths: 1,
            spray: SprayPolicy::Weighted,
            extra_addrs: Vec::new(),
            slice_size: None,
            slices_in_flight: 64,
            tcp_lanes: 4,
            transfer_timeout: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(10),
            slice_attempts: 3,
            max_qps_per_caller: 1024,
            unused_qp_timeout: Duration::from_secs(10),
            stack: None,
        }
    }
}

/// Most queue pairs an engine connects to one peer ([`EngineConfig::qps_per_peer`]), all in
/// one connection-manager call: the most a call to this engine's connection manager may ask.
pub const MAX_QPS_PER_PEER: usize = 64;

/// The shortest [`EngineConfig::unused_qp_timeout`]: a live peer must answer the probe sent
/// half-way within the other half.
pub const MIN_UNUSED_QP_TIMEOUT: Duration = Duration::from_millis(100);

impl EngineConfig {
    /// The connection manager's limits for this configuration (checked by [`Self::validate`]):
    /// a call may ask for one peer's QPs, a caller may hold `max_qps_per_caller`, and QPs
    /// unused for `unused_qp_timeout` are reaped.
    pub fn door_limits(&self) -> netstack::cm::DoorLimits {
        netstack::cm::DoorLimits {
            max_batch: MAX_QPS_PER_PEER,
            max_qps_per_caller: self.max_qps_per_caller,
            unused_timeout: self.unused_qp_timeout,
        }
    }

    /// Checks the connection manager's settings (part of [`Self::validate`]); the error names
    /// the field.
    pub fn check_door(&self) -> Result<(), TransferError> {
        let bad = |f: &str, m: String| Err(TransferError::Config(format!("{f}: {m}")));
        if !(1..=65536).contains(&self.max_qps_per_caller) {
            return bad(
                "max_qps_per_caller",
                format!("{} not in 1..=65536", self.max_qps_per_caller),
            );
        }
        if !(MIN_UNUSED_QP_TIMEOUT..=Duration::from_secs(3600)).contains(&self.unused_qp_timeout) {
            return bad(
                "unused_qp_timeout",
                format!("{:?} not in 100 ms ..= 1 h", self.unused_qp_timeout),
            );
        }
        Ok(())
    }

    /// The flexns stack an engine uses when [`EngineConfig::stack`] is `None`: netstack's
    /// defaults with `link = "shm"` (and `same_host_copy` on, netstack's default): same-host
    /// peers on `shm` get the one-copy path, peers elsewhere (or on `udp`) get UDP.
    pub fn default_stack() -> netstack::verbs::ContextConfig {
        netstack::verbs::ContextConfig {
            link: netstack::config::LinkMode::Shm,
            ..Default::default()
        }
    }

    /// The stack this configuration opens: [`EngineConfig::stack`] or the default one.
    pub fn stack_or_default(&self) -> netstack::verbs::ContextConfig {
        self.stack.clone().unwrap_or_else(Self::default_stack)
    }

    /// Sets the link of the stack (the default stack when none is given): `udp` or `shm`.
    pub fn set_link(&mut self, link: netstack::config::LinkMode) {
        let mut s = self.stack_or_default();
        s.link = link;
        self.stack = Some(s);
    }

    /// Runs the engine's flexns stack in the `flexnsd` listening at `socket` instead of in this
    /// process (netstack's `ContextConfig::flexnsd`): its QPs and memory regions are the
    /// daemon's, and the engine's buffers are memfds the daemon maps.
    pub fn set_flexnsd(&mut self, socket: std::path::PathBuf) {
        let mut s = self.stack_or_default();
        s.flexnsd = Some(socket);
        self.stack = Some(s);
    }

    /// A configuration with this name and transport, everything else default.
    pub fn new(name: &str, transport: TransportKind) -> EngineConfig {
        EngineConfig {
            name: name.to_string(),
            transport,
            ..Default::default()
        }
    }

    /// The slice size in effect.
    pub fn slice_bytes(&self) -> usize {
        self.slice_size.unwrap_or(match self.transport {
            TransportKind::Flexns => 4 << 20,
            TransportKind::Tcp => 256 << 10,
        })
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), TransferError> {
        let bad = |f: &str, m: String| Err(TransferError::Config(format!("{f}: {m}")));
        if !(Duration::from_secs(2)..=Duration::from_secs(3600)).contains(&self.lease_ttl) {
            return bad("lease_ttl", format!("{:?} not in 2 s ..= 1 h", self.lease_ttl));
        }
        if self.metadata != MetadataConfig::P2p {
            if self.name.is_empty() {
                return bad("name", "an engine needs a segment name (unique in the cluster)".into());
            }
            if self.name.len() > 255 || self.name.contains(['/', '\n', ' ']) {
                return bad(
                    "name",
                    format!("{:?}: at most 255 bytes, no '/', space or newline", self.name),
                );
            }
        }
        if let MetadataConfig::Etcd { prefix, .. } = &self.metadata {
            if prefix.contains(' ') {
                return bad("metadata.prefix", format!("{prefix:?} contains a space"));
            }
        }
        if self.paths > 1 && self.stack.as_ref().is_some_and(|s| s.flexnsd.is_some()) {
            return bad(
                "paths",
                format!("{}: a queue pair through flexnsd has one path", self.paths),
            );
        }
        if !(1..=16).contains(&self.data_cores) {
            return bad("data_cores", format!("{} not in 1..=16", self.data_cores));
        }
        if !(1..=MAX_QPS_PER_PEER).contains(&self.qps_per_peer) {
            return bad(
                "qps_per_peer",
                format!("{} not in 1..={MAX_QPS_PER_PEER}", self.qps_per_peer),
            );
        }
        self.check_door()?;
        if !(1..=netstack::path::MAX_PATHS).contains(&self.paths) {
            return bad(
                "paths",
                format!("{} not in 1..={}", self.paths, netstack::path::MAX_PATHS),
            );
        }
        if let Some(n) = self.slice_size.filter(|&n| !(4096..=64 << 20).contains(&n)) {
            return bad("slice_size", format!("{n} not in 4 KiB..=64 MiB"));
        }
        if !(1..=1024).contains(&self.slices_in_flight) {
            return bad("slices_in_flight", format!("{} not in 1..=1024", self.slices_in_flight));
        }
        if !(1..=64).contains(&self.tcp_lanes) {
            return bad("tcp_lanes", format!("{} not in 1..=64", self.tcp_lanes));
        }
        if self.transfer_timeout.is_zero() {
            return bad("transfer_timeout", "must be > 0".into());
        }
        if self.slice_attempts == 0 {
            return bad("slice_attempts", "must be >= 1".into());
        }
        if let Some(s) = &self.stack {
            s.validate().map_err(|e| TransferError::Config(format!("stack: {e}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_strings_parse_like_mooncake() {
        assert_eq!(
            MetadataConfig::parse("P2PHANDSHAKE", None).unwrap(),
            MetadataConfig::P2p
        );
        assert_eq!(
            MetadataConfig::parse("embedded", None).unwrap(),
            MetadataConfig::Embedded
        );
        assert_eq!(
            MetadataConfig::parse("127.0.0.1:2379", Some("t1/")).unwrap(),
            MetadataConfig::Etcd {
                endpoint: "127.0.0.1:2379".into(),
                prefix: "t1/".into()
            }
        );
        let e = MetadataConfig::parse("redis", None).unwrap_err().to_string();
        assert!(e.contains("metadata"), "{e}");
    }

    #[test]
    fn bad_fields_are_named() {
        let mut c = EngineConfig::new("p", TransportKind::Flexns);
        c.validate().unwrap();
        c.slice_size = Some(10);
        assert!(c.validate().unwrap_err().to_string().contains("slice_size"));
        let c = EngineConfig::new("", TransportKind::Tcp);
        assert!(c.validate().unwrap_err().to_string().contains("name"));
        assert_eq!("tcp".parse::<TransportKind>(), Ok(TransportKind::Tcp));
        assert!("ib".parse::<TransportKind>().unwrap_err().contains("flexns, tcp"));
    }

    #[test]
    fn door_settings_are_checked_by_field() {
        let mut c = EngineConfig::new("p", TransportKind::Flexns);
        let d = c.door_limits();
        assert_eq!(
            (d.max_batch, d.max_qps_per_caller, d.unused_timeout),
            (64, 1024, Duration::from_secs(10))
        );
        c.max_qps_per_caller = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("max_qps_per_caller: 0 not in"), "{e}");
        c.max_qps_per_caller = 8;
        c.unused_qp_timeout = Duration::from_millis(10);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("unused_qp_timeout: 10ms not in"), "{e}");
        c.unused_qp_timeout = Duration::from_secs(1);
        c.validate().unwrap();
        assert_eq!(c.door_limits().max_qps_per_caller, 8);
    }
}
