//! A pipelining RESP2 client for redis-server (and kv-server's RESP front door), and a
//! redis-server started as a child process for the comparison.
//!
//! The client is built to cost as little CPU as `redis-benchmark -P`: a batch's commands are
//! formatted into one reused buffer (numbers written in place, nothing allocated per argument)
//! and sent with one write; replies are parsed in place from one reused receive buffer (nothing
//! allocated per reply line; a GET's value is the only allocation, as in any client that
//! returns it). `ycsb --system redis` also runs redis-benchmark against the same server and
//! prints both rates, so the client's cost can be checked in every run.

use anyhow::{bail, Context as _, Result};
use kv_store::client::{Op, OpResult};
use kv_store::KvError;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// One connection; a batch is written at once and its replies read in order (`redis-benchmark
/// -P`).
pub struct RedisConn {
    s: TcpStream,
    out: Vec<u8>,
    /// Received bytes; `buf[at..len]` not parsed yet.
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

/// Appends `n` in decimal.
fn decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut d = [0u8; 20];
    let mut i = d.len();
    loop {
        i -= 1;
        d[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&d[i..]);
}

fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    decimal(out, args.len());
    out.extend_from_slice(b"\r\n");
    for a in args {
        out.push(b'$');
        decimal(out, a.len());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// One parsed reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// A simple string (`+OK`).
    Simple(String),
    /// An error (`-ERR ...`).
    Error(String),
    /// An integer (`:1`).
    Int(i64),
    /// A bulk string (`$`); `None` for the null bulk string.
    Bulk(Option<Vec<u8>>),
    /// An array of replies (`*`).
    Array(Vec<Reply>),
}

fn parse_int(b: &[u8]) -> Result<i64> {
    let (neg, d) = match b.first() {
        Some(b'-') => (true, &b[1..]),
        _ => (false, b),
    };
    if d.is_empty() || d.len() > 18 || !d.iter().all(u8::is_ascii_digit) {
        bail!("bad integer {:?} in a reply", String::from_utf8_lossy(b));
    }
    let v = d.iter().fold(0i64, |v, c| v * 10 + (c - b'0') as i64);
    Ok(if neg { -v } else { v })
}

impl RedisConn {
    /// Connects to the redis server at `addr`.
    pub fn connect(addr: SocketAddr) -> Result<RedisConn> {
        let s = TcpStream::connect(addr).with_context(|| format!("connecting to redis at {addr}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RedisConn {
            s,
            out: Vec::with_capacity(64 << 10),
            buf: vec![0u8; 256 << 10],
            at: 0,
            len: 0,
        })
    }

    /// Sends one command and reads its reply.
    pub fn command(&mut self, args: &[&[u8]]) -> Result<Reply> {
        self.out.clear();
        command(&mut self.out, args);
        self.s.write_all(&self.out)?;
        self.reply()
    }

    /// Makes at least `n` unparsed bytes available (reading more, moving the rest to the front
    /// or growing the buffer as needed).
    fn fill(&mut self, n: usize) -> Result<()> {
        while self.len - self.at < n {
            if self.at > 0 && self.buf.len() - self.at < n.max(4096) {
                self.buf.copy_within(self.at..self.len, 0);
                self.len -= self.at;
                self.at = 0;
            }
            if self.buf.len() - self.len < n.max(4096) {
                let grow = (self.at + n).max(self.buf.len() * 2);
                self.buf.resize(grow, 0);
            }
            let k = self.s.read(&mut self.buf[self.len..])?;
            if k == 0 {
                bail!("redis closed the connection");
            }
            self.len += k;
        }
        Ok(())
    }

    /// The next line (without CRLF) as a range of the buffer, consumed.
    fn line(&mut self) -> Result<std::ops::Range<usize>> {
        let mut scanned = 0;
        loop {
            let hay = &self.buf[self.at + scanned..self.len];
            if let Some(p) = hay.windows(2).position(|w| w == b"\r\n") {
                let r = self.at..self.at + scanned + p;
                self.at = r.end + 2;
                return Ok(r);
            }
            scanned = (self.len - self.at).saturating_sub(1);
            self.fill(self.len - self.at + 1)?;
        }
    }

    /// Reads one reply.
    pub fn reply(&mut self) -> Result<Reply> {
        let l = self.line()?;
        if l.is_empty() {
            bail!("an empty reply line");
        }
        let (t, rest) = (self.buf[l.start], l.start + 1..l.end);
        let text = |c: &RedisConn| String::from_utf8_lossy(&c.buf[rest.clone()]).into_owned();
        Ok(match t {
            b'+' => Reply::Simple(text(self)),
            b'-' => Reply::Error(text(self)),
            b':' => Reply::Int(parse_int(&self.buf[rest])?),
            b'$' => {
                let n = parse_int(&self.buf[rest])?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let n = n as usize;
                    self.fill(n + 2)?;
                    let v = self.buf[self.at..self.at + n].to_vec();
                    self.at += n + 2;
                    Reply::Bulk(Some(v))
                }
            }
            b'*' => {
                let n = parse_int(&self.buf[rest])?;
                let mut v = Vec::new();
                for _ in 0..n.max(0) {
                    v.push(self.reply()?);
                }
                Reply::Array(v)
            }
            _ => bail!("unexpected reply line {:?}", text(self)),
        })
    }

    /// Runs a batch pipelined: GET, SET (put/insert/update), DEL.
    pub fn execute(&mut self, ops: Vec<Op>) -> Vec<OpResult> {
        self.out.clear();
        for op in &ops {
            match op {
                Op::Get(k) => command(&mut self.out, &[b"GET", k]),
                Op::Put(k, v) | Op::Insert(k, v) | Op::Update(k, v) => command(&mut self.out, &[b"SET", k, v]),
                Op::Delete(k) => command(&mut self.out, &[b"DEL", k]),
            }
        }
        if let Err(e) = self.s.write_all(&self.out) {
            return ops
                .iter()
                .map(|_| Err(KvError::Io(std::io::Error::other(e.to_string()))))
                .collect();
        }
        ops.iter()
            .map(|op| match self.reply() {
                Ok(Reply::Bulk(v)) => Ok(v),
                Ok(Reply::Simple(_)) => Ok(None),
                Ok(Reply::Int(0)) if matches!(op, Op::Delete(_)) => Err(KvError::NotFound),
                Ok(Reply::Int(_)) => Ok(None),
                Ok(Reply::Error(e)) => Err(KvError::Server(e)),
                Ok(r) => Err(KvError::Protocol(format!("unexpected reply {r:?}"))),
                Err(e) => Err(KvError::Protocol(e.to_string())),
            })
            .collect()
    }
}

/// A redis-server child process (persistence off, like the research anchors), stopped on drop.
pub struct RedisServer {
    /// The child process.
    pub server: crate::bench::ChildServer,
    /// The address it serves on.
    pub addr: SocketAddr,
}

impl RedisServer {
    /// Starts `redis-server` on a free port of 127.0.0.1 and waits until it answers PING.
    pub fn start() -> Result<RedisServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let exe = which("redis-server").context(
            "redis-server is not installed (apt-get install redis-server; scripts/install-test-deps.sh does it)",
        )?;
        let args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let server = crate::bench::ChildServer::start(&exe, &args)?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = RedisConn::connect(addr) {
                if c.command(&[b"PING"]).is_ok() {
                    break;
                }
            }
            if Instant::now() > until {
                bail!("redis-server on {addr} did not answer PING within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(RedisServer { server, addr })
    }
}

/// The path of an executable on PATH.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake server that answers any request with `reply`, written in small pieces.
    fn fake(reply: &'static [u8]) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = [0u8; 4096];
            let _ = s.read(&mut b);
            for c in reply.chunks(3) {
                s.write_all(c).unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        a
    }

    #[test]
    fn replies_split_across_reads_parse_in_order() {
        let a = fake(b"$5\r\nhello\r\n$-1\r\n+OK\r\n:0\r\n-ERR no\r\n$0\r\n\r\n");
        let mut c = RedisConn::connect(a).unwrap();
        let k = b"k".to_vec();
        let r = c.execute(vec![
            Op::Get(k.clone()),
            Op::Get(k.clone()),
            Op::Put(k.clone(), b"v".to_vec()),
            Op::Delete(k.clone()),
            Op::Get(k.clone()),
            Op::Get(k),
        ]);
        assert_eq!(r[0].as_ref().unwrap().as_deref(), Some(&b"hello"[..]));
        assert_eq!(r[1].as_ref().unwrap(), &None);
        assert_eq!(r[2].as_ref().unwrap(), &None);
        assert!(matches!(r[3], Err(KvError::NotFound)));
        assert!(matches!(&r[4], Err(KvError::Server(m)) if m == "ERR no"));
        assert_eq!(r[5].as_ref().unwrap().as_deref(), Some(&b""[..]));
    }

    #[test]
    fn commands_are_formatted_as_resp() {
        let mut out = Vec::new();
        command(&mut out, &[b"SET", b"key", &[7u8; 12]]);
        let mut want = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$12\r\n".to_vec();
        want.extend_from_slice(&[7u8; 12]);
        want.extend_from_slice(b"\r\n");
        assert_eq!(out, want);
        assert!(parse_int(b"12x").is_err() && parse_int(b"").is_err());
        assert_eq!(parse_int(b"-1").unwrap(), -1);
    }
}
