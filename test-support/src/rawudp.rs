//! A raw IPv4 socket that sends UDP datagrams from any source address: how the hostile-peer
//! tests forge a peer's packets (root only; the caller skips without it).

use rustix::fd::OwnedFd;
use rustix::net::{ipproto, sendto, socket, AddressFamily, SendFlags, SocketType};
use std::net::SocketAddrV4;

/// A raw socket with `IP_HDRINCL` (implied by `IPPROTO_RAW`): each datagram carries its own IP
/// header, so its source is whatever the caller writes there.
pub struct RawUdp(OwnedFd);

impl RawUdp {
    /// Opens the socket (needs `CAP_NET_RAW`).
    pub fn open() -> std::io::Result<RawUdp> {
        Ok(RawUdp(socket(
            AddressFamily::INET,
            SocketType::RAW,
            Some(ipproto::RAW),
        )?))
    }

    /// Sends `body` as one UDP datagram from `src` to `dst`. The kernel fills the IP checksum;
    /// the UDP checksum is 0 ("none", as IPv4 allows).
    pub fn send(&self, src: SocketAddrV4, dst: SocketAddrV4, body: &[u8]) -> std::io::Result<()> {
        let total = 20 + 8 + body.len();
        let too_long = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "datagram over 64 KiB");
        let total16 = u16::try_from(total).map_err(|_| too_long())?;
        let mut d = Vec::with_capacity(total);
        d.extend_from_slice(&[0x45, 0]);
        d.extend_from_slice(&total16.to_be_bytes());
        d.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]); // ID 0, DF, TTL 64, UDP
        d.extend_from_slice(&src.ip().octets());
        d.extend_from_slice(&dst.ip().octets());
        d.extend_from_slice(&src.port().to_be_bytes());
        d.extend_from_slice(&dst.port().to_be_bytes());
        d.extend_from_slice(&(total16 - 20).to_be_bytes());
        d.extend_from_slice(&[0, 0]);
        d.extend_from_slice(body);
        let n = sendto(&self.0, &d, SendFlags::empty(), &SocketAddrV4::new(*dst.ip(), 0))?;
        if n != d.len() {
            return Err(std::io::Error::other(format!("raw send took {n} of {} bytes", d.len())));
        }
        Ok(())
    }
}
