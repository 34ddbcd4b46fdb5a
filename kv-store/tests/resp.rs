//! The RESP front door with the real `redis-cli` (redis-tools): SET, GET, DEL, PING, errors,
//! and the server keeps serving after bad input.

use kv_store::server::{KvServer, ServerConfig};
use std::io::{Read, Write};
use std::process::Command;

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("running redis-cli");
    assert!(
        out.status.success(),
        "redis-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn redis_cli_round_trip() {
    if Command::new("redis-cli").arg("--version").output().is_err() {
        test_support::skip(
            "kv-store RESP with redis-cli",
            test_support::Missing::Tool,
            "redis-cli is not installed (scripts/install-test-deps.sh installs redis-tools as root)",
        );
        return;
    }
    let s = KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 1 << 20,
        resp: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    })
    .unwrap();
    let port = s.resp_addr().unwrap().port();
    assert_eq!(redis_cli(port, &["ping"]), "PONG");
    assert_eq!(redis_cli(port, &["set", "greeting", "hello flexns"]), "OK");
    assert_eq!(redis_cli(port, &["get", "greeting"]), "hello flexns");
    assert_eq!(redis_cli(port, &["get", "absent"]), "");
    assert_eq!(redis_cli(port, &["del", "greeting", "absent"]), "1");
    assert_eq!(redis_cli(port, &["get", "greeting"]), "");
    assert!(redis_cli(port, &["hset", "h", "f", "v"]).contains("unknown command"));
    assert!(redis_cli(port, &["get"]).contains("wrong number of arguments"));
    assert!(redis_cli(port, &["set", "k", "v", "EX", "10"]).contains("not supported"));
    assert_eq!(redis_cli(port, &["config", "get", "save"]), "save");
    // a key over the limit is an error, not a crash
    let long = "k".repeat(300);
    assert!(redis_cli(port, &["set", &long, "v"]).contains("ERR"));
    // a protocol error closes that connection only
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.write_all(b"*1\r\n$x\r\n").unwrap();
    let mut reply = String::new();
    raw.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("-ERR Protocol error"), "{reply:?}");
    assert_eq!(redis_cli(port, &["ping"]), "PONG");
    // redis-benchmark (CONFIG GET first, then pipelined SETs and GETs of 16-byte keys)
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args([
            "-t", "set,get", "-n", "2000", "-r", "1000", "-d", "64", "-c", "4", "-P", "8", "-q", "--csv",
        ])
        .output()
        .expect("running redis-benchmark");
    let csv = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "redis-benchmark: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(csv.contains("\"SET\"") && csv.contains("\"GET\""), "{csv}");
    // the value written through RESP is the one the stack serves
    assert_eq!(redis_cli(port, &["set", "shared", "v1"]), "OK");
    let ctx = netstack::verbs::Context::open(Default::default()).unwrap();
    let mut c = kv_store::client::KvClient::connect(
        &ctx,
        kv_store::client::ClientConfig {
            servers: vec![s.cm_addr()],
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(c.get(b"shared").unwrap().as_deref(), Some(&b"v1"[..]));
    assert!(s.stats().resp_requests >= 10);
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// A client that pipelines far more replies than it reads is answered a batch at a time: the
/// server's memory stays bounded, another client is served meanwhile, and once the first one
/// reads, every reply arrives.
#[test]
fn a_pipelining_client_that_does_not_read_stalls_only_itself() {
    let s = KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 4 << 20,
        resp: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    })
    .unwrap();
    let port = s.resp_addr().unwrap().port();
    let value = vec![b'v'; 60_000];
    let mut a = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut set = format!("*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n${}\r\n", value.len()).into_bytes();
    set.extend_from_slice(&value);
    set.extend_from_slice(b"\r\n");
    a.write_all(&set).unwrap();
    let mut ok = [0u8; 5];
    a.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n");
    let before = rss_kib();
    // 20,800 GETs of a 60 KB value: 1.2 GB of replies, none read yet
    const N: usize = 20_800;
    const BATCH: usize = 2_600; // 62 KB of commands: one read of the server's
    let get = b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n";
    let mut w = a.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let batch: Vec<u8> = get.iter().copied().cycle().take(get.len() * BATCH).collect();
        for _ in 0..N / BATCH {
            if w.write_all(&batch).is_err() {
                break;
            }
        }
    });
    std::thread::sleep(std::time::Duration::from_secs(2));
    let grown = rss_kib().saturating_sub(before);
    assert!(
        grown < 16 << 10,
        "the server grew by {grown} KiB for one client's unread replies"
    );
    // another client is served meanwhile
    let t = std::time::Instant::now();
    let mut b = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    b.write_all(b"*1\r\n$4\r\nPING\r\n").unwrap();
    let mut pong = [0u8; 7];
    b.read_exact(&mut pong).unwrap();
    assert_eq!(&pong, b"+PONG\r\n");
    assert!(t.elapsed() < std::time::Duration::from_secs(2), "{:?}", t.elapsed());
    // the first client reads: every reply arrives
    let one = format!("${}\r\n", value.len()).len() + value.len() + 2;
    let mut left = N * one;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let n = a.read(&mut buf[..left.min(1 << 20)]).unwrap();
        assert!(n > 0, "the connection closed with {left} bytes of replies missing");
        left -= n;
    }
    writer.join().unwrap();
}
