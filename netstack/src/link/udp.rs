//! The UDP link: one nonblocking socket per engine, DF set (so Linux sends IP ID 0 on an
//! unconnected socket, which the ICRC covers), large buffers, batched send and receive.

use super::sys::{self, OutMsg, RecvBatch, SendScratch};
use std::io;
use std::net::{SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

/// Socket buffer size requested for both directions.
pub const SOCKET_BUFFER: i32 = 8 << 20;

/// Asks for [`SOCKET_BUFFER`] bytes of send and receive buffer: the FORCE options work as root
/// and ignore the sysctl cap; otherwise the request is made within the cap.
pub fn set_large_buffers(fd: RawFd) {
    for (force, plain) in [
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
    ] {
        if sys::setsockopt_int(fd, libc::SOL_SOCKET, force, SOCKET_BUFFER).is_err() {
            let _ = sys::setsockopt_int(fd, libc::SOL_SOCKET, plain, SOCKET_BUFFER);
        }
    }
}

/// A bound UDP socket carrying RoCEv2 datagrams.
pub struct UdpLink {
    sock: UdpSocket,
    local: SocketAddrV4,
}

impl UdpLink {
    /// Binds `addr`. The address must be a concrete IPv4 address (the ICRC covers it, so the
    /// receiver must know which address a datagram was sent to); port 0 picks a free port.
    pub fn bind(addr: SocketAddrV4) -> io::Result<UdpLink> {
        if addr.ip().is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bind address must be a concrete IPv4 address, not 0.0.0.0 (the ICRC covers it)",
            ));
        }
        let sock = UdpSocket::bind(addr)?;
        sock.set_nonblocking(true)?;
        let fd = sock.as_raw_fd();
        sys::setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)?;
        set_large_buffers(fd);
        let local = match sock.local_addr()? {
            std::net::SocketAddr::V4(a) => a,
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "IPv4 only")),
        };
        Ok(UdpLink { sock, local })
    }

    /// Marks sent packets ECN-capable (ECT(0)) and reports the received TOS byte, so congestion
    /// control sees CE marks.
    pub fn set_ecn(&self) -> io::Result<()> {
        sys::setsockopt_int(self.fd(), libc::IPPROTO_IP, libc::IP_TOS, 0x02)?;
        sys::setsockopt_int(self.fd(), libc::IPPROTO_IP, libc::IP_RECVTOS, 1)
    }

    /// Turns UDP generic receive offload on or off: with it on, the kernel may hand several
    /// datagrams of one flow to a single receive (split them with [`sys::segments`]).
    /// Sends UDP checksum 0 (no checksum) instead of a computed one.
    pub fn set_no_checksum(&self) -> io::Result<()> {
        sys::setsockopt_int(self.fd(), libc::SOL_SOCKET, libc::SO_NO_CHECK, 1)
    }

    /// Has every receive report when the kernel took the datagram in (`SO_TIMESTAMPNS`): the
    /// time a packet waited for the engine to run counts as host delay, not network delay
    /// ([`sys::RecvBatch::arrived`]).
    pub fn set_rx_timestamps(&self) -> io::Result<()> {
        sys::setsockopt_int(self.fd(), libc::SOL_SOCKET, sys::SO_TIMESTAMPNS, 1)
    }

    /// Turns UDP GRO (coalesced receives) on or off.
    pub fn set_gro(&self, on: bool) -> io::Result<()> {
        sys::setsockopt_int(self.fd(), sys::SOL_UDP, sys::UDP_GRO, on as i32)
    }

    /// The address it is bound to.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    /// Its descriptor.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Sends a batch; returns how many datagrams the kernel accepted.
    pub fn send_batch(&self, msgs: &mut [OutMsg]) -> io::Result<usize> {
        sys::sendmmsg(self.fd(), msgs)
    }

    /// [`UdpLink::send_batch`] with a reused buffer for the kernel's message headers.
    pub fn send_batch_with(&self, msgs: &mut [OutMsg], scratch: &mut SendScratch) -> io::Result<usize> {
        sys::sendmmsg_with(self.fd(), msgs, scratch)
    }

    /// Sends one datagram to `to` without blocking (a control message of another link layered
    /// over this one).
    pub fn send_to(&self, data: &[u8], to: SocketAddrV4) -> io::Result<usize> {
        self.sock.send_to(data, to)
    }

    /// Receives into `batch` without blocking.
    pub fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        batch.recv(self.fd())
    }
}

/// A data core's UDP sockets as a [`super::Link`]: port `i` is socket `i`.
pub struct UdpPorts(pub Vec<UdpLink>);

impl super::Link for UdpPorts {
    fn ports(&self) -> usize {
        self.0.len()
    }
    fn local_addr(&self, port: usize) -> SocketAddrV4 {
        self.0[port].local_addr()
    }
    fn send(&self, port: usize, msgs: &mut [OutMsg], scratch: &mut SendScratch) -> io::Result<usize> {
        self.0[port].send_batch_with(msgs, scratch)
    }
    fn recv(&self, port: usize, batch: &mut RecvBatch) -> io::Result<usize> {
        self.0[port].recv_batch(batch)
    }
    fn wait_fd(&self, port: usize) -> Option<RawFd> {
        Some(self.0[port].fd())
    }
    fn route_mtu(&self, to: SocketAddrV4) -> Option<u32> {
        sys::route_mtu(to).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn a_receive_reports_when_the_kernel_took_the_datagram_in() {
        let lo = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
        let (a, b) = (UdpLink::bind(lo).expect("bind"), UdpLink::bind(lo).expect("bind"));
        b.set_gro(true).expect("gro");
        b.set_ecn().expect("ecn");
        let mut batch = RecvBatch::new(4, 2048);
        // without the option: no time
        let before = sys::monotonic_ns();
        a.sock.send_to(b"one", b.local_addr()).expect("send");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(b.recv_batch(&mut batch).expect("recv"), 1);
        assert_eq!(batch.arrived(0), None);
        // with it: the time the datagram came in, on the transports' clock, however long it
        // then waited for the receive. The kernel turns arrival stamps on from a work item
        // when the first socket asks; a datagram that came in before that is stamped when it
        // is read (and counts as no host delay), so the first tries may see that.
        b.set_rx_timestamps().expect("timestamps");
        let mut tries = Vec::new();
        for _ in 0..10 {
            let sent = sys::monotonic_ns();
            a.sock.send_to(b"two", b.local_addr()).expect("send");
            std::thread::sleep(std::time::Duration::from_millis(20));
            let received = sys::monotonic_ns();
            assert_eq!(b.recv_batch(&mut batch).expect("recv"), 1);
            let (data, ..) = batch.get(0);
            assert_eq!(data, Some(&b"two"[..]));
            let at = batch.arrived(0).expect("a receive time");
            assert!(sent > before && at + 1_000_000 >= sent, "sent {sent}, arrived {at}");
            tries.push((sent, at, received));
            if at + 15_000_000 < received {
                return;
            }
        }
        panic!("no datagram stamped on arrival: (sent, arrived, received) {tries:?}");
    }
}
