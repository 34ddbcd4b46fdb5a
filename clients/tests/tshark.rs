//! tshark decodes packets captured from a real run on the loopback interface as InfiniBand,
//! with the opcode, QPN, PSN, VA, rkey and length the stack put there, and nothing malformed;
//! scapy independently recomputes every ICRC. Needs root (capture) and tshark; `.ci/run`
//! installs both tools and CI runs as root.

use netstack::verbs::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn skip(why: &str) -> bool {
    let missing = if why.contains("root") {
        test_support::Missing::Root
    } else {
        test_support::Missing::Tool
    };
    test_support::skip("tshark wire format", missing, why);
    true
}

fn parse_num(s: &str) -> u64 {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap_or(u64::MAX),
        None => s.parse().unwrap_or(u64::MAX),
    }
}

#[test]
fn tshark_decodes_our_packets_as_infiniband() {
    if !test_support::is_root() && skip("not root (capturing on lo needs root)") {
        return;
    }
    if !have("tshark", "--version") && skip("tshark is not installed (.ci/run installs it)") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("flexns-tshark-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cap = dir.join("cap.pcapng");
    let mut ts = Command::new("tshark")
        .args(["-i", "lo", "-f", "udp port 4791", "-w"])
        .arg(&cap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tshark starts");
    let mut err = BufReader::new(ts.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "tshark exited before capturing");
        if line.contains("Capture started") {
            break;
        }
        if line.contains("Capturing on") {
            // some versions print no "Capture started": give dumpcap a moment
            std::thread::sleep(Duration::from_millis(1500));
            break;
        }
    }
    std::thread::spawn(move || {
        let mut s = String::new();
        while err.read_line(&mut s).is_ok_and(|n| n > 0) {
            s.clear();
        }
    });

    // two nodes on the RoCEv2 port, on two loopback addresses
    // GSO/GRO off: a capture on lo sees GSO super-datagrams before segmentation, which no real
    // wire carries (a NIC or the kernel segments them first)
    let open = |ip: &str| {
        let bind = format!("{ip}:4791").parse().unwrap();
        Context::open(ContextConfig {
            bind,
            gso: false,
            gro: false,
            ..Default::default()
        })
        .unwrap()
    };
    let (ca, cb) = (open("127.0.0.1"), open("127.0.0.2"));
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (qa_cq, qb_cq) = (ca.create_cq(64).unwrap(), cb.create_cq(64).unwrap());
    let qa = ca.create_qp(&pa, &qa_cq, &qa_cq, QpInitAttr::default()).unwrap();
    let qb = cb.create_qp(&pb, &qb_cq, &qb_cq, QpInitAttr::default()).unwrap();
    let (ea, eb) = (qa.local_endpoint(), qb.local_endpoint());
    qa.connect(&eb).unwrap();
    qb.connect(&ea).unwrap();
    let ma = pa.reg_mr(1 << 16, Access::ALL).unwrap();
    let mb = pb.reg_mr(1 << 16, Access::ALL).unwrap();
    ma.write(0, &[0x42; 20_000]);
    qb.post_recv(RecvWr {
        wr_id: 1,
        sg_list: [mb.sge(40_000, 100)].into_iter().collect(),
    })
    .unwrap();
    qb.post_recv(RecvWr {
        wr_id: 2,
        sg_list: Default::default(),
    })
    .unwrap();
    let wrs = vec![
        SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(ma.sge(0, 10_000))
            .remote(mb.addr(), mb.rkey()),
        SendWr::new(2, WrOpcode::RdmaRead)
            .sge(ma.sge(20_000, 100))
            .remote(mb.addr() + 64, mb.rkey()),
        SendWr::new(3, WrOpcode::Send).sge(ma.sge(0, 50)),
        SendWr::new(4, WrOpcode::RdmaWriteWithImm)
            .sge(ma.sge(0, 10))
            .remote(mb.addr() + 30_000, mb.rkey())
            .imm(7),
        SendWr::new(5, WrOpcode::AtomicCmpAndSwp)
            .sge(ma.sge(30_000, 8))
            .remote(mb.addr() + 32_768, mb.rkey())
            .atomic(0, 1),
        SendWr::new(6, WrOpcode::AtomicFetchAndAdd)
            .sge(ma.sge(30_008, 8))
            .remote(mb.addr() + 32_768, mb.rkey())
            .atomic(5, 0),
    ];
    for wr in wrs {
        qa.post_send(wr).unwrap();
        let wc = qa_cq.next(Duration::from_secs(10)).unwrap();
        assert_eq!(wc.status, WcStatus::Success);
    }
    std::thread::sleep(Duration::from_millis(500));
    clients::procs::signal(ts.id(), libc::SIGINT);
    ts.wait().unwrap();

    let out = Command::new("tshark")
        .arg("-r")
        .arg(&cap)
        .args([
            "--disable-heuristic",
            "rpcrdma_infiniband",
            "-T",
            "fields",
            "-E",
            "separator=;",
        ])
        .args([
            "-e",
            "ip.src",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "infiniband.bth.psn",
        ])
        .args([
            "-e",
            "infiniband.reth.va",
            "-e",
            "infiniband.reth.r_key",
            "-e",
            "infiniband.reth.dmalen",
            "-e",
            "_ws.malformed",
        ])
        .args(["-e", "ip.dsfield.ecn"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tshark -r failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(';').collect()).collect();
    eprintln!("{text}");
    assert!(rows.len() >= 12, "expected at least 12 packets, got {}", rows.len());
    for r in &rows {
        assert_eq!(r.len(), 9, "row {r:?}");
        assert_eq!(parse_num(r[8]), 2, "packets are sent ECN-capable, ECT(0): {r:?}");
        assert!(r[7].is_empty(), "tshark reports a malformed packet: {r:?}");
        assert!(!r[1].is_empty(), "not decoded as InfiniBand: {r:?}");
    }
    let from_a: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == "127.0.0.1").collect();
    let op = |r: &Vec<&str>| parse_num(r[1]);
    // requests from A, in order: WRITE FIRST/MIDDLE/LAST, READ, SEND ONLY, WRITE ONLY IMM, CAS, FETCH_ADD
    // peer address validation: each side challenges the other (PROBE 0x84 with the challenge
    // bit in its PSN field, answered by PROBE_REPLY 0x85 echoing it), decoded and well-formed
    for side in ["127.0.0.1", "127.0.0.2"] {
        let of = |o: u64| {
            rows.iter()
                .filter(|r| r[0] == side && op(r) == o && parse_num(r[3]) & 0x80_0000 != 0)
                .count()
        };
        assert!(
            of(0x84) >= 1 && of(0x85) >= 1,
            "{side}: no challenge or no answer in {rows:?}"
        );
    }
    let reqs: Vec<&&Vec<&str>> = from_a.iter().filter(|r| !matches!(op(r), 0x11 | 0x84 | 0x85)).collect();
    let ops: Vec<u64> = reqs.iter().map(|r| op(r)).collect();
    assert_eq!(ops, vec![0x06, 0x07, 0x08, 0x0C, 0x04, 0x0B, 0x13, 0x14], "{reqs:?}");
    for r in &reqs {
        assert_eq!(parse_num(r[2]), eb.qpn as u64, "dest QP of {r:?}");
    }
    // PSNs: the WRITE takes 3, READ of 100 B one, then one each
    let psns: Vec<u64> = reqs.iter().map(|r| parse_num(r[3])).collect();
    let p0 = ea.psn as u64;
    assert_eq!(psns, (0..8).map(|i| (p0 + i) & 0xFF_FFFF).collect::<Vec<_>>());
    let first = reqs[0];
    assert_eq!(parse_num(first[4]), mb.addr(), "RETH VA");
    assert_eq!(parse_num(first[5]), mb.rkey() as u64, "RETH rkey");
    assert_eq!(parse_num(first[6]), 10_000, "RETH length");
    assert_eq!(parse_num(reqs[3][4]), mb.addr() + 64);
    assert_eq!(parse_num(reqs[3][6]), 100);
    // responses from B: an ACK, the READ response and the atomic ACKs are there
    let resp_ops: Vec<u64> = rows.iter().filter(|r| r[0] == "127.0.0.2").map(op).collect();
    for want in [0x11, 0x10, 0x12] {
        assert!(resp_ops.contains(&want), "no response opcode {want:#x} in {resp_ops:?}");
    }

    // independent ICRC check
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/icrc_check.py");
    match Command::new("python3").arg(script).arg(&cap).output() {
        Ok(o) if o.status.success() => eprintln!("{}", String::from_utf8_lossy(&o.stdout)),
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("No module named 'scapy'") => {
            skip("scapy is not installed (.ci/run installs it), ICRC not cross-checked");
        }
        Ok(o) => panic!(
            "ICRC check failed:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("cannot run python3: {e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
