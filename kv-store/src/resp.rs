//! The RESP (redis serialization protocol, RESP2) front door of a partition, so `redis-cli`
//! and `redis-benchmark` work against kv-server: GET, SET, DEL, PING, CONFIG GET, QUIT;
//! anything else gets an error reply and the connection keeps serving. Pipelined commands are
//! answered in one write.
//!
//! A hostile or broken client cannot exhaust the server (redis's own rules, [`RespLimits`]):
//! - at most [`RespLimits::max_clients`] connections (redis `maxclients`); one more gets
//!   `-ERR max number of clients reached` and is closed;
//! - a `*N` or `$N` header line is at most [`MAX_HEADER_LINE`] bytes, an inline command at
//!   most [`MAX_INLINE`], a command at most [`RespLimits::max_multibulk_len`] elements of at
//!   most [`RespLimits::max_bulk_len`] bytes each: anything longer is a protocol error, refused
//!   as soon as its header says so (a declared `$1000000000` is not waited for);
//! - a connection buffers at most [`RespLimits::query_buffer_limit`] bytes of one command
//!   (redis `client-query-buffer-limit`), plus one read of [`READ_CHUNK`]: a command declared
//!   or buffered beyond it gets `-ERR max query buffer length reached ...` and the connection
//!   is closed;
//! - the parser keeps its place across reads ([`Parser`]), so a command arriving a byte at a
//!   time costs time linear in its length, not quadratic;
//! - replies are written in batches of at most [`MAX_REPLY_BATCH`] bytes (plus one reply); the
//!   rest of a pipeline waits in the client's socket until the batch is written, so a client
//!   that sends without reading fills its own buffers and stalls itself;
//! - an idle connection holds no buffers.
//!
//! Refusals are counted ([`RespStats`], the `flexns_kv_resp_*` metrics).

use crate::KvError;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Longest bulk string accepted (a value of the largest entry, with room for the key).
pub const MAX_BULK: usize = crate::layout::MAX_VALUE + 1024;
/// Longest `*N` or `$N` header line (the bytes between the marker and CRLF); redis's numbers
/// fit in 20.
pub const MAX_HEADER_LINE: usize = 32;
/// Longest inline command (redis's `PROTO_INLINE_MAX_SIZE`).
pub const MAX_INLINE: usize = 64 * 1024;
/// The largest command of the default limits: a SET of the largest value, or a DEL of
/// the most keys.
pub const MAX_COMMAND: usize = 2 * MAX_BULK + 1024 * (crate::layout::MAX_KEY + 16);
/// Reply bytes gathered before they are written (and no more commands run until they are).
pub const MAX_REPLY_BATCH: usize = 1 << 20;
/// Bytes asked of the socket per read (redis's `PROTO_IOBUF_LEN`).
pub const READ_CHUNK: usize = 16 * 1024;

/// The limits of the RESP door (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RespLimits {
    /// Most RESP connections at once (redis `maxclients`).
    pub max_clients: usize,
    /// Most bytes of one command a connection buffers (redis `client-query-buffer-limit`).
    pub query_buffer_limit: usize,
    /// Longest bulk string (redis `proto-max-bulk-len`), at most [`MAX_BULK`].
    pub max_bulk_len: usize,
    /// Most elements of one command (redis allows 1024 × 1024).
    pub max_multibulk_len: usize,
}

impl Default for RespLimits {
    fn default() -> Self {
        RespLimits {
            max_clients: 1024,
            query_buffer_limit: 512 * 1024,
            max_bulk_len: MAX_BULK,
            max_multibulk_len: 1024,
        }
    }
}

/// The smallest query-buffer limit (a few commands' worth).
pub const MIN_QUERY_BUFFER: usize = 1024;
/// The largest query-buffer limit (redis's default).
pub const MAX_QUERY_BUFFER: usize = 1 << 30;
/// The largest multibulk length (redis's).
pub const MAX_MULTIBULK: usize = 1024 * 1024;

impl RespLimits {
    /// Checks every limit; the error names the field and its allowed range.
    pub fn check(&self) -> Result<(), String> {
        let range = |field: &str, v: usize, lo: usize, hi: usize| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{field} {v} is out of range: {lo} to {hi}"))
            }
        };
        range("resp max_clients", self.max_clients, 1, 1_000_000)?;
        range(
            "resp query_buffer_limit",
            self.query_buffer_limit,
            MIN_QUERY_BUFFER,
            MAX_QUERY_BUFFER,
        )?;
        range("resp max_bulk_len", self.max_bulk_len, 1, MAX_BULK)?;
        range("resp max_multibulk_len", self.max_multibulk_len, 1, MAX_MULTIBULK)
    }

    fn parse_limits(&self) -> ParseLimits {
        ParseLimits {
            max_multibulk: self.max_multibulk_len,
            max_bulk: self.max_bulk_len,
            max_command: self.query_buffer_limit,
        }
    }
}

/// What one parser enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Most elements of one command.
    pub max_multibulk: usize,
    /// Longest bulk string.
    pub max_bulk: usize,
    /// Most bytes of one command, buffered or declared (the query-buffer limit).
    pub max_command: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        RespLimits::default().parse_limits()
    }
}

/// What parsing a buffer gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A command (its arguments) and the bytes it used.
    Command(Vec<Vec<u8>>, usize),
    /// More bytes needed.
    Incomplete,
    /// A protocol error: reply with it and close (the stream cannot be resynchronized).
    Error(String),
    /// The command is (or is declared) larger than the query-buffer limit: reply and close.
    OverLimit(String),
}

/// Where a parser is in the command at the front of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing parsed yet.
    Start,
    /// An inline command: its line ends at the first LF.
    Inline,
    /// The `*N` line.
    Count,
    /// The `$N` line of the next element; `left` elements to go, this one included.
    Header { left: usize },
    /// The `len` bytes and CRLF of an element starting at `at`.
    Bulk { len: usize, left: usize },
}

/// An incremental RESP parser: it keeps its place in a command that has not fully arrived, so
/// every byte is examined a bounded number of times however the command is split into reads.
///
/// [`Parser::parse`] is given the buffer from the start of the command it is parsing; after
/// [`Parsed::Incomplete`] the next call must be given the same bytes and more (the connection
/// appends what it reads), after a command the bytes that follow it.
#[derive(Debug)]
pub struct Parser {
    limits: ParseLimits,
    step: Step,
    /// Offset in the command of the first byte not yet parsed (the current line's start, or the
    /// current bulk string's first byte).
    at: usize,
    /// Offset up to which the current line has been searched for its end.
    searched: usize,
    args: Vec<Vec<u8>>,
    scanned: u64,
}

fn over_limit(n: usize, max: usize) -> Parsed {
    Parsed::OverLimit(format!(
        "max query buffer length reached: a command of {n} bytes or more, the query buffer limit is {max} bytes"
    ))
}

fn number(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

impl Parser {
    /// A parser enforcing `limits`.
    pub fn new(limits: ParseLimits) -> Parser {
        Parser {
            limits,
            step: Step::Start,
            at: 0,
            searched: 0,
            args: Vec::new(),
            scanned: 0,
        }
    }

    /// Bytes the parser has examined (searched or copied) so far: the measure of its work.
    pub fn scanned(&self) -> u64 {
        self.scanned
    }

    fn done(&mut self, used: usize) -> Parsed {
        self.step = Step::Start;
        self.at = 0;
        self.searched = 0;
        Parsed::Command(std::mem::take(&mut self.args), used)
    }

    /// Not complete yet: over the limit if `b` (all of it the command) already is.
    fn incomplete(&self, b: &[u8]) -> Parsed {
        if b.len() > self.limits.max_command {
            return over_limit(b.len(), self.limits.max_command);
        }
        Parsed::Incomplete
    }

    /// The `*N` or `$N` line starting at `self.at`: its number and the offset after its CRLF.
    /// `Ok(None)`: not complete yet.
    fn header(&mut self, b: &[u8], too_big: &str, invalid: &str) -> Result<Option<(i64, usize)>, String> {
        let start = self.at;
        let from = self.searched.max(start + 1);
        // past the longest line's CR (the marker, the number, CR)
        let longest = start + 1 + MAX_HEADER_LINE + 1;
        let end = longest.min(b.len());
        let window = b.get(from..end).unwrap_or_default();
        match window.iter().position(|&c| c == b'\r') {
            Some(i) => {
                let cr = from + i;
                self.scanned += i as u64 + 1;
                if cr + 1 >= b.len() {
                    self.searched = cr; // the LF has not arrived
                    return Ok(None);
                }
                self.searched = 0;
                match (b[cr + 1], number(&b[start + 1..cr])) {
                    (b'\n', Some(n)) => Ok(Some((n, cr + 2))),
                    _ => Err(invalid.into()),
                }
            }
            None => {
                self.scanned += window.len() as u64;
                self.searched = end.max(self.searched);
                if b.len() >= longest {
                    return Err(too_big.into());
                }
                Ok(None)
            }
        }
    }

    /// Parses the command at the front of `b` (see [`Parser`] for what `b` must be): a RESP
    /// array of bulk strings, or an inline command (words separated by spaces, as typed into
    /// telnet).
    pub fn parse(&mut self, b: &[u8]) -> Parsed {
        loop {
            match self.step {
                Step::Start => match b.first() {
                    None => return Parsed::Incomplete,
                    Some(b'*') => self.step = Step::Count,
                    Some(_) => self.step = Step::Inline,
                },
                Step::Inline => {
                    let from = self.searched;
                    let Some(i) = b[from..].iter().position(|&c| c == b'\n') else {
                        self.scanned += (b.len() - from) as u64;
                        self.searched = b.len();
                        if b.len() > MAX_INLINE {
                            return Parsed::Error("too big inline request".into());
                        }
                        return self.incomplete(b);
                    };
                    self.scanned += i as u64 + 1;
                    let end = from + i;
                    let line = b[..end].strip_suffix(b"\r").unwrap_or(&b[..end]);
                    self.args = line
                        .split(|&c| c == b' ')
                        .filter(|w| !w.is_empty())
                        .map(|w| w.to_vec())
                        .collect();
                    return self.done(end + 1);
                }
                Step::Count => {
                    let (n, next) = match self.header(b, "too big mbulk count string", "invalid multibulk length") {
                        Ok(Some(h)) => h,
                        Ok(None) => return self.incomplete(b),
                        Err(e) => return Parsed::Error(e),
                    };
                    if !(0..=self.limits.max_multibulk as i64).contains(&n) {
                        return Parsed::Error("invalid multibulk length".into());
                    }
                    self.at = next;
                    if n == 0 {
                        return self.done(next);
                    }
                    // what the count promises is not allocated before it arrives
                    self.args = Vec::with_capacity((n as usize).min(16));
                    self.step = Step::Header { left: n as usize };
                }
                Step::Header { left } => {
                    match b.get(self.at) {
                        None => return self.incomplete(b),
                        Some(b'$') => {}
                        Some(&c) => return Parsed::Error(format!("expected '$', got '{}'", c.escape_ascii())),
                    }
                    let (len, next) = match self.header(b, "too big bulk count string", "invalid bulk length") {
                        Ok(Some(h)) => h,
                        Ok(None) => return self.incomplete(b),
                        Err(e) => return Parsed::Error(e),
                    };
                    if !(0..=self.limits.max_bulk as i64).contains(&len) {
                        return Parsed::Error("invalid bulk length".into());
                    }
                    let len = len as usize;
                    if next + len + 2 > self.limits.max_command {
                        return over_limit(next + len + 2, self.limits.max_command);
                    }
                    self.at = next;
                    self.step = Step::Bulk { len, left };
                }
                Step::Bulk { len, left } => {
                    let at = self.at;
                    if b.len() < at + len + 2 {
                        return self.incomplete(b);
                    }
                    self.scanned += len as u64 + 2;
                    if &b[at + len..at + len + 2] != b"\r\n" {
                        return Parsed::Error("bulk string not terminated by CRLF".into());
                    }
                    self.args.push(b[at..at + len].to_vec());
                    self.at = at + len + 2;
                    if left == 1 {
                        return self.done(self.at);
                    }
                    self.step = Step::Header { left: left - 1 };
                }
            }
        }
    }
}

/// Parses one command from the front of `b` with the default limits (a fresh [`Parser`]).
pub fn parse(b: &[u8]) -> Parsed {
    Parser::new(ParseLimits::default()).parse(b)
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
    /// The door's limits and counters.
    fn door(&self) -> &Door;
}

/// The RESP door's limits and counters (one per partition).
#[derive(Debug, Default)]
pub(crate) struct Door {
    limits: RespLimits,
    connections: AtomicU64,
    refused_max_clients: AtomicU64,
    refused_query_buffer: AtomicU64,
    protocol_errors: AtomicU64,
    peak_query_buffer: AtomicU64,
}

/// Counters of the RESP door.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RespStats {
    /// RESP connections open now.
    pub connections: u64,
    /// Connections refused with `-ERR max number of clients reached`.
    pub refused_max_clients: u64,
    /// Connections closed for a command over the query-buffer limit.
    pub refused_query_buffer: u64,
    /// Connections closed on a protocol error (limits on header lines, inline commands,
    /// multibulk and bulk lengths included).
    pub protocol_errors: u64,
    /// The most bytes one connection has had buffered.
    pub peak_query_buffer_bytes: u64,
}

impl Door {
    /// A door enforcing `limits`.
    pub(crate) fn new(limits: RespLimits) -> Door {
        Door {
            limits,
            ..Default::default()
        }
    }

    /// Its counters.
    pub(crate) fn stats(&self) -> RespStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RespStats {
            connections: l(&self.connections),
            refused_max_clients: l(&self.refused_max_clients),
            refused_query_buffer: l(&self.refused_query_buffer),
            protocol_errors: l(&self.protocol_errors),
            peak_query_buffer_bytes: l(&self.peak_query_buffer),
        }
    }
}

/// One of the door's connection slots, given back when the connection's task ends.
struct Slot<P: Partition>(Arc<P>);

impl<P: Partition> Drop for Slot<P> {
    fn drop(&mut self) {
        self.0.door().connections.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection(mut s: tokio::net::TcpStream, inner: Arc<impl Partition>) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let door = inner.door();
    let mut parser = Parser::new(door.limits.parse_limits());
    // `buf` holds the unparsed bytes from the start of the command being parsed; it and `out`
    // are allocated while there is something in them only, so an idle connection holds none
    let mut buf: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    // whether complete commands may still be waiting in `buf` (then they run before the next
    // read)
    let mut pending = false;
    loop {
        if !pending {
            s.readable().await?;
            let len = buf.len();
            buf.resize(len + READ_CHUNK, 0);
            match s.try_read(&mut buf[len..]) {
                Ok(0) => return Ok(()),
                Ok(n) => buf.truncate(len + n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    buf.truncate(len);
                    continue;
                }
                Err(e) => return Err(e),
            }
            door.peak_query_buffer.fetch_max(buf.len() as u64, Ordering::Relaxed);
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
                match parser.parse(&buf[at..]) {
                    Parsed::Command(args, used) => {
                        at += used;
                        inner.count_request();
                        open = execute(&*inner, &args, &mut out);
                    }
                    Parsed::Incomplete => break,
                    Parsed::Error(e) => {
                        door.protocol_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("RESP protocol error, closing: {e}");
                        error(&mut out, &format!("ERR Protocol error: {e}"));
                        open = false;
                    }
                    Parsed::OverLimit(e) => {
                        door.refused_query_buffer.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("RESP client over its query buffer limit, closing: {e}");
                        error(&mut out, &format!("ERR {e}"));
                        open = false;
                    }
                }
            }
        }
        if !open {
            s.write_all(&out).await?;
            // FIN after the error, so the client reads it before the connection ends
            let _ = s.shutdown().await;
            return Ok(());
        }
        buf.drain(..at);
        if buf.is_empty() {
            buf = Vec::new();
        } else if buf.capacity() > 4 * buf.len() + 4096 {
            // a short partial command keeps no read-sized buffer (copies under 4 KiB)
            buf.shrink_to(buf.len());
        }
        if !out.is_empty() {
            s.write_all(&out).await?;
            if out.capacity() > 4096 {
                out = Vec::new();
            } else {
                out.clear();
            }
        }
    }
}

/// Redis's reply to a client over `maxclients`.
pub const MAX_CLIENTS_ERROR: &[u8] = b"-ERR max number of clients reached\r\n";

/// Serves RESP clients on `l` until the runtime stops.
pub(crate) async fn serve<P: Partition>(l: tokio::net::TcpListener, inner: Arc<P>) {
    loop {
        match l.accept().await {
            Ok((s, peer)) => {
                let door = inner.door();
                if door.connections.load(Ordering::Relaxed) >= door.limits.max_clients as u64 {
                    door.refused_max_clients.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        "RESP connection from {peer} refused: max_clients {} reached",
                        door.limits.max_clients
                    );
                    // a new socket's send buffer is empty: the reply goes without waiting
                    let _ = s.try_write(MAX_CLIENTS_ERROR);
                    continue;
                }
                // the only place that adds: no other accept can pass the check meanwhile
                door.connections.fetch_add(1, Ordering::Relaxed);
                let slot = Slot(inner.clone());
                tokio::spawn(async move {
                    if let Err(e) = connection(s, slot.0.clone()).await {
                        tracing::debug!("RESP connection ended: {e}");
                    }
                    drop(slot);
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
        assert_eq!(parse(b"PING\n"), Parsed::Command(vec![b"PING".to_vec()], 5));
        assert!(matches!(parse(b"*x\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n+3\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n$-5\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r\n$1\r\nab\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*99999999\r\n"), Parsed::Error(_)));
        assert!(matches!(parse(b"*1\r"), Parsed::Incomplete));
        assert!(matches!(parse(b"*1\rx"), Parsed::Error(_)));
    }

    /// Every way of splitting a pipeline into reads gives the commands of parsing it whole, and
    /// fed a byte at a time the parser examines each byte a bounded number of times (a parser
    /// that starts a command over on every read examines each about as often as the command
    /// is long).
    #[test]
    fn a_parser_fed_piecewise_gives_what_parsing_whole_gives_in_linear_work() {
        let b: &[u8] = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$12\r\nvalue\r\nvalue\r\nPING\r\n*0\r\n\
            *2\r\n$3\r\nGET\r\n$1\r\nk\r\nget  k\n*1\r\n$4\r\nPING\r\n";
        let mut whole = Vec::new();
        let mut at = 0;
        while let Parsed::Command(a, n) = parse(&b[at..]) {
            whole.push(a);
            at += n;
        }
        assert_eq!((whole.len(), at), (6, b.len()));
        for step in 1..=7 {
            let mut p = Parser::new(ParseLimits::default());
            let (mut got, mut start, mut fed) = (Vec::new(), 0, 0);
            while fed < b.len() {
                fed = (fed + step).min(b.len());
                while let Parsed::Command(a, n) = p.parse(&b[start..fed]) {
                    got.push(a);
                    start += n;
                }
            }
            assert_eq!(got, whole, "fed {step} bytes at a time");
            if step == 1 {
                assert!(p.scanned() <= 2 * b.len() as u64, "{} bytes examined", p.scanned());
            }
        }
    }

    /// Feeds `b` one byte at a time; returns what the parser gave at the end, the bytes fed,
    /// and the bytes it examined.
    fn bytewise(limits: ParseLimits, b: &[u8]) -> (Parsed, usize, u64) {
        let mut p = Parser::new(limits);
        for n in 1..=b.len() {
            match p.parse(&b[..n]) {
                Parsed::Incomplete => {}
                r => return (r, n, p.scanned()),
            }
        }
        (Parsed::Incomplete, b.len(), p.scanned())
    }

    /// A command of 1 MB arriving a byte at a time is parsed examining each byte a bounded
    /// number of times (a parser that starts over on every read examines ~n²/2 bytes: 5·10¹¹).
    #[test]
    fn a_command_arriving_bytewise_costs_linear_work() {
        let big = ParseLimits {
            max_multibulk: 1 << 20,
            max_bulk: 1 << 21,
            max_command: 1 << 23,
        };
        // one large value
        let mut set = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1000000\r\n".to_vec();
        set.extend(std::iter::repeat_n(b'v', 1_000_000));
        set.extend_from_slice(b"\r\n");
        // many small elements
        let mut del = b"*100001\r\n$3\r\nDEL\r\n".to_vec();
        for i in 0..100_000 {
            del.extend_from_slice(format!("$6\r\nk{i:05}\r\n").as_bytes());
        }
        // and an inline command
        let mut inline = b"PING ".to_vec();
        inline.extend(std::iter::repeat_n(b'x', 60_000));
        inline.extend_from_slice(b"\r\n");
        for (what, b, args) in [("SET", &set, 3), ("inline", &inline, 2), ("DEL", &del, 100_001)] {
            let (r, fed, scanned) = bytewise(big, b);
            let Parsed::Command(a, used) = r else {
                panic!("{what}: {r:?}")
            };
            assert_eq!((a.len(), used, fed), (args, b.len(), b.len()), "{what}");
            assert!(
                scanned <= 2 * b.len() as u64,
                "{what}: {scanned} bytes examined to parse {} fed bytewise",
                b.len()
            );
        }
    }

    /// Header lines, bulk and multibulk lengths and the command's size are refused as soon as
    /// they are over their limits, not buffered.
    #[test]
    fn limits_refuse_at_once() {
        let l = ParseLimits {
            max_multibulk: 8,
            max_bulk: 100,
            max_command: 4096,
        };
        let digits: Vec<u8> = std::iter::repeat_n(b'1', 10_000).collect();
        for (prefix, err) in [
            (&b"*"[..], "too big mbulk count string"),
            (b"*1\r\n$", "too big bulk count string"),
        ] {
            let mut b = prefix.to_vec();
            b.extend_from_slice(&digits);
            let (r, fed, scanned) = bytewise(l, &b);
            assert_eq!(r, Parsed::Error(err.into()));
            assert_eq!(fed, prefix.len() + MAX_HEADER_LINE + 1, "{err}");
            assert!(scanned <= fed as u64, "{err}: {scanned}");
        }
        let once = |b: &[u8]| Parser::new(l).parse(b);
        assert_eq!(once(b"*9\r\n"), Parsed::Error("invalid multibulk length".into()));
        assert_eq!(once(b"*1\r\n$101\r\n"), Parsed::Error("invalid bulk length".into()));
        assert_eq!(
            once(b"*1\r\n$1000000000\r\n"),
            Parsed::Error("invalid bulk length".into())
        );
        assert_eq!(once(b"*1\r\n$100\r\n"), Parsed::Incomplete);
        // the declared size is over the query-buffer limit before the bytes arrive
        let mut b = b"*8\r\n".to_vec();
        for _ in 0..7 {
            b.extend_from_slice(b"$100\r\n");
            b.extend(std::iter::repeat_n(b'x', 100));
            b.extend_from_slice(b"\r\n");
        }
        assert_eq!(once(&b), Parsed::Incomplete);
        b.extend_from_slice(b"$100\r\n");
        assert!(matches!(once(&b), Parsed::Incomplete), "{} bytes", b.len());
        let tight = ParseLimits { max_command: 800, ..l };
        assert!(matches!(Parser::new(tight).parse(&b), Parsed::OverLimit(_)));
        // an inline command without its end
        let mut b = b"GET ".to_vec();
        b.extend(std::iter::repeat_n(b'k', 5000));
        assert!(matches!(once(&b), Parsed::OverLimit(_)));
        b.extend(std::iter::repeat_n(b'k', MAX_INLINE));
        let loose = ParseLimits {
            max_command: 1 << 20,
            ..l
        };
        assert_eq!(
            Parser::new(loose).parse(&b),
            Parsed::Error("too big inline request".into())
        );
    }

    #[test]
    fn limits_are_checked_by_field() {
        assert_eq!(RespLimits::default().check(), Ok(()));
        for (l, field) in [
            (
                RespLimits {
                    max_clients: 0,
                    ..Default::default()
                },
                "max_clients",
            ),
            (
                RespLimits {
                    query_buffer_limit: 10,
                    ..Default::default()
                },
                "query_buffer_limit",
            ),
            (
                RespLimits {
                    max_bulk_len: MAX_BULK + 1,
                    ..Default::default()
                },
                "max_bulk_len",
            ),
            (
                RespLimits {
                    max_multibulk_len: 0,
                    ..Default::default()
                },
                "max_multibulk_len",
            ),
        ] {
            let e = l.check().unwrap_err();
            assert!(e.contains(field), "{e}");
        }
        assert!(RespLimits::default().query_buffer_limit > MAX_COMMAND);
    }
}
