//! A pipelining RESP2 client for redis-server (and kv-server's RESP front door), and a
//! redis-server started as a child process for the comparison.

use anyhow::{bail, Context as _, Result};
use kv_store::client::{Op, OpResult};
use kv_store::KvError;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// One connection; a batch is written at once and its replies read in order (`redis-benchmark
/// -P`).
pub struct RedisConn {
    w: TcpStream,
    r: BufReader<TcpStream>,
    out: Vec<u8>,
}

fn arg(out: &mut Vec<u8>, a: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
    out.extend_from_slice(a);
    out.extend_from_slice(b"\r\n");
}

/// One parsed reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

impl RedisConn {
    pub fn connect(addr: SocketAddr) -> Result<RedisConn> {
        let s = TcpStream::connect(addr).with_context(|| format!("connecting to redis at {addr}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RedisConn {
            r: BufReader::new(s.try_clone()?),
            w: s,
            out: Vec::new(),
        })
    }

    /// Sends one command and reads its reply.
    pub fn command(&mut self, args: &[&[u8]]) -> Result<Reply> {
        self.out.clear();
        self.out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            arg(&mut self.out, a);
        }
        self.w.write_all(&self.out)?;
        self.reply()
    }

    fn line(&mut self) -> Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            bail!("redis closed the connection");
        }
        Ok(l.trim_end_matches(['\r', '\n']).to_string())
    }

    /// Reads one reply.
    pub fn reply(&mut self) -> Result<Reply> {
        let l = self.line()?;
        let (t, rest) = l.split_at(1.min(l.len()));
        Ok(match t {
            "+" => Reply::Simple(rest.into()),
            "-" => Reply::Error(rest.into()),
            ":" => Reply::Int(rest.parse().context("integer reply")?),
            "$" => {
                let n: i64 = rest.parse().context("bulk length")?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut b = vec![0u8; n as usize + 2];
                    self.r.read_exact(&mut b)?;
                    b.truncate(n as usize);
                    Reply::Bulk(Some(b))
                }
            }
            "*" => {
                let n: i64 = rest.parse().context("array length")?;
                let mut v = Vec::new();
                for _ in 0..n.max(0) {
                    v.push(self.reply()?);
                }
                Reply::Array(v)
            }
            _ => bail!("unexpected reply line {l:?}"),
        })
    }

    /// Runs a batch pipelined: GET, SET (put/insert/update), DEL.
    pub fn execute(&mut self, ops: Vec<Op>) -> Vec<OpResult> {
        self.out.clear();
        for op in &ops {
            let args: Vec<&[u8]> = match op {
                Op::Get(k) => vec![b"GET", k],
                Op::Put(k, v) | Op::Insert(k, v) | Op::Update(k, v) => vec![b"SET", k, v],
                Op::Delete(k) => vec![b"DEL", k],
            };
            self.out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for a in args {
                arg(&mut self.out, a);
            }
        }
        if let Err(e) = self.w.write_all(&self.out) {
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
    pub server: crate::bench::ChildServer,
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
