//! Choosing the address an engine advertises. Mooncake users' second most common complaint is
//! an engine that publishes the docker bridge or a management NIC, so peers hang connecting to
//! it. The rule here: an explicit `advertise_ip` wins, then an explicit `bind_ip`; with embedded
//! metadata (one machine) 127.0.0.1; otherwise the source address of the default route, never
//! loopback or a container/VM bridge, then the first other interface address.

use std::net::{Ipv4Addr, UdpSocket};

/// Interface name prefixes of container and VM bridges: never advertised by default.
const BRIDGE_PREFIXES: &[&str] = &[
    "docker", "br-", "virbr", "veth", "cni", "flannel", "podman", "lxc", "lxd",
];

/// Whether an interface name is a container or VM bridge (or its veth end).
pub fn is_bridge(ifname: &str) -> bool {
    BRIDGE_PREFIXES.iter().any(|p| ifname.starts_with(p))
}

/// The IPv4 addresses of this host's interfaces that are up, with the interface names.
pub fn interfaces() -> Vec<(String, Ipv4Addr)> {
    netstack::link::sys::interfaces()
}

/// The source address the kernel would use toward a remote host (the default route's), found
/// by connecting a UDP socket (no packet is sent).
pub fn default_route_source() -> Option<Ipv4Addr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?; // TEST-NET-1: routed by the default route, never answered
    match s.local_addr().ok()?.ip() {
        std::net::IpAddr::V4(ip) if !ip.is_unspecified() => Some(ip),
        _ => None,
    }
}

/// The address to advertise to remote peers when none is configured.
pub fn pick_remote_advertise() -> Ipv4Addr {
    let ifs = interfaces();
    let usable = |ip: &Ipv4Addr| !ip.is_loopback() && !ifs.iter().any(|(n, a)| a == ip && is_bridge(n));
    if let Some(ip) = default_route_source().filter(usable) {
        return ip;
    }
    if let Some((_, ip)) = ifs.iter().find(|(n, ip)| !ip.is_loopback() && !is_bridge(n)) {
        return *ip;
    }
    tracing::warn!("no non-loopback interface: advertising 127.0.0.1, reachable only from this host");
    Ipv4Addr::LOCALHOST
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridges_are_never_picked() {
        assert!(is_bridge("docker0") && is_bridge("br-1a2b") && is_bridge("virbr0"));
        assert!(!is_bridge("eth0") && !is_bridge("ens5") && !is_bridge("bond0"));
        let ip = pick_remote_advertise();
        let ifs = interfaces();
        if ifs.iter().any(|(n, a)| !a.is_loopback() && !is_bridge(n)) {
            assert!(!ip.is_loopback(), "{ip} with interfaces {ifs:?}");
            assert!(!ifs.iter().any(|(n, a)| *a == ip && is_bridge(n)), "{ip} is a bridge's");
        }
    }
}
