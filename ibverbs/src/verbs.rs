//! The exported `ibv_*` functions and the operations the inline functions of `verbs.h` call
//! through `ibv_context.ops`.
//!
//! Every object handed to the program is a `#[repr(C)]` box whose first field is the C struct
//! (so the program's pointer is the box's) followed by a magic number and the Rust state. A
//! pointer the program passes back is checked for NULL and for the magic number of its kind
//! before its Rust state is touched; the program's own fields (the C struct) are only read and
//! written through the raw pointer, never through a Rust reference.

use crate::abi::*;
use crate::{guard, report, report_post, set_errno};
use libc::{c_char, c_int, c_uint, c_void, EINVAL, ENOMEM, EOPNOTSUPP};
use netstack::verbs::{
    Access, Context, ContextConfig, Cq, Endpoint, Mr, Pd, Qp, QpInitAttr, RecvWr, SendFlags, SendWr, SgList, Sge,
    VerbsError, Wc, WcOpcode, WcStatus, WrOpcode, EMPTY_WC,
};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::ptr::{self, null_mut};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The UDP port of RoCEv2, where every process's engine listens (on its own address).
const ROCE_PORT: u16 = 4791;
/// The device's name.
const DEVICE_NAME: &str = "flexns0";
/// The largest INLINE payload a QP takes.
const MAX_INLINE: u32 = 512;
/// The most work requests of a queue, completions of a CQ, SGEs of a request.
const MAX_QP_WR: u32 = 16384;
const MAX_CQE: c_int = 1 << 20;
const MAX_SGE: c_int = 16;

const MAGIC_CTX: u64 = 0x666c_786e_5f63_7478;
const MAGIC_PD: u64 = 0x666c_786e_5f70_6400;
const MAGIC_MR: u64 = 0x666c_786e_5f6d_7200;
const MAGIC_CQ: u64 = 0x666c_786e_5f63_7100;
const MAGIC_QP: u64 = 0x666c_786e_5f71_7000;
const MAGIC_CH: u64 = 0x666c_786e_5f63_6800;

/// The `flexnsd` socket the engine is in (`FLEXNS_FLEXNSD`), if the program runs on one.
fn flexnsd_socket() -> Option<std::path::PathBuf> {
    std::env::var_os("FLEXNS_FLEXNSD")
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

/// This process's address: with `FLEXNS_FLEXNSD`, the daemon's data address (whose port must
/// be 4791: peers are named by GID alone); else `FLEXNS_IBV_ADDR` (an IPv4 address), or
/// `127.a.b.c` from the pid (`a` in 1..=254, so never `127.0.0.0` nor `127.255.255.255`),
/// distinct for every pid below 2^24. Its RoCEv2 GID is `::ffff:` followed by it.
pub fn process_addr() -> Result<Ipv4Addr, String> {
    static ADDR: OnceLock<Result<Ipv4Addr, String>> = OnceLock::new();
    if let Some(sock) = flexnsd_socket() {
        return ADDR
            .get_or_init(|| {
                let att = netstack::verbs::attach::client::Attachment::connect(&sock, "flexns-ibverbs-probe")
                    .map_err(|e| format!("FLEXNS_FLEXNSD: cannot attach to {}: {e}", sock.display()))?;
                let addr = att
                    .daemon_addr()
                    .ok_or_else(|| format!("FLEXNS_FLEXNSD: {} did not say its data address", sock.display()))?;
                if addr.ip().is_unspecified() || addr.port() != ROCE_PORT {
                    return Err(format!(
                        "FLEXNS_FLEXNSD: {} listens on {addr}; ibverbs programs name peers by GID alone, so \
                         the daemon's [context] bind must be a concrete address with port {ROCE_PORT}",
                        sock.display()
                    ));
                }
                Ok(*addr.ip())
            })
            .clone();
    }
    ADDR.get_or_init(|| match std::env::var("FLEXNS_IBV_ADDR") {
        Ok(s) => s
            .trim()
            .parse::<Ipv4Addr>()
            .map_err(|e| format!("FLEXNS_IBV_ADDR: {s:?} is not an IPv4 address ({e})")),
        Err(_) => {
            let pid = std::process::id();
            Ok(Ipv4Addr::new(
                127,
                1 + ((pid >> 16) % 254) as u8,
                (pid >> 8) as u8,
                pid as u8,
            ))
        }
    })
    .clone()
}

fn gid_of(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

// ---------------------------------------------------------------------------------------------
// objects

#[repr(C)]
struct Device {
    ibv: IbvDevice,
}

/// The one device, at a fixed address for the process's lifetime.
fn device() -> *mut IbvDevice {
    static DEV: OnceLock<usize> = OnceLock::new();
    *DEV.get_or_init(|| {
        let mut d = IbvDevice {
            ops: [0; 2],
            node_type: IBV_NODE_CA,
            transport_type: IBV_TRANSPORT_IB,
            name: [0; 64],
            dev_name: [0; 64],
            dev_path: [0; 256],
            ibdev_path: [0; 256],
        };
        fill(&mut d.name, DEVICE_NAME);
        fill(&mut d.dev_name, "uverbs-flexns0");
        fill(&mut d.dev_path, "/sys/class/infiniband_verbs/uverbs-flexns0");
        fill(&mut d.ibdev_path, "/sys/class/infiniband/flexns0");
        // never freed: programs keep device pointers after freeing the list
        Box::into_raw(Box::new(Device { ibv: d })) as usize
    }) as *mut IbvDevice
}

/// Copies `s` into a C string field (truncated, NUL-terminated).
fn fill(dst: &mut [c_char], s: &str) {
    let n = dst.len() - 1;
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
}

#[repr(C)]
struct FlexCtx {
    ibv: IbvContext,
    magic: u64,
    inner: CtxInner,
}

struct CtxInner {
    engine: Context,
}

#[repr(C)]
struct FlexPd {
    ibv: IbvPd,
    magic: u64,
    inner: PdInner,
}

struct PdInner {
    pd: Pd,
    /// One clone per MR and QP of the PD: `ibv_dealloc_pd` is refused (`EBUSY`) while any is
    /// left.
    users: Arc<()>,
}

#[repr(C)]
struct FlexMr {
    ibv: IbvMr,
    magic: u64,
    inner: MrInner,
}

struct MrInner {
    mr: Mr,
    /// Its PD's use count.
    _pd_use: Arc<()>,
}

#[repr(C)]
struct FlexCh {
    ibv: IbvCompChannel,
    magic: u64,
    inner: Arc<ChannelInner>,
}

/// A completion channel: an eventfd counting events (semaphore mode: one read, one event) and
/// the CQs whose events those are, in order.
struct ChannelInner {
    fd: c_int,
    queue: Mutex<EventQueue>,
    /// One clone per CQ of the channel: `ibv_destroy_comp_channel` is refused (`EBUSY`) while
    /// any is left (the C `refcnt` mirrors the count).
    users: Arc<()>,
}

/// The events posted on a channel and not yet handed out, in order, with their CQs' counts.
#[derive(Default)]
struct EventQueue {
    events: VecDeque<(usize, Arc<CqEvents>)>,
    /// Eventfd counts whose events a destroyed CQ took back (see [`ibv_destroy_cq`]): the
    /// eventfd is read by blocking reads, so the counts are consumed by later readers.
    stale: u64,
}

/// A CQ's channel events: handed out by `ibv_get_cq_event` and acknowledged by
/// `ibv_ack_cq_events`; `ibv_destroy_cq` waits until the two balance, as rdma-core's does.
#[derive(Default)]
struct CqEvents {
    /// (reported, acked).
    counts: Mutex<(u64, u64)>,
    cv: Condvar,
}

impl ChannelInner {
    fn post(&self, cq: usize, events: &Arc<CqEvents>) {
        self.queue.lock().events.push_back((cq, events.clone()));
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to the eventfd this channel owns.
        let n = unsafe { libc::write(self.fd, (&one as *const u64).cast(), 8) };
        if n != 8 {
            report("completion channel: writing the eventfd failed");
        }
    }
}

#[repr(C)]
struct FlexCq {
    ibv: IbvCq,
    magic: u64,
    inner: CqInner,
}

struct CqInner {
    cq: Cq,
    /// One clone per QP using the CQ: `ibv_destroy_cq` is refused (`EBUSY`) while any is left.
    users: Arc<()>,
    /// Its channel events (with a channel).
    events: Arc<CqEvents>,
    /// Its channel's use count (with a channel).
    _channel_use: Option<Arc<()>>,
    /// With a completion channel: the thread that turns armed completions into events.
    notifier: Option<Notifier>,
    /// Since when (ns after [`epoch`]; 0: not) polls of this CQ have found it empty.
    empty_since: AtomicU64,
}

/// How long a program may spin on an empty CQ before each further empty `ibv_poll_cq` yields
/// the core (`sched_yield`), as `nsperf`'s spinning client does after every empty poll. A
/// program waiting on a short exchange (`ib_send_lat`: about 10 µs) spins undisturbed; one
/// that waits longer (`ib_write_bw` with its send queue full, waiting for the peer's
/// acknowledgements) lets the engine threads and the peer's process on the same cores run.
/// Measured on 2 shared cores: yielding on every empty poll raised `ib_send_lat`'s typical
/// latency from about 10 to 30-50 µs; not yielding at all halved `ib_write_bw`'s bandwidth.
const SPIN_BEFORE_YIELD_NS: u64 = 50_000;

/// The process's clock origin for [`CqInner::empty_since`].
fn epoch() -> &'static std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(std::time::Instant::now)
}

impl CqInner {
    /// After an empty poll: yields the core once the CQ has been empty for
    /// [`SPIN_BEFORE_YIELD_NS`].
    fn empty_poll(&self) {
        let now = (epoch().elapsed().as_nanos() as u64).max(1);
        let since = self.empty_since.load(Ordering::Relaxed);
        if since == 0 {
            self.empty_since.store(now, Ordering::Relaxed);
        } else if now - since.min(now) >= SPIN_BEFORE_YIELD_NS {
            std::thread::yield_now();
        }
    }
}

/// `ibv_req_notify_cq` arms the CQ; the notifier thread waits for a completion on an armed
/// CQ, disarms it and posts one event on the channel.
struct Notifier {
    shared: Arc<NotifyShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct NotifyShared {
    armed: Mutex<bool>,
    cv: Condvar,
    stop: AtomicBool,
}

impl Notifier {
    fn start(cq: Cq, channel: Arc<ChannelInner>, cq_ptr: usize, events: Arc<CqEvents>) -> std::io::Result<Notifier> {
        let shared = Arc::new(NotifyShared {
            armed: Mutex::new(false),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("flexns-ibv-cq".into())
            .spawn(move || loop {
                {
                    let mut armed = s.armed.lock();
                    while !*armed && !s.stop.load(Ordering::Acquire) {
                        s.cv.wait(&mut armed);
                    }
                }
                // armed: wait for a completion (bounded, to see `stop`)
                loop {
                    if s.stop.load(Ordering::Acquire) {
                        return;
                    }
                    if cq.wait(Duration::from_millis(20)) {
                        break;
                    }
                }
                *s.armed.lock() = false;
                channel.post(cq_ptr, &events);
            })?;
        Ok(Notifier {
            shared,
            thread: Some(thread),
        })
    }

    fn arm(&self) {
        *self.shared.armed.lock() = true;
        self.shared.cv.notify_one();
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = self.shared.armed.lock();
            self.shared.cv.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[repr(C)]
struct FlexQp {
    ibv: IbvQp,
    magic: u64,
    inner: QpInner,
}

struct QpInner {
    /// `None` once `ibv_destroy_qp` has destroyed it.
    qp: Option<Qp>,
    /// Its PD's and CQs' use counts.
    _uses: [Arc<()>; 3],
    /// Its engine (for the linger of [`linger`]).
    engine: Context,
    sq_sig_all: bool,
    /// The ibverbs state (netstack's QP is in INIT from its creation; RESET is ours).
    state: AtomicI32,
    /// What `ibv_query_qp` reports: the attributes the program set.
    attr: Mutex<IbvQpAttr>,
    cap: IbvQpCap,
}

impl QpInner {
    /// Its engine QP (present until the box is freed: only `ibv_destroy_qp` takes it).
    fn qp(&self) -> &Qp {
        self.qp.as_ref().expect("a live QP has its engine QP")
    }

    /// The ibverbs state: RESET (which is ours: the engine's QP is in INIT from its creation)
    /// or the engine's (an error the engine ran into moves it to ERR).
    fn state(&self) -> c_int {
        let ours = self.state.load(Ordering::Acquire);
        if ours == IBV_QPS_RESET {
            return ours;
        }
        match self.qp().state() {
            netstack::transport::rc::QpState::Reset => IBV_QPS_RESET,
            netstack::transport::rc::QpState::Init => IBV_QPS_INIT,
            netstack::transport::rc::QpState::Rtr => IBV_QPS_RTR,
            netstack::transport::rc::QpState::Rts => IBV_QPS_RTS,
            netstack::transport::rc::QpState::Err => IBV_QPS_ERR,
        }
    }
}

/// The Rust state behind a program's pointer, if it is non-NULL and of the right kind.
///
/// # Safety
/// `p` is NULL or was returned by this library as an object of type `W` (whose layout starts
/// with the C struct, then the magic number) and has not been destroyed.
unsafe fn state<'a, W, T>(
    p: *mut W,
    magic: u64,
    field: impl FnOnce(*const W) -> (*const u64, *const T),
) -> Option<&'a T> {
    if p.is_null() {
        return None;
    }
    let (m, t) = field(p);
    // SAFETY: per the contract `p` points to a live `W`; `m` and `t` point into it.
    unsafe { (ptr::read(m) == magic).then(|| &*t) }
}

macro_rules! getter {
    ($name:ident, $w:ty, $c:ty, $t:ty, $magic:expr) => {
        /// # Safety
        /// The pointer is NULL or an object of this kind this library returned, not destroyed.
        unsafe fn $name<'a>(p: *mut $c) -> Option<&'a $t> {
            // SAFETY: forwarded contract; the field pointers are computed without references.
            unsafe {
                state(p as *mut $w, $magic, |w| {
                    (ptr::addr_of!((*w).magic), ptr::addr_of!((*w).inner))
                })
            }
        }
    };
}
getter!(ctx_of, FlexCtx, IbvContext, CtxInner, MAGIC_CTX);
getter!(pd_of, FlexPd, IbvPd, PdInner, MAGIC_PD);
getter!(mr_of, FlexMr, IbvMr, MrInner, MAGIC_MR);
getter!(cq_of, FlexCq, IbvCq, CqInner, MAGIC_CQ);
getter!(qp_of, FlexQp, IbvQp, QpInner, MAGIC_QP);
getter!(ch_of, FlexCh, IbvCompChannel, Arc<ChannelInner>, MAGIC_CH);

/// Frees an object: clears its magic (a second destroy is refused) and drops the box.
///
/// # Safety
/// `p` was returned by this library as a `W` (checked by the caller) and is not used again.
unsafe fn destroy<W>(p: *mut W, magic: *mut u64) {
    // SAFETY: per the contract both point into the live box, which `Box::into_raw` made.
    unsafe {
        ptr::write(magic, 0);
        drop(Box::from_raw(p));
    }
}

// ---------------------------------------------------------------------------------------------
// the engine: one per process, shared by its open contexts

static ENGINE: Mutex<Option<(Context, usize)>> = Mutex::new(None);

fn engine_acquire() -> Result<Context, String> {
    let mut g = ENGINE.lock();
    if let Some((c, n)) = g.as_mut() {
        *n += 1;
        return Ok(c.clone());
    }
    let ip = process_addr()?;
    let drive = drive_of(std::env::var("FLEXNS_IBV_DRIVE").ok().as_deref())?;
    let cfg = ContextConfig {
        bind: SocketAddrV4::new(ip, ROCE_PORT),
        drive,
        path_ports: 1,
        max_inline: MAX_INLINE,
        // the engine in a flexnsd daemon instead of this process, if one is named
        flexnsd: flexnsd_socket(),
        ..ContextConfig::default()
    };
    let c = Context::open(cfg).map_err(|e| format!("opening the flexns engine on {ip}:{ROCE_PORT}: {e}"))?;
    *g = Some((c.clone(), 1));
    Ok(c)
}

/// Who runs the engine (`FLEXNS_IBV_DRIVE`): by default the application's own threads in their
/// `ibv_poll_cq`/`ibv_post_*` calls (`application`; perftest and the pingpongs spin on their
/// CQs, and an engine thread of its own would compete with them for a core), or an engine
/// thread (`threads`). A backstop thread runs the engine while the program does not call.
pub(crate) fn drive_of(v: Option<&str>) -> Result<netstack::verbs::Drive, String> {
    match v.map(str::trim) {
        None | Some("") | Some("application") => Ok(netstack::verbs::Drive::Application),
        Some("threads") => Ok(netstack::verbs::Drive::Threads),
        Some(o) => Err(format!(
            "FLEXNS_IBV_DRIVE: {o:?} is neither \"application\" nor \"threads\""
        )),
    }
}

fn engine_release() {
    let mut g = ENGINE.lock();
    if let Some((_, n)) = g.as_mut() {
        *n -= 1;
        if *n == 0 {
            *g = None;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// devices and contexts

/// `ibv_get_device_list`: the one device `flexns0`.
///
/// # Safety
/// `num` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut IbvDevice {
    guard("ibv_get_device_list", null_mut(), || {
        // SAFETY: two pointer-sized slots, zeroed (the list ends with NULL); freed by
        // ibv_free_device_list with free(3).
        let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut IbvDevice>()) } as *mut *mut IbvDevice;
        if list.is_null() {
            set_errno(ENOMEM);
            return null_mut();
        }
        // SAFETY: `list` has two slots; `num` is NULL or writable per the contract.
        unsafe {
            *list = device();
            if !num.is_null() {
                *num = 1;
            }
        }
        list
    })
}

/// `ibv_free_device_list`.
///
/// # Safety
/// `list` is NULL or was returned by `ibv_get_device_list`.
#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut IbvDevice) {
    // SAFETY: `list` came from calloc in ibv_get_device_list (or is NULL).
    guard("ibv_free_device_list", (), || unsafe { libc::free(list.cast()) })
}

/// `ibv_get_device_name`.
///
/// # Safety
/// `dev` is NULL or a device pointer.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut IbvDevice) -> *const c_char {
    guard("ibv_get_device_name", ptr::null(), || {
        if dev != device() {
            set_errno(EINVAL);
            return ptr::null();
        }
        // SAFETY: `dev` is the static device.
        unsafe { (*dev).name.as_ptr() }
    })
}

/// `ibv_open_device`: a context on this process's engine (opened with the first context; it
/// binds UDP 4791 on the process's address).
///
/// # Safety
/// `dev` is NULL or a device pointer.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut IbvDevice) -> *mut IbvContext {
    guard("ibv_open_device", null_mut(), || {
        if dev != device() {
            report("ibv_open_device: device: not flexns0");
            set_errno(EINVAL);
            return null_mut();
        }
        let engine = match engine_acquire() {
            Ok(e) => e,
            Err(e) => {
                report(&format!("ibv_open_device: {e}"));
                set_errno(libc::ENODEV);
                return null_mut();
            }
        };
        // SAFETY: eventfd(2) has no memory arguments.
        let (cmd_fd, async_fd) = unsafe {
            (
                libc::eventfd(0, libc::EFD_CLOEXEC),
                libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            )
        };
        if cmd_fd < 0 || async_fd < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: closes only the fds just made here.
            unsafe {
                for fd in [cmd_fd, async_fd] {
                    if fd >= 0 {
                        libc::close(fd);
                    }
                }
            }
            engine_release();
            report(&format!("ibv_open_device: eventfd: {e}"));
            set_errno(e.raw_os_error().unwrap_or(libc::EMFILE));
            return null_mut();
        }
        let ibv = IbvContext {
            device: dev,
            ops: IbvContextOps {
                compat_a: [0; 11],
                poll_cq: Some(poll_cq),
                req_notify_cq: Some(req_notify_cq),
                compat_b: [0; 7],
                post_srq_recv: Some(post_srq_recv),
                compat_c: [0; 4],
                post_send: Some(post_send),
                post_recv: Some(post_recv),
                compat_d: [0; 5],
            },
            cmd_fd,
            async_fd,
            num_comp_vectors: 1,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            abi_compat: null_mut(),
        };
        Box::into_raw(Box::new(FlexCtx {
            ibv,
            magic: MAGIC_CTX,
            inner: CtxInner { engine },
        })) as *mut IbvContext
    })
}

/// `ibv_close_device`.
///
/// # Safety
/// `ctx` is NULL or a context this library opened, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut IbvContext) -> c_int {
    guard("ibv_close_device", -1, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() {
            set_errno(EINVAL);
            return -1;
        }
        let w = ctx as *mut FlexCtx;
        // SAFETY: `w` is a live FlexCtx (checked); its fds are its own.
        unsafe {
            libc::close((*w).ibv.cmd_fd);
            libc::close((*w).ibv.async_fd);
            destroy(w, ptr::addr_of_mut!((*w).magic));
        }
        engine_release();
        0
    })
}

/// `ibv_query_device`.
///
/// # Safety
/// `ctx` is NULL or a context; `attr` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(ctx: *mut IbvContext, attr: *mut IbvDeviceAttr) -> c_int {
    guard("ibv_query_device", EINVAL, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || attr.is_null() {
            return EINVAL;
        }
        let ip = process_addr().unwrap_or(Ipv4Addr::LOCALHOST);
        let guid = (0x02_fe00_u64 << 40 | u64::from(u32::from(ip))).to_be();
        let mut a = IbvDeviceAttr {
            fw_ver: [0; 64],
            node_guid: guid,
            sys_image_guid: guid,
            max_mr_size: 1 << 40,
            page_size_cap: 4096,
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 1 << 16,
            max_qp_wr: MAX_QP_WR as c_int,
            device_cap_flags: 0,
            max_sge: MAX_SGE,
            max_sge_rd: MAX_SGE,
            max_cq: 1 << 16,
            max_cqe: MAX_CQE,
            max_mr: 1 << 20,
            max_pd: 1 << 16,
            max_qp_rd_atom: 16,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 1 << 16,
            max_qp_init_rd_atom: 16,
            max_ee_init_rd_atom: 0,
            atomic_cap: IBV_ATOMIC_HCA,
            max_ee: 0,
            max_rdd: 0,
            max_mw: 0,
            max_raw_ipv6_qp: 0,
            max_raw_ethy_qp: 0,
            max_mcast_grp: 0,
            max_mcast_qp_attach: 0,
            max_total_mcast_qp_attach: 0,
            max_ah: 0,
            max_fmr: 0,
            max_map_per_fmr: 0,
            max_srq: 0,
            max_srq_wr: 0,
            max_srq_sge: 0,
            max_pkeys: 1,
            local_ca_ack_delay: 16,
            phys_port_cnt: 1,
        };
        fill(&mut a.fw_ver, concat!("flexns ", env!("CARGO_PKG_VERSION")));
        // SAFETY: `attr` is writable per the contract.
        unsafe { ptr::write(attr, a) };
        0
    })
}

/// `ibv_query_port` (the exported one: the inline `ibv_query_port` of `verbs.h` zeroes the
/// caller's full `struct ibv_port_attr` and calls this with it; only the compat prefix is
/// written).
///
/// # Safety
/// `ctx` is NULL or a context; `attr` is NULL or valid for a write of the compat struct.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(ctx: *mut IbvContext, port: u8, attr: *mut IbvPortAttr) -> c_int {
    guard("ibv_query_port", EINVAL, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || attr.is_null() || port != 1 {
            return EINVAL;
        }
        let a = IbvPortAttr {
            state: IBV_PORT_ACTIVE,
            max_mtu: IBV_MTU_4096,
            active_mtu: IBV_MTU_4096,
            gid_tbl_len: 1,
            port_cap_flags: 0,
            max_msg_sz: 1 << 31,
            bad_pkey_cntr: 0,
            qkey_viol_cntr: 0,
            pkey_tbl_len: 1,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            max_vl_num: 1,
            sm_sl: 0,
            subnet_timeout: 0,
            init_type_reply: 0,
            active_width: 2,  // 4X
            active_speed: 32, // EDR (25 Gb/s per lane)
            phys_state: 5,    // LinkUp
            link_layer: IBV_LINK_LAYER_ETHERNET,
            flags: 0,
        };
        // SAFETY: `attr` is writable per the contract.
        unsafe { ptr::write(attr, a) };
        0
    })
}

/// `ibv_query_gid`: index 0 is the process's RoCEv2 GID; there is no other.
///
/// # Safety
/// `ctx` is NULL or a context; `gid` is NULL or valid for 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(ctx: *mut IbvContext, port: u8, index: c_int, gid: *mut [u8; 16]) -> c_int {
    guard("ibv_query_gid", -1, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || gid.is_null() || port != 1 || index != 0 {
            set_errno(EINVAL);
            return -1;
        }
        let Ok(ip) = process_addr() else {
            set_errno(EINVAL);
            return -1;
        };
        // SAFETY: `gid` is writable per the contract.
        unsafe { ptr::write(gid, gid_of(ip)) };
        0
    })
}

/// `_ibv_query_gid_ex` (behind the inline `ibv_query_gid_ex`).
///
/// # Safety
/// `ctx` is NULL or a context; `entry` is NULL or valid for `entry_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut IbvContext,
    port: u32,
    index: u32,
    entry: *mut IbvGidEntry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard("_ibv_query_gid_ex", EINVAL, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || entry.is_null() || flags != 0 {
            return EINVAL;
        }
        if entry_size < std::mem::size_of::<IbvGidEntry>() {
            return EINVAL;
        }
        if port != 1 || index != 0 {
            return libc::ENODATA;
        }
        let Ok(ip) = process_addr() else { return EINVAL };
        let e = IbvGidEntry {
            gid: gid_of(ip),
            gid_index: 0,
            port_num: 1,
            gid_type: IBV_GID_TYPE_ROCE_V2,
            ndev_ifindex: 1, // lo
        };
        // SAFETY: `entry` is writable for at least the struct (checked) per the contract.
        unsafe { ptr::write(entry, e) };
        0
    })
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34, which ibv_devinfo imports): RoCE v2.
///
/// # Safety
/// `ctx` is NULL or a context; `ty` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(ctx: *mut IbvContext, port: u8, index: c_uint, ty: *mut c_int) -> c_int {
    guard("ibv_query_gid_type", -1, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || ty.is_null() || port != 1 || index != 0 {
            set_errno(EINVAL);
            return -1;
        }
        // SAFETY: writable per the contract.
        unsafe { *ty = IBV_GID_TYPE_SYSFS_ROCE_V2 };
        0
    })
}

/// `ibv_query_pkey`: the default P_Key at index 0.
///
/// # Safety
/// `ctx` is NULL or a context; `pkey` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(ctx: *mut IbvContext, port: u8, index: c_int, pkey: *mut u16) -> c_int {
    guard("ibv_query_pkey", -1, || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() || pkey.is_null() || port != 1 || index != 0 {
            set_errno(EINVAL);
            return -1;
        }
        // SAFETY: writable per the contract.
        unsafe { *pkey = 0xffff_u16.to_be() };
        0
    })
}

/// `ibv_read_sysfs_file`: there is no sysfs for this device; always -1 (`ENOENT`).
#[no_mangle]
pub extern "C" fn ibv_read_sysfs_file(
    _dir: *const c_char,
    _file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    set_errno(libc::ENOENT);
    -1
}

/// `ibv_wc_status_str`.
#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    usize::try_from(status)
        .ok()
        .and_then(|i| WC_STATUS_STR.get(i))
        .map_or(c"unknown".as_ptr(), |s| s.as_ptr())
}

// ---------------------------------------------------------------------------------------------
// protection domains and memory regions

/// `ibv_alloc_pd`.
///
/// # Safety
/// `ctx` is NULL or a context.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut IbvContext) -> *mut IbvPd {
    guard("ibv_alloc_pd", null_mut(), || {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { ctx_of(ctx) }) else {
            set_errno(EINVAL);
            return null_mut();
        };
        let pd = c.engine.alloc_pd();
        Box::into_raw(Box::new(FlexPd {
            ibv: IbvPd {
                context: ctx,
                handle: pd.id(),
            },
            magic: MAGIC_PD,
            inner: PdInner {
                pd,
                users: Arc::new(()),
            },
        })) as *mut IbvPd
    })
}

/// `ibv_dealloc_pd`.
///
/// # Safety
/// `pd` is NULL or a PD this library allocated, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut IbvPd) -> c_int {
    guard("ibv_dealloc_pd", EINVAL, || {
        // SAFETY: per the contract.
        let Some(p) = (unsafe { pd_of(pd) }) else {
            return EINVAL;
        };
        let n = Arc::strong_count(&p.users) - 1;
        if n > 0 {
            report(&format!(
                "ibv_dealloc_pd: {n} memory regions and QPs still use the PD (EBUSY)"
            ));
            return libc::EBUSY;
        }
        let w = pd as *mut FlexPd;
        // SAFETY: checked live FlexPd.
        unsafe { destroy(w, ptr::addr_of_mut!((*w).magic)) };
        0
    })
}

/// The netstack access of ibverbs access flags, or why they are refused.
fn access_of(flags: c_int) -> Result<Access, (c_int, String)> {
    let basic = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    // HUGETLB (128) is a hint; MW_BIND is accepted (no window can be bound); the optional range
    // is hints a provider may ignore
    let ignored = IBV_ACCESS_MW_BIND | 128 | IBV_ACCESS_OPTIONAL_RANGE;
    let rest = flags & !(basic | ignored);
    if rest != 0 {
        return Err((
            EOPNOTSUPP,
            format!("access: flags {rest:#x} not supported (zero-based, on-demand paging and the like)"),
        ));
    }
    if flags & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0 && flags & IBV_ACCESS_LOCAL_WRITE == 0 {
        return Err((
            EINVAL,
            "access: IBV_ACCESS_REMOTE_WRITE and IBV_ACCESS_REMOTE_ATOMIC need IBV_ACCESS_LOCAL_WRITE".into(),
        ));
    }
    Ok(Access((flags & basic) as u32))
}

fn reg(pd: *mut IbvPd, addr: *mut c_void, len: usize, iova: u64, access: c_int, what: &str) -> *mut IbvMr {
    // SAFETY: the exported functions' contract: `pd` is NULL or a PD.
    let Some(p) = (unsafe { pd_of(pd) }) else {
        report(&format!("{what}: pd: not a protection domain of flexns"));
        set_errno(EINVAL);
        return null_mut();
    };
    let fail = |msg: String, e: c_int| {
        report(&format!("{what}: {msg}"));
        set_errno(e);
        null_mut()
    };
    if addr.is_null() && len > 0 {
        return fail("addr: NULL".into(), EINVAL);
    }
    if iova != addr as u64 {
        return fail(
            format!("iova: {iova:#x} differs from addr {addr:p}; flexns names memory by its address"),
            EOPNOTSUPP,
        );
    }
    let acc = match access_of(access) {
        Ok(a) => a,
        Err((e, m)) => return fail(m, e),
    };
    if (addr as usize).checked_add(len).is_none() {
        return fail(format!("addr {addr:p} + length {len:#x} wraps around"), EINVAL);
    }
    let writable = access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0;
    if let Err(m) = probe(addr as usize, len, writable) {
        return fail(m, libc::EFAULT);
    }
    // SAFETY: the program keeps `addr..addr+len` mapped until it deregisters the region (the
    // contract of ibv_reg_mr); work requests that use it complete before that in a correct
    // program, and flexns only copies in and out of it.
    let mr = match unsafe { p.pd.reg_mr_raw(addr.cast(), len, acc) } {
        Ok(m) => m,
        Err(e) => return fail(e.to_string(), errno_of(&e)),
    };
    // SAFETY: `pd` is a live FlexPd (checked); reading its context field through the pointer.
    let context = unsafe { (*pd).context };
    Box::into_raw(Box::new(FlexMr {
        ibv: IbvMr {
            context,
            pd,
            addr,
            length: len,
            handle: mr.lkey(),
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        },
        magic: MAGIC_MR,
        inner: MrInner {
            mr,
            _pd_use: p.users.clone(),
        },
    })) as *mut IbvMr
}

/// Checks that `addr..addr+len` is mapped readable (and writable when `writable`) in this
/// process, from `/proc/self/maps`; why not, naming the first byte that is not.
fn probe(addr: usize, len: usize, writable: bool) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    let end = addr + len;
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| format!("reading /proc/self/maps: {e}"))?;
    let mut at = addr;
    for line in maps.lines() {
        let mut cols = line.split_whitespace();
        let (Some(range), Some(perms)) = (cols.next(), cols.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at {
            break;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') {
            return Err(format!("addr..addr+length: {at:#x} is not readable"));
        }
        if writable && p.get(1) != Some(&b'w') {
            return Err(format!(
                "addr..addr+length: {at:#x} is read-only and the access flags ask for writes"
            ));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    Err(format!("addr..addr+length: {at:#x} is not mapped"))
}

/// How long `ibv_dereg_mr` waits for the engine's in-flight work to let go of a region (a QP
/// with a request on it completes or flushes within its retry budget, well below this).
const DEREG_WAIT_MAX: Duration = Duration::from_secs(30);

/// `ibv_reg_mr`.
///
/// # Safety
/// `pd` is NULL or a PD; `addr..addr+len` stays mapped until `ibv_dereg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut IbvPd, addr: *mut c_void, len: usize, access: c_int) -> *mut IbvMr {
    guard("ibv_reg_mr", null_mut(), || {
        reg(pd, addr, len, addr as u64, access, "ibv_reg_mr")
    })
}

/// `ibv_reg_mr_iova2` (what the `ibv_reg_mr` macro calls when optional access flags are set):
/// the iova must equal the address.
///
/// # Safety
/// As [`ibv_reg_mr`].
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut IbvPd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut IbvMr {
    guard("ibv_reg_mr_iova2", null_mut(), || {
        reg(pd, addr, len, iova, access as c_int, "ibv_reg_mr_iova2")
    })
}

/// The engine of a PD's context.
///
/// # Safety
/// `pd` is NULL or a PD this library allocated.
unsafe fn pd_context_engine(pd: *mut IbvPd) -> Option<Context> {
    // SAFETY: per the contract.
    unsafe { pd_of(pd) }?;
    // SAFETY: `pd` is live (checked); its context outlives it in a correct program.
    unsafe { ctx_of((*pd).context) }.map(|c| c.engine.clone())
}

/// `ibv_dereg_mr`: returns once the engine has let go of the region's memory (in-flight
/// requests on it finished or flushed), bounded by [`DEREG_WAIT_MAX`] (then `EBUSY`).
///
/// # Safety
/// `mr` is NULL or a region this library registered, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut IbvMr) -> c_int {
    guard("ibv_dereg_mr", EINVAL, || {
        // SAFETY: per the contract.
        let Some(m) = (unsafe { mr_of(mr) }) else {
            return EINVAL;
        };
        let region = m.mr.region().clone();
        // SAFETY: `mr` is a live FlexMr (checked); its PD outlives it (EBUSY otherwise).
        let engine = unsafe { pd_context_engine((*mr).pd) };
        let w = mr as *mut FlexMr;
        // SAFETY: checked live FlexMr.
        unsafe { destroy(w, ptr::addr_of_mut!((*w).magic)) };
        // the registration is gone; in-flight work (a READ response being sent, a send
        // request's segments) may still hold the region, which is the program's memory: the
        // program may free it once this returns, so wait for them to finish, running the engine
        let start = std::time::Instant::now();
        let scratch = engine.and_then(|e| e.create_cq(1).ok());
        while Arc::strong_count(&region) > 1 {
            if start.elapsed() > DEREG_WAIT_MAX {
                report(&format!(
                    "ibv_dereg_mr: in-flight work still uses the region after {DEREG_WAIT_MAX:?} (EBUSY); \
                     the registration is gone, but the memory must not be freed yet"
                ));
                return libc::EBUSY;
            }
            match &scratch {
                Some(c) => {
                    c.wait(Duration::from_millis(1));
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        0
    })
}

// ---------------------------------------------------------------------------------------------
// completion channels and CQs

/// `ibv_create_comp_channel`: its fd is an eventfd that becomes readable with each event.
///
/// # Safety
/// `ctx` is NULL or a context.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut IbvContext) -> *mut IbvCompChannel {
    guard("ibv_create_comp_channel", null_mut(), || {
        // SAFETY: per the contract.
        if unsafe { ctx_of(ctx) }.is_none() {
            set_errno(EINVAL);
            return null_mut();
        }
        // SAFETY: eventfd(2) has no memory arguments.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return null_mut();
        }
        Box::into_raw(Box::new(FlexCh {
            ibv: IbvCompChannel {
                context: ctx,
                fd,
                refcnt: 0,
            },
            magic: MAGIC_CH,
            inner: Arc::new(ChannelInner {
                fd,
                queue: Mutex::new(EventQueue::default()),
                users: Arc::new(()),
            }),
        })) as *mut IbvCompChannel
    })
}

/// `ibv_destroy_comp_channel`: `EBUSY` while a CQ uses it.
///
/// # Safety
/// `ch` is NULL or a channel this library created, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut IbvCompChannel) -> c_int {
    guard("ibv_destroy_comp_channel", EINVAL, || {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { ch_of(ch) }) else {
            return EINVAL;
        };
        if Arc::strong_count(&c.users) > 1 {
            return libc::EBUSY;
        }
        let w = ch as *mut FlexCh;
        // SAFETY: checked live FlexCh; its fd is its own.
        unsafe {
            libc::close((*w).ibv.fd);
            destroy(w, ptr::addr_of_mut!((*w).magic));
        }
        0
    })
}

/// `ibv_create_cq`.
///
/// # Safety
/// `ctx` is NULL or a context; `channel` is NULL or a channel of it.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    guard("ibv_create_cq", null_mut(), || {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { ctx_of(ctx) }) else {
            set_errno(EINVAL);
            return null_mut();
        };
        if !(1..=MAX_CQE).contains(&cqe) || comp_vector != 0 {
            report(&format!(
                "ibv_create_cq: cqe {cqe} not in 1..={MAX_CQE} or comp_vector {comp_vector} not 0"
            ));
            set_errno(EINVAL);
            return null_mut();
        }
        // SAFETY: per the contract.
        let ch = match (channel.is_null(), unsafe { ch_of(channel) }) {
            (true, _) => None,
            (false, Some(ch)) => Some(ch.clone()),
            (false, None) => {
                report("ibv_create_cq: channel: not a completion channel of flexns");
                set_errno(EINVAL);
                return null_mut();
            }
        };
        let cq = match c.engine.create_cq(cqe as usize) {
            Ok(cq) => cq,
            Err(e) => {
                report(&format!("ibv_create_cq: {e}"));
                set_errno(errno_of(&e));
                return null_mut();
            }
        };
        let b = Box::into_raw(Box::new(FlexCq {
            ibv: IbvCq {
                context: ctx,
                channel,
                cq_context,
                handle: cq.cq_num(),
                cqe,
                mutex: libc::PTHREAD_MUTEX_INITIALIZER,
                cond: libc::PTHREAD_COND_INITIALIZER,
                comp_events_completed: 0,
                async_events_completed: 0,
            },
            magic: MAGIC_CQ,
            inner: CqInner {
                cq: cq.clone(),
                users: Arc::new(()),
                events: Arc::new(CqEvents::default()),
                _channel_use: ch.as_ref().map(|c| c.users.clone()),
                notifier: None,
                empty_since: AtomicU64::new(0),
            },
        }));
        if let Some(ch) = ch {
            // SAFETY: `b` is the box just made, not yet shared with the program.
            let events = unsafe { (*b).inner.events.clone() };
            let users = ch.users.clone();
            match Notifier::start(cq, ch, b as usize, events) {
                // SAFETY: `b` is the box just made, not yet shared with the program; `channel` a
                // live channel (checked): its C `refcnt` mirrors the use count.
                Ok(n) => unsafe {
                    (*b).inner.notifier = Some(n);
                    (*channel).refcnt = (Arc::strong_count(&users) - 2) as c_int;
                },
                Err(e) => {
                    report(&format!("ibv_create_cq: starting the event thread: {e}"));
                    // SAFETY: `b` is ours, not shared.
                    unsafe { drop(Box::from_raw(b)) };
                    set_errno(ENOMEM);
                    return null_mut();
                }
            }
        }
        b as *mut IbvCq
    })
}

/// `ibv_destroy_cq`.
///
/// # Safety
/// `cq` is NULL or a CQ this library created, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    guard("ibv_destroy_cq", EINVAL, || {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { cq_of(cq) }) else {
            return EINVAL;
        };
        let n = Arc::strong_count(&c.users) - 1;
        if n > 0 {
            report(&format!("ibv_destroy_cq: {n} QPs still use the CQ (EBUSY)"));
            return libc::EBUSY;
        }
        let w = cq as *mut FlexCq;
        // SAFETY: checked live FlexCq; the program does not use it concurrently (the contract
        // of destroy), so its notifier may be taken out.
        let notifier = unsafe { (*ptr::addr_of_mut!((*w).inner.notifier)).take() };
        // its thread is joined: no further event of this CQ is posted
        drop(notifier);
        // SAFETY: checked live FlexCq; its channel (if any) outlives it (the use count).
        let ch = unsafe { ch_of((*w).ibv.channel) };
        if let Some(ch) = ch {
            // take back its events not yet handed out
            let mut q = ch.queue.lock();
            let before = q.events.len();
            q.events.retain(|(p, _)| *p != cq as usize);
            q.stale += (before - q.events.len()) as u64;
        }
        // wait until every event handed out was acknowledged, as rdma-core's destroy does
        let mut counts = c.events.counts.lock();
        let mut warned = false;
        while counts.0 != counts.1 {
            if c.events.cv.wait_for(&mut counts, Duration::from_secs(1)).timed_out() && !warned {
                warned = true;
                report(&format!(
                    "ibv_destroy_cq: waiting for ibv_ack_cq_events of {} events",
                    counts.0 - counts.1
                ));
            }
        }
        drop(counts);
        // SAFETY: checked live FlexCq; the channel (if any) is live (the use count).
        unsafe {
            let chp = (*w).ibv.channel;
            destroy(w, ptr::addr_of_mut!((*w).magic));
            if let Some(ch) = ch {
                (*chp).refcnt = (Arc::strong_count(&ch.users) - 1) as c_int;
            }
        }
        0
    })
}

/// `ops.req_notify_cq`: arms the CQ; the next completion posts an event on its channel.
unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, _solicited_only: c_int) -> c_int {
    guard("ibv_req_notify_cq", EINVAL, || {
        // SAFETY: the program passes a CQ of this library (checked).
        let Some(c) = (unsafe { cq_of(cq) }) else { return EINVAL };
        if let Some(n) = &c.notifier {
            n.arm();
        }
        0
    })
}

/// `ibv_get_cq_event`: blocks until an event, then names its CQ.
///
/// # Safety
/// `ch` is NULL or a channel; `cq_out` and `ctx_out` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut IbvCompChannel,
    cq_out: *mut *mut IbvCq,
    ctx_out: *mut *mut c_void,
) -> c_int {
    guard("ibv_get_cq_event", -1, || {
        // SAFETY: per the contract.
        let Some(c) = (unsafe { ch_of(ch) }) else {
            set_errno(EINVAL);
            return -1;
        };
        if cq_out.is_null() || ctx_out.is_null() {
            set_errno(EINVAL);
            return -1;
        }
        let cq = loop {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from the channel's eventfd.
            let n = unsafe { libc::read(c.fd, (&mut v as *mut u64).cast(), 8) };
            if n != 8 {
                return -1;
            }
            let mut q = c.queue.lock();
            if q.stale > 0 {
                // the count of an event a destroyed CQ took back
                q.stale -= 1;
                continue;
            }
            let Some((cq, events)) = q.events.pop_front() else {
                set_errno(libc::EAGAIN);
                return -1;
            };
            // counted while the queue is locked: a destroy of the CQ either took the event
            // back or waits for its acknowledgement
            events.counts.lock().0 += 1;
            break cq;
        };
        let cq = cq as *mut IbvCq;
        // SAFETY: `cq` is a live CQ of this channel (a CQ with events pending is not destroyed
        // in a correct program); the outputs are writable per the contract.
        unsafe {
            *cq_out = cq;
            *ctx_out = (*cq).cq_context;
        }
        0
    })
}

/// `ibv_ack_cq_events`.
///
/// # Safety
/// `cq` is NULL or a CQ.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut IbvCq, n: c_uint) {
    guard("ibv_ack_cq_events", (), || {
        // SAFETY: per the contract.
        if let Some(c) = unsafe { cq_of(cq) } {
            let mut counts = c.events.counts.lock();
            counts.1 = (counts.1 + u64::from(n)).min(counts.0);
            c.events.cv.notify_all();
            // SAFETY: live CQ (checked); the C field mirrors the count.
            unsafe { (*cq).comp_events_completed = counts.1 as c_uint };
        }
    })
}

fn wc_status(s: WcStatus) -> c_int {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocLenErr => 1,
        WcStatus::LocQpOpErr => 2,
        WcStatus::LocProtErr => 4,
        WcStatus::WrFlushErr => 5,
        WcStatus::RemInvReqErr => 9,
        WcStatus::RemAccessErr => 10,
        WcStatus::RemOpErr => 11,
        WcStatus::RetryExcErr => 12,
        WcStatus::RnrRetryExcErr => 13,
    }
}

fn wc_opcode(o: WcOpcode) -> c_int {
    match o {
        WcOpcode::Send | WcOpcode::Offload | WcOpcode::Noop => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::CompSwap => IBV_WC_COMP_SWAP,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvRdmaWithImm => IBV_WC_RECV_RDMA_WITH_IMM,
    }
}

/// The `struct ibv_wc` of a flexns completion.
pub(crate) fn to_ibv_wc(w: &Wc) -> IbvWc {
    IbvWc {
        wr_id: w.wr_id,
        status: wc_status(w.status),
        opcode: wc_opcode(w.opcode),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: w.imm_data.unwrap_or(0),
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: if w.imm_data.is_some() { IBV_WC_WITH_IMM } else { 0 },
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

/// `ops.poll_cq`: up to `n` completions into `wc`; the number, or -1.
unsafe extern "C" fn poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    guard("ibv_poll_cq", -1, || {
        // SAFETY: the program passes a CQ of this library (checked).
        let Some(c) = (unsafe { cq_of(cq) }) else { return -1 };
        if n < 0 || (n > 0 && wc.is_null()) {
            return -1;
        }
        let n = n as usize;
        let mut buf = [EMPTY_WC; 32];
        let mut total = 0;
        while total < n {
            let want = (n - total).min(buf.len());
            let got = c.cq.poll(&mut buf[..want]);
            for (i, w) in buf[..got].iter().enumerate() {
                // SAFETY: `wc` has room for `n` entries (the program's contract) and
                // `total + i < n`.
                unsafe { ptr::write(wc.add(total + i), to_ibv_wc(w)) };
            }
            total += got;
            if got < want {
                break;
            }
        }
        if total == 0 && n > 0 {
            c.empty_poll();
        } else if total > 0 {
            c.empty_since.store(0, Ordering::Relaxed);
        }
        total as c_int
    })
}

// ---------------------------------------------------------------------------------------------
// queue pairs

/// The errno of a refused verb.
fn errno_of(e: &VerbsError) -> c_int {
    use netstack::transport::rc::PostError;
    match e {
        VerbsError::Post(PostError::QueueFull(_)) => ENOMEM,
        VerbsError::TableFull(_) => ENOMEM,
        VerbsError::Io(io) => io.raw_os_error().unwrap_or(libc::EIO),
        VerbsError::Gone => libc::EIO,
        _ => EINVAL,
    }
}

/// `ibv_create_qp`: RC only; SRQs are not offered.
///
/// # Safety
/// `pd` is NULL or a PD; `init` is NULL or a valid `struct ibv_qp_init_attr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut IbvPd, init: *mut IbvQpInitAttr) -> *mut IbvQp {
    guard("ibv_create_qp", null_mut(), || {
        let fail = |msg: &str, e: c_int| {
            report(&format!("ibv_create_qp: {msg}"));
            set_errno(e);
            null_mut()
        };
        // SAFETY: per the contract.
        let Some(p) = (unsafe { pd_of(pd) }) else {
            return fail("pd: not a protection domain of flexns", EINVAL);
        };
        if init.is_null() {
            return fail("qp_init_attr: NULL", EINVAL);
        }
        // SAFETY: `init` is a valid struct per the contract; read by value.
        let (qp_context, send_cq, recv_cq, srq, cap, qp_type, sig_all) = unsafe {
            let i = &*init;
            (
                i.qp_context,
                i.send_cq,
                i.recv_cq,
                i.srq,
                i.cap,
                i.qp_type,
                i.sq_sig_all,
            )
        };
        if qp_type != IBV_QPT_RC {
            let name = match qp_type {
                3 => "UC",
                4 => "UD",
                8 => "RAW_PACKET",
                9 | 10 => "XRC",
                _ => "unknown",
            };
            return fail(
                &format!("qp_type {qp_type} ({name}) not supported: flexns offers RC QPs only"),
                EOPNOTSUPP,
            );
        }
        if !srq.is_null() {
            return fail("srq: shared receive queues are not supported", EOPNOTSUPP);
        }
        // SAFETY: per the contract (checked for kind).
        let (Some(scq), Some(rcq)) = (unsafe { cq_of(send_cq) }, unsafe { cq_of(recv_cq) }) else {
            return fail("send_cq/recv_cq: not CQs of flexns", EINVAL);
        };
        if cap.max_send_wr > MAX_QP_WR || cap.max_recv_wr > MAX_QP_WR {
            return fail(
                &format!(
                    "cap.max_send_wr {} / cap.max_recv_wr {}: at most {MAX_QP_WR}",
                    cap.max_send_wr, cap.max_recv_wr
                ),
                EINVAL,
            );
        }
        if cap.max_send_sge > MAX_SGE as u32 || cap.max_recv_sge > MAX_SGE as u32 {
            return fail(&format!("cap.max_send_sge/max_recv_sge: at most {MAX_SGE}"), EINVAL);
        }
        if cap.max_inline_data > MAX_INLINE {
            return fail(
                &format!("cap.max_inline_data {}: at most {MAX_INLINE}", cap.max_inline_data),
                EINVAL,
            );
        }
        // SAFETY: `pd` is a live FlexPd (checked).
        let ctx = unsafe { (*pd).context };
        // SAFETY: the PD's context is a live context (a PD outlives no context in a correct
        // program).
        let Some(c) = (unsafe { ctx_of(ctx) }) else {
            return fail("pd's context is gone", EINVAL);
        };
        let mut cfg = c.engine.config().qp;
        cfg.max_send_wr = cap.max_send_wr.max(1);
        cfg.max_recv_wr = cap.max_recv_wr.max(1);
        let attr = QpInitAttr {
            config: Some(cfg),
            ..QpInitAttr::default()
        };
        let qp = match c.engine.create_qp(&p.pd, &scq.cq, &rcq.cq, attr) {
            Ok(q) => q,
            Err(e) => return fail(&e.to_string(), errno_of(&e)),
        };
        let out_cap = IbvQpCap {
            max_send_wr: cfg.max_send_wr,
            max_recv_wr: cfg.max_recv_wr,
            max_send_sge: cap.max_send_sge.max(1),
            max_recv_sge: cap.max_recv_sge.max(1),
            max_inline_data: MAX_INLINE,
        };
        // SAFETY: `init` is writable per the contract: ibv_create_qp reports the real caps.
        unsafe { (*init).cap = out_cap };
        let qp_num = qp.qp_num();
        Box::into_raw(Box::new(FlexQp {
            ibv: IbvQp {
                context: ctx,
                qp_context,
                pd,
                send_cq,
                recv_cq,
                srq: null_mut(),
                handle: qp_num,
                qp_num,
                state: IBV_QPS_RESET,
                qp_type,
                mutex: libc::PTHREAD_MUTEX_INITIALIZER,
                cond: libc::PTHREAD_COND_INITIALIZER,
                events_completed: 0,
            },
            magic: MAGIC_QP,
            inner: QpInner {
                qp: Some(qp),
                _uses: [p.users.clone(), scq.users.clone(), rcq.users.clone()],
                engine: c.engine.clone(),
                sq_sig_all: sig_all != 0,
                state: AtomicI32::new(IBV_QPS_RESET),
                attr: Mutex::new(IbvQpAttr {
                    cap: out_cap,
                    ..IbvQpAttr::default()
                }),
                cap: out_cap,
            },
        })) as *mut IbvQp
    })
}

/// `ibv_destroy_qp`.
///
/// # Safety
/// `qp` is NULL or a QP this library created, not used again.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    guard("ibv_destroy_qp", EINVAL, || {
        // SAFETY: per the contract.
        let Some(q) = (unsafe { qp_of(qp) }) else {
            return EINVAL;
        };
        linger(q);
        let w = qp as *mut FlexQp;
        // SAFETY: checked live FlexQp, not used concurrently (the contract of destroy): its QP
        // is taken out and destroyed, which returns once the engine's core has removed it (no
        // further delivery into its receive buffers), before the box goes.
        unsafe {
            if let Some(x) = (*ptr::addr_of_mut!((*w).inner.qp)).take() {
                x.destroy();
            }
            destroy(w, ptr::addr_of_mut!((*w).magic));
        }
        0
    })
}

/// How long a QP being destroyed must have received nothing before it goes: longer than a
/// delayed ACK and than the peer's first retransmission timeout (16.8 ms), so that an ACK the
/// peer lost is asked for again and answered.
const LINGER_QUIET: Duration = Duration::from_millis(40);
/// The longest a destroy lingers.
const LINGER_MAX: Duration = Duration::from_millis(500);

/// Keeps a connected QP's engine running until the QP has been quiet for [`LINGER_QUIET`]:
/// the acknowledgement of the last message a program received is still to be sent when the
/// program destroys the QP right after polling it (ibv_rc_pingpong's client does), and a
/// hardware NIC would send it; without it the peer's last send ends in RETRY_EXC_ERR. Run to
/// completion, waiting on a scratch CQ hands the engine to its backstop thread meanwhile.
fn linger(q: &QpInner) {
    if q.state.load(Ordering::Acquire) < IBV_QPS_RTR {
        return;
    }
    let scratch = q.engine.create_cq(1).ok();
    let start = std::time::Instant::now();
    let mut last = q.qp().stats().rx_packets;
    let mut quiet_since = start;
    while start.elapsed() < LINGER_MAX {
        match &scratch {
            Some(c) => {
                c.wait(Duration::from_millis(2));
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
        let rx = q.qp().stats().rx_packets;
        if rx != last {
            last = rx;
            quiet_since = std::time::Instant::now();
        } else if quiet_since.elapsed() >= LINGER_QUIET {
            break;
        }
    }
}

/// The peer's data-path address in a RoCEv2 GID (`::ffff:a.b.c.d`).
fn addr_of_gid(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    std::net::Ipv6Addr::from(*gid).to_ipv4_mapped()
}

/// Applies one `ibv_modify_qp`; `Err((errno, why))`.
fn modify(q: &QpInner, a: &IbvQpAttr, mask: c_int) -> Result<c_int, (c_int, String)> {
    let mut guard = q.attr.lock();
    let saved = &mut *guard;
    let cur = q.state.load(Ordering::Acquire);
    let new = if mask & IBV_QP_STATE != 0 { a.qp_state } else { cur };
    let need = |bits: c_int, names: &str| {
        if mask & bits == bits {
            Ok(())
        } else {
            Err((EINVAL, format!("attr_mask: {names} required for this transition")))
        }
    };
    match (cur, new) {
        (IBV_QPS_RESET | IBV_QPS_INIT, IBV_QPS_INIT) => {
            if mask & IBV_QP_ACCESS_FLAGS != 0 {
                saved.qp_access_flags = a.qp_access_flags;
            }
            saved.port_num = 1;
        }
        (IBV_QPS_INIT, IBV_QPS_RTR) => {
            need(
                IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
                "IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_DEST_QPN and IBV_QP_RQ_PSN",
            )?;
            if a.ah_attr.is_global == 0 {
                return Err((
                    EINVAL,
                    "ah_attr.is_global: 0 (LID routing); flexns routes by RoCEv2 GID: give the program a \
                     GID index (ibv_rc_pingpong -g 0, perftest -x 0)"
                        .into(),
                ));
            }
            let Some(ip) = addr_of_gid(&a.ah_attr.grh.dgid) else {
                return Err((
                    EINVAL,
                    format!(
                        "ah_attr.grh.dgid: {} is not an IPv4-mapped RoCEv2 GID (::ffff:a.b.c.d)",
                        std::net::Ipv6Addr::from(a.ah_attr.grh.dgid)
                    ),
                ));
            };
            if !(IBV_MTU_256..=IBV_MTU_4096).contains(&a.path_mtu) {
                return Err((EINVAL, format!("path_mtu: {} not in 1..=5", a.path_mtu)));
            }
            let mtu = 256u32 << (a.path_mtu - 1);
            let template = q.qp().local_endpoint();
            let remote = Endpoint {
                qpn: a.dest_qp_num & 0xff_ffff,
                psn: a.rq_psn & 0xff_ffff,
                addr: SocketAddrV4::new(ip, ROCE_PORT),
                mtu,
                extra_addrs: Vec::new(),
                sources: Vec::new(),
                same_host: None,
                ..template
            };
            q.qp()
                .modify_to_rtr(&remote)
                .map_err(|e| (errno_of(&e), e.to_string()))?;
            saved.ah_attr = a.ah_attr;
            saved.path_mtu = a.path_mtu;
            saved.dest_qp_num = a.dest_qp_num;
            saved.rq_psn = a.rq_psn;
            if mask & IBV_QP_MAX_DEST_RD_ATOMIC != 0 {
                saved.max_dest_rd_atomic = a.max_dest_rd_atomic;
            }
            if mask & IBV_QP_MIN_RNR_TIMER != 0 {
                saved.min_rnr_timer = a.min_rnr_timer;
            }
        }
        (IBV_QPS_RTR, IBV_QPS_RTS) => {
            need(IBV_QP_SQ_PSN, "IBV_QP_SQ_PSN")?;
            q.qp()
                .modify_to_rts_at(a.sq_psn & 0xff_ffff)
                .map_err(|e| (errno_of(&e), e.to_string()))?;
            saved.sq_psn = a.sq_psn;
            for (bit, dst, src) in [
                (IBV_QP_TIMEOUT, &mut saved.timeout, a.timeout),
                (IBV_QP_RETRY_CNT, &mut saved.retry_cnt, a.retry_cnt),
                (IBV_QP_RNR_RETRY, &mut saved.rnr_retry, a.rnr_retry),
                (IBV_QP_MAX_QP_RD_ATOMIC, &mut saved.max_rd_atomic, a.max_rd_atomic),
            ] {
                if mask & bit != 0 {
                    *dst = src;
                }
            }
        }
        (IBV_QPS_RTS, IBV_QPS_RTS) => {}
        (_, IBV_QPS_ERR) => q.qp().modify_to_err(),
        (_, IBV_QPS_RESET) => {
            return Err((
                EOPNOTSUPP,
                "qp_state: returning a QP to RESET is not supported; destroy it and create another".into(),
            ))
        }
        (c, n) => return Err((EINVAL, format!("qp_state: transition {c} -> {n} is not allowed"))),
    }
    saved.qp_state = new;
    saved.cur_qp_state = new;
    q.state.store(new, Ordering::Release);
    Ok(new)
}

/// `ibv_modify_qp`: RESET→INIT→RTR→RTS and →ERR. The timeouts and retry counts are the
/// engine's (they are recorded for `ibv_query_qp`).
///
/// # Safety
/// `qp` is NULL or a QP; `attr` is NULL or a valid `struct ibv_qp_attr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int {
    guard("ibv_modify_qp", EINVAL, || {
        // SAFETY: per the contract.
        let Some(q) = (unsafe { qp_of(qp) }) else {
            report("ibv_modify_qp: qp: not a QP of flexns");
            return EINVAL;
        };
        if attr.is_null() {
            return EINVAL;
        }
        // SAFETY: valid per the contract; copied out.
        let a = unsafe { ptr::read(attr) };
        match modify(q, &a, mask) {
            Ok(state) => {
                // SAFETY: live QP (checked); the program reads `state`.
                unsafe { (*qp).state = state };
                0
            }
            Err((e, why)) => {
                report(&format!("ibv_modify_qp: {why}"));
                e
            }
        }
    })
}

/// `ibv_query_qp`: what the program set, and the QP's capabilities.
///
/// # Safety
/// `qp` is NULL or a QP; `attr` and `init` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _mask: c_int,
    init: *mut IbvQpInitAttr,
) -> c_int {
    guard("ibv_query_qp", EINVAL, || {
        // SAFETY: per the contract.
        let Some(q) = (unsafe { qp_of(qp) }) else { return EINVAL };
        if attr.is_null() || init.is_null() {
            return EINVAL;
        }
        let mut a = *q.attr.lock();
        a.qp_state = q.state();
        a.cur_qp_state = a.qp_state;
        // SAFETY: writable per the contract; `qp` live (checked).
        unsafe {
            ptr::write(attr, a);
            ptr::write(
                init,
                IbvQpInitAttr {
                    qp_context: (*qp).qp_context,
                    send_cq: (*qp).send_cq,
                    recv_cq: (*qp).recv_cq,
                    srq: null_mut(),
                    cap: q.cap,
                    qp_type: IBV_QPT_RC,
                    sq_sig_all: q.sq_sig_all as c_int,
                },
            );
        }
        0
    })
}

/// The scatter list of a work request.
///
/// # Safety
/// `sg` points to `n` valid SGEs when `n > 0`.
unsafe fn sges(sg: *const IbvSge, n: c_int) -> Result<SgList, String> {
    if !(0..=MAX_SGE).contains(&n) {
        return Err(format!("num_sge: {n} not in 0..={MAX_SGE}"));
    }
    if n > 0 && sg.is_null() {
        return Err("sg_list: NULL with num_sge > 0".into());
    }
    let mut l = SgList::new();
    for i in 0..n as usize {
        // SAFETY: `i < n`, valid per the contract.
        let s = unsafe { ptr::read(sg.add(i)) };
        l.push(Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        });
    }
    Ok(l)
}

/// The flexns work request of an `ibv_send_wr`.
fn send_wr(w: &IbvSendWr, sig_all: bool) -> Result<SendWr, (c_int, String)> {
    let opcode = match w.opcode {
        IBV_WR_RDMA_WRITE => WrOpcode::RdmaWrite,
        IBV_WR_RDMA_WRITE_WITH_IMM => WrOpcode::RdmaWriteWithImm,
        IBV_WR_SEND => WrOpcode::Send,
        IBV_WR_SEND_WITH_IMM => WrOpcode::SendWithImm,
        IBV_WR_RDMA_READ => WrOpcode::RdmaRead,
        IBV_WR_ATOMIC_CMP_AND_SWP => WrOpcode::AtomicCmpAndSwp,
        IBV_WR_ATOMIC_FETCH_AND_ADD => WrOpcode::AtomicFetchAndAdd,
        o => {
            return Err((
                EOPNOTSUPP,
                format!("opcode {o} not supported (memory windows, invalidation, TSO, atomic write)"),
            ))
        }
    };
    if w.send_flags & !0xf != 0 {
        return Err((EINVAL, format!("send_flags: {:#x} not supported", w.send_flags & !0xf)));
    }
    // SAFETY: the program's list, valid per ibv_post_send's contract.
    let sg_list = unsafe { sges(w.sg_list, w.num_sge) }.map_err(|m| (EINVAL, m))?;
    let mut flags = SendFlags(w.send_flags & 0xf);
    if sig_all {
        flags = flags | SendFlags::SIGNALED;
    }
    let atomic = matches!(opcode, WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd);
    let (remote_addr, rkey, compare_add, swap) = if atomic {
        (w.wr.remote_addr, w.wr.rkey, w.wr.compare_add, w.wr.swap)
    } else {
        (w.wr.remote_addr, w.rdma_rkey(), 0, 0)
    };
    Ok(SendWr {
        wr_id: w.wr_id,
        opcode,
        sg_list,
        flags,
        imm_data: w.imm_data,
        remote_addr,
        rkey,
        compare_add,
        swap,
    })
}

/// Posts one send request. With `IBV_SEND_INLINE` the payload is read from the SGEs' addresses
/// now, without checking their lkeys (`man ibv_post_send`: the buffers need not be registered),
/// and handed to the engine as INLINE bytes.
fn post_one(qp: &Qp, s: SendWr) -> Result<(), VerbsError> {
    if !s.flags.contains(SendFlags::INLINE) {
        return qp.post_send(s);
    }
    let total: u64 = s.sg_list.iter().map(|g| u64::from(g.length)).sum();
    if total > u64::from(MAX_INLINE) {
        return Err(VerbsError::InlineTooLong {
            len: total,
            max: MAX_INLINE,
        });
    }
    let mut data = Vec::with_capacity(total as usize);
    for g in &s.sg_list {
        if g.length > 0 && g.addr == 0 {
            return Err(VerbsError::Invalid("sg_list: an INLINE element's addr is NULL".into()));
        }
        // SAFETY: with IBV_SEND_INLINE the program guarantees the SGEs' bytes are readable
        // during the call (`man ibv_post_send`); at most MAX_INLINE bytes in all.
        let bytes = unsafe { std::slice::from_raw_parts(g.addr as usize as *const u8, g.length as usize) };
        data.extend_from_slice(bytes);
    }
    qp.post_send_inline(s, &data)
}

/// `ops.post_send`: posts the list in order; on the first refused request sets `*bad` to it and
/// returns its errno.
unsafe extern "C" fn post_send(qp: *mut IbvQp, mut wr: *mut IbvSendWr, bad: *mut *mut IbvSendWr) -> c_int {
    guard("ibv_post_send", EINVAL, || {
        // SAFETY: the program passes a QP of this library (checked).
        let Some(q) = (unsafe { qp_of(qp) }) else { return EINVAL };
        while !wr.is_null() {
            if !bad.is_null() {
                // SAFETY: writable per the contract; set first, so that a panic caught below
                // names the request too.
                unsafe { *bad = wr };
            }
            // SAFETY: a valid list per the contract of ibv_post_send.
            let w = unsafe { &*wr };
            let state = q.state.load(Ordering::Relaxed);
            let r = if state != IBV_QPS_RTS && state != IBV_QPS_ERR {
                // (in ERR the engine completes the request with IBV_WC_WR_FLUSH_ERR)
                Err((EINVAL, "the QP is neither in RTS nor in ERR".to_string()))
            } else {
                send_wr(w, q.sq_sig_all).and_then(|s| post_one(q.qp(), s).map_err(|e| (errno_of(&e), e.to_string())))
            };
            if let Err((e, why)) = r {
                report_post(&format!("ibv_post_send: {why}"));
                return e;
            }
            wr = w.next;
        }
        0
    })
}

/// `ops.post_recv`.
unsafe extern "C" fn post_recv(qp: *mut IbvQp, mut wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int {
    guard("ibv_post_recv", EINVAL, || {
        // SAFETY: the program passes a QP of this library (checked).
        let Some(q) = (unsafe { qp_of(qp) }) else { return EINVAL };
        while !wr.is_null() {
            if !bad.is_null() {
                // SAFETY: writable per the contract; set first, so that a panic caught below
                // names the request too.
                unsafe { *bad = wr };
            }
            // SAFETY: a valid list per the contract of ibv_post_recv.
            let w = unsafe { &*wr };
            let r = if q.state.load(Ordering::Relaxed) == IBV_QPS_RESET {
                Err((EINVAL, "the QP is in RESET".to_string()))
            } else {
                // SAFETY: the request's list, valid per the contract.
                unsafe { sges(w.sg_list, w.num_sge) }
                    .map_err(|m| (EINVAL, m))
                    .and_then(|sg_list| {
                        q.qp()
                            .post_recv(RecvWr {
                                wr_id: w.wr_id,
                                sg_list,
                            })
                            .map_err(|e| (errno_of(&e), e.to_string()))
                    })
            };
            if let Err((e, why)) = r {
                report_post(&format!("ibv_post_recv: {why}"));
                return e;
            }
            wr = w.next;
        }
        0
    })
}

/// `ops.post_srq_recv`: there are no SRQs.
unsafe extern "C" fn post_srq_recv(_srq: *mut c_void, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int {
    if !bad.is_null() {
        // SAFETY: writable per ibv_post_srq_recv's contract.
        unsafe { *bad = wr };
    }
    EOPNOTSUPP
}

// ---------------------------------------------------------------------------------------------
// verbs flexns does not offer: the documented failure

fn unsupported_null(name: &str) -> *mut c_void {
    report(&format!("{name}: not supported by flexns (EOPNOTSUPP)"));
    set_errno(EOPNOTSUPP);
    null_mut()
}

/// `ibv_create_srq`: no shared receive queues (NULL, `EOPNOTSUPP`).
#[no_mangle]
pub extern "C" fn ibv_create_srq(_pd: *mut IbvPd, _attr: *mut c_void) -> *mut c_void {
    unsupported_null("ibv_create_srq")
}

/// `ibv_destroy_srq`: none exists.
#[no_mangle]
pub extern "C" fn ibv_destroy_srq(_srq: *mut c_void) -> c_int {
    EINVAL
}

/// `ibv_create_ah`: no address handles (UD is not offered).
#[no_mangle]
pub extern "C" fn ibv_create_ah(_pd: *mut IbvPd, _attr: *mut c_void) -> *mut c_void {
    unsupported_null("ibv_create_ah")
}

/// `ibv_create_ah_from_wc`: no address handles.
#[no_mangle]
pub extern "C" fn ibv_create_ah_from_wc(_pd: *mut IbvPd, _wc: *mut IbvWc, _grh: *mut c_void, _port: u8) -> *mut c_void {
    unsupported_null("ibv_create_ah_from_wc")
}

/// `ibv_destroy_ah`: none exists.
#[no_mangle]
pub extern "C" fn ibv_destroy_ah(_ah: *mut c_void) -> c_int {
    EINVAL
}

/// `ibv_attach_mcast`: no multicast (`EOPNOTSUPP`).
#[no_mangle]
pub extern "C" fn ibv_attach_mcast(_qp: *mut IbvQp, _gid: *const c_void, _lid: u16) -> c_int {
    report("ibv_attach_mcast: not supported by flexns (EOPNOTSUPP)");
    EOPNOTSUPP
}

/// `ibv_detach_mcast`: no multicast (`EOPNOTSUPP`).
#[no_mangle]
pub extern "C" fn ibv_detach_mcast(_qp: *mut IbvQp, _gid: *const c_void, _lid: u16) -> c_int {
    EOPNOTSUPP
}

/// `ibv_qp_to_qp_ex`: the extended QP API (`ibv_wr_*`) is not offered (NULL, `EOPNOTSUPP`).
#[no_mangle]
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut IbvQp) -> *mut c_void {
    unsupported_null("ibv_qp_to_qp_ex")
}
