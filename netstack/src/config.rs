//! Context configuration, from TOML or code; every field has a default.

use crate::transport::rc::RcConfig;
use serde::{Deserialize, Serialize};
use std::net::SocketAddrV4;

/// How an idle engine thread waits for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PollMode {
    /// Spin forever (a dedicated core).
    BusyPoll,
    /// Spin for `spin_us`, then sleep until a packet, a post or a timer.
    #[default]
    Adaptive,
    /// Sleep as soon as there is no work.
    Sleep,
}

/// Who runs a context's data cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Drive {
    /// Engine threads run the cores; application threads hand them work through pipes and
    /// read completions from pipes (FlexiNS's SmartNIC cores).
    #[default]
    Threads,
    /// Run to completion: the application thread that posts, polls or waits runs the cores in
    /// its own call, with no hand-off (eRPC). A backstop thread per core runs it while no
    /// application thread has for a millisecond, or once one blocks; `poll_mode` and `spin_us`
    /// say how a waiting application thread (and the backstop) waits.
    Application,
    /// A task on the tokio runtime of the thread that opens the context runs each core: it
    /// awaits the core's sockets, send queue and timer in the runtime's own poll, so a
    /// packet's receive, its completion and the task awaiting it run on one runtime thread,
    /// with no hand-off between threads (a Solar client in a service's runtime). Opening the
    /// context outside a runtime fails. A backstop thread per core runs it while the task has
    /// not for 50 ms (a runtime blocked or shut down); `poll_mode` applies to the backstop only.
    Runtime,
}

/// What a context's data cores send and receive through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkMode {
    /// Kernel UDP sockets (GSO, GRO, ECN) to every peer.
    #[default]
    Udp,
    /// Shared-memory rings to peers on the same host that use `shm` too (no system call on the
    /// data path), UDP to every other peer; see `netstack::link::shm`.
    Shm,
}

pub use crate::chain::RednGuards;

/// Configuration of a [`crate::verbs::Context`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContextConfig {
    /// Local IPv4 address and UDP port of the data path. Port 0 picks a free port; the RoCEv2
    /// port 4791 needs a distinct address per context on one host (e.g. 127.0.0.1, 127.0.0.2).
    pub bind: SocketAddrV4,
    /// Engine threads ("data cores"), each with its own socket (port `bind.port + i`, or free
    /// ports when the port is 0); QPs are sharded over them by QPN.
    pub data_cores: usize,
    /// Who runs the data cores: engine threads, or the application's own threads.
    pub drive: Drive,
    /// What the data cores send and receive through: `udp`, or `shm` (rings to same-host
    /// peers that use `shm` too, UDP to the others).
    pub link: LinkMode,
    /// With `link = "shm"`: an RDMA WRITE or READ to a same-host peer that uses `shm` too is
    /// one copy into (or out of) its memory by this context's data core, no packets
    /// (`netstack::samehost`); off, it goes through the rings as packets.
    pub same_host_copy: bool,
    /// How idle engine threads wait.
    pub poll_mode: PollMode,
    /// Spin time before an adaptive engine sleeps, in microseconds.
    pub spin_us: u64,
    /// Largest INLINE payload accepted by `post_send`.
    pub max_inline: u32,
    /// Hand several same-size packets to the kernel in one UDP GSO send.
    pub gso: bool,
    /// Receive with UDP GRO (several datagrams per receive buffer).
    pub gro: bool,
    /// Send ECN-capable packets (ECT(0)) and hand CE marks to congestion control.
    pub ecn: bool,
    /// Receive staging memory per data core, in bytes (recycled, hottest buffers first).
    pub rx_staging_bytes: usize,
    /// Compute the UDP checksum of sent packets. Off (checksum 0, allowed for UDP over IPv4)
    /// lets a switch rewrite the congestion-control header in flight, as the testbed's eBPF INT
    /// stamper does; the ICRC still covers everything else. Off, packets go one per send (the
    /// kernel does not segment UDP GSO sends without checksums), and QPs offer only
    /// `qp.icrc = "icrc"`.
    pub udp_checksum: bool,
    /// Emulated one-way propagation delay added to every received packet before it is
    /// processed, in microseconds (0 = none): the testbed's RTT where the kernel cannot add delay
    /// (no netem).
    pub rx_delay_us: u64,
    /// More local IPv4 addresses of this host (other NICs or bonded ports): each gets a socket
    /// per data core like `bind`'s, and a QP with several paths pairs them with the peer's
    /// addresses (explicit local/remote address pairs).
    pub extra_addrs: Vec<std::net::Ipv4Addr>,
    /// UDP source ports per local address and data core (1..=64): path `k` of a QP leaves from
    /// port `k / pairs` of address pair `k % pairs`, so an ECMP fabric that hashes the 5-tuple
    /// routes the paths apart. The first is the main port; the others are free ports.
    pub path_ports: u8,
    /// Multipath health parameters of new QPs (`[paths]`).
    pub paths: crate::path::PathParams,
    /// Defaults of new queue pairs.
    pub qp: RcConfig,
    /// Congestion-control parameters of every algorithm (`[cc.dcqcn]`, `[cc.hpcc]`, ...).
    pub cc: crate::cc::CcParams,
    /// The offloading engine: threads, handler time budget (`[offload]`).
    pub offload: crate::offload::OffloadConfig,
    /// Guards of RedN work-request programs on managed QPs (`[redn]`).
    pub redn: RednGuards,
    /// Attach to the `flexnsd` listening at this Unix socket instead of starting an engine in
    /// this process (docs/FLEXNSD.md): the daemon's own configuration then governs the data
    /// path (links, data cores, addresses); of this one, only `qp` (new QPs' parameters) is used.
    pub flexnsd: Option<std::path::PathBuf>,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            bind: "127.0.0.1:0".parse().expect("valid"),
            data_cores: 1,
            drive: Drive::Threads,
            link: LinkMode::Udp,
            same_host_copy: true,
            poll_mode: PollMode::Adaptive,
            spin_us: 50,
            max_inline: 256,
            gso: true,
            gro: true,
            ecn: true,
            rx_staging_bytes: 2 << 20,
            udp_checksum: true,
            rx_delay_us: 0,
            extra_addrs: Vec::new(),
            path_ports: 8,
            paths: crate::path::PathParams::default(),
            qp: RcConfig::default(),
            cc: crate::cc::CcParams::default(),
            offload: Default::default(),
            redn: Default::default(),
            flexnsd: None,
        }
    }
}

/// A configuration error naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The TOML did not parse (it names the line and field).
    #[error("config: {0}")]
    Parse(#[from] toml::de::Error),
    /// A field has a bad value (which, and why).
    #[error("config field {0}")]
    Invalid(String),
    /// The file could not be read.
    #[error("reading {0}: {1}")]
    Read(std::path::PathBuf, std::io::Error),
}

impl ContextConfig {
    /// Parses TOML (unknown fields are errors that name them).
    pub fn from_toml(s: &str) -> Result<ContextConfig, ConfigError> {
        let c: ContextConfig = toml::from_str(s)?;
        c.validate()?;
        Ok(c)
    }

    /// Reads and parses the TOML file at `path` (the errors name the file).
    pub fn from_file(path: &std::path::Path) -> Result<ContextConfig, ConfigError> {
        let s = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
        ContextConfig::from_toml(&s)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.qp
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("qp.{e}")))?;
        if self.bind.ip().is_unspecified() {
            return Err(ConfigError::Invalid(
                "bind: must be a concrete IPv4 address, not 0.0.0.0 (the ICRC covers it)".into(),
            ));
        }
        if self.data_cores == 0 || self.data_cores > 64 {
            return Err(ConfigError::Invalid(format!(
                "data_cores: {} not in 1..=64",
                self.data_cores
            )));
        }
        if self.rx_staging_bytes < 64 << 10 || self.rx_staging_bytes > 256 << 20 {
            return Err(ConfigError::Invalid(format!(
                "rx_staging_bytes: {} not in 64 KiB..256 MiB",
                self.rx_staging_bytes
            )));
        }
        self.cc
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("cc.{e}")))?;
        if self.rx_delay_us > 1_000_000 {
            return Err(ConfigError::Invalid(format!("rx_delay_us: {} > 1 s", self.rx_delay_us)));
        }
        if self.path_ports == 0 || self.path_ports as usize > crate::path::MAX_PATHS {
            return Err(ConfigError::Invalid(format!(
                "path_ports: {} not in 1..={}",
                self.path_ports,
                crate::path::MAX_PATHS
            )));
        }
        for (i, a) in self.extra_addrs.iter().enumerate() {
            if a.is_unspecified() || a == self.bind.ip() || self.extra_addrs[..i].contains(a) {
                return Err(ConfigError::Invalid(format!(
                    "extra_addrs[{i}]: {a} must be a concrete address other than bind's and the others"
                )));
            }
        }
        if self.paths.down_after_rtos == 0 || self.paths.probe_interval_ns == 0 || self.paths.min_rto_ns == 0 {
            return Err(ConfigError::Invalid(
                "paths: down_after_rtos, probe_interval_ns and min_rto_ns must be > 0".into(),
            ));
        }
        self.offload
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("offload.{e}")))?;
        self.redn
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("redn.{e}")))?;
        if self.max_inline > 4096 {
            return Err(ConfigError::Invalid(format!("max_inline: {} > 4096", self.max_inline)));
        }
        Ok(())
    }
}

/// Parses a size with an optional suffix: `4096`, `4k`, `64KiB`, `16MiB`, `1G` (the command
/// lines of the benchmarks and services share it).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suf) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected a number with an optional k/KiB/M/MiB/G/GiB suffix"))?;
    let mul = match suf.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("invalid size suffix in {s:?}: use k, KiB, M, MiB, G or GiB")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("size {s:?} overflows"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("16MiB").unwrap(), 16 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("4q").unwrap_err().contains("suffix"));
        assert!(parse_size("x").is_err());
    }

    #[test]
    fn toml_round_trip_and_errors_name_fields() {
        let c = ContextConfig::from_toml(
            "bind = \"127.0.0.1:4791\"\npoll_mode = \"sleep\"\n[qp]\nmtu = 1024\nrecovery = \"selective-repeat\"\n",
        )
        .unwrap();
        assert_eq!(c.qp.mtu, 1024);
        assert_eq!(c.poll_mode, PollMode::Sleep);
        let e = ContextConfig::from_toml("[qp]\nmtu = 1000\n").unwrap_err().to_string();
        assert!(e.contains("qp.mtu"), "{e}");
        let c = ContextConfig::from_toml("[cc.dcqcn]\nline_rate = \"25gbit\"\n").unwrap();
        assert_eq!(c.cc.dcqcn.line_rate, 25_000_000_000 / 8);
        let e = ContextConfig::from_toml("[cc.timely]\nbeta = 3.0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cc.timely.beta"), "{e}");
        let e = ContextConfig::from_toml("bogus = 1\n").unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = ContextConfig::from_toml("bind = \"0.0.0.0:1\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bind"), "{e}");
        let e = ContextConfig::from_toml(
            "path_ports = 0
",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("path_ports"), "{e}");
        let e = ContextConfig::from_toml("bind = \"127.0.0.1:0\"\nextra_addrs = [\"127.0.0.1\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("extra_addrs[0]"), "{e}");
        let c = ContextConfig::from_toml("[paths]\ndown_after_rtos = 5\n").unwrap();
        assert_eq!(c.paths.down_after_rtos, 5);
    }

    #[test]
    fn the_icrc_mode_parses_and_a_bad_value_names_the_field() {
        use crate::transport::rc::IcrcMode;
        assert_eq!(ContextConfig::default().qp.icrc, IcrcMode::Icrc, "on by default");
        let c = ContextConfig::from_toml("[qp]\nicrc = \"none\"\n").unwrap();
        assert_eq!(c.qp.icrc, IcrcMode::None);
        let c = ContextConfig::from_toml("[qp]\nicrc = \"icrc\"\n").unwrap();
        assert_eq!(c.qp.icrc, IcrcMode::Icrc);
        for bad in ["\"off\"", "\"ICRC\"", "0"] {
            let e = ContextConfig::from_toml(&format!("[qp]\nicrc = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("icrc"), "{bad}: {e}");
        }
    }
}

#[cfg(test)]
mod example_tests {
    #[test]
    fn the_shipped_example_config_parses() {
        let s = include_str!("../../deploy/config/context.toml");
        super::ContextConfig::from_toml(s).unwrap();
    }
}
