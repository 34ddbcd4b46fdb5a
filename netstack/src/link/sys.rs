//! Thin wrappers over the socket syscalls the link needs and std does not expose:
//! `sendmmsg` with scatter-gather iovecs, `recvmmsg`, socket options, `poll`, `eventfd`,
//! `timerfd`.
//! This is the stack's second (and last) `unsafe` module; every function here documents why
//! its pointers are valid.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Sets an integer socket option.
pub fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: passes a pointer to a live c_int and its size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &v as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// Reads an integer socket option.
pub fn getsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: v and len are live and sized for the kernel to fill.
    cvt(unsafe { libc::getsockopt(fd, level, name, &mut v as *mut _ as *mut libc::c_void, &mut len) })?;
    Ok(v)
}

/// The MTU (bytes of an IP packet) of the route to `to`, as the kernel knows it (the outgoing
/// interface's, or a smaller one learned for that destination).
pub fn route_mtu(to: SocketAddrV4) -> io::Result<u32> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
    s.connect(to)?;
    Ok(getsockopt_int(s.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU)? as u32)
}

fn sockaddr(a: &SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

fn from_sockaddr(s: &libc::sockaddr_in) -> SocketAddrV4 {
    SocketAddrV4::new(
        Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes()),
        u16::from_be(s.sin_port),
    )
}

/// `SOL_UDP` (the libc crate lacks it for glibc targets).
pub const SOL_UDP: libc::c_int = 17;
/// UDP generic segmentation offload: the segment size of a multi-datagram send.
pub const UDP_SEGMENT: libc::c_int = 103;
/// UDP generic receive offload: coalesced receives report their segment size in a cmsg.
pub const UDP_GRO: libc::c_int = 104;
/// `SO_TIMESTAMPNS` (= `SCM_TIMESTAMPNS`, the generic Linux value, x86-64 and arm64): each
/// receive reports in a cmsg when the kernel took the packet in (CLOCK_REALTIME `timespec`).
pub const SO_TIMESTAMPNS: libc::c_int = 35;

/// Most iovecs in one message (a GSO message holds up to [`MAX_GSO_SEGMENTS`] packets of a few
/// spans each).
pub const MAX_IOV: usize = 64;
/// Most segments the kernel accepts in one GSO send.
pub const MAX_GSO_SEGMENTS: usize = 64;
/// Largest GSO super-datagram payload (the IP packet must stay under 64 KiB).
pub const MAX_GSO_BYTES: usize = 65_000;

/// One message to send: a destination, up to [`MAX_IOV`] byte spans, and, for GSO, the segment
/// size at which the kernel cuts the concatenated spans into datagrams. The spans are not
/// public: outside netstack they enter only through [`OutMsg::push`], whose contract keeps them
/// readable until the message is sent, so the safe [`OutMsg::gather`] and [`sendmmsg`] can
/// read them (netstack's own links read them in place).
pub struct OutMsg {
    /// The destination.
    pub(crate) dst: libc::sockaddr_in,
    /// The byte spans, in order.
    pub(crate) iov: [libc::iovec; MAX_IOV],
    /// How many of `iov` are used (at most [`MAX_IOV`]).
    pub(crate) iovcnt: usize,
    /// Segment size for UDP GSO; 0 sends one datagram.
    pub gso: u16,
    cmsg: [u64; 4],
}

impl OutMsg {
    /// An empty message to `dst`.
    pub fn new(dst: &SocketAddrV4) -> OutMsg {
        OutMsg {
            dst: sockaddr(dst),
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; MAX_IOV],
            iovcnt: 0,
            gso: 0,
            cmsg: [0; 4],
        }
    }
    /// Appends a span of `len` bytes at `p`; false when the message has no room left.
    ///
    /// # Safety
    /// `p..p+len` must stay valid for reads until every [`sendmmsg`] or [`OutMsg::gather`] call
    /// given this message has returned (the kernel, or `gather`, reads the span there); a
    /// message whose spans are no longer valid must not be sent. The memory may be shared (the
    /// kernel's reads are not Rust accesses, and `gather`'s are byte-wise atomic).
    pub unsafe fn push(&mut self, p: *const u8, len: usize) -> bool {
        if self.iovcnt == MAX_IOV {
            return false;
        }
        self.iov[self.iovcnt] = libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: len,
        };
        self.iovcnt += 1;
        true
    }
    /// Spans left.
    pub fn room(&self) -> usize {
        MAX_IOV - self.iovcnt
    }

    /// Its destination.
    pub fn destination(&self) -> SocketAddrV4 {
        from_sockaddr(&self.dst)
    }

    /// Appends the bytes of its spans to `out`, as the kernel reads them when it sends the
    /// message (the simulated link sends it this way). Spans into registered memory are read
    /// with byte-wise atomic loads: a remote peer's WRITE or the application may be writing it.
    pub fn gather(&self, out: &mut Vec<u8>) {
        for v in &self.iov[..self.iovcnt] {
            let at = out.len();
            out.resize(at + v.iov_len, 0);
            // SAFETY: the span is valid for reads until the message is sent (the contract of
            // `push`, the only way a span gets in, covers this call); `out` is this function's
            // own buffer, resized to hold it, and cannot overlap a span.
            unsafe { crate::mem::load_bytes(v.iov_base as *const u8, out.as_mut_ptr().add(at), v.iov_len) };
        }
    }
}

/// Sends `msgs` with `sendmmsg` (repeated for what the kernel did not take); returns how many
/// messages were sent. Nonblocking: stops early on EAGAIN.
///
/// The iovecs must point to live memory; callers build them from buffers they hold (header
/// buffers in the batch, payload in registered regions held by `Arc`) until this returns.
pub fn sendmmsg(fd: RawFd, msgs: &mut [OutMsg]) -> io::Result<usize> {
    sendmmsg_with(fd, msgs, &mut SendScratch::default())
}

/// Scratch space a sender reuses across batches: the kernel's message headers for `sendmmsg`,
/// rebuilt from the messages before every send and never read after it (no allocation per batch
/// on the data path). Links that make no system call ignore it.
#[derive(Default)]
pub struct SendScratch {
    hdrs: Vec<libc::mmsghdr>,
}

impl SendScratch {
    /// Scratch with room for `n` messages per batch before it grows.
    pub fn with_capacity(n: usize) -> SendScratch {
        SendScratch {
            hdrs: Vec::with_capacity(n),
        }
    }
}

impl std::fmt::Debug for SendScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendScratch")
            .field("capacity", &self.hdrs.capacity())
            .finish()
    }
}

// SAFETY: the headers' raw pointers are written by `sendmmsg_with` from the messages it was
// given and used only inside that call; between calls they are stale values nothing reads, so
// moving the scratch to another thread (with the data core that owns it) cannot reach them.
unsafe impl Send for SendScratch {}

/// [`sendmmsg`] building the kernel's message headers in `scratch`, which the caller reuses
/// across calls (no allocation per batch on the data path).
pub fn sendmmsg_with(fd: RawFd, msgs: &mut [OutMsg], scratch: &mut SendScratch) -> io::Result<usize> {
    let space = cmsg_space(std::mem::size_of::<u16>());
    let hdrs = &mut scratch.hdrs;
    hdrs.clear();
    hdrs.extend(msgs.iter_mut().map(|m| {
        let (control, controllen) = if m.gso > 0 {
            // SAFETY: the control buffer is 32 bytes, u64-aligned, larger than
            // CMSG_SPACE(2); the CMSG macros only compute offsets into it.
            unsafe {
                let mut mh: libc::msghdr = std::mem::zeroed();
                mh.msg_control = m.cmsg.as_mut_ptr() as *mut libc::c_void;
                mh.msg_controllen = space as _;
                let c = libc::CMSG_FIRSTHDR(&mh);
                (*c).cmsg_level = SOL_UDP;
                (*c).cmsg_type = UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, m.gso);
            }
            (m.cmsg.as_mut_ptr() as *mut libc::c_void, space)
        } else {
            (std::ptr::null_mut(), 0)
        };
        libc::mmsghdr {
            msg_hdr: libc::msghdr {
                msg_name: &mut m.dst as *mut _ as *mut libc::c_void,
                msg_namelen: std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                msg_iov: m.iov.as_mut_ptr(),
                msg_iovlen: m.iovcnt as _,
                msg_control: control,
                msg_controllen: controllen as _,
                msg_flags: 0,
            },
            msg_len: 0,
        }
    }));
    let mut done = 0;
    while done < hdrs.len() {
        // SAFETY: hdrs[done..] are valid mmsghdrs whose names, iovecs and control buffers point
        // into `msgs` (borrowed mutably for this call) and into memory the caller keeps alive.
        let r = unsafe {
            libc::sendmmsg(
                fd,
                hdrs[done..].as_mut_ptr(),
                (hdrs.len() - done) as libc::c_uint,
                libc::MSG_DONTWAIT,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
                break;
            }
            if done > 0 {
                break;
            }
            return Err(e);
        }
        done += r as usize;
    }
    Ok(done)
}

fn cmsg_space(n: usize) -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE(n as u32) as usize }
}

/// Receive buffers for `recvmmsg`, with room for the GRO segment-size, TOS and receive-time
/// cmsgs.
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    names: Vec<libc::sockaddr_in>,
    iovs: Vec<libc::iovec>,
    cmsgs: Vec<[u64; 12]>,
    hdrs: Vec<libc::mmsghdr>,
    lens: Vec<usize>,
    segs: Vec<usize>,
    tos: Vec<u8>,
    /// When the kernel received each datagram, CLOCK_MONOTONIC ns (0: not reported).
    arrived: Vec<u64>,
}

// SAFETY: the raw pointers in a batch (iovecs, message headers) point only into heap buffers
// the batch owns, which move with it; nothing else refers to them.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    /// `n` buffers of `size` bytes each.
    pub fn new(n: usize, size: usize) -> RecvBatch {
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; size]).collect();
        let names = vec![sockaddr(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)); n];
        let iovs = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: mmsghdr is plain data; zero is a valid (empty) value, filled before use.
        let hdrs = (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
        RecvBatch {
            bufs,
            names,
            iovs,
            cmsgs: vec![[0; 12]; n],
            hdrs,
            lens: vec![0; n],
            segs: vec![0; n],
            tos: vec![0; n],
            arrived: vec![0; n],
        }
    }

    /// Receives up to the batch size without blocking; returns the count.
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        let n = self.bufs.len();
        for i in 0..n {
            self.hdrs[i] = libc::mmsghdr {
                msg_hdr: libc::msghdr {
                    msg_name: &mut self.names[i] as *mut _ as *mut libc::c_void,
                    msg_namelen: std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                    msg_iov: &mut self.iovs[i],
                    msg_iovlen: 1,
                    msg_control: self.cmsgs[i].as_mut_ptr() as *mut libc::c_void,
                    msg_controllen: std::mem::size_of::<[u64; 12]>() as _,
                    msg_flags: 0,
                },
                msg_len: 0,
            };
        }
        // SAFETY: every header points at a live name, iovec and control buffer owned by self.
        let r = unsafe {
            libc::recvmmsg(
                fd,
                self.hdrs.as_mut_ptr(),
                n as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(e);
        }
        // receive timestamps are CLOCK_REALTIME; the transports' clock is CLOCK_MONOTONIC
        let mut clock_offset = None;
        for i in 0..r as usize {
            let h = &self.hdrs[i].msg_hdr;
            // MSG_TRUNC in msg_flags: the datagram was larger than the buffer
            self.lens[i] = if h.msg_flags & libc::MSG_TRUNC != 0 {
                usize::MAX
            } else {
                self.hdrs[i].msg_len as usize
            };
            self.segs[i] = 0;
            self.tos[i] = 0;
            self.arrived[i] = 0;
            // SAFETY: the kernel filled msg_control/msg_controllen; the CMSG macros walk it
            // within those bounds.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(h);
                while !c.is_null() {
                    if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                        self.segs[i] = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int) as usize;
                    }
                    if (*c).cmsg_level == libc::IPPROTO_IP && (*c).cmsg_type == libc::IP_TOS {
                        self.tos[i] = *libc::CMSG_DATA(c);
                    }
                    if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == SO_TIMESTAMPNS {
                        let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::timespec);
                        let real = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
                        let off = *clock_offset.get_or_insert_with(realtime_minus_monotonic);
                        self.arrived[i] = u64::try_from(real - off).unwrap_or(0);
                    }
                    c = libc::CMSG_NXTHDR(h, c);
                }
            }
        }
        Ok(r as usize)
    }

    /// Datagram `i` of the last receive, its source, and the GRO segment size when several
    /// datagrams were coalesced into it (0 otherwise); `None` data for a truncated one.
    pub fn get(&self, i: usize) -> (Option<&[u8]>, SocketAddrV4, usize) {
        let src = from_sockaddr(&self.names[i]);
        match self.lens[i] {
            usize::MAX => (None, src, 0),
            l => (Some(&self.bufs[i][..l]), src, self.segs[i]),
        }
    }

    /// The IP TOS byte of receive `i` (with `IP_RECVTOS` on; its low two bits are the ECN field).
    pub fn tos(&self, i: usize) -> u8 {
        self.tos[i]
    }

    /// When the kernel received datagram `i` of the last receive, CLOCK_MONOTONIC ns (with
    /// `SO_TIMESTAMPNS` on; `None` when it was not reported, or for a batch filled without a
    /// system call). For a GRO-coalesced receive, its first datagram's time.
    pub fn arrived(&self, i: usize) -> Option<u64> {
        Some(self.arrived[i]).filter(|&t| t != 0)
    }

    /// Fills the batch from `datagrams` (source address, TOS byte, receive time as
    /// [`RecvBatch::arrived`] reports it (0: not known), bytes) without a system call, as a
    /// simulated link delivers; returns how many it took (at most its size). A datagram larger
    /// than a buffer is reported truncated, as `recvmmsg` reports it.
    pub fn fill<'a>(&mut self, datagrams: impl Iterator<Item = (SocketAddrV4, u8, u64, &'a [u8])>) -> usize {
        let mut n = 0;
        for (src, tos, arrived, data) in datagrams.take(self.bufs.len()) {
            let buf = &mut self.bufs[n];
            self.lens[n] = if data.len() > buf.len() {
                usize::MAX
            } else {
                buf[..data.len()].copy_from_slice(data);
                data.len()
            };
            self.names[n] = sockaddr(&src);
            self.segs[n] = 0;
            self.tos[n] = tos;
            self.arrived[n] = arrived;
            n += 1;
        }
        n
    }

    /// Buffers in the batch (the most one receive returns).
    pub fn capacity(&self) -> usize {
        self.bufs.len()
    }

    /// Bytes of staging memory this batch holds.
    pub fn staging_bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.len()).sum()
    }

    /// Bytes one buffer of the batch holds (the largest receive it takes).
    pub fn buffer_len(&self) -> usize {
        self.bufs.first().map_or(0, |b| b.len())
    }

    /// Keeps the receives among the first `n` for which `keep(bytes, source)` says so (in
    /// order, at the front) and returns how many were kept; a truncated receive is kept.
    pub fn retain(&mut self, n: usize, mut keep: impl FnMut(&[u8], SocketAddrV4) -> bool) -> usize {
        let mut k = 0;
        for i in 0..n {
            let src = from_sockaddr(&self.names[i]);
            let kept = match self.lens[i] {
                usize::MAX => true,
                l => keep(&self.bufs[i][..l], src),
            };
            if kept {
                if i != k {
                    // the buffers move with their iovecs (an iovec points into its buffer)
                    self.bufs.swap(i, k);
                    self.iovs.swap(i, k);
                    self.names.swap(i, k);
                    self.lens.swap(i, k);
                    self.segs.swap(i, k);
                    self.tos.swap(i, k);
                    self.arrived.swap(i, k);
                }
                k += 1;
            }
        }
        k
    }

    /// Puts a receive in slot `i` that was too large for its buffer (reported as `recvmmsg`
    /// reports a truncated datagram); false when `i` is past the batch.
    pub fn put_truncated(&mut self, i: usize, src: SocketAddrV4) -> bool {
        if i >= self.bufs.len() {
            return false;
        }
        self.lens[i] = usize::MAX;
        self.names[i] = sockaddr(&src);
        self.segs[i] = 0;
        self.tos[i] = 0;
        self.arrived[i] = 0;
        true
    }

    /// Puts a receive of `len` bytes copied from shared memory at `p` in slot `i`, from `src`,
    /// with GRO segment size `seg` (0: one datagram) and TOS byte `tos`; false (and nothing
    /// copied) when `i` is past the batch or `len` is larger than a buffer.
    ///
    /// # Safety
    /// `p..p+len` must be valid for reads during the call and accessed by others only
    /// atomically (the copy is a byte-wise atomic load, [`crate::mem::load_bytes`]).
    pub(crate) unsafe fn put_shared(
        &mut self,
        i: usize,
        src: SocketAddrV4,
        tos: u8,
        seg: usize,
        p: *const u8,
        len: usize,
    ) -> bool {
        let Some(buf) = self.bufs.get_mut(i) else {
            return false;
        };
        if len > buf.len() {
            return false;
        }
        // SAFETY: the caller's contract covers the source; the destination is this batch's own
        // buffer, at least `len` bytes long, which cannot overlap shared memory.
        unsafe { crate::mem::load_bytes(p, buf.as_mut_ptr(), len) };
        self.lens[i] = len;
        self.names[i] = sockaddr(&src);
        self.segs[i] = seg;
        self.tos[i] = tos;
        self.arrived[i] = 0;
        true
    }
}

/// Splits a (possibly GRO-coalesced) receive into its datagrams.
pub fn segments(data: &[u8], seg: usize) -> impl Iterator<Item = &[u8]> {
    let step = if seg == 0 { data.len().max(1) } else { seg };
    data.chunks(step)
}

/// An eventfd used to wake a sleeping engine thread.
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A nonblocking eventfd.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd returns a new descriptor we own, or -1.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
    /// Wakes whoever polls it.
    pub fn notify(&self) {
        let v: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64.
        unsafe { libc::write(self.0.as_raw_fd(), &v as *const u64 as *const libc::c_void, 8) };
    }
    /// Consumes the pending notifications.
    pub fn drain(&self) {
        self.take();
    }
    /// Consumes the pending notifications; returns whether there were any (nonblocking).
    pub fn take(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64.
        let r = unsafe { libc::read(self.0.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
        r == 8
    }
    /// Its descriptor (to poll).
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A nonblocking CLOCK_MONOTONIC timerfd: a sleeper that polls it wakes at the time it was
/// last armed for, and another thread may move that time earlier without waking it now.
pub struct TimerFd(OwnedFd);

impl TimerFd {
    /// A disarmed timer.
    pub fn new() -> io::Result<TimerFd> {
        // SAFETY: timerfd_create returns a new descriptor we own, or -1.
        let fd = cvt(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) })?;
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        Ok(TimerFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
    /// Fires (becomes readable) at CLOCK_MONOTONIC time `at_ns`, or at once if it has passed.
    pub fn arm_at(&self, at_ns: u64) {
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            // a zero value would disarm it
            it_value: libc::timespec {
                tv_sec: (at_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (at_ns % 1_000_000_000).max(1) as libc::c_long,
            },
        };
        // SAFETY: spec is a live itimerspec; the old value is not asked for (null).
        unsafe { libc::timerfd_settime(self.0.as_raw_fd(), libc::TFD_TIMER_ABSTIME, &spec, std::ptr::null_mut()) };
    }
    /// Consumes an expiry (nonblocking).
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64.
        unsafe { libc::read(self.0.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
    /// Its descriptor (to poll).
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable or `timeout_ns` passes (nanosecond resolution).
pub fn ppoll_readable(fds: &[RawFd], timeout_ns: u64) -> io::Result<()> {
    ppoll_ready(fds, timeout_ns).map(drop)
}

/// [`ppoll_readable`], returning those of `fds` that are readable (none after a timeout).
pub fn ppoll_ready(fds: &[RawFd], timeout_ns: u64) -> io::Result<smallvec::SmallVec<[RawFd; 8]>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: p is a live pollfd array of the given length; ts is a live timespec; no sigmask.
    let r = unsafe { libc::ppoll(p.as_mut_ptr(), p.len() as libc::nfds_t, &ts, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(p.iter().filter(|q| q.revents != 0).map(|q| q.fd).collect())
}

/// CLOCK_REALTIME minus CLOCK_MONOTONIC now, ns (converts a receive timestamp to the
/// transports' clock; read once per receive batch, so a step of the wall clock mismeasures at
/// most one batch).
fn realtime_minus_monotonic() -> i128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid pointer it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    let real = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
    real - monotonic_ns() as i128
}

/// CLOCK_MONOTONIC in nanoseconds: the clock every process (and network namespace) on this
/// host shares, so timestamps one process writes into packets mean the same to another.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid pointer it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sets the calling thread's timer slack (how late the kernel may end its sleeps).
pub fn set_timer_slack_ns(ns: u64) {
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and affects only this thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0) };
}

/// The IPv4 addresses of this host's interfaces that are up, with the interface names.
pub fn interfaces() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that stays valid until freeifaddrs; every node
    // and its name/address pointers are read only before that, null-checked first.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut p = head;
        while !p.is_null() {
            let ifa = &*p;
            if !ifa.ifa_addr.is_null()
                && (*ifa.ifa_addr).sa_family as i32 == libc::AF_INET
                && ifa.ifa_flags & libc::IFF_UP as u32 != 0
            {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                let name = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy().into_owned();
                out.push((name, ip));
            }
            p = ifa.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    out
}
