//! The system calls flexnsd makes that std does not wrap: `SOCK_SEQPACKET` Unix sockets with
//! `SCM_RIGHTS`, eventfds, memfds and their seals, and `poll(2)`. Every `unsafe` block of the
//! crate that is not a shared-memory access ([`super::shm`]) is here.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

/// Most file descriptors one message carries.
pub const MAX_FDS: usize = 4;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {}: longer than 107 bytes or has a NUL", path.display()),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked and owned below.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening `SOCK_SEQPACKET` socket at `path` (an existing socket file there is replaced).
pub fn listen(path: &Path) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (addr, len) = sockaddr(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(_) => {}
    }
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) })?;
    // SAFETY: plain listen(2) on our socket.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 64) })?;
    Ok(fd)
}

/// Accepts one connection (blocking).
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: accept4 with no address buffer; the result is checked and owned.
        let r = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        match cvt(r) {
            // SAFETY: a fresh descriptor nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Connects to the listening socket at `path`.
pub fn connect(path: &Path) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    let (addr, len) = sockaddr(path)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe { libc::connect(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) })?;
    Ok(fd)
}

/// Sets or clears `O_NONBLOCK`.
pub fn set_nonblocking(fd: BorrowedFd<'_>, on: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we borrow.
    let fl = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    let fl = if on {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl) })?;
    Ok(())
}

/// Sends one packet with `fds` attached.
pub fn send_msg(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "at most {MAX_FDS} descriptors per message");
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cbuf = [0u64; 8]; // 64 bytes, 8-aligned: room for the header and MAX_FDS ints
                              // SAFETY: msghdr is plain data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * std::mem::size_of::<RawFd>()) as u32;
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: the control buffer is 64 bytes, more than CMSG_SPACE of MAX_FDS ints, and
        // aligned for cmsghdr; CMSG_FIRSTHDR/CMSG_DATA point inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as usize;
            let data = libc::CMSG_DATA(c) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: msg points at live buffers for the duration of the call.
        let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What [`recv_msg`] got.
pub enum Recv {
    /// A packet of this many bytes (whole: a truncated one is an error), and its descriptors.
    Msg(usize, Vec<OwnedFd>),
    /// The peer closed the connection.
    Eof,
    /// Nothing waiting (only with `nonblocking`).
    WouldBlock,
}

/// Receives one packet into `buf`.
pub fn recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8], nonblocking: bool) -> io::Result<Recv> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    let flags = libc::MSG_CMSG_CLOEXEC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    let n = loop {
        // SAFETY: msg points at live buffers for the duration of the call.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
        if r >= 0 {
            break r as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(Recv::WouldBlock),
            io::ErrorKind::ConnectionReset => return Ok(Recv::Eof),
            _ => return Err(e),
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with well-formed cmsghdrs within msg_controllen;
    // the CMSG_* macros walk them inside the buffer. Each SCM_RIGHTS int is a new descriptor
    // this process now owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message: longer than the largest allowed, or more than 4 descriptors",
        ));
    }
    if n == 0 && fds.is_empty() {
        return Ok(Recv::Eof);
    }
    Ok(Recv::Msg(n, fds))
}

/// A non-blocking, close-on-exec eventfd.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain eventfd(2); the result is checked and owned.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd another process passed (and could have made blocking again since):
/// never blocks, an eventfd at its maximum count (readable already, so its waiter wakes
/// anyway) is skipped.
pub fn eventfd_signal_peer(fd: BorrowedFd<'_>) {
    if matches!(poll(&[(fd, libc::POLLOUT)], Some(Duration::ZERO)), Ok(r) if r[0] & libc::POLLOUT != 0) {
        eventfd_signal(fd);
    }
}

/// Adds one to an eventfd (wakes its waiter).
pub fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write from a live buffer; a full counter (EAGAIN) still wakes.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
}

/// Resets an eventfd's counter: reads until EAGAIN (one read for a plain eventfd; an
/// `EFD_SEMAPHORE` one gives 1 a read, so at most 64 reads). `fd` must be non-blocking.
pub fn eventfd_drain(fd: BorrowedFd<'_>) {
    let mut v = [0u8; 8];
    for _ in 0..64 {
        // SAFETY: an 8-byte read into a live buffer; EAGAIN (already zero) ends the loop.
        let r = unsafe { libc::read(fd.as_raw_fd(), v.as_mut_ptr() as *mut libc::c_void, 8) };
        if r != 8 {
            break;
        }
    }
}

/// Whether `fd` is an eventfd (what a passed doorbell or notify descriptor must be).
pub fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|p| p.to_string_lossy() == "anon_inode:[eventfd]")
        .unwrap_or(false)
}

/// Whether `fd` is a file of tmpfs (a plain memfd is; a hugetlbfs one, whose punched holes
/// fault with SIGBUS and whose 4 KiB-rounded unmaps fail, is not).
pub fn is_tmpfs(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: statfs is plain data; all-zero is valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs(2) fills the live struct; the result is checked.
    cvt(unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) })?;
    // both are `c_long` here, other types on other targets: compared as i64 everywhere
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = st.f_type as i64 == libc::TMPFS_MAGIC as i64;
    Ok(tmpfs)
}

/// A new memfd that can be sealed (so that a daemon mapping it can forbid shrinking).
pub fn memfd(name: &CStr) -> io::Result<std::fs::File> {
    // SAFETY: a C string; the flags ask for a close-on-exec file that allows seals.
    let fd = cvt(unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })?;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Forbids shrinking the memfd from now on (`F_SEAL_SHRINK`): fails for a file that is not a
/// memfd or was created without `MFD_ALLOW_SEALING`.
pub fn seal_shrink(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS on a descriptor we borrow.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) })?;
    Ok(())
}

/// Waits up to `timeout` (`None`: forever) until one of `fds` has one of its `events`; returns
/// each one's `revents`.
pub fn poll(fds: &[(BorrowedFd<'_>, i16)], timeout: Option<Duration>) -> io::Result<Vec<i16>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|(fd, ev)| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: *ev,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    // SAFETY: `p` is a live array of `p.len()` pollfds.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(p.iter().map(|x| x.revents).collect())
}

/// Registers an owned descriptor with the current Tokio runtime (read readiness).
pub fn async_fd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the descriptor, so it stays open for as long as it is registered
    // (it is deregistered when the AsyncFd drops, before the descriptor closes).
    Ok(unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }?)
}

/// CPU seconds (user + system) this process's threads used so far.
pub fn cpu_seconds_self() -> f64 {
    // SAFETY: rusage is plain data; all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF covers every thread.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The unit of /proc/<pid>/stat's CPU times.
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}
