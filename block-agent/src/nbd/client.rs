//! A small blocking NBD client (fixed newstyle, NBD_OPT_GO, simple replies, one request at a
//! time): for the demo, tests and tools that need to know exactly which writes were
//! acknowledged. Benchmarks use the real clients (fio, qemu-img, nbdcopy).

use super::proto::*;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Errors of the client; `Nbd` carries the server's error number.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A socket operation failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The server broke the protocol (what it sent).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The server refused an option.
    #[error("the server refused option {opt}: reply {reply:#x} {msg}")]
    Refused {
        /// The option (`OPT_*`).
        opt: u32,
        /// The server's reply type (`REP_ERR_*`).
        reply: u32,
        /// The server's message.
        msg: String,
    },
    /// The server answered a request with this error number.
    #[error("the server answered error {0}")]
    Nbd(u32),
}

/// One connection to one export.
pub struct NbdClient {
    s: TcpStream,
    size: u64,
    flags: u16,
    next: u64,
}

impl NbdClient {
    /// Connects to `addr` and opens `export`.
    pub fn connect(addr: impl ToSocketAddrs, export: &str) -> Result<NbdClient, ClientError> {
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello)?;
        if u64::from_be_bytes(hello[0..8].try_into().expect("8")) != NBDMAGIC
            || u64::from_be_bytes(hello[8..16].try_into().expect("8")) != IHAVEOPT
        {
            return Err(ClientError::Protocol("not an NBD newstyle server".into()));
        }
        s.write_all(&((FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES) as u32).to_be_bytes())?;
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&OPT_GO.to_be_bytes());
        o.extend_from_slice(&(d.len() as u32).to_be_bytes());
        o.extend_from_slice(&d);
        s.write_all(&o)?;
        let (mut size, mut flags) = (0, 0);
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h)?;
            if u64::from_be_bytes(h[0..8].try_into().expect("8")) != REPLY_MAGIC {
                return Err(ClientError::Protocol("bad option reply magic".into()));
            }
            let reply = u32::from_be_bytes(h[12..16].try_into().expect("4"));
            let len = u32::from_be_bytes(h[16..20].try_into().expect("4"));
            if len > 1 << 20 {
                return Err(ClientError::Protocol(format!("option reply of {len} bytes")));
            }
            let mut data = vec![0u8; len as usize];
            s.read_exact(&mut data)?;
            match reply {
                REP_INFO if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    size = u64::from_be_bytes(data[2..10].try_into().expect("8"));
                    flags = u16::from_be_bytes([data[10], data[11]]);
                }
                REP_INFO => {}
                REP_ACK => break,
                r => {
                    return Err(ClientError::Refused {
                        opt: OPT_GO,
                        reply: r,
                        msg: String::from_utf8_lossy(&data).to_string(),
                    })
                }
            }
        }
        Ok(NbdClient {
            s,
            size,
            flags,
            next: 1,
        })
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Transmission flags the server advertised.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    /// Limits how long one request may wait for its reply.
    pub fn set_timeout(&self, t: Option<Duration>) -> Result<(), ClientError> {
        self.s.set_read_timeout(t)?;
        Ok(())
    }

    fn request(
        &mut self,
        typ: u16,
        flags: u16,
        offset: u64,
        length: u32,
        data: &[u8],
        out: Option<&mut [u8]>,
    ) -> Result<(), ClientError> {
        let handle = self.next;
        self.next += 1;
        let r = Request {
            flags,
            typ,
            handle,
            offset,
            length,
        };
        let mut msg = r.encode().to_vec();
        msg.extend_from_slice(data);
        self.s.write_all(&msg)?;
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        if u32::from_be_bytes(h[0..4].try_into().expect("4")) != SIMPLE_REPLY_MAGIC {
            return Err(ClientError::Protocol("bad reply magic".into()));
        }
        if u64::from_be_bytes(h[8..16].try_into().expect("8")) != handle {
            return Err(ClientError::Protocol("reply to another request".into()));
        }
        let err = u32::from_be_bytes(h[4..8].try_into().expect("4"));
        if err != 0 {
            return Err(ClientError::Nbd(err));
        }
        if let Some(out) = out {
            self.s.read_exact(out)?;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let n = buf.len() as u32;
        self.request(CMD_READ, 0, offset, n, &[], Some(buf))
    }

    /// Writes `data` at `offset`; with `fua`, durable when answered.
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        let f = if fua { CMD_FLAG_FUA } else { 0 };
        self.request(CMD_WRITE, f, offset, data.len() as u32, data, None)
    }

    /// Makes every completed write durable.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.request(CMD_FLUSH, 0, 0, 0, &[], None)
    }

    /// Zeroes `len` bytes at `offset`.
    pub fn write_zeroes(&mut self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.request(CMD_WRITE_ZEROES, 0, offset, len, &[], None)
    }

    /// Ends the session politely.
    pub fn disconnect(mut self) {
        let r = Request {
            flags: 0,
            typ: CMD_DISC,
            handle: 0,
            offset: 0,
            length: 0,
        };
        let _ = self.s.write_all(&r.encode());
    }
}
