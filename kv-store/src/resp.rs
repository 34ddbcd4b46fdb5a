//! The RESP (redis serialization protocol, RESP2) front door of a partition, so `redis-cli`
//! and `redis-benchmark` work against kv-server: GET, SET, DEL, PING, CONFIG GET, QUIT;
//! anything else gets an error reply and the connection keeps serving. Pipelined commands are
//! answered in one write.
//!
//! One client cannot exhaust the server's memory: a command is at most [`MAX_COMMAND`] bytes,
//! and replies are written in batches of at most [`MAX_REPLY_BATCH`] bytes (plus one reply);
//! the rest of a pipeline waits in the client's socket until the batch is written, so a client
//! that sends without reading fills its own buffers and stalls itself.

use crate::KvError;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Longest bulk string accepted (a value of the largest entry, with room for the key).
const MAX_BULK: usize = crate::layout::MAX_VALUE + 1024;
/// Most elements in one command.
const MAX_ARGS: usize = 1024;
/// Longest command (all its elements): one value's bulk string and many keys.
pub const MAX_COMMAND: usize = 2 * MAX_BULK + MAX_ARGS * (crate::layout::MAX_KEY + 16);
/// Reply bytes gathered before they are written (and no more commands run until they are).
pub const MAX_REPLY_BATCH: usize = 1 << 20;

/// What parsing a buffer gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A command (its arguments) and the bytes it used.
    Command(Vec<Vec<u8>>, usize),
    /// More bytes needed.
    Incomplete,
    /// A protocol error: reply with it and close (the stream cannot be resynchronized).
    Error(String),
}

fn line(b: &[u8]) -> Option<(&[u8], usize)> {
    let p = b.windows(2).position(|w| w == b"\r\n")?;
    Some((&b[..p], p + 2))
}

fn number(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Parses one command from the front of `b`: a RESP array of bulk strings, or an inline
/// command (words separated by spaces, as typed into telnet).
pub fn parse(b: &[u8]) -> Parsed {
    if b.is_empty() {
        return Parsed::Incomplete;
    }
    if b[0] != b'*' {
        let Some((l, used)) = line(b) else {
            return if b.len() > MAX_BULK {
                Parsed::Error("inline command too long".into())
            } else {
                Parsed::Incomplete
            };
        };
        let args: Vec<Vec<u8>> = l
            .split(|&c| c == b' ')
            .filter(|w| !w.is_empty())
            .map(|w| w.to_vec())
            .collect();
        return Parsed::Command(args, used);
    }
    let Some((l, mut at)) = line(b) else {
        return Parsed::Incomplete;
    };
    let n = match number(&l[1..]) {
        Some(n) if (0..=MAX_ARGS as i64).contains(&n) => n as usize,
        _ => {
            return Parsed::Error(format!(
                "invalid multibulk length {:?}",
                String::from_utf8_lossy(&l[1..])
            ))
        }
    };
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        let Some((l, used)) = line(&b[at..]) else {
            return Parsed::Incomplete;
        };
        if l.first() != Some(&b'$') {
            return Parsed::Error(format!("expected '$', got {:?}", String::from_utf8_lossy(l)));
        }
        let len = match number(&l[1..]) {
            Some(n) if (0..=MAX_BULK as i64).contains(&n) => n as usize,
            _ => return Parsed::Error("invalid bulk length".into()),
        };
        at += used;
        if at + len > MAX_COMMAND {
            return Parsed::Error(format!("command longer than {MAX_COMMAND} bytes"));
        }
        if b.len() < at + len + 2 {
            return Parsed::Incomplete;
        }
        if &b[at + len..at + len + 2] != b"\r\n" {
            return Parsed::Error("bulk string not terminated by CRLF".into());
        }
        args.push(b[at..at + len].to_vec());
        at += len + 2;
    }
    Parsed::Command(args, at)
}

fn bulk(out: &mut Vec<u8>, v: &[u8]) {
    out.extend_from_slice(format!("${}\r\n", v.len()).as_bytes());
    out.extend_from_slice(v);
    out.extend_from_slice(b"\r\n");
}

fn error(out: &mut Vec<u8>, msg: &str) {
    out.extend_from_slice(b"-");
    out.extend_from_slice(msg.replace(['\r', '\n'], " ").as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// What the RESP door needs of the partition it serves (the server's state implements it).
pub(crate) trait Partition: Send + Sync + 'static {
    /// The value of `key`, if this partition holds it.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError>;
    /// Stores `value` under `key` (a key of another partition is an error).
    fn set(&self, key: &[u8], value: &[u8]) -> Result<(), KvError>;
    /// Deletes `key`; whether it existed.
    fn delete(&self, key: &[u8]) -> Result<bool, KvError>;
    /// Held while a batch of commands runs (the partition's application-thread gate).
    fn gate(&self) -> parking_lot::MutexGuard<'_, ()>;
    /// Counts one RESP command.
    fn count_request(&self);
}

/// Executes one command against the partition; returns false when the client asked to quit.
fn execute(inner: &impl Partition, args: &[Vec<u8>], out: &mut Vec<u8>) -> bool {
    let Some(cmd) = args.first() else {
        return true; // an empty inline line
    };
    let cmd = String::from_utf8_lossy(cmd).to_ascii_uppercase();
    let kv_err = |out: &mut Vec<u8>, e: KvError| error(out, &format!("ERR {e}"));
    match (cmd.as_str(), args.len()) {
        ("PING", 1) => out.extend_from_slice(b"+PONG\r\n"),
        ("PING", 2) => bulk(out, &args[1]),
        ("QUIT", _) => {
            out.extend_from_slice(b"+OK\r\n");
            return false;
        }
        ("GET", 2) => match inner.get(&args[1]) {
            Ok(Some(v)) => bulk(out, &v),
            Ok(None) => out.extend_from_slice(b"$-1\r\n"),
            Err(e) => kv_err(out, e),
        },
        ("SET", 3) => match inner.set(&args[1], &args[2]) {
            Ok(_) => out.extend_from_slice(b"+OK\r\n"),
            Err(e) => kv_err(out, e),
        },
        ("SET", _) if args.len() > 3 => error(out, "ERR SET options (EX, PX, NX, XX, ...) are not supported"),
        ("DEL", n) if n >= 2 => {
            let mut deleted = 0;
            for k in &args[1..] {
                match inner.delete(k) {
                    Ok(true) => deleted += 1,
                    Ok(false) => {}
                    Err(e) => {
                        kv_err(out, e);
                        return true;
                    }
                }
            }
            out.extend_from_slice(format!(":{deleted}\r\n").as_bytes());
        }
        ("CONFIG", 3) if args[1].eq_ignore_ascii_case(b"GET") => {
            // what redis-benchmark asks for; persistence is not a RESP-visible setting here
            let p = String::from_utf8_lossy(&args[2]).to_ascii_lowercase();
            let v: Option<&[u8]> = match p.as_str() {
                "save" => Some(b""),
                "appendonly" => Some(b"no"),
                _ => None,
            };
            match v {
                Some(v) => {
                    out.extend_from_slice(b"*2\r\n");
                    bulk(out, p.as_bytes());
                    bulk(out, v);
                }
                None => out.extend_from_slice(b"*0\r\n"),
            }
        }
        ("GET" | "SET" | "DEL" | "PING" | "CONFIG", _) => error(
            out,
            &format!("ERR wrong number of arguments for '{}' command", cmd.to_lowercase()),
        ),
        _ => error(
            out,
            &format!(
                "ERR unknown command '{}' (kv-server speaks GET, SET, DEL, PING, CONFIG GET, QUIT)",
                String::from_utf8_lossy(&args[0])
            ),
        ),
    }
    true
}

async fn connection(mut s: tokio::net::TcpStream, inner: Arc<impl Partition>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut out = Vec::with_capacity(16 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    // whether complete commands may still be waiting in `buf` (then they run before the next
    // read)
    let mut pending = false;
    loop {
        if !pending {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        pending = false;
        let mut at = 0;
        let mut open = true;
        {
            let _gate = inner.gate();
            while open {
                if out.len() >= MAX_REPLY_BATCH {
                    pending = true;
                    break;
                }
                match parse(&buf[at..]) {
                    Parsed::Command(args, used) => {
                        at += used;
                        inner.count_request();
                        open = execute(&*inner, &args, &mut out);
                    }
                    Parsed::Incomplete => break,
                    Parsed::Error(e) => {
                        error(&mut out, &format!("ERR Protocol error: {e}"));
                        open = false;
                    }
                }
            }
        }
        buf.drain(..at);
        if !out.is_empty() {
            s.write_all(&out).await?;
            out.clear();
        }
        if !open {
            return Ok(());
        }
    }
}

/// Serves RESP clients on `l` until the runtime stops.
pub(crate) async fn serve(l: tokio::net::TcpListener, inner: Arc<impl Partition>) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let inner = inner.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(s, inner).await {
                        tracing::debug!("RESP connection ended: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("RESP accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_arrays_inline_and_partial_input() {
        let b = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\nvv\r\n*1\r\n$4\r\nPING\r\n";
        let Parsed::Command(a, n) = parse(b) else { panic!() };
        assert_eq!(a, vec![b"SET".to_vec(), b"k".to_vec(), b"vv".to_vec()]);
        assert_eq!(parse(&b[n..]), Parsed::Command(vec![b"PING".to_vec()], b.len() - n));
        for cut in 1..n {
            assert_eq!(parse(&b[..cut]), Parsed::Incomplete, "cut {cut}");
        }
        assert_eq!(
            parse(b"get  k\r\n"),
            Parsed::Command(vec![b"get".to_vec(), b"k".to_vec()], 8)
        );
        assert!(matches!(parse(b"*x\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n+3\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n$-5\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n$1\r\nab\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*99999999\r\n"), Parsed::Error(_)));
    }
}
