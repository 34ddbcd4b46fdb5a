//! The command-line flags every flexns program shares for its stack, in one place: a clap
//! [`ContextArgs`] that each binary flattens (`#[command(flatten)]`) and maps to a
//! [`ContextConfig`] with [`ContextArgs::apply`] or [`ContextArgs::to_config`]. Built with the
//! `cli` feature (it brings in clap).
//!
//! Every flag is optional: a flag left out keeps the value of the configuration it is applied
//! to (a `--config` file's, or the defaults), a flag given overrides it. The error of a bad
//! value names the flag.

use crate::config::{ConfigError, ContextConfig, LinkMode};
use crate::transport::rc::IcrcMode;
use std::net::{Ipv4Addr, SocketAddrV4};

/// A flag's value the stack cannot run with.
#[derive(Debug, thiserror::Error)]
pub enum ContextArgsError {
    /// One flag has a bad value: the flag (`--spray-burst`) and why.
    #[error("{flag}: {reason}")]
    Flag {
        /// The flag, as typed (`--pacing-burst`).
        flag: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// The flags together make a configuration that does not validate (it names the field).
    #[error(transparent)]
    Config(#[from] ConfigError),
}

fn bad(flag: &'static str, reason: impl Into<String>) -> ContextArgsError {
    ContextArgsError::Flag {
        flag,
        reason: reason.into(),
    }
}

/// The stack's flags (data path, engine threads, link, checksums, congestion-control
/// parameters); see the module documentation.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct ContextArgs {
    /// Data-path (RoCEv2/UDP) address [config: bind; default 127.0.0.1:0].
    #[arg(long)]
    pub data: Option<SocketAddrV4>,
    /// Engine threads (data cores) [config: data_cores; default 1].
    #[arg(long)]
    pub data_cores: Option<usize>,
    /// Line rate the congestion-control algorithms assume (`200mbit`, `10gbit`, bytes/s).
    #[arg(long, value_parser = crate::cc::params::parse_rate)]
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
    #[arg(long, value_parser = crate::config::parse_size)]
    pub pacing_burst: Option<u64>,
    /// Multipath: new packets a QP sends on one path before its spray policy picks again.
    #[arg(long)]
    pub spray_burst: Option<u32>,
    /// Another local address of this host for address-pair paths (repeatable; paired by
    /// position with the peer's).
    #[arg(long = "extra-addr")]
    pub extra_addrs: Vec<Ipv4Addr>,
    /// What the data path runs over: `udp`, or `shm` (same-host peers through shared memory:
    /// WRITEs and READs by one copy into the peer's memory, the rest through rings)
    /// [config: link].
    #[arg(long, value_parser = parse_link)]
    pub link: Option<LinkMode>,
    /// With `--link shm`: WRITEs and READs go through the rings as packets instead of one copy
    /// [config: same_host_copy = false].
    #[arg(long)]
    pub no_same_host_copy: bool,
    /// ICRC mode the QPs offer: `icrc`, or `none` for flexns peers on a trusted link (no CRC
    /// pass; the UDP checksum protects the bytes). A connection runs `none` only when both ends
    /// offer it and send UDP checksums; the JSON says which it ran [config: qp.icrc].
    #[arg(long, value_parser = parse_icrc)]
    pub icrc: Option<IcrcMode>,
    /// Run the stack in the `flexnsd` listening at this Unix socket instead of in this process
    /// (its configuration then governs links, data cores and addresses) [config: flexnsd].
    #[arg(long, value_name = "SOCKET")]
    pub flexnsd: Option<std::path::PathBuf>,
}

/// Parses an `--icrc` value, `icrc` or `none`.
pub fn parse_icrc(s: &str) -> Result<IcrcMode, String> {
    s.parse()
}

/// The `--link` value (and config spelling) of a link mode.
pub fn link_name(l: LinkMode) -> &'static str {
    match l {
        LinkMode::Udp => "udp",
        LinkMode::Shm => "shm",
    }
}

/// Parses a `--link` value, `udp` or `shm`.
pub fn parse_link(s: &str) -> Result<LinkMode, String> {
    match s {
        "udp" => Ok(LinkMode::Udp),
        "shm" => Ok(LinkMode::Shm),
        o => Err(format!("{o:?}: expected udp or shm")),
    }
}

impl ContextArgs {
    /// The defaults with these flags applied.
    pub fn to_config(&self) -> Result<ContextConfig, ContextArgsError> {
        let mut cfg = ContextConfig::default();
        self.apply(&mut cfg)?;
        Ok(cfg)
    }

    /// Applies the flags given to `cfg` (a file's configuration, or one a program built) and
    /// validates the result; the error names the bad flag, or the field that does not validate.
    pub fn apply(&self, cfg: &mut ContextConfig) -> Result<(), ContextArgsError> {
        if let Some(d) = self.data {
            cfg.bind = d;
        }
        if let Some(n) = self.data_cores {
            if n == 0 || n > 64 {
                return Err(bad("--data-cores", format!("{n} not in 1..=64")));
            }
            cfg.data_cores = n;
        }
        let mut p = cfg.cc.clone();
        if let Some(r) = self.line_rate {
            p.set_line_rate(r);
        }
        cfg.cc = p
            .with_overrides(&self.cc_params)
            .map_err(|e| bad("--cc-param", e.to_string()))?;
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
        if let Some(p) = &self.flexnsd {
            if p.as_os_str().is_empty() {
                return Err(bad("--flexnsd", "an empty path (the daemon's Unix socket)"));
            }
            cfg.flexnsd = Some(p.clone());
        }
        if let Some(b) = self.pacing_burst {
            cfg.qp.pacing_burst = u32::try_from(b).map_err(|_| bad("--pacing-burst", format!("{b} is too large")))?;
        }
        if !self.extra_addrs.is_empty() {
            cfg.extra_addrs = self.extra_addrs.clone();
        }
        if let Some(b) = self.spray_burst {
            if b == 0 {
                return Err(bad("--spray-burst", "must be at least 1 packet"));
            }
            cfg.paths.burst_packets = b;
        }
        cfg.validate()?;
        Ok(())
    }

    /// The same flags as command-line words (for a child process that flattens them too).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(d) = self.data {
            v.extend(["--data".into(), d.to_string()]);
        }
        if let Some(n) = self.data_cores {
            v.extend(["--data-cores".into(), n.to_string()]);
        }
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
        if let Some(p) = &self.flexnsd {
            v.extend(["--flexnsd".into(), p.display().to_string()]);
        }
        v
    }

    /// These flags without the data-path address (a child that binds its own).
    pub fn without_data(&self) -> ContextArgs {
        ContextArgs {
            data: None,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        ctx: ContextArgs,
    }

    /// The flags of a command line, words split at spaces.
    fn parse(line: &str) -> ContextArgs {
        Cli::try_parse_from(std::iter::once("prog").chain(line.split_whitespace()))
            .expect("flags parse")
            .ctx
    }

    fn err(line: &str) -> String {
        parse(line).to_config().expect_err("a bad value").to_string()
    }

    #[test]
    fn a_bad_value_names_its_flag() {
        assert!(err("--spray-burst 0").starts_with("--spray-burst:"));
        assert!(err("--pacing-burst 8GiB").starts_with("--pacing-burst:"));
        assert!(err("--data-cores 0").starts_with("--data-cores:"));
        assert!(err("--cc-param dcqcn.nope=1").starts_with("--cc-param:"));
        // a combination that only the whole configuration can refuse names the field
        let e = err("--data 0.0.0.0:0");
        assert!(e.contains("bind"), "{e}");
    }

    #[test]
    fn flags_left_out_keep_the_configuration_they_are_applied_to() {
        let mut cfg = ContextConfig {
            data_cores: 3,
            gso: false,
            link: LinkMode::Shm,
            ..ContextConfig::default()
        };
        let before = cfg.clone();
        parse("").apply(&mut cfg).expect("no flags");
        assert_eq!(cfg, before);
        assert_eq!(parse("").to_config().expect("defaults"), ContextConfig::default());
    }

    #[test]
    fn flags_given_set_their_fields() {
        let a = parse(concat!(
            "--data 127.0.0.2:4791 --data-cores 2 --link shm --icrc none --no-gso --no-gro ",
            "--no-udp-checksum --no-same-host-copy --rx-delay-us 7 --spray-burst 3 ",
            "--pacing-burst 16KiB --extra-addr 127.0.0.3"
        ));
        let c = a.to_config().expect("valid flags");
        assert_eq!(c.bind, "127.0.0.2:4791".parse::<SocketAddrV4>().expect("addr"));
        assert_eq!((c.data_cores, c.link, c.qp.icrc), (2, LinkMode::Shm, IcrcMode::None));
        assert!(!c.gso && !c.gro && !c.udp_checksum && !c.same_host_copy);
        assert_eq!(
            (c.rx_delay_us, c.paths.burst_packets, c.qp.pacing_burst),
            (7, 3, 16 << 10)
        );
        assert_eq!(c.extra_addrs, vec![Ipv4Addr::new(127, 0, 0, 3)]);
    }

    #[test]
    fn to_args_parses_back_to_the_same_flags() {
        let a = parse(concat!(
            "--data 127.0.0.2:0 --data-cores 2 --line-rate 10gbit --cc-param dcqcn.g=0.5 --link shm ",
            "--icrc none --no-gro --spray-burst 4 --extra-addr 127.0.0.3 --flexnsd /run/flexnsd.sock"
        ));
        let words = a.to_args();
        let back = parse(&words.join(" "));
        assert_eq!(back, a);
        assert_eq!(
            a.to_config().unwrap().flexnsd.as_deref(),
            Some(std::path::Path::new("/run/flexnsd.sock"))
        );
        assert_eq!(a.without_data().data, None);
    }
}
