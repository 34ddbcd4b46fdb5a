//! The ICRC mode negotiated per connection (issue 44): two contexts over real UDP sockets on
//! 127.0.0.1. A pair whose ends both offer `none` (and send UDP checksums) moves WRITE, READ and
//! SEND data intact with every ICRC field 0 on the wire (captured on `lo` by a packet socket, so
//! root) and checks none, and so does a pair on one data core (hairpin); a peer that offers `icrc`, or an end that sends no UDP checksum, makes
//! the connection run the ICRC; a packet with a bad ICRC is dropped by an `icrc` QP and taken by
//! a `none` QP, which ignores the field.

use netstack::verbs::*;
use netstack::wire::{encode_into, Bth, HeaderBuf, Opcode};
use std::collections::HashSet;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_support::rawudp::RawUdp;

const T: Duration = Duration::from_secs(10);
const MEM: usize = 4 << 20;
/// A WRITE and a READ of this many bytes: 256 packets of 4 KiB, most of them middle packets
/// (those an `icrc` QP places in its ICRC pass).
const OP: usize = 1 << 20;

struct Side {
    ctx: Context,
    _pd: Pd,
    cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn config(icrc: IcrcMode, udp_checksum: bool) -> ContextConfig {
    ContextConfig {
        // one datagram per send, so a capture sees each packet's own trailer
        gso: false,
        udp_checksum,
        qp: RcConfig {
            icrc,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn side(cfg: ContextConfig) -> Side {
    let ctx = Context::open(cfg).unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    let mr = pd.reg_mr(MEM, Access::ALL).unwrap();
    Side {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
    }
}

/// Two sides connected to each other.
fn pair(a: ContextConfig, b: ContextConfig) -> (Side, Side) {
    let (a, b) = (side(a), side(b));
    let (ae, be) = (a.qp.local_endpoint(), b.qp.local_endpoint());
    a.qp.connect(&be).unwrap();
    b.qp.connect(&ae).unwrap();
    (a, b)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 ^ seed).wrapping_mul(2654435761).to_le_bytes()[1])
        .collect()
}

/// A WRITE from `a` to `b`, a READ of it back, and a SEND from `a` into a RECV of `b`, each
/// checked byte for byte.
fn traffic(a: &Side, b: &Side, seed: u32) {
    let data = pattern(OP, seed);
    a.mr.write(0, &data);
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, OP))
            .remote(b.mr.addr() + 4096, b.mr.rkey()),
    )
    .unwrap();
    let wc = a.cq.next(T).expect("WRITE completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    let mut got = vec![0u8; OP];
    b.mr.read(4096, &mut got);
    assert!(got == data, "the WRITE placed other bytes than it carried");
    a.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(a.mr.sge(OP, OP))
            .remote(b.mr.addr() + 4096, b.mr.rkey()),
    )
    .unwrap();
    let wc = a.cq.next(T).expect("READ completion");
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    a.mr.read(OP, &mut got);
    assert!(got == data, "the READ returned other bytes than the WRITE wrote");
    b.qp.post_recv(RecvWr {
        wr_id: 3,
        sg_list: [b.mr.sge(3 * OP, 10_000)].into_iter().collect(),
    })
    .unwrap();
    a.qp.post_send(SendWr::new(4, WrOpcode::Send).sge(a.mr.sge(0, 9_000)))
        .unwrap();
    assert_eq!(a.cq.next(T).expect("SEND completion").status, WcStatus::Success);
    let wc = b.cq.next(T).expect("RECV completion");
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 9_000), "{wc:?}");
    let mut got = vec![0u8; 9_000];
    b.mr.read(3 * OP, &mut got);
    assert!(got[..] == data[..9_000], "the SEND delivered other bytes");
}

/// The UDP ports of both sides' data paths (every socket of their data cores).
fn ports(sides: &[&Side]) -> HashSet<u16> {
    let mut v = HashSet::new();
    for s in sides {
        let e = s.qp.local_endpoint();
        v.insert(e.addr.port());
        v.extend(e.sources.iter().chain(&e.extra_addrs).map(|a| a.port()));
    }
    v
}

/// Every UDP datagram on `lo` while it runs: a packet socket bound to the loopback device, read
/// on a thread until dropped.
struct Capture {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Vec<u8>>>>,
}

impl Capture {
    /// Starts capturing UDP payloads to or from `ports`; `None` without the rights to.
    fn start(ports: HashSet<u16>) -> Option<Capture> {
        let proto = (libc::ETH_P_IP as u16).to_be();
        // SAFETY: plain system calls on a descriptor this function owns; `sll` and `size` are
        // initialized values of the types the calls take, passed with their sizes.
        let fd = unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, proto as i32);
            if fd < 0 {
                return None;
            }
            let fd = OwnedFd::from_raw_fd(fd);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = libc::if_nametoindex(c"lo".as_ptr()) as i32;
            let len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            if libc::bind(fd.as_raw_fd(), (&sll as *const libc::sockaddr_ll).cast(), len) != 0 {
                return None;
            }
            let size: libc::c_int = 64 << 20;
            let int = std::mem::size_of::<libc::c_int>() as u32;
            let opt = (&size as *const libc::c_int).cast();
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, opt, int);
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 20_000,
            };
            let tvl = std::mem::size_of::<libc::timeval>() as u32;
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                tvl,
            );
            fd
        };
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            let mut got = Vec::new();
            loop {
                // SAFETY: `buf` is writable for its length and outlives the call.
                let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n < 0 {
                    if s.load(Ordering::SeqCst) {
                        return got;
                    }
                    continue;
                }
                if let Some(p) = udp_payload(&buf[..n as usize], &ports) {
                    got.push(p.to_vec());
                }
            }
        });
        Some(Capture {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops and returns the UDP payloads captured.
    fn finish(mut self) -> Vec<Vec<u8>> {
        // the last packets may still be on their way through the socket
        std::thread::sleep(Duration::from_millis(100));
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// The UDP payload of an IPv4 packet to or from one of `ports`.
fn udp_payload<'a>(ip: &'a [u8], ports: &HashSet<u16>) -> Option<&'a [u8]> {
    let ihl = (*ip.first()? & 0x0f) as usize * 4;
    if ip.len() < ihl + 8 || ip[0] >> 4 != 4 || ip[9] != 17 {
        return None;
    }
    let u = &ip[ihl..];
    let (sp, dp) = (u16::from_be_bytes([u[0], u[1]]), u16::from_be_bytes([u[2], u[3]]));
    let len = u16::from_be_bytes([u[4], u[5]]) as usize;
    if !ports.contains(&sp) && !ports.contains(&dp) || len < 8 || len > u.len() {
        return None;
    }
    Some(&u[8..len])
}

fn icrc_field(d: &[u8]) -> u32 {
    u32::from_le_bytes(d[d.len() - 4..].try_into().unwrap())
}

fn need_root(test: &str, why: &str) -> bool {
    if test_support::is_root() {
        return true;
    }
    test_support::skip(test, test_support::Missing::Root, why);
    false
}

#[test]
fn a_pair_that_both_offer_none_moves_data_with_every_icrc_field_zero() {
    let (a, b) = pair(config(IcrcMode::None, true), config(IcrcMode::None, true));
    assert_eq!(a.qp.local_endpoint().icrc, IcrcMode::None, "offered");
    assert_eq!((a.qp.icrc_mode(), b.qp.icrc_mode()), (IcrcMode::None, IcrcMode::None));
    assert_eq!(a.qp.config().icrc, IcrcMode::None);
    let capture = if need_root(
        "icrc_mode::a_pair_that_both_offer_none",
        "capturing on lo needs a packet socket (root); the data is still checked",
    ) {
        Some(Capture::start(ports(&[&a, &b])).expect("a packet socket on lo (root)"))
    } else {
        None
    };
    for seed in 0..3 {
        traffic(&a, &b, seed);
    }
    for s in [&a, &b] {
        let st = s.ctx.stats();
        assert_eq!((st.rx_bad_icrc, st.rx_malformed), (0, 0), "{st:?}");
    }
    // a pair on one data core: the hairpin path writes the field 0 and skips the check too
    hairpin_pair_moves_data();
    if let Some(c) = capture {
        let got = c.finish();
        // 3 × (256 WRITE + 256 READ response packets + 3 SEND), and the ACKs
        assert!(got.len() >= 3 * 515, "captured {} datagrams", got.len());
        let nonzero = got.iter().filter(|d| d.len() >= 16 && icrc_field(d) != 0).count();
        assert_eq!(nonzero, 0, "{nonzero} of {} datagrams carry an ICRC", got.len());
        let big = got.iter().filter(|d| d.len() > 4096).count();
        assert!(big >= 3 * 511, "{big} full-size datagrams captured");
    }
}

/// Two QPs of one context (one data core) whose packets to each other never leave the core.
fn hairpin_pair_moves_data() {
    // one context, one data core: its QPs' packets to each other never leave the core
    let ctx = Context::open(config(IcrcMode::None, true)).unwrap();
    let pd = ctx.alloc_pd();
    let mk = || {
        let cq = ctx.create_cq(1024).unwrap();
        let qp = ctx.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
        let mr = pd.reg_mr(MEM, Access::ALL).unwrap();
        (cq, qp, mr)
    };
    let ((acq, aqp, amr), (bcq, bqp, bmr)) = (mk(), mk());
    let (ae, be) = (aqp.local_endpoint(), bqp.local_endpoint());
    aqp.connect(&be).unwrap();
    bqp.connect(&ae).unwrap();
    assert_eq!((aqp.icrc_mode(), bqp.icrc_mode()), (IcrcMode::None, IcrcMode::None));
    let side = |cq, qp, mr| Side {
        ctx: ctx.clone(),
        _pd: pd.clone(),
        cq,
        qp,
        mr,
    };
    let (a, b) = (side(acq, aqp, amr), side(bcq, bqp, bmr));
    traffic(&a, &b, 11);
    let st = ctx.stats();
    assert!(st.hairpin_packets >= 515, "{st:?}");
    assert_eq!((st.rx_bad_icrc, st.rx_malformed), (0, 0), "{st:?}");
}

#[test]
fn an_icrc_peer_makes_a_none_qp_run_the_icrc() {
    // either side offering icrc: the connection runs it both ways, and the data moves (a side
    // that ran none against the other's icrc would have every packet it sends dropped)
    for (x, y) in [(IcrcMode::None, IcrcMode::Icrc), (IcrcMode::Icrc, IcrcMode::None)] {
        let (a, b) = pair(config(x, true), config(y, true));
        assert_eq!((a.qp.icrc_mode(), b.qp.icrc_mode()), (IcrcMode::Icrc, IcrcMode::Icrc));
        let capture = test_support::is_root().then(|| Capture::start(ports(&[&a, &b])).unwrap());
        traffic(&a, &b, 7);
        if let Some(c) = capture {
            let got = c.finish();
            let zero = got.iter().filter(|d| icrc_field(d) == 0).count();
            // a CRC-32 of 0 is a 1-in-4-billion chance per packet
            assert!(got.len() >= 515 && zero == 0, "{zero} of {} without ICRC", got.len());
        }
        for s in [&a, &b] {
            assert_eq!(s.ctx.stats().rx_bad_icrc, 0);
        }
    }
}

#[test]
fn a_none_qp_without_udp_checksums_offers_and_runs_the_icrc() {
    // the context sends no UDP checksum: nothing would protect its bytes without the ICRC
    let (a, b) = pair(config(IcrcMode::None, false), config(IcrcMode::None, true));
    assert_eq!(a.qp.local_endpoint().icrc, IcrcMode::Icrc, "offered");
    assert_eq!((a.qp.icrc_mode(), b.qp.icrc_mode()), (IcrcMode::Icrc, IcrcMode::Icrc));
    traffic(&a, &b, 9);
    traffic(&b, &a, 10);
}

/// A SEND carrying `body` as sent from `src` to `dst`, with a correct ICRC, then its ICRC field
/// replaced by `icrc` when given.
fn forged_send(
    qpn: u32,
    psn: u32,
    body: &[u8],
    (src, dst): (SocketAddrV4, SocketAddrV4),
    icrc: Option<u32>,
) -> Vec<u8> {
    let mut bth = Bth::new(Opcode::SendOnly as u8, qpn, psn);
    bth.ack_req = true;
    let mut h = HeaderBuf::with_bth(&bth);
    h.set_pad_for(body.len());
    let mut out = Vec::new();
    encode_into(&mut out, &h, &[body], src, dst);
    if let Some(c) = icrc {
        let n = out.len();
        out[n - 4..].copy_from_slice(&c.to_le_bytes());
    }
    out
}

#[test]
fn a_bad_icrc_is_dropped_by_an_icrc_qp_and_ignored_by_a_none_qp() {
    if !need_root(
        "icrc_mode::a_bad_icrc_is_dropped",
        "forging the peer's packets needs a raw socket (root)",
    ) {
        return;
    }
    let raw = RawUdp::open().expect("a raw socket (root)");
    for mode in [IcrcMode::Icrc, IcrcMode::None] {
        let (a, b) = pair(config(mode, true), config(mode, true));
        assert_eq!(b.qp.icrc_mode(), mode);
        let (ae, be) = (a.qp.local_endpoint(), b.qp.local_endpoint());
        b.qp.post_recv(RecvWr {
            wr_id: 5,
            sg_list: [b.mr.sge(0, 4096)].into_iter().collect(),
        })
        .unwrap();
        let before = b.ctx.stats();
        // the PSN `b` expects next, from `a`'s address: only the ICRC is wrong
        let body = b"forged bytes under a bad ICRC";
        let d = forged_send(be.qpn, ae.psn, body, (ae.addr, be.addr), Some(0xdead_beef));
        raw.send(ae.addr, be.addr, &d).expect("a forged datagram sent");
        match mode {
            IcrcMode::Icrc => {
                // waited for by its own counter: another datagram (a late ACK of the
                // connection's set-up) can move rx_datagrams first, and the two counters are
                // not bumped at one instant
                let end = Instant::now() + T;
                while b.ctx.stats().rx_bad_icrc == before.rx_bad_icrc {
                    assert!(
                        Instant::now() < end,
                        "the forged datagram was never counted as a bad ICRC"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                let bad = b.ctx.stats().rx_bad_icrc - before.rx_bad_icrc;
                assert_eq!(bad, 1, "counted as a bad ICRC once");
                assert!(b.cq.next(Duration::from_millis(200)).is_none(), "nothing delivered");
                // the real SEND of that PSN is taken
                a.mr.write(0, b"the real one");
                a.qp.post_send(SendWr::new(6, WrOpcode::Send).sge(a.mr.sge(0, 12)))
                    .unwrap();
                assert_eq!(a.cq.next(T).unwrap().status, WcStatus::Success);
                let wc = b.cq.next(T).expect("the real SEND");
                assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 12));
                let mut got = [0u8; 12];
                b.mr.read(0, &mut got);
                assert_eq!(&got, b"the real one");
            }
            IcrcMode::None => {
                // the field is ignored: what the UDP checksum let through is delivered
                let wc = b.cq.next(T).expect("the forged SEND is delivered");
                assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, body.len() as u32));
                let bad = b.ctx.stats().rx_bad_icrc - before.rx_bad_icrc;
                assert_eq!(bad, 0, "a none QP counts no ICRC as bad");
                let mut got = vec![0u8; body.len()];
                b.mr.read(0, &mut got);
                assert_eq!(&got[..], &body[..]);
            }
        }
    }
}
