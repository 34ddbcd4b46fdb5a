//! The references every netstack benchmark runs beside itself: `udp-raw` (the link limit: a
//! plain UDP blaster with sendmmsg/recvmmsg batches, and a UDP ping-pong) and `tcp` (kernel TCP
//! streaming, one stream per QP, and ping-pong), with the same message or datagram sizes and
//! the same waiting discipline as the flexns run ([`Wait`]).
//!
//! Every run proves its own data: udp-raw datagrams carry the run's tag, which the server
//! checks in each one (a datagram of another run counts as bad); a tcp stream lands in a ring
//! of `slots` messages at the server, which returns the CRC32C of the ring after the stream
//! ends (so the check costs nothing during the timed run), and the client compares it with the
//! CRC of what it sent; ping-pong echoes carry a sequence number and the run's tag and are
//! compared whole.

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

/// How application threads wait for a completion or a reply: both sides of a comparison wait
/// the same way, and the result line says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Wait {
    /// Poll without sleeping (a completion queue, a non-blocking socket), yielding the core
    /// between polls to other runnable threads (the stack's engine threads share the two cores
    /// of these machines): the lowest latency, a busy core each.
    Spin,
    /// Sleep in the kernel until woken (a CQ's eventfd, a blocking socket).
    Block,
}

/// A spinning server idle this long parks (sleeps until work comes), flexns's and the
/// references' alike: a comparison interleaves the systems, and the idle one's spinning
/// server would otherwise take one of the two cores from the system under test. A run's
/// first operation pays the wake-up; every later one finds the server spinning.
pub const PARK_AFTER: Duration = Duration::from_millis(5);

impl Wait {
    /// The value as on the command line (`spin`, `block`).
    pub fn name(self) -> &'static str {
        match self {
            Wait::Spin => "spin",
            Wait::Block => "block",
        }
    }
}

/// The udp-raw server: echoes `E` datagrams; checks and counts `D` datagrams; answers
/// `R`+tag with the good bytes and bad datagrams since the last report and takes the tag as
/// the run's from then on.
pub struct UdpServer {
    sock: UdpSocket,
    wait: Wait,
}

impl UdpServer {
    /// Binds the server to `addr`; it waits for datagrams as `wait` says.
    pub fn bind(addr: SocketAddrV4, wait: Wait) -> Result<UdpServer> {
        let sock = UdpSocket::bind(addr)?;
        let fd = sock.as_raw_fd();
        netstack::link::udp::set_large_buffers(fd);
        // the link limit includes GRO, as the stack uses it
        sys::setsockopt_int(fd, sys::SOL_UDP, sys::UDP_GRO, 1)?;
        if wait == Wait::Spin {
            sock.set_nonblocking(true)?;
        }
        Ok(UdpServer { sock, wait })
    }
    /// The address it is bound to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.sock.local_addr()
    }
    /// Serves forever (the process ends it).
    pub fn run(self) {
        let fd = self.sock.as_raw_fd();
        // the same staging budget as the stack: 32 x 64 KiB
        let mut batch = RecvBatch::new(32, 65536);
        let (mut good, mut bad, mut tag) = (0u64, 0u64, [0u8; 8]);
        let mut last_work = Instant::now();
        loop {
            if self.wait == Wait::Block {
                let _ = sys::ppoll_readable(&[fd], 1_000_000_000);
            }
            let n = batch.recv(fd).unwrap_or(0);
            if n == 0 && self.wait == Wait::Spin {
                if last_work.elapsed() > PARK_AFTER {
                    let _ = sys::ppoll_readable(&[fd], 100_000_000);
                } else {
                    std::thread::yield_now();
                }
            }
            if n > 0 {
                last_work = Instant::now();
            }
            for i in 0..n {
                let (d, src, seg) = batch.get(i);
                let Some(d) = d else { continue };
                for d in sys::segments(d, seg) {
                    match d.first() {
                        Some(&ECHO) => {
                            let _ = self.sock.send_to(d, src);
                        }
                        Some(&DATA) if d.len() >= 9 && d[1..9] == tag => good += d.len() as u64,
                        Some(&DATA) => bad += 1,
                        Some(&REPORT) => {
                            let mut a = [0u8; 16];
                            a[..8].copy_from_slice(&good.to_le_bytes());
                            a[8..].copy_from_slice(&bad.to_le_bytes());
                            let _ = self.sock.send_to(&a, src);
                            if d.len() >= 9 {
                                tag.copy_from_slice(&d[1..9]);
                            }
                            (good, bad) = (0, 0);
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// Asks the udp-raw server for its counts (good bytes, bad datagrams) and sets the run's tag.
fn udp_report(sock: &UdpSocket, dst: SocketAddrV4, tag: u64) -> Result<(u64, u64)> {
    let mut m = [0u8; 9];
    m[0] = REPORT;
    m[1..].copy_from_slice(&tag.to_le_bytes());
    sock.send_to(&m, dst)?;
    let mut b = [0u8; 16];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match sock.recv_from(&mut b) {
            Ok((16, _)) => break,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => return Err(e).context("udp-raw server did not answer"),
        }
    }
    Ok((
        u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
    ))
}

/// udp-raw bandwidth: blasts `dgram`-byte datagrams tagged with the run's seed in sendmmsg
/// batches of 64 for `secs`; the server counts what arrived with the tag (loss counts against
/// the figure, a datagram of another run makes the run unverified).
pub fn udp_bw(server: SocketAddr, dgram: usize, secs: f64, seed: u64) -> Result<BenchResult> {
    let SocketAddr::V4(dst) = server else {
        bail!("udp-raw needs an IPv4 server address")
    };
    // the route to the server picks the source: loopback for a local server, else its link
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let fd = sock.as_raw_fd();
    netstack::link::udp::set_large_buffers(fd);
    // reset the server's counts and give it this run's tag
    udp_report(&sock, dst, seed)?;
    let mut buf = vec![0u8; dgram.max(9)];
    crate::bench::fill_pattern(&mut buf, 0, seed);
    buf[0] = DATA;
    buf[1..9].copy_from_slice(&seed.to_le_bytes());
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
                    // SAFETY: `buf` lives, unchanged, until after `sendmmsg` below returns.
                    unsafe { m.push(buf.as_ptr(), buf.len()) };
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
    let (bytes, bad) = udp_report(&sock, dst, 0)?;
    let mut r = BenchResult {
        bench: "write_bw".into(),
        system: "udp-raw".into(),
        msg_bytes: buf.len() as u64,
        qps: 1,
        depth: (16 * per_msg) as u32,
        bytes,
        ops: bytes / buf.len() as u64,
        secs,
        verified: bytes > 0 && bad == 0,
        ..Default::default()
    };
    r.note = Some(
        "GSO sends of up to 64 KiB, GRO receives; depth is datagrams per sendmmsg call; the server counts what arrived with this run's tag (payloads are covered by the UDP checksum)"
            .into(),
    );
    r.extra.insert("datagrams_sent".into(), sent.into());
    r.extra.insert("datagrams_of_other_runs".into(), bad.into());
    r.rates();
    Ok(r)
}

/// Runs a ping-pong for `secs`: `exchange` sends the first buffer and receives the echo into the
/// second, returning the received length (`None` for a lost round). Each message carries a
/// sequence number and the run's tag after `prefix`, and every echo is compared whole.
fn ping_pong(
    system: &str,
    size: usize,
    secs: f64,
    prefix: &[u8],
    seed: u64,
    mut exchange: impl FnMut(&[u8], &mut [u8]) -> Result<Option<usize>>,
) -> Result<BenchResult> {
    let mut buf = vec![0u8; size.max(prefix.len() + 16)];
    crate::bench::fill_pattern(&mut buf, 0, seed);
    buf[..prefix.len()].copy_from_slice(prefix);
    let p = prefix.len();
    buf[p + 8..p + 16].copy_from_slice(&seed.to_le_bytes());
    let mut rbuf = vec![0u8; buf.len()];
    let mut h = histogram();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let (mut ops, mut verified) = (0u64, true);
    while crate::procs::running_until(end) {
        buf[p..p + 8].copy_from_slice(&ops.to_le_bytes());
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
        verified: verified && ops > 0,
        ..Default::default()
    };
    r.latencies(&h);
    r.rates();
    Ok(r)
}

/// Receives one datagram: spinning on a non-blocking socket, or blocking; None after 200 ms.
fn udp_recv(sock: &UdpSocket, buf: &mut [u8], wait: Wait) -> Option<usize> {
    match wait {
        Wait::Block => sock.recv(buf).ok(),
        Wait::Spin => {
            let limit = Instant::now() + Duration::from_millis(200);
            loop {
                match sock.recv(buf) {
                    Ok(n) => return Some(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < limit => {
                        std::thread::yield_now()
                    }
                    Err(_) => return None,
                }
            }
        }
    }
}

/// udp-raw ping-pong latency with `size`-byte datagrams; reports half the round trip.
pub fn udp_lat(server: SocketAddr, size: usize, secs: f64, wait: Wait, seed: u64) -> Result<BenchResult> {
    // the route to the server picks the source: loopback for a local server, else its link
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    sock.connect(server)?;
    match wait {
        Wait::Spin => sock.set_nonblocking(true)?,
        Wait::Block => sock.set_read_timeout(Some(Duration::from_millis(200)))?,
    }
    ping_pong("udp-raw", size, secs, &[ECHO], seed, |buf, rbuf| {
        sock.send(buf)?;
        Ok(udp_recv(&sock, rbuf, wait)) // a lost datagram is not counted
    })
}

/// The tcp reference server: per connection, mode byte `E` + u32 size echoes size-byte
/// messages; `D` + u32 size + u32 slots receives a stream into a ring of `slots` messages
/// until the client shuts down its side, then answers the byte count and the CRC32C of the
/// ring's first min(count, ring) bytes. `wait` spins (non-blocking reads) or blocks.
pub fn tcp_serve(l: TcpListener, wait: Wait) {
    for s in l.incoming().flatten() {
        std::thread::spawn(move || {
            let _ = tcp_conn(s, wait);
        });
    }
}

/// Reads some bytes: spinning on a non-blocking socket, or blocking.
fn read_some(s: &mut TcpStream, buf: &mut [u8], wait: Wait) -> std::io::Result<usize> {
    loop {
        match s.read(buf) {
            Err(e) if wait == Wait::Spin && e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            r => return r,
        }
    }
}

/// Writes all of `buf`, spinning while a non-blocking socket's buffer is full.
fn write_all(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                std::thread::yield_now()
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_all(s: &mut TcpStream, mut buf: &mut [u8], wait: Wait) -> std::io::Result<()> {
    while !buf.is_empty() {
        match read_some(s, buf, wait)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

fn tcp_conn(mut s: TcpStream, wait: Wait) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut mode = [0u8; 9];
    s.read_exact(&mut mode)?;
    let size = u32::from_le_bytes(mode[1..5].try_into().expect("4 bytes")) as usize;
    let slots = u32::from_le_bytes(mode[5..9].try_into().expect("4 bytes")) as usize;
    if size == 0 || size > 64 << 20 || slots == 0 || size * slots > 256 << 20 {
        return Err(std::io::ErrorKind::InvalidInput.into());
    }
    s.set_nonblocking(wait == Wait::Spin)?;
    match mode[0] {
        ECHO => {
            let mut buf = vec![0u8; size];
            loop {
                read_all(&mut s, &mut buf, wait)?;
                write_all(&mut s, &buf)?;
            }
        }
        _ => {
            // the stream lands in the ring: stream offset o at ring offset o % ring
            let mut ring = vec![0u8; size * slots];
            let (mut n, mut at) = (0u64, 0usize);
            loop {
                match read_some(&mut s, &mut ring[at..], wait)? {
                    0 => break,
                    k => {
                        n += k as u64;
                        at = (at + k) % ring.len();
                    }
                }
            }
            let covered = (n as usize).min(ring.len());
            let mut a = [0u8; 12];
            a[..8].copy_from_slice(&n.to_le_bytes());
            a[8..].copy_from_slice(&crc32c::crc32c(&ring[..covered]).to_le_bytes());
            write_all(&mut s, &a)
        }
    }
}

fn tcp_open(server: SocketAddr, mode: u8, size: usize, slots: usize) -> Result<TcpStream> {
    let mut s = TcpStream::connect(server).with_context(|| format!("connecting to the tcp reference at {server}"))?;
    s.set_nodelay(true)?;
    let mut hdr = vec![mode];
    hdr.extend_from_slice(&(size as u32).to_le_bytes());
    hdr.extend_from_slice(&(slots as u32).to_le_bytes());
    s.write_all(&hdr)?;
    Ok(s)
}

/// Most streams the tcp bandwidth reference runs (one thread each).
pub const MAX_TCP_STREAMS: usize = 1024;

/// Kernel TCP bandwidth: one stream per QP (`streams`), each writing `size`-byte messages
/// cyclically from its own `slots` message buffers (as a flexns QP reposts its slots) for
/// `secs`. The server's byte counts are the figure; each stream is verified by the CRC of the
/// ring the server received it into.
pub fn tcp_bw(
    server: SocketAddr,
    size: usize,
    secs: f64,
    streams: usize,
    slots: usize,
    seed: u64,
) -> Result<BenchResult> {
    if streams == 0 || streams > MAX_TCP_STREAMS {
        bail!("the tcp reference runs one stream per QP: 1 to {MAX_TCP_STREAMS}, not {streams}");
    }
    let size = size.max(1);
    let slots = slots.clamp(1, ((256 << 20) / size).max(1));
    let socks = (0..streams)
        .map(|_| tcp_open(server, DATA, size, slots))
        .collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let outs: Vec<Result<(u64, u64, bool)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = socks
            .into_iter()
            .enumerate()
            .map(|(i, mut s)| {
                sc.spawn(move || -> Result<(u64, u64, bool)> {
                    let mut buf = vec![0u8; size * slots];
                    let base = (i * buf.len()) as u64;
                    crate::bench::fill_pattern(&mut buf, base, seed);
                    let mut ops = 0u64;
                    while crate::procs::running_until(end) {
                        let k = (ops as usize) % slots;
                        s.write_all(&buf[k * size..(k + 1) * size])?;
                        ops += 1;
                    }
                    s.shutdown(std::net::Shutdown::Write)?;
                    let mut a = [0u8; 12];
                    s.read_exact(&mut a)?;
                    let bytes = u64::from_le_bytes(a[..8].try_into().expect("8 bytes"));
                    let crc = u32::from_le_bytes(a[8..].try_into().expect("4 bytes"));
                    let covered = (bytes as usize).min(buf.len());
                    let ok = bytes == ops * size as u64 && crc == crc32c::crc32c(&buf[..covered]);
                    Ok((bytes, ops, ok))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("tcp stream thread")).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let (mut bytes, mut ops, mut verified) = (0u64, 0u64, true);
    for o in outs {
        let (b, n, ok) = o?;
        bytes += b;
        ops += n;
        verified &= ok;
    }
    let mut r = BenchResult {
        bench: "write_bw".into(),
        system: "tcp".into(),
        msg_bytes: size as u64,
        qps: streams as u32,
        depth: slots as u32,
        bytes,
        ops,
        secs,
        verified: verified && bytes > 0,
        ..Default::default()
    };
    r.extra.insert("streams".into(), streams.into());
    r.rates();
    Ok(r)
}

/// Kernel TCP ping-pong latency; reports half the round trip.
pub fn tcp_lat(server: SocketAddr, size: usize, secs: f64, wait: Wait, seed: u64) -> Result<BenchResult> {
    let size = size.max(16);
    let mut s = tcp_open(server, ECHO, size, 1)?;
    s.set_nonblocking(wait == Wait::Spin)?;
    ping_pong("tcp", size, secs, &[], seed, |buf, rbuf| {
        write_all(&mut s, buf)?;
        read_all(&mut s, rbuf, wait)?;
        Ok(Some(rbuf.len()))
    })
}
