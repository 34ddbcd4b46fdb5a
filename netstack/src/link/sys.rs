//! Thin wrappers over the socket syscalls the link needs and std does not expose:
//! `sendmmsg` with scatter-gather iovecs, `recvmmsg`, socket options, `poll`, `eventfd`.
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

/// One datagram to send: a destination and up to [`MAX_IOV`] byte spans.
pub struct OutMsg {
    pub dst: libc::sockaddr_in,
    pub iov: [libc::iovec; MAX_IOV],
    pub iovcnt: usize,
}

/// Most iovecs per datagram (header, payload parts, pad + ICRC trailer).
pub const MAX_IOV: usize = 6;

impl OutMsg {
    pub fn new(dst: &SocketAddrV4) -> OutMsg {
        OutMsg {
            dst: sockaddr(dst),
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; MAX_IOV],
            iovcnt: 0,
        }
    }
    /// Appends a span. The caller keeps the bytes alive until [`sendmmsg`] returns.
    pub fn push(&mut self, p: *const u8, len: usize) -> bool {
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
}

/// Sends `msgs` with one `sendmmsg` call (repeated for what the kernel did not take);
/// returns how many were sent. Nonblocking: stops early on EAGAIN.
///
/// The iovecs must point to live memory; callers build them from buffers they hold (header
/// buffers in the batch, payload in registered regions held by `Arc`) until this returns.
pub fn sendmmsg(fd: RawFd, msgs: &mut [OutMsg]) -> io::Result<usize> {
    let mut hdrs: Vec<libc::mmsghdr> = msgs
        .iter_mut()
        .map(|m| libc::mmsghdr {
            msg_hdr: libc::msghdr {
                msg_name: &mut m.dst as *mut _ as *mut libc::c_void,
                msg_namelen: std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                msg_iov: m.iov.as_mut_ptr(),
                msg_iovlen: m.iovcnt as _,
                msg_control: std::ptr::null_mut(),
                msg_controllen: 0,
                msg_flags: 0,
            },
            msg_len: 0,
        })
        .collect();
    let mut done = 0;
    while done < hdrs.len() {
        // SAFETY: hdrs[done..] are valid mmsghdrs whose names and iovecs point into `msgs`
        // (borrowed mutably for this call) and into memory the caller keeps alive.
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

/// Receive buffers for [`recvmmsg`].
pub struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    names: Vec<libc::sockaddr_in>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    lens: Vec<usize>,
}

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
            hdrs,
            lens: vec![0; n],
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
                    msg_control: std::ptr::null_mut(),
                    msg_controllen: 0,
                    msg_flags: 0,
                },
                msg_len: 0,
            };
        }
        // SAFETY: every header points at a live name and a live iovec over a buffer owned by self.
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
        for i in 0..r as usize {
            // MSG_TRUNC in msg_flags: the datagram was larger than the buffer
            self.lens[i] = if self.hdrs[i].msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                usize::MAX
            } else {
                self.hdrs[i].msg_len as usize
            };
        }
        Ok(r as usize)
    }

    /// Datagram `i` of the last receive and its source; `None` for a truncated (oversized) one.
    pub fn get(&self, i: usize) -> (Option<&[u8]>, SocketAddrV4) {
        let src = from_sockaddr(&self.names[i]);
        match self.lens[i] {
            usize::MAX => (None, src),
            l => (Some(&self.bufs[i][..l]), src),
        }
    }

    /// Bytes of staging memory this batch holds.
    pub fn staging_bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.len()).sum()
    }
}

/// An eventfd used to wake a sleeping engine thread.
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd returns a new descriptor we own, or -1.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
    pub fn notify(&self) {
        let v: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64.
        unsafe { libc::write(self.0.as_raw_fd(), &v as *const u64 as *const libc::c_void, 8) };
    }
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64.
        unsafe { libc::read(self.0.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    }
    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable or `timeout_ns` passes (nanosecond resolution).
pub fn ppoll_readable(fds: &[RawFd], timeout_ns: u64) -> io::Result<()> {
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
    Ok(())
}
