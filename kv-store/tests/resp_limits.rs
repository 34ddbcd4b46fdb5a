//! The RESP door against hostile peers (issue 43): unterminated header lines, bulk lengths and
//! commands over the limits, and more connections than `max_clients`, over real sockets
//! against a live partition. Each is refused and closed early, counted, and other clients are
//! served meanwhile.

use kv_store::resp::{RespLimits, MAX_HEADER_LINE, READ_CHUNK};
use kv_store::server::{KvServer, ServerConfig};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The tests of this file run one at a time, so one's memory is not another's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn server(limits: RespLimits) -> KvServer {
    KvServer::start(ServerConfig {
        capacity: 1024,
        data_bytes: 4 << 20,
        resp: Some("127.0.0.1:0".parse().unwrap()),
        resp_limits: limits,
        ..Default::default()
    })
    .unwrap()
}

fn connect(s: &KvServer) -> TcpStream {
    let c = TcpStream::connect(s.resp_addr().unwrap()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c
}

/// Reads until the server closes the connection (EOF or reset) or 10 s pass without a byte:
/// what arrived, and whether the server closed.
fn read_to_close(c: &mut TcpStream) -> (String, bool) {
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        match c.read(&mut b) {
            Ok(0) => return (String::from_utf8_lossy(&got).into(), true),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => {
                return (String::from_utf8_lossy(&got).into(), true)
            }
            Err(_) => return (String::from_utf8_lossy(&got).into(), false),
        }
    }
}

/// Sends `cmd` and reads one reply of `want.len()` bytes.
fn ask(c: &mut TcpStream, cmd: &[u8], want: &[u8]) {
    c.write_all(cmd).unwrap();
    let mut got = vec![0u8; want.len()];
    c.read_exact(&mut got).unwrap();
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";
const GET: &[u8] = b"*2\r\n$3\r\nGET\r\n$5\r\nhello\r\n";
const HELLO: &[u8] = b"$5\r\nworld\r\n";

/// Eight connections each send a header marker and 10 MB of digits with no CRLF (`*` and
/// `$`): each is answered with redis's protocol error and closed after a few dozen bytes,
/// before it could send its 10 MB; the server holds no more than one read of it, and a client
/// doing PING and GET meanwhile is answered promptly throughout.
#[test]
fn unterminated_headers_are_refused_and_others_are_served() {
    let _one = one_at_a_time();
    let s = server(RespLimits::default());
    let mut good = connect(&s);
    ask(
        &mut good,
        b"*3\r\n$3\r\nSET\r\n$5\r\nhello\r\n$5\r\nworld\r\n",
        b"+OK\r\n",
    );
    let before = rss_kib();
    const ATTACK: usize = 10 << 20;
    let attackers: Vec<_> = (0..8)
        .map(|i| {
            let mut c = connect(&s);
            std::thread::spawn(move || {
                let (head, err): (&[u8], &str) = if i % 2 == 0 {
                    (b"*", "-ERR Protocol error: too big mbulk count string\r\n")
                } else {
                    (b"*1\r\n$", "-ERR Protocol error: too big bulk count string\r\n")
                };
                c.write_all(head).unwrap();
                let digits = vec![b'7'; 64 << 10];
                let mut sent = 0;
                while sent < ATTACK {
                    match c.write(&digits) {
                        Ok(n) => sent += n,
                        Err(_) => break, // the server closed the connection
                    }
                }
                let (reply, closed) = read_to_close(&mut c);
                (sent, reply, closed, err)
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    let mut rounds = 0;
    let mut peak = before;
    while rounds < 20 || attackers.iter().any(|a| !a.is_finished()) {
        let t = Instant::now();
        ask(&mut good, PING, b"+PONG\r\n");
        ask(&mut good, GET, HELLO);
        slowest = slowest.max(t.elapsed());
        peak = peak.max(rss_kib());
        rounds += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    let grown = peak - before;
    for a in attackers {
        let (sent, reply, closed, err) = a.join().unwrap();
        assert_eq!(reply, err);
        assert!(closed, "the attacker's connection is still open");
        assert!(
            sent < ATTACK,
            "the server took all {sent} bytes of an unterminated header"
        );
    }
    eprintln!("slowest PING+GET during the attack: {slowest:?} ({rounds} rounds), RSS grew {grown} KiB at most");
    // honest on a loaded 2-core machine: the attack costs the server a few dozen bytes each
    assert!(slowest < Duration::from_secs(2), "{slowest:?}");
    assert!(grown < 32 << 10, "the server grew by {grown} KiB");
    let st = s.stats().resp;
    assert_eq!(st.protocol_errors, 8, "{st:?}");
    assert!(
        st.peak_query_buffer_bytes <= (READ_CHUNK + MAX_HEADER_LINE + 1) as u64,
        "{st:?}"
    );
}

/// A bulk length over the limit is refused as soon as its `$N` line arrives, the data it
/// announces not waited for; a command whose declared size passes the query-buffer limit is
/// refused at that element; a bulk at the limit is served.
#[test]
fn a_bulk_length_over_the_limit_is_refused_at_once() {
    let _one = one_at_a_time();
    let s = server(RespLimits {
        max_bulk_len: 4096,
        query_buffer_limit: 64 << 10,
        ..Default::default()
    });
    for head in [&b"*1\r\n$1000000000\r\n"[..], b"*2\r\n$3\r\nGET\r\n$4097\r\n"] {
        let mut c = connect(&s);
        c.write_all(head).unwrap();
        let t = Instant::now();
        let (reply, closed) = read_to_close(&mut c);
        assert_eq!(reply, "-ERR Protocol error: invalid bulk length\r\n", "{head:?}");
        assert!(closed && t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
    // 40 elements of 4000 bytes: 160 kB declared one element at a time; the 17th passes 64 KiB
    let mut c = connect(&s);
    c.write_all(b"*40\r\n").unwrap();
    let element: Vec<u8> = [&b"$4000\r\n"[..], &[b'x'; 4000], b"\r\n"].concat();
    for _ in 0..16 {
        c.write_all(&element).unwrap();
    }
    c.write_all(b"$4000\r\n").unwrap();
    let (reply, closed) = read_to_close(&mut c);
    assert!(
        reply.starts_with("-ERR max query buffer length reached") && reply.ends_with("65536 bytes\r\n"),
        "{reply:?}"
    );
    assert!(closed);
    // at the limit: served
    let mut c = connect(&s);
    let mut set = b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n$4096\r\n".to_vec();
    set.extend_from_slice(&[b'v'; 4096]);
    set.extend_from_slice(b"\r\n");
    ask(&mut c, &set, b"+OK\r\n");
    assert_eq!(s.get(b"big").unwrap().map(|v| v.len()), Some(4096));
    let st = s.stats().resp;
    assert_eq!((st.protocol_errors, st.refused_query_buffer), (2, 1), "{st:?}");
}

/// With `max_clients` 8, a ninth connection gets redis's max-clients error and is closed;
/// once one of the eight closes, a new client is served.
#[test]
fn connections_over_max_clients_are_refused_until_one_closes() {
    let _one = one_at_a_time();
    let s = server(RespLimits {
        max_clients: 8,
        ..Default::default()
    });
    let mut open: Vec<TcpStream> = (0..8).map(|_| connect(&s)).collect();
    for c in &mut open {
        ask(c, PING, b"+PONG\r\n");
    }
    let mut ninth = connect(&s);
    let (reply, closed) = read_to_close(&mut ninth);
    assert_eq!(reply, "-ERR max number of clients reached\r\n");
    assert!(closed);
    assert_eq!(s.stats().resp.connections, 8);
    drop(open.pop());
    // the server gives the slot back when it reads the close: soon, not at once
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut refused = 1;
    loop {
        let mut c = connect(&s);
        c.write_all(PING).unwrap();
        let mut got = [0u8; 7];
        match c.read_exact(&mut got) {
            Ok(()) if &got == b"+PONG\r\n" => {
                open.push(c);
                break;
            }
            _ => refused += 1,
        }
        assert!(Instant::now() < deadline, "no slot came free after a client closed");
        std::thread::sleep(Duration::from_millis(20));
    }
    // the others were served throughout
    for c in &mut open {
        ask(c, PING, b"+PONG\r\n");
    }
    let st = s.stats().resp;
    assert_eq!((st.refused_max_clients, st.connections), (refused, 8), "{st:?}");
    // and Prometheus sees them (the only test of this process that serves metrics)
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    netstack::telemetry::serve_prometheus(port).unwrap();
    netstack::telemetry::collect_now();
    // the exporter listens from its own thread: give it a moment
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let mut text = String::new();
        let got = TcpStream::connect(port).and_then(|mut m| {
            m.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
            m.read_to_string(&mut text)
        });
        if got.is_ok() && text.contains("flexns_kv_resp") {
            break text;
        }
        assert!(Instant::now() < deadline, "no kv-store metrics served: {got:?} {text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    for want in [
        format!("flexns_kv_resp_refused_total{{shard=\"0\",reason=\"max_clients\"}} {refused}"),
        "flexns_kv_resp_refused_total{shard=\"0\",reason=\"protocol\"} 0".into(),
        "flexns_kv_resp_connections{shard=\"0\"} 8".into(),
    ] {
        assert!(text.contains(&want), "{want} not in\n{text}");
    }
}

/// `redis-cli` shows the refusals as errors.
#[test]
fn redis_cli_shows_the_max_clients_error() {
    let _one = one_at_a_time();
    if !test_support::have("redis-cli", "--version") {
        test_support::skip(
            "kv-store RESP limits with redis-cli",
            test_support::Missing::Tool,
            "redis-cli is not installed (scripts/install-test-deps.sh installs redis-tools as root)",
        );
        return;
    }
    let s = server(RespLimits {
        max_clients: 1,
        ..Default::default()
    });
    let port = s.resp_addr().unwrap().port().to_string();
    let cli = || {
        let o = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &port, "ping"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
    };
    assert!(cli().contains("PONG"));
    let mut held = connect(&s);
    ask(&mut held, PING, b"+PONG\r\n");
    let out = cli();
    assert!(out.contains("ERR max number of clients reached"), "{out}");
}
