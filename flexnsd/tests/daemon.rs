//! flexnsd with real processes: a `flexnsd` daemon process, applications in this process and
//! in child processes (this test binary started again with `FLEXNSD_ROLE`, running [`child`]).

use flexnsd::client::{Attachment, ClientError, Cq, Mr, Pd, Qp, QpInitAttr};
use flexnsd::proto::{Reply, Request};
use flexnsd::shm::RingFault;
use netstack::verbs::{Access, Endpoint, RecvWr, SendFlags, SendWr, WcOpcode, WcStatus, WrOpcode};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::Daemon;

const T: Duration = Duration::from_secs(10);

impl Daemon {
    fn attach(&self, name: &str) -> Attachment {
        Attachment::connect(&self.socket, name).expect("attach")
    }

    /// Waits until the daemon's status satisfies `ok` (the probe attachment of `att` counted).
    fn status_until(
        &self,
        att: &Attachment,
        what: &str,
        ok: impl Fn(&flexnsd::proto::Status) -> bool,
    ) -> flexnsd::proto::Status {
        let deadline = Instant::now() + T;
        loop {
            let s = att.status().unwrap();
            if ok(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "{what}: status stayed {s:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The byte at offset `i` of pattern `seed`.
fn pat(seed: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8
}

fn fill(mr: &Mr, off: usize, len: usize, seed: u8) {
    let v: Vec<u8> = (0..len).map(|i| pat(seed, i)).collect();
    mr.write(off, &v);
}

fn check(mr: &Mr, off: usize, len: usize, seed: u8, what: &str) {
    let mut v = vec![0u8; len];
    mr.read(off, &mut v);
    if let Some(i) = (0..len).find(|&i| v[i] != pat(seed, i)) {
        panic!("{what}: byte {i} of {len} is {:#x}, expected {:#x}", v[i], pat(seed, i));
    }
}

/// One application's objects: a PD, a 1 MiB MR, a CQ and a QP.
struct Node {
    qp: Qp,
    cq: Cq,
    mr: Mr,
    _pd: Pd,
    att: Attachment,
}

const MR_LEN: usize = 1 << 20;

fn node(att: Attachment) -> Node {
    let pd = att.alloc_pd().unwrap();
    let mr = pd.reg_mr(MR_LEN, Access::ALL).unwrap();
    let cq = att.create_cq(256).unwrap();
    let qp = att.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    Node {
        qp,
        cq,
        mr,
        _pd: pd,
        att,
    }
}

/// Waits for one completion and checks it succeeded with `op`.
fn done(cq: &Cq, wr_id: u64, op: WcOpcode) -> u32 {
    let wc = cq.next(T).unwrap().expect("a completion within the timeout");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (wr_id, WcStatus::Success, op),
        "{wc:?}"
    );
    wc.byte_len
}

/// What the peer process tells the test: its endpoint and its memory.
#[derive(serde::Serialize, serde::Deserialize)]
struct Hello {
    ep: Endpoint,
    addr: u64,
    rkey: u32,
}

fn send_line<T: serde::Serialize>(w: &mut impl Write, v: &T) {
    // marked: the test harness of a child writes its own lines to stdout too
    writeln!(w, "\nFLEXNSD:{}", serde_json::to_string(v).unwrap()).unwrap();
    w.flush().unwrap();
}

fn read_line<T: for<'de> serde::Deserialize<'de>>(r: &mut impl BufRead) -> T {
    loop {
        let mut s = String::new();
        assert!(r.read_line(&mut s).unwrap() > 0, "the peer closed its output");
        if let Some((_, msg)) = s.split_once("FLEXNSD:") {
            return serde_json::from_str(msg).unwrap_or_else(|e| panic!("peer said {s:?}: {e}"));
        }
    }
}

/// Starts this test binary as a child application running `role` against `socket`.
fn spawn_child(role: &str, socket: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child", "--nocapture", "--test-threads=1"])
        .env("FLEXNSD_ROLE", role)
        .env("FLEXNSD_SOCKET", socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The child applications' entry point (not a test by itself: the tests start it).
#[test]
#[ignore = "entry point of the child applications the other tests start"]
fn child() {
    let role = std::env::var("FLEXNSD_ROLE").expect("FLEXNSD_ROLE");
    let socket = PathBuf::from(std::env::var("FLEXNSD_SOCKET").expect("FLEXNSD_SOCKET"));
    let mut out = std::io::stdout();
    let mut input = BufReader::new(std::io::stdin());
    match role.as_str() {
        // the passive side of `two_processes_move_data`
        "peer" => {
            let n = node(Attachment::connect(&socket, "peer").unwrap());
            fill(&n.mr, 0, MR_LEN, 0xB0);
            n.qp.post_recv(recv(10, n.mr.sge(MR_LEN - 4096, 4096))).unwrap();
            let ep = n.qp.local_endpoint().unwrap();
            send_line(
                &mut out,
                &Hello {
                    ep,
                    addr: n.mr.addr(),
                    rkey: n.mr.rkey(),
                },
            );
            let theirs: Hello = read_line(&mut input);
            n.qp.connect(&theirs.ep).unwrap();
            send_line(&mut out, &"connected");
            // the test WRITEs our first 256 KiB, READs the next 256 KiB, then SENDs 64 bytes
            let wc = n.cq.next(T).unwrap().expect("the SEND arrives");
            assert_eq!(
                (wc.wr_id, wc.status, wc.byte_len),
                (10, WcStatus::Success, 64),
                "{wc:?}"
            );
            check(&n.mr, 0, 256 << 10, 0xA0, "the WRITE's bytes in the peer");
            check(&n.mr, MR_LEN - 4096, 64, 0xA1, "the SEND's bytes in the peer");
            // answer with a SEND of 4 KiB
            fill(&n.mr, 512 << 10, 4096, 0xB1);
            n.qp.post_send(SendWr::new(11, WrOpcode::Send).sge(n.mr.sge(512 << 10, 4096)))
                .unwrap();
            done(&n.cq, 11, WcOpcode::Send);
            send_line(&mut out, &"ok");
            // stay attached until the test closes our stdin
            let _ = input.read_line(&mut String::new());
        }
        // an application that keeps its own QP pair busy with WRITEs until it is killed
        "load" => {
            let att = Attachment::connect(&socket, "load").unwrap();
            let a = node(att.clone());
            let b = node(att);
            a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
            b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
            send_line(&mut out, &"loaded");
            let mut id = 0u64;
            loop {
                for _ in 0..8 {
                    id += 1;
                    let wr = SendWr::new(id, WrOpcode::RdmaWrite)
                        .sge(a.mr.sge(0, 64 << 10))
                        .remote(b.mr.addr(), b.mr.rkey());
                    a.qp.post_send(wr).unwrap();
                }
                for _ in 0..8 {
                    a.cq.next(T).unwrap().expect("load completes");
                }
            }
        }
        r => panic!("unknown role {r}"),
    }
}

/// Two application processes attached to one daemon move data between their memory with
/// WRITE, READ and SEND in both directions, every byte checked on the side that receives it.
#[test]
fn two_processes_move_data() {
    let d = Daemon::start("data");
    let n = node(d.attach("test"));
    fill(&n.mr, 0, MR_LEN, 0xA0);
    let mut peer = spawn_child("peer", &d.socket);
    let mut to_peer = peer.stdin.take().unwrap();
    let mut from_peer = BufReader::new(peer.stdout.take().unwrap());
    let theirs: Hello = read_line(&mut from_peer);
    send_line(
        &mut to_peer,
        &Hello {
            ep: n.qp.local_endpoint().unwrap(),
            addr: n.mr.addr(),
            rkey: n.mr.rkey(),
        },
    );
    n.qp.post_recv(recv(3, n.mr.sge(768 << 10, 4096))).unwrap();
    n.qp.connect(&theirs.ep).unwrap();
    assert_eq!(read_line::<String>(&mut from_peer), "connected");

    // WRITE our first 256 KiB into the peer's first 256 KiB
    n.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(n.mr.sge(0, 256 << 10))
            .remote(theirs.addr, theirs.rkey),
    )
    .unwrap();
    done(&n.cq, 1, WcOpcode::RdmaWrite);
    // READ the peer's second 256 KiB (its pattern 0xB0 at offsets 256 KiB..) into ours there
    n.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(n.mr.sge(256 << 10, 256 << 10))
            .remote(theirs.addr + (256 << 10), theirs.rkey),
    )
    .unwrap();
    done(&n.cq, 2, WcOpcode::RdmaRead);
    let mut got = vec![0u8; 256 << 10];
    n.mr.read(256 << 10, &mut got);
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, pat(0xB0, (256 << 10) + i), "READ byte {i}");
    }
    // SEND 64 bytes into the peer's posted receive
    fill(&n.mr, 600 << 10, 64, 0xA1);
    n.qp.post_send(SendWr::new(4, WrOpcode::Send).sge(n.mr.sge(600 << 10, 64)))
        .unwrap();
    done(&n.cq, 4, WcOpcode::Send);
    // the peer checked the WRITE and the SEND and answers with a SEND of 4 KiB
    assert_eq!(done(&n.cq, 3, WcOpcode::Recv), 4096);
    check(&n.mr, 768 << 10, 4096, 0xB1, "the peer's SEND in our receive buffer");
    assert_eq!(read_line::<String>(&mut from_peer), "ok");
    drop(to_peer);
    assert!(peer.wait().unwrap().success(), "the peer process failed");
}

/// An application killed with SIGKILL while it posts: the other application, on the same
/// daemon, sees no error and keeps moving correct data; the daemon frees everything the dead
/// one held (its QPs, MRs, CQs, PDs, the mappings of its memfds and their descriptors).
#[test]
fn app_killed_under_load_frees_everything_and_others_see_no_error() {
    let d = Daemon::start("appkill");
    let probe = d.attach("probe");
    // the survivor: its own QP pair, WRITE then READ back, every byte checked
    let att = d.attach("survivor");
    let a = node(att.clone());
    let b = node(att);
    a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
    let before = d.status_until(&probe, "probe and survivor attached", |s| s.attachments == 2);

    let mut victim = spawn_child("load", &d.socket);
    let mut from_victim = BufReader::new(victim.stdout.take().unwrap());
    assert_eq!(read_line::<String>(&mut from_victim), "loaded");
    let loaded = d.status_until(&probe, "the victim attached and posting", |s| {
        s.attachments == 3 && s.apps.iter().any(|(_, c)| c.wrs > 50)
    });
    assert_eq!(loaded.totals.qps, before.totals.qps + 2, "{loaded:?}");
    assert!(loaded.mapped_memfds > before.mapped_memfds, "{loaded:?}");

    let mut round = 0u64;
    let round_trip = |round: u64| {
        let seed = round as u8;
        fill(&a.mr, 0, 128 << 10, seed);
        let w = SendWr::new(round * 2, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 128 << 10))
            .remote(b.mr.addr(), b.mr.rkey());
        a.qp.post_send(w).unwrap();
        done(&a.cq, round * 2, WcOpcode::RdmaWrite);
        let r = SendWr::new(round * 2 + 1, WrOpcode::RdmaRead)
            .sge(a.mr.sge(256 << 10, 128 << 10))
            .remote(b.mr.addr(), b.mr.rkey());
        a.qp.post_send(r).unwrap();
        done(&a.cq, round * 2 + 1, WcOpcode::RdmaRead);
        check(&a.mr, 256 << 10, 128 << 10, seed, "survivor's data read back");
    };
    for _ in 0..20 {
        round += 1;
        round_trip(round);
    }
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    let killed = Instant::now();
    // keep going while the daemon tears the victim down
    while killed.elapsed() < Duration::from_millis(500) {
        round += 1;
        round_trip(round);
    }
    let after = d.status_until(&probe, "the victim's resources freed", |s| s.attachments == 2);
    // everything back to its level before the victim attached: its objects, the mappings of
    // its memfds and every descriptor it passed
    let level = |s: &flexnsd::proto::Status| {
        (
            s.totals.pds,
            s.totals.mrs,
            s.totals.cqs,
            s.totals.qps,
            s.mapped_memfds,
            s.open_fds,
        )
    };
    assert_eq!(level(&after), level(&before), "after {after:?}\nbefore {before:?}");
    let survivor = |s: &flexnsd::proto::Status| s.apps.iter().find(|x| x.0 == a.att.app_id()).unwrap().1.errors;
    assert_eq!(survivor(&after), 0, "{after:?}");
    round += 1;
    round_trip(round);
}

/// A daemon killed with SIGKILL: an application waiting for a completion gets an error within
/// 1 s, and a command fails, instead of hanging.
#[test]
fn daemon_killed_waiting_call_errors_within_a_second() {
    let mut d = Daemon::start("dkill");
    let n = node(d.attach("waiter"));
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = n.cq.wait(Duration::from_secs(30));
        tx.send(Instant::now()).unwrap();
        (r, n)
    });
    std::thread::sleep(Duration::from_millis(300)); // the waiter is asleep on its eventfd
    d.child.kill().unwrap();
    let killed = Instant::now();
    let returned = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the waiting call returned");
    let took = returned.saturating_duration_since(killed);
    let (r, n) = waiter.join().unwrap();
    assert!(matches!(r, Err(ClientError::DaemonGone)), "{r:?}");
    assert!(
        took < Duration::from_secs(1),
        "the waiting call returned {took:?} after the kill"
    );
    assert!(matches!(n.qp.local_endpoint(), Err(ClientError::DaemonGone)));
}

/// A daemon killed with SIGKILL while work is outstanding: every work request posted and not
/// completed completes with a flush error within 1 s (sends, stuck on a receiver with no
/// receive posted, and receives nobody sends to); ones already completed are not flushed
/// again, an unsignaled one with the same id as the signaled one after it included; and then
/// the CQ, posts and commands say the daemon is gone.
#[test]
fn daemon_killed_outstanding_work_completes_with_flush_errors() {
    let mut d = Daemon::start("dflush");
    let att = d.attach("app");
    let a = node(att.clone());
    let b = node(att);
    a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
    fill(&a.mr, 0, 4096, 7);
    // two WRITEs with one id, the first unsignaled: the second's completion retires both
    let w = SendWr::new(1, WrOpcode::RdmaWrite)
        .sge(a.mr.sge(0, 4096))
        .remote(b.mr.addr(), b.mr.rkey());
    a.qp.post_send(w.clone().flags(SendFlags(0))).unwrap();
    a.qp.post_send(w).unwrap();
    done(&a.cq, 1, WcOpcode::RdmaWrite);
    // b posts no receive: these SENDs wait on RNR (retried without end), and nothing sends to a
    for id in [2, 3] {
        a.qp.post_send(SendWr::new(id, WrOpcode::Send).sge(a.mr.sge(0, 64)))
            .unwrap();
    }
    for id in [20, 21] {
        a.qp.post_recv(RecvWr {
            wr_id: id,
            sg_list: [a.mr.sge(8192, 64)].into_iter().collect(),
        })
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        a.cq.poll(&mut [netstack::verbs::EMPTY_WC; 4]).unwrap(),
        0,
        "nothing completed yet"
    );
    d.child.kill().unwrap();
    let killed = Instant::now();
    let mut flushed = Vec::new();
    let end = loop {
        match a.cq.next(Duration::from_secs(5)) {
            Ok(Some(wc)) => flushed.push((wc.wr_id, wc.status, wc.opcode, wc.qp_num)),
            other => break other,
        }
    };
    let took = killed.elapsed();
    let q = a.qp.qp_num();
    assert_eq!(
        flushed,
        [
            (2, WcStatus::WrFlushErr, WcOpcode::Send, q),
            (3, WcStatus::WrFlushErr, WcOpcode::Send, q),
            (20, WcStatus::WrFlushErr, WcOpcode::Recv, q),
            (21, WcStatus::WrFlushErr, WcOpcode::Recv, q),
        ]
    );
    assert!(matches!(end, Err(ClientError::DaemonGone)), "{end:?}");
    assert!(
        took < Duration::from_secs(1),
        "the flushes came {took:?} after the kill"
    );
    assert!(matches!(
        b.cq.next(Duration::from_secs(5)),
        Err(ClientError::DaemonGone)
    ));
    let again = a.qp.post_send(SendWr::new(4, WrOpcode::Send).sge(a.mr.sge(0, 64)));
    assert!(matches!(again, Err(ClientError::DaemonGone)), "{again:?}");
}

/// Both atomics go through the ring (their operands ride where a second SGE would) and give the
/// old value and the new memory; INLINE, whose payload the daemon would read after the post
/// returned, is refused at the post.
#[test]
fn atomics_go_through_the_ring_and_inline_is_refused() {
    let d = Daemon::start("atomics");
    let att = d.attach("app");
    let a = node(att.clone());
    let b = node(att);
    a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
    b.mr.region().store_u64(64, 5).unwrap();
    let atomic = |id: u64, op: WrOpcode, compare_add: u64, swap: u64| {
        a.qp.post_send(
            SendWr::new(id, op)
                .sge(a.mr.sge(8 * id as usize, 8))
                .remote(b.mr.addr() + 64, b.mr.rkey())
                .atomic(compare_add, swap),
        )
        .unwrap();
        let want = if op == WrOpcode::AtomicFetchAndAdd {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompSwap
        };
        done(&a.cq, id, want);
        (
            a.mr.region().load_u64(8 * id as usize).unwrap(),
            b.mr.region().load_u64(64).unwrap(),
        )
    };
    assert_eq!(atomic(1, WrOpcode::AtomicFetchAndAdd, 3, 0), (5, 8));
    assert_eq!(atomic(2, WrOpcode::AtomicCmpAndSwp, 8, 42), (8, 42));
    // a compare that fails leaves the memory as it was and still returns the old value
    assert_eq!(atomic(3, WrOpcode::AtomicCmpAndSwp, 1, 0), (42, 42));
    let inline = SendWr::new(4, WrOpcode::Send)
        .sge(a.mr.sge(0, 16))
        .flags(SendFlags::SIGNALED | SendFlags::INLINE);
    match a.qp.post_send(inline) {
        Err(ClientError::Invalid(m)) if m.contains("INLINE") => {}
        r => panic!("INLINE through the ring: {r:?}"),
    }
}

/// GET /metrics from `addr`: the body.
fn scrape(addr: &str) -> String {
    use std::io::Read as _;
    let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

/// The per-application series stay bounded: they are labelled by the attachment's slot (at
/// most `max_attachments`), which the next attachment reuses, not by its ever-growing id, and a
/// detached application's slot reads 0. Twelve applications attached one after another leave
/// one slot's series, not twelve.
#[test]
fn per_application_metrics_reuse_slots_instead_of_growing() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start_cfg("metrics", &format!("metrics = \"{addr}\""), "");
    let watcher = d.attach("watcher");
    for i in 0..12 {
        let n = node(d.attach(&format!("app{i}")));
        let id = n.att.app_id();
        let deadline = Instant::now() + T;
        // this attachment's counts are published under a slot of its own while it lives
        while !scrape(&addr)
            .lines()
            .any(|l| l.starts_with("flexnsd_app_id{") && l.ends_with(&format!(" {id}")))
        {
            assert!(
                Instant::now() < deadline,
                "attachment {id} not in /metrics:\n{}",
                scrape(&addr)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(n);
        d.status_until(&watcher, "the application detached", |s| s.attachments == 1);
    }
    let body = scrape(&addr);
    let series = |name: &str| body.lines().filter(|l| l.starts_with(&format!("{name}{{"))).count();
    // the startup probe, the watcher and one application at a time: at most three slots
    for name in ["flexnsd_app_id", "flexnsd_app_qps", "flexnsd_app_bytes"] {
        assert!(series(name) <= 3, "{} series of {name}:\n{body}", series(name));
    }
    // no slot still names a detached application, and the freed slots read 0 QPs
    let ids: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("flexnsd_app_id{"))
        .filter_map(|l| l.rsplit(' ').next())
        .filter(|v| *v != "0")
        .collect();
    assert_eq!(ids, [watcher.app_id().to_string()], "slots naming attachments:\n{body}");
}

/// A hostile application: bad handles, handles of another application, a memfd too small, a
/// file that cannot be sealed, a shrink after registration, a ring index far out of range.
/// Each gets an error for it alone; the other application keeps moving correct data.
#[test]
fn hostile_app_gets_errors_and_the_daemon_keeps_serving_others() {
    let mut d = Daemon::start("hostile");
    let good = d.attach("good");
    let a = node(good.clone());
    let b = node(good);
    a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
    let write_check = |round: u8| {
        fill(&a.mr, 0, 64 << 10, round);
        let w = SendWr::new(u64::from(round), WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 64 << 10))
            .remote(b.mr.addr(), b.mr.rkey());
        a.qp.post_send(w).unwrap();
        done(&a.cq, u64::from(round), WcOpcode::RdmaWrite);
        check(&b.mr, 0, 64 << 10, round, "the good application's WRITE");
    };
    write_check(1);

    let h = d.attach("hostile");
    let refused = |r: Result<Reply, ClientError>, field: &str| match r {
        Err(ClientError::Refused { field: f, .. }) if f == field => {}
        r => panic!("expected a refusal of {field}, got {r:?}"),
    };
    // handles it never got: the good application's QP handle (1..) is not the hostile one's
    refused(h.raw_call(&Request::QpEndpoint { qp: a.qp.handle() }, &[]), "qp");
    refused(h.raw_call(&Request::DestroyQp { qp: 999 }, &[]), "qp");
    refused(h.raw_call(&Request::DeregMr { mr: 1 }, &[]), "mr");
    let hpd = h.alloc_pd().unwrap();
    let file = flexnsd::sys::memfd(c"flexnsd-mr").unwrap();
    file.set_len(4096).unwrap();
    let reg = |len: u64, pd: u32, f: &std::fs::File| {
        h.raw_call(
            &Request::RegMr {
                pd,
                len,
                addr: 0x1000,
                access: 15,
            },
            &[f.as_fd()],
        )
    };
    refused(reg(4096, 77, &file), "pd");
    refused(reg(1 << 20, hpd.handle(), &file), "len"); // longer than the memfd
    refused(
        h.raw_call(
            &Request::RegMr {
                pd: hpd.handle(),
                len: 4096,
                addr: 0,
                access: 1 << 9,
            },
            &[file.as_fd()],
        ),
        "access",
    );
    refused(h.raw_call(&Request::AllocPd, &[file.as_fd()]), "fds");
    // a regular file cannot be sealed: refused before anything maps it
    let plain = tempfile_in(&d.dir);
    refused(reg(4096, hpd.handle(), &plain), "fds");
    // registered, then shrunk: the seal refuses the shrink (the daemon never faults on it)
    assert!(matches!(reg(4096, hpd.handle(), &file), Ok(Reply::Mr { .. })));
    let e = file.set_len(0).expect_err("a registered memfd cannot shrink");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");

    // a ring index far past the ring: the hostile QP's ring is closed, nothing else is
    let hn = node(h.clone());
    let before = h.status().unwrap();
    hn.qp.store_raw_tail(1 << 40);
    let deadline = Instant::now() + T;
    while hn.qp.ring_fault().is_none() {
        assert!(Instant::now() < deadline, "the daemon did not close the overrun ring");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(hn.qp.ring_fault(), Some(RingFault::Overrun));
    let e = hn
        .qp
        .post_send(SendWr::new(1, WrOpcode::Send))
        .expect_err("a closed ring takes no post");
    assert!(matches!(e, ClientError::RingClosed(RingFault::Overrun)), "{e:?}");
    let after = h.status().unwrap();
    let errs = |s: &flexnsd::proto::Status, app: u64| s.apps.iter().find(|x| x.0 == app).map(|x| x.1.errors);
    assert!(
        errs(&after, h.app_id()) > errs(&before, h.app_id()),
        "the ring fault is counted for the hostile app"
    );
    assert_eq!(
        errs(&after, a.att.app_id()),
        Some(0),
        "no error is counted for the good app"
    );
    for round in 2..10 {
        write_check(round);
    }
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon is still running");
    refused(h.raw_call(&Request::QpEndpoint { qp: 12345 }, &[]), "qp");
}

/// Receives posted before SENDs on other QPs reach the engine before those SENDs, as they do
/// in-process: ping-pong between two QPs of one application, each SEND right after the receive
/// for it on the other QP, meets no RNR NAK. (A daemon that drained the QPs' rings one after
/// the other could post a SEND before the receive the application posted before it: in one
/// of the two directions, whichever order it drains them in.)
#[test]
fn receives_posted_before_sends_on_other_qps_come_first() {
    // run to completion: the daemon's post runs the engine's core at once, so a SEND posted
    // before its receive reaches the peer QP first
    let d = Daemon::start_with("order", "drive = \"application\"");
    let att = d.attach("order");
    let a = node(att.clone());
    let b = node(att);
    a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
    b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
    fill(&a.mr, 0, 64, 0xA0);
    fill(&b.mr, 0, 64, 0xB0);
    for i in 0..60u64 {
        // even rounds a -> b, odd rounds b -> a; each after the daemon fell asleep, so that
        // the doorbell of the receive wakes it to find both entries
        std::thread::sleep(Duration::from_millis(2));
        let (tx, rx) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        rx.qp.post_recv(recv(i, rx.mr.sge(4096, 64))).unwrap();
        tx.qp
            .post_send(SendWr::new(i, WrOpcode::Send).sge(tx.mr.sge(0, 64)))
            .unwrap();
        assert_eq!(done(&rx.cq, i, WcOpcode::Recv), 64);
        done(&tx.cq, i, WcOpcode::Send);
        check(
            &rx.mr,
            4096,
            64,
            if i % 2 == 0 { 0xA0 } else { 0xB0 },
            "the SEND's bytes",
        );
    }
    for n in [&a, &b] {
        let st = n.qp.stats().unwrap();
        assert_eq!((st.rnr_naks_sent, st.rnr_naks_received), (0, 0), "{st:?}");
        assert!(st.rx_packets >= 30, "{st:?}");
    }
}

fn recv(wr_id: u64, sge: netstack::verbs::Sge) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: [sge].into_iter().collect(),
    }
}

fn tempfile_in(dir: &Path) -> std::fs::File {
    let p = dir.join("plain");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.set_len(4096).unwrap();
    f
}

/// A QP whose send ring is the test's own memfd (made before the QP, with the indices it
/// likes): what a hostile application controls.
fn raw_qp(att: &Attachment, pd: &Pd, cq: u32, slots: u32, start: u64) -> (flexnsd::shm::Mapping, u32) {
    use flexnsd::shm;
    let ring = shm::Mapping::create(c"flexnsd-sq", shm::sq_bytes(slots as usize)).unwrap();
    ring.word(shm::SQ_TAIL)
        .store(start, std::sync::atomic::Ordering::SeqCst);
    ring.word(shm::SQ_HEAD)
        .store(start, std::sync::atomic::Ordering::SeqCst);
    let r = att.raw_call(
        &Request::CreateQp {
            pd: pd.handle(),
            send_cq: cq,
            recv_cq: cq,
            slots,
            config: None,
        },
        &[ring.file().unwrap().as_fd()],
    );
    let Ok(Reply::Qp { handle, .. }) = r else {
        panic!("CreateQp: {r:?}");
    };
    (ring, handle)
}

fn refused_field<T>(r: Result<T, ClientError>, field: &str) {
    match r {
        Err(ClientError::Refused { field: f, .. }) if f == field => {}
        Err(e) => panic!("expected a refusal of {field}, got {e:?}"),
        Ok(_) => panic!("expected a refusal of {field}, it succeeded"),
    }
}

/// Per-attachment limits: objects and mapped bytes past the config's limits are refused
/// (naming the limit) before anything is mapped, a connection past `max_attachments` is told
/// so, and a connection that never says Hello is closed after `hello_timeout_ms`.
#[test]
fn limits_bound_attachments_objects_bytes_and_silent_connections() {
    let d = Daemon::start_cfg(
        "limits",
        "max_attachments = 3\nmax_app_objects = 6\nmax_app_bytes = 1048576\nhello_timeout_ms = 300",
        "",
    );
    let h = d.attach("greedy");
    let pd = h.alloc_pd().unwrap();
    let mut mrs: Vec<Mr> = (0..5).map(|_| pd.reg_mr(4096, Access::ALL).unwrap()).collect();
    refused_field(pd.reg_mr(4096, Access::ALL), "max_app_objects");
    refused_field(h.create_cq(4), "max_app_objects");
    let s = h.status().unwrap();
    let mine = s.apps.iter().find(|x| x.0 == h.app_id()).unwrap().1;
    assert_eq!((mine.pds, mine.mrs), (1, 5), "{s:?}");
    mrs.pop();
    // 4 pages mapped: 1 MiB more passes the 1 MiB limit; what is left of it does not
    refused_field(pd.reg_mr(1 << 20, Access::ALL), "max_app_bytes");
    mrs.push(pd.reg_mr((1 << 20) - 4 * 4096, Access::ALL).unwrap());

    // attachments: greedy + two more; the fourth is refused, and admitted once one leaves
    let b = d.attach("b");
    let c = d.attach("c");
    d.status_until(&b, "three attachments (the probe gone)", |s| s.attachments == 3);
    refused_field(Attachment::connect(&d.socket, "fourth"), "max_attachments");
    drop(c);
    let deadline = Instant::now() + T;
    let fourth = loop {
        match Attachment::connect(&d.socket, "fourth") {
            Ok(a) => break a,
            Err(ClientError::Refused { .. }) => {
                assert!(Instant::now() < deadline, "no place freed after a detach");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    };
    drop(fourth);
    drop(b);

    // a connection that says nothing is closed after the Hello timeout
    let deadline = Instant::now() + T;
    let silent = loop {
        let s = flexnsd::sys::connect(&d.socket).unwrap();
        // a refused one (the places of b and fourth not freed yet) is closed at once: retry
        std::thread::sleep(Duration::from_millis(50));
        let r = flexnsd::sys::poll(&[(s.as_fd(), libc::POLLIN)], Some(Duration::ZERO)).unwrap();
        if r[0] == 0 {
            break s;
        }
        assert!(Instant::now() < deadline, "the daemon kept refusing");
    };
    let t0 = Instant::now();
    let r = flexnsd::sys::poll(&[(silent.as_fd(), libc::POLLIN)], Some(T)).unwrap();
    assert!(r[0] & (libc::POLLHUP | libc::POLLIN) != 0, "not closed within {T:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "closed after {:?}", t0.elapsed());
    drop(mrs);
}

/// An application that never takes completions and keeps filling its send ring with garbage:
/// the daemon stops reading the ring once a ring's worth of its own error completions waits
/// (instead of queueing without bound), and reads on when the application takes them.
#[test]
fn unread_error_completions_stop_the_ring_instead_of_growing() {
    use flexnsd::shm;
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start("pending");
    let h = d.attach("flood");
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(4).unwrap();
    let (ring, _qp) = raw_qp(&h, &pd, cq.handle(), 64, 0);
    // zeroed entries are bad entries: each makes an error completion
    let flood = |dur: Duration| {
        let t0 = Instant::now();
        while t0.elapsed() < dur {
            let head = ring.word(shm::SQ_HEAD).load(SeqCst);
            ring.word(shm::SQ_TAIL).store(head + 64, SeqCst);
            h.status().unwrap(); // a command wakes the daemon
        }
        ring.word(shm::SQ_HEAD).load(SeqCst)
    };
    let taken = flood(Duration::from_millis(500));
    // 4 in the ring, at least 4 and at most one pass (64) more waiting: nothing like the
    // thousands an unbounded daemon takes in half a second
    assert!(
        taken <= 4 + 4 + 64 + 64,
        "the daemon took {taken} entries nobody completes"
    );
    assert!(taken >= 8, "the daemon took only {taken} entries");
    // the completions come in the ring's order, each an error, and reading them frees the ring
    for i in 0..taken {
        let wc = cq.next(T).unwrap().expect("an error completion");
        assert_eq!(wc.status, WcStatus::LocQpOpErr, "completion {i}: {wc:?}");
    }
    let later = flood(Duration::from_millis(100));
    assert!(
        later > taken,
        "the ring was not read again after completions were taken"
    );
}

/// Ring indices an application stored before CreateQp (near u64::MAX) do not reach the
/// daemon's arithmetic: it starts the ring at 0, and the attachment keeps working.
#[test]
fn ring_indices_start_at_zero_whatever_the_application_stored() {
    use flexnsd::shm;
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start("indices");
    let h = d.attach("wrap");
    let pd = h.alloc_pd().unwrap();
    let cq = h.create_cq(16).unwrap();
    let (ring, _qp) = raw_qp(&h, &pd, cq.handle(), 4, u64::MAX - 1);
    assert_eq!(
        ring.word(shm::SQ_TAIL).load(SeqCst),
        0,
        "the daemon starts the tail at 0"
    );
    assert_eq!(
        ring.word(shm::SQ_HEAD).load(SeqCst),
        0,
        "the daemon starts the head at 0"
    );
    // the application goes on from where it started: 4 entries past u64::MAX - 1 (wrapped)
    ring.word(shm::SQ_TAIL).store((u64::MAX - 1).wrapping_add(4), SeqCst);
    h.status().unwrap();
    // 2 entries (the wrapped tail is 2) of zeros: two error completions, no panic
    for _ in 0..2 {
        let wc = cq.next(T).unwrap().expect("an error completion");
        assert_eq!(wc.status, WcStatus::LocQpOpErr, "{wc:?}");
    }
    let s = h.status().expect("the attachment is served on");
    assert!(s.apps.iter().any(|x| x.0 == h.app_id()), "{s:?}");
}

/// DestroyCq and DeallocPd: refused while a QP (or MR) uses the object, done after; the
/// client's `Cq` and `Pd` free theirs on drop (the daemon's counts go back to zero while the
/// application stays attached).
#[test]
fn cqs_and_pds_are_freed_on_drop_and_refused_while_in_use() {
    let d = Daemon::start("free");
    let h = d.attach("freer");
    let pd = h.alloc_pd().unwrap();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    // the probe of `start` gone (its descriptors closed before the status drops it)
    let fds0 = d
        .status_until(&h, "the probe detached", |s| s.attachments == 1)
        .open_fds;
    let cq = h.create_cq(16).unwrap();
    // the daemon keeps the notify eventfd and the engine CQ has one of its own; the ring's
    // memfd is closed once mapped (it was a third)
    assert_eq!(
        h.status().unwrap().open_fds,
        fds0 + 2,
        "descriptors a CQ costs the daemon"
    );
    let qp = h.create_qp(&pd, &cq, &cq, QpInitAttr::default()).unwrap();
    refused_field(h.raw_call(&Request::DestroyCq { cq: cq.handle() }, &[]), "cq");
    refused_field(h.raw_call(&Request::DeallocPd { pd: pd.handle() }, &[]), "pd");
    drop(qp);
    refused_field(h.raw_call(&Request::DeallocPd { pd: pd.handle() }, &[]), "pd"); // the MR
    drop(mr);
    let held = |s: &flexnsd::proto::Status| s.apps.iter().find(|x| x.0 == h.app_id()).unwrap().1;
    let s = h.status().unwrap();
    assert_eq!((held(&s).pds, held(&s).cqs), (1, 1), "{s:?}");
    let fds = s.open_fds;
    drop(cq);
    drop(pd);
    let s = h.status().unwrap();
    let c = held(&s);
    assert_eq!((c.pds, c.mrs, c.cqs, c.qps), (0, 0, 0, 0), "{s:?}");
    // the CQ's notify eventfd is closed with it (its ring's memfd was closed once mapped)
    assert!(s.open_fds < fds, "{} descriptors open, {fds} before", s.open_fds);
    refused_field(h.raw_call(&Request::DestroyCq { cq: 12345 }, &[]), "cq");
}

/// A notify eventfd passed blocking and at its maximum count: the daemon's signal of a
/// completion does not block its attachment thread (which keeps answering commands).
#[test]
fn a_blocking_full_notify_eventfd_does_not_wedge_the_daemon() {
    use flexnsd::shm;
    use std::os::fd::FromRawFd;
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start("wedge");
    let h = d.attach("wedger");
    let pd = h.alloc_pd().unwrap();
    let ring = shm::Mapping::create(c"flexnsd-cq", shm::cq_bytes(16)).unwrap();
    // SAFETY: plain eventfd(2), checked, owned at once.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(efd >= 0);
    // SAFETY: a fresh descriptor nothing else owns.
    let notify = unsafe { std::os::fd::OwnedFd::from_raw_fd(efd) };
    let Ok(Reply::Handle(cq)) = h.raw_call(
        &Request::CreateCq { slots: 16 },
        &[ring.file().unwrap().as_fd(), notify.as_fd()],
    ) else {
        panic!("CreateCq refused");
    };
    // the application makes its eventfd blocking again (it shares the open file) and fills it
    flexnsd::sys::set_nonblocking(notify.as_fd(), false).unwrap();
    let max = (u64::MAX - 1).to_ne_bytes();
    // SAFETY: an 8-byte write from a live buffer.
    assert_eq!(unsafe { libc::write(efd, max.as_ptr().cast(), 8) }, 8);
    ring.word(shm::CQ_ARMED).store(1, SeqCst);
    let (sq, _qp) = raw_qp(&h, &pd, cq, 4, 0);
    sq.word(shm::SQ_TAIL).store(1, SeqCst); // one zeroed entry: an error completion
    let (tx, rx) = std::sync::mpsc::channel();
    let h2 = h.clone();
    std::thread::spawn(move || {
        h2.status().unwrap(); // wakes the daemon: it takes the entry and signals
        std::thread::sleep(Duration::from_millis(100));
        tx.send(h2.status().is_ok()).unwrap();
    });
    let answered = rx.recv_timeout(Duration::from_secs(5));
    assert_eq!(answered, Ok(true), "the attachment thread stopped answering");
    assert_eq!(ring.word(shm::CQ_TAIL).load(SeqCst), 1, "the completion was written");
    assert_eq!(ring.word(shm::CQ_ARMED).load(SeqCst), 0, "the arm was taken");
}

/// Isolation, not just unknown handles: a hostile application posts the good application's
/// lkey (as its own SGE) and rkey (as the target of a WRITE and of a READ) on QPs connected to
/// its own QPs; it gets protection errors and the good application's memory is untouched.
#[test]
fn another_applications_keys_get_protection_errors() {
    let d = Daemon::start("keys");
    let good = node(d.attach("good"));
    fill(&good.mr, 0, MR_LEN, 0x5A);
    let h = d.attach("hostile");
    // a fresh pair of the hostile application's QPs per case (an error moves a QP to error)
    let pair = || {
        let a = node(h.clone());
        let b = node(h.clone());
        a.qp.connect(&b.qp.local_endpoint().unwrap()).unwrap();
        b.qp.connect(&a.qp.local_endpoint().unwrap()).unwrap();
        fill(&a.mr, 0, 4096, 0x11);
        (a, b)
    };
    let first = |n: &Node, wr_id: u64| {
        let wc = n.cq.next(T).unwrap().expect("a completion");
        assert_eq!(wc.wr_id, wr_id, "{wc:?}");
        wc.status
    };
    // its own memory, named with the good application's lkey
    let (a, b) = pair();
    let mut sge = a.mr.sge(0, 4096);
    sge.lkey = good.mr.lkey();
    a.qp.post_send(
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(sge)
            .remote(b.mr.addr(), b.mr.rkey()),
    )
    .unwrap();
    assert_eq!(first(&a, 1), WcStatus::LocProtErr);
    // a WRITE to the good application's address with its rkey
    let (a, _b) = pair();
    a.qp.post_send(
        SendWr::new(2, WrOpcode::RdmaWrite)
            .sge(a.mr.sge(0, 4096))
            .remote(good.mr.addr(), good.mr.rkey()),
    )
    .unwrap();
    assert_eq!(first(&a, 2), WcStatus::RemAccessErr);
    // a READ of it
    let (a, _b) = pair();
    a.qp.post_send(
        SendWr::new(3, WrOpcode::RdmaRead)
            .sge(a.mr.sge(0, 4096))
            .remote(good.mr.addr(), good.mr.rkey()),
    )
    .unwrap();
    assert_eq!(first(&a, 3), WcStatus::RemAccessErr);
    check(&a.mr, 0, 4096, 0x11, "the hostile READ's buffer (nothing read into it)");
    check(&good.mr, 0, MR_LEN, 0x5A, "the good application's memory");
}

/// A hugetlbfs memfd (MFD_HUGETLB) is refused before the daemon maps it.
#[test]
fn a_hugetlb_memfd_is_refused() {
    // SAFETY: a C string; the flags ask for a sealable hugetlb memfd; the result is checked.
    let fd = unsafe {
        libc::memfd_create(
            c"flexnsd-huge".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB,
        )
    };
    if fd < 0 {
        let why = format!(
            "a_hugetlb_memfd_is_refused: memfd_create(MFD_HUGETLB): {} (no hugetlbfs in this kernel)",
            std::io::Error::last_os_error()
        );
        eprintln!("SKIPPED {why}");
        if let Some(p) = std::env::var_os("FLEXNS_SKIP_LOG") {
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(p) {
                let _ = writeln!(f, "{why}");
            }
        }
        return;
    }
    use std::os::fd::FromRawFd;
    // SAFETY: a fresh descriptor nothing else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    // one huge page long, where the kernel lets it be sized (the old daemon then mapped it)
    let _ = file.set_len(2 << 20);
    let d = Daemon::start("huge");
    let h = d.attach("huge");
    let pd = h.alloc_pd().unwrap();
    let r = h.raw_call(
        &Request::RegMr {
            pd: pd.handle(),
            len: 4096,
            addr: 0x1000,
            access: 15,
        },
        &[file.as_fd()],
    );
    match r {
        Err(ClientError::Refused { field, message }) if field == "fds" && message.contains("tmpfs") => {}
        r => panic!("expected a refusal of the hugetlb memfd, got {r:?}"),
    }
}

/// An error completion the daemon makes itself (a bad ring entry) comes after the completion
/// of a send posted before it on the same QP, as verbs orders a send queue's completions, even
/// when that send completes late (a SEND waiting for its receive).
#[test]
fn a_daemon_made_error_does_not_overtake_an_earlier_send() {
    use flexnsd::shm;
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start("order-err");
    let h = d.attach("order-err");
    let b = node(h.clone());
    let pd = h.alloc_pd().unwrap();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    let cq = h.create_cq(16).unwrap();
    let (ring, qp) = raw_qp(&h, &pd, cq.handle(), 4, 0);
    let Ok(Reply::Endpoint(ep)) = h.raw_call(&Request::QpEndpoint { qp }, &[]) else {
        panic!("QpEndpoint");
    };
    b.qp.connect(&ep).unwrap();
    let r = h.raw_call(
        &Request::Connect {
            qp,
            remote: b.qp.local_endpoint().unwrap(),
        },
        &[],
    );
    assert!(matches!(r, Ok(Reply::Done)), "{r:?}");
    // entry 0: a SEND the peer has no receive for yet; entry 1: zeros (a bad entry)
    let send = shm::encode_send(&SendWr::new(1, WrOpcode::Send).sge(mr.sge(0, 64))).unwrap();
    ring.write_words(shm::slot_off(0, 4, shm::WQE_BYTES), &send);
    ring.word(shm::SQ_TAIL).store(2, SeqCst);
    h.status().unwrap(); // wakes the daemon
    std::thread::sleep(Duration::from_millis(20));
    b.qp.post_recv(recv(9, b.mr.sge(0, 4096))).unwrap();
    let first = cq.next(T).unwrap().expect("a completion");
    let second = cq.next(T).unwrap().expect("a second completion");
    assert_eq!(
        first.wr_id, 1,
        "the SEND's completion comes first: {first:?} then {second:?}"
    );
    assert_eq!((second.wr_id, second.status), (0, WcStatus::LocQpOpErr), "{second:?}");
}
