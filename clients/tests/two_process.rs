//! Verbs between two OS processes: this test process and an `nsperf server` child.

use clients::bench::{pattern_byte, ChildServer};
use clients::perf::{server::SEED, Hello, Op, Welcome};
use netstack::cm;
use netstack::verbs::*;
use std::net::SocketAddr;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn server(mr_size: &str) -> (ChildServer, SocketAddr, SocketAddr) {
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_nsperf"));
    let c = ChildServer::start(&exe, &["server".into(), "--mr-size".into(), mr_size.into()]).expect("server starts");
    let cm = c.field("cm").unwrap().parse().unwrap();
    let data = c.field("data").unwrap().parse().unwrap();
    (c, cm, data)
}

struct Client {
    _ctx: Context,
    pd: Pd,
    cq: Cq,
}

impl Client {
    fn new() -> Client {
        let ctx = Context::open(ContextConfig::default()).unwrap();
        let pd = ctx.alloc_pd();
        let cq = ctx.create_cq(4096).unwrap();
        Client { _ctx: ctx, pd, cq }
    }
    fn connect(&self, cm_addr: SocketAddr, hello: &Hello) -> (Qp, Welcome) {
        let qp = self
            ._ctx
            .create_qp(&self.pd, &self.cq, &self.cq, QpInitAttr::default())
            .unwrap();
        let w = cm::connect_blocking(cm_addr, &qp, serde_json::to_vec(hello).unwrap()).expect("connect");
        (qp, serde_json::from_slice(&w).unwrap())
    }
    fn wait(&self) -> Wc {
        self.cq.next(T).expect("a completion within the timeout")
    }
    fn ok(&self, qp: &Qp, wr: SendWr) -> Wc {
        qp.post_send(wr).unwrap();
        let wc = self.wait();
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        wc
    }
}

fn fast_fill(buf: &mut [u8], mut x: u64) {
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

#[test]
fn every_opcode_moves_verified_data_between_processes() {
    let (_srv, cm_addr, _) = server("64MiB");
    let c = Client::new();
    let (qp, w) = c.connect(
        cm_addr,
        &Hello {
            op: Op::Send,
            size: 65536,
            depth: 4,
            echo: true,
            low_latency: false,
            signaled: false,
            resp_addr: 0,
            resp_rkey: 0,
            need: 0,
            session: 0,
        },
    );
    let mr = c.pd.reg_mr(1 << 20, Access::LOCAL_WRITE).unwrap();
    let mut data = vec![0u8; 200_000];
    fast_fill(&mut data, 42);
    mr.write(0, &data);
    let target = w.addr + (16 << 20);

    // SEND (echoed back by the server)
    qp.post_recv(RecvWr {
        wr_id: 100,
        sg_list: [mr.sge(600_000, 65536)].into_iter().collect(),
    })
    .unwrap();
    c.ok(&qp, SendWr::new(1, WrOpcode::Send).sge(mr.sge(0, 50_000)));
    let r = c.wait();
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (100, WcStatus::Success, WcOpcode::Recv, 50_000)
    );
    let mut echo = vec![0u8; 50_000];
    mr.read(600_000, &mut echo);
    assert_eq!(echo, data[..50_000]);

    // WRITE, then READ it back
    c.ok(
        &qp,
        SendWr::new(2, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 200_000))
            .remote(target, w.rkey),
    );
    c.ok(
        &qp,
        SendWr::new(3, WrOpcode::RdmaRead)
            .sge(mr.sge(300_000, 200_000))
            .remote(target, w.rkey),
    );
    let mut back = vec![0u8; 200_000];
    mr.read(300_000, &mut back);
    assert_eq!(back, data);

    // WRITE_WITH_IMM: data placed, immediate delivered (the server echoes it in a SEND_WITH_IMM)
    qp.post_recv(RecvWr {
        wr_id: 101,
        sg_list: Default::default(),
    })
    .unwrap();
    c.ok(
        &qp,
        SendWr::new(4, WrOpcode::RdmaWriteWithImm)
            .sge(mr.sge(0, 5000))
            .remote(target + 300_000, w.rkey)
            .imm(0xfeed_f00d),
    );
    let r = c.wait();
    assert_eq!((r.wr_id, r.imm_data), (101, Some(0xfeed_f00d)));
    c.ok(
        &qp,
        SendWr::new(5, WrOpcode::RdmaRead)
            .sge(mr.sge(300_000, 5000))
            .remote(target + 300_000, w.rkey),
    );
    mr.read(300_000, &mut back[..5000]);
    assert_eq!(back[..5000], data[..5000]);

    // READ of the server's patterned memory
    let off = 40 << 20;
    c.ok(
        &qp,
        SendWr::new(6, WrOpcode::RdmaRead)
            .sge(mr.sge(0, 12_345))
            .remote(w.addr + off, w.rkey),
    );
    let mut got = vec![0u8; 12_345];
    mr.read(0, &mut got);
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, &b)| b == pattern_byte(off + i as u64, SEED)));

    // CMP_AND_SWP and FETCH_AND_ADD on an aligned word
    let word = target + 512_000;
    mr.write(0, &7u64.to_le_bytes());
    c.ok(
        &qp,
        SendWr::new(7, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 8))
            .remote(word, w.rkey),
    );
    c.ok(
        &qp,
        SendWr::new(8, WrOpcode::AtomicCmpAndSwp)
            .sge(mr.sge(8, 8))
            .remote(word, w.rkey)
            .atomic(7, 100),
    );
    assert_eq!(mr.load_u64(8), Some(7));
    c.ok(
        &qp,
        SendWr::new(9, WrOpcode::AtomicCmpAndSwp)
            .sge(mr.sge(8, 8))
            .remote(word, w.rkey)
            .atomic(7, 200),
    );
    assert_eq!(mr.load_u64(8), Some(100), "failed compare returns the current value");
    for i in 0..50 {
        c.ok(
            &qp,
            SendWr::new(10 + i, WrOpcode::AtomicFetchAndAdd)
                .sge(mr.sge(16, 8))
                .remote(word, w.rkey)
                .atomic(2, 0),
        );
        assert_eq!(mr.load_u64(16), Some(100 + 2 * i));
    }
    c.ok(
        &qp,
        SendWr::new(70, WrOpcode::RdmaRead)
            .sge(mr.sge(24, 8))
            .remote(word, w.rkey),
    );
    assert_eq!(mr.load_u64(24), Some(200));
}

#[test]
fn one_gib_write_with_end_to_end_checksum() {
    let (_srv, cm_addr, _) = server("1GiB");
    let c = Client::new();
    let (qp, w) = c.connect(
        cm_addr,
        &Hello {
            op: Op::Write,
            size: 1 << 30,
            depth: 1,
            echo: false,
            low_latency: false,
            signaled: false,
            resp_addr: 0,
            resp_rkey: 0,
            need: 0,
            session: 0,
        },
    );
    const GIB: usize = 1 << 30;
    let src = c.pd.reg_mr(GIB, Access::LOCAL_WRITE).unwrap();
    let mut chunk = vec![0u8; 64 << 20];
    let mut want = crc32fast::Hasher::new();
    for (i, off) in (0..GIB).step_by(chunk.len()).enumerate() {
        fast_fill(&mut chunk, 0x1234_5678 + i as u64);
        src.write(off, &chunk);
        want.update(&chunk);
    }
    let want = want.finalize();
    let t = std::time::Instant::now();
    c.ok(
        &qp,
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(src.sge(0, GIB))
            .remote(w.addr, w.rkey),
    );
    eprintln!("1 GiB WRITE took {:?}", t.elapsed());
    // read it back in 64 MiB pieces and checksum what the server holds
    let back = c.pd.reg_mr(chunk.len(), Access::LOCAL_WRITE).unwrap();
    let mut got = crc32fast::Hasher::new();
    for off in (0..GIB).step_by(chunk.len()) {
        c.ok(
            &qp,
            SendWr::new(2, WrOpcode::RdmaRead)
                .sge(back.sge(0, chunk.len()))
                .remote(w.addr + off as u64, w.rkey),
        );
        back.read(0, &mut chunk);
        got.update(&chunk);
    }
    assert_eq!(
        got.finalize(),
        want,
        "CRC-32 of the remote GiB differs from what was written"
    );
}

#[test]
fn bad_remote_accesses_end_in_rem_access_err_and_touch_nothing() {
    let (_srv, cm_addr, _) = server("16MiB");
    let c = Client::new();
    let hello = Hello {
        op: Op::Write,
        size: 4096,
        depth: 1,
        echo: false,
        low_latency: false,
        signaled: false,
        resp_addr: 0,
        resp_rkey: 0,
        need: 0,
        session: 0,
    };
    let (good, w) = c.connect(cm_addr, &hello);
    let mr = c.pd.reg_mr(1 << 16, Access::LOCAL_WRITE).unwrap();
    mr.write(0, &[0xAB; 8192]);
    let snapshot = |addr: u64, rkey: u32, len: usize| -> Vec<u8> {
        c.ok(
            &good,
            SendWr::new(99, WrOpcode::RdmaRead)
                .sge(mr.sge(16384, len))
                .remote(addr, rkey),
        );
        let mut v = vec![0u8; len];
        mr.read(16384, &mut v);
        v
    };
    let cases: Vec<(&str, u64, u32, u64, u32, WrOpcode)> = vec![
        // (what, target addr, rkey, snapshot addr, snapshot rkey, opcode)
        (
            "bad rkey",
            w.addr + 4096,
            w.rkey ^ 0x0000_ff00,
            w.addr + 4096,
            w.rkey,
            WrOpcode::RdmaWrite,
        ),
        (
            "out of bounds",
            w.addr + w.len - 100,
            w.rkey,
            w.addr + w.len - 4096,
            w.rkey,
            WrOpcode::RdmaWrite,
        ),
        (
            "no REMOTE_WRITE",
            w.ro_addr,
            w.ro_rkey,
            w.ro_addr,
            w.ro_rkey,
            WrOpcode::RdmaWrite,
        ),
        (
            "no REMOTE_ATOMIC",
            w.ro_addr,
            w.ro_rkey,
            w.ro_addr,
            w.ro_rkey,
            WrOpcode::AtomicFetchAndAdd,
        ),
        (
            "READ with bad rkey",
            w.addr,
            w.rkey.wrapping_add(1 << 8),
            w.addr,
            w.rkey,
            WrOpcode::RdmaRead,
        ),
    ];
    for (what, addr, rkey, snap_addr, snap_rkey, op) in cases {
        let before = snapshot(snap_addr, snap_rkey, 4096);
        let (qp, _) = c.connect(cm_addr, &hello);
        let len = if op == WrOpcode::AtomicFetchAndAdd { 8 } else { 4096 };
        let mut wr = SendWr::new(1, op).sge(mr.sge(0, len)).remote(addr, rkey);
        if op == WrOpcode::AtomicFetchAndAdd {
            wr = wr.atomic(1, 0);
        }
        qp.post_send(wr).unwrap();
        let wc = c.wait();
        assert_eq!(wc.status, WcStatus::RemAccessErr, "{what}: {wc:?}");
        assert_eq!(qp.state(), QpState::Err, "{what}");
        // later work requests are flushed
        qp.post_send(
            SendWr::new(2, WrOpcode::RdmaWrite)
                .sge(mr.sge(0, 8))
                .remote(w.addr, w.rkey),
        )
        .unwrap();
        assert_eq!(c.wait().status, WcStatus::WrFlushErr, "{what}");
        assert_eq!(
            snapshot(snap_addr, snap_rkey, 4096),
            before,
            "{what}: remote memory changed"
        );
    }
}

#[test]
fn garbage_datagrams_do_not_hurt_the_server() {
    let (mut srv, cm_addr, data) = server("16MiB");
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut x = 99u64;
    for i in 0..5000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 4200) as usize;
        let mut buf = vec![0u8; len];
        fast_fill(&mut buf, x);
        if i % 4 == 0 && len > 12 {
            buf[0] = (x % 0x18) as u8; // a valid opcode with garbage headers
            buf[1] &= 0xF0;
        }
        let _ = sock.send_to(&buf, data);
    }
    std::thread::sleep(Duration::from_millis(200));
    let c = Client::new();
    let (qp, w) = c.connect(
        cm_addr,
        &Hello {
            op: Op::Write,
            size: 4096,
            depth: 1,
            echo: false,
            low_latency: false,
            signaled: false,
            resp_addr: 0,
            resp_rkey: 0,
            need: 0,
            session: 0,
        },
    );
    let mr = c.pd.reg_mr(8192, Access::LOCAL_WRITE).unwrap();
    mr.write(0, b"still serving");
    c.ok(
        &qp,
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(mr.sge(0, 13))
            .remote(w.addr, w.rkey),
    );
    c.ok(
        &qp,
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(mr.sge(4096, 13))
            .remote(w.addr, w.rkey),
    );
    let mut b = [0u8; 13];
    mr.read(4096, &mut b);
    assert_eq!(&b, b"still serving");
    assert!(srv.is_running(), "the server process died");
}

/// `nsperf client --op send --depth 1 --signaled`: the ping-pong runs with every SEND
/// signaled (each round trip waits for its own send's completion too, as perftest's
/// ib_send_lat does), checks every echo and says so on its line; any other operation is
/// refused naming the flag.
#[test]
fn a_signaled_ping_pong_completes_every_send_and_checks_every_echo() {
    let exe = env!("CARGO_BIN_EXE_nsperf");
    let out = std::process::Command::new(exe)
        .args(["client", "--op", "send", "--size", "64", "--depth", "1", "--signaled"])
        .args(["--duration", "0.5", "--json"])
        .output()
        .expect("nsperf runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .find(|v: &serde_json::Value| v["bench"] == "send_lat")
        .unwrap_or_else(|| panic!("no send_lat line in:\n{text}"));
    assert_eq!(line["signaled"], true, "{line}");
    assert_eq!(line["verified"], true, "{line}");
    assert!(line["ops"].as_u64().is_some_and(|n| n > 10), "{line}");
    // each round trip waited for its own SEND's completion: one per round trip, counted
    assert_eq!(line["send_completions"], line["ops"], "{line}");
    let out = std::process::Command::new(exe)
        .args(["client", "--op", "write", "--signaled", "--duration", "0.2"])
        .output()
        .expect("nsperf runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--signaled"), "the refusal names the flag: {err}");
}
