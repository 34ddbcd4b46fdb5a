//! The references every netstack benchmark runs beside itself: `udp-raw` (the link limit: a
//! plain UDP blaster with sendmmsg/recvmmsg batches, and a UDP ping-pong) and `tcp` (kernel TCP
//! streaming and ping-pong), with the same message or datagram sizes.

use crate::bench::{histogram, BenchResult};
use anyhow::{bail, Context as _, Result};
use netstack::link::sys::{self, OutMsg, RecvBatch};
use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Datagram kinds of the udp-raw protocol (first byte).
const ECHO: u8 = b'E';
const DATA: u8 = b'D';
const REPORT: u8 = b'R';

/// The udp-raw server: echoes `E` datagrams, counts `D` datagrams, answers `R` with the count
/// of data bytes since the last report.
pub struct UdpServer {
    sock: UdpSocket,
}

impl UdpServer {
    pub fn bind(addr: SocketAddrV4) -> Result<UdpServer> {
        let sock = UdpSocket::bind(addr)?;
        let fd = sock.as_raw_fd();
        netstack::link::udp::set_large_buffers(fd);
        // the link limit includes GRO, as the stack uses it
        sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_GRO, 1)?;
        Ok(UdpServer { sock })
    }
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.sock.local_addr()
    }
    /// Serves forever (the process ends it).
    pub fn run(self) {
        let fd = self.sock.as_raw_fd();
        // the same staging budget as the stack: 32 x 64 KiB
        let mut batch = RecvBatch::new(32, 65536);
        let mut count = 0u64;
        loop {
            let _ = sys::ppoll_readable(&[fd], 1_000_000_000);
            let n = batch.recv(fd).unwrap_or(0);
            for i in 0..n {
                let (d, src, seg) = batch.get(i);
                let Some(d) = d else { continue };
                for d in sys::segments(d, seg) {
                    match d.first() {
                        Some(&ECHO) => {
                            let _ = self.sock.send_to(d, src);
                        }
                        Some(&DATA) => count += d.len() as u64,
                        Some(&REPORT) => {
                            let _ = self.sock.send_to(&count.to_le_bytes(), src);
                            count = 0;
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// udp-raw bandwidth: blasts `dgram`-byte datagrams in sendmmsg batches of 64 for `secs`;
/// the server counts what arrived (so loss counts against the figure).
pub fn udp_bw(server: SocketAddr, dgram: usize, secs: f64) -> Result<BenchResult> {
    let SocketAddr::V4(dst) = server else {
        bail!("udp-raw needs an IPv4 server address")
    };
    let sock = UdpSocket::bind("127.0.0.1:0")?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let fd = sock.as_raw_fd();
    netstack::link::udp::set_large_buffers(fd);
    // reset the server's counter
    sock.send_to(&[REPORT], dst)?;
    let mut b = [0u8; 8];
    sock.recv_from(&mut b).context("udp-raw server did not answer")?;
    let mut buf = vec![0u8; dgram.max(1)];
    buf[0] = DATA;
    // GSO: as many datagrams per message as fit in one 64 KiB super-datagram
    let per_msg = (sys::MAX_GSO_BYTES / buf.len()).clamp(1, sys::MAX_GSO_SEGMENTS);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut sent = 0u64;
    while crate::procs::running_until(end) {
        let mut msgs: Vec<OutMsg> = (0..16)
            .map(|_| {
                let mut m = OutMsg::new(&dst);
                for _ in 0..per_msg {
                    m.push(buf.as_ptr(), buf.len());
                }
                if per_msg > 1 {
                    m.gso = buf.len() as u16;
                }
                m
            })
            .collect();
        match sys::sendmmsg(fd, &mut msgs) {
            Ok(0) => std::thread::yield_now(),
            Ok(n) => sent += (n * per_msg) as u64,
            Err(e) => bail!("sendmmsg: {e}"),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(50));
    sock.send_to(&[REPORT], dst)?;
    sock.recv_from(&mut b).context("udp-raw server did not report")?;
    let bytes = u64::from_le_bytes(b);
    let mut r = BenchResult {
        bench: "write_bw".into(),
        system: "udp-raw".into(),
        msg_bytes: dgram as u64,
        qps: 1,
        depth: (16 * per_msg) as u32,
        bytes,
        ops: bytes / dgram as u64,
        secs,
        ..Default::default()
    };
    r.note = Some(
        "GSO sends of up to 64 KiB, GRO receives; depth is datagrams per sendmmsg call; the server counts what arrived"
            .into(),
    );
    r.extra.insert("datagrams_sent".into(), sent.into());
    r.rates();
    Ok(r)
}

/// Runs a ping-pong for `secs`: `exchange` sends the first buffer and receives the echo into the
/// second, returning the received length (`None` for a lost round). Each message carries a
/// sequence number after `prefix`, and every echo is compared with what was sent.
fn ping_pong(
    system: &str,
    size: usize,
    secs: f64,
    prefix: &[u8],
    mut exchange: impl FnMut(&[u8], &mut [u8]) -> Result<Option<usize>>,
) -> Result<BenchResult> {
    let mut buf = vec![0u8; size.max(prefix.len() + 8)];
    buf[..prefix.len()].copy_from_slice(prefix);
    let mut rbuf = vec![0u8; buf.len()];
    let seq = prefix.len()..prefix.len() + 8;
    let mut h = histogram();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let (mut ops, mut verified) = (0u64, true);
    while crate::procs::running_until(end) {
        buf[seq.clone()].copy_from_slice(&ops.to_le_bytes());
        let t = Instant::now();
        let Some(n) = exchange(&buf, &mut rbuf)? else { continue };
        h.record((t.elapsed().as_nanos() as u64 / 2).max(1))?;
        verified &= n == buf.len() && rbuf == buf;
        ops += 1;
    }
    let mut r = BenchResult {
        bench: "send_lat".into(),
        system: system.into(),
        msg_bytes: buf.len() as u64,
        depth: 1,
        qps: 1,
        ops,
        bytes: ops * buf.len() as u64,
        secs: start.elapsed().as_secs_f64(),
        verified,
        ..Default::default()
    };
    r.latencies(&h);
    r.rates();
    Ok(r)
}

/// udp-raw ping-pong latency with `size`-byte datagrams; reports half the round trip.
pub fn udp_lat(server: SocketAddr, size: usize, secs: f64) -> Result<BenchResult> {
    let sock = UdpSocket::bind("127.0.0.1:0")?;
    sock.connect(server)?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    ping_pong("udp-raw", size, secs, &[ECHO], |buf, rbuf| {
        sock.send(buf)?;
        Ok(sock.recv(rbuf).ok()) // a lost datagram is not counted
    })
}

/// The tcp reference server: per connection, mode byte `E` + u32 size echoes size-byte
/// messages; `D` discards until the client shuts down its side, then answers the byte count.
pub fn tcp_serve(l: TcpListener) {
    for s in l.incoming().flatten() {
        std::thread::spawn(move || {
            let _ = tcp_conn(s);
        });
    }
}

fn tcp_conn(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut mode = [0u8; 5];
    s.read_exact(&mut mode)?;
    let size = u32::from_le_bytes([mode[1], mode[2], mode[3], mode[4]]) as usize;
    match mode[0] {
        ECHO => {
            let mut buf = vec![0u8; size];
            loop {
                s.read_exact(&mut buf)?;
                s.write_all(&buf)?;
            }
        }
        _ => {
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            loop {
                match s.read(&mut buf)? {
                    0 => break,
                    k => n += k as u64,
                }
            }
            s.write_all(&n.to_le_bytes())
        }
    }
}

/// Kernel TCP streaming `size`-byte writes for `secs`; the server's byte count is the figure.
pub fn tcp_bw(server: SocketAddr, size: usize, secs: f64) -> Result<BenchResult> {
    let mut s = TcpStream::connect(server)?;
    let mut hdr = vec![DATA];
    hdr.extend_from_slice(&(size as u32).to_le_bytes());
    s.write_all(&hdr)?;
    let buf = vec![0x5Au8; size.max(1)];
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut ops = 0;
    while crate::procs::running_until(end) {
        s.write_all(&buf)?;
        ops += 1;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    let secs = start.elapsed().as_secs_f64();
    let bytes = u64::from_le_bytes(b);
    let mut r = BenchResult {
        bench: "write_bw".into(),
        system: "tcp".into(),
        msg_bytes: size as u64,
        qps: 1,
        depth: 1,
        bytes,
        ops,
        secs,
        verified: bytes == ops * size as u64,
        ..Default::default()
    };
    r.rates();
    Ok(r)
}

/// Kernel TCP ping-pong latency; reports half the round trip.
pub fn tcp_lat(server: SocketAddr, size: usize, secs: f64) -> Result<BenchResult> {
    let mut s = TcpStream::connect(server)?;
    s.set_nodelay(true)?;
    let size = size.max(8);
    let mut hdr = vec![ECHO];
    hdr.extend_from_slice(&(size as u32).to_le_bytes());
    s.write_all(&hdr)?;
    ping_pong("tcp", size, secs, &[], |buf, rbuf| {
        s.write_all(buf)?;
        s.read_exact(rbuf)?;
        Ok(Some(rbuf.len()))
    })
}
