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
