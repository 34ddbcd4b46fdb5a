//! NBD wire constants and the pure parts of the protocol (request parsing and checking, reply
//! encoding), after the NBD protocol document (fixed newstyle negotiation, simple and
//! structured replies).

/// "NBDMAGIC".
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT".
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of option replies.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request (`NBD_REQUEST_MAGIC`).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply (`NBD_SIMPLE_REPLY_MAGIC`).
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk (`NBD_STRUCTURED_REPLY_MAGIC`).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
/// `NBD_FLAG_NO_ZEROES`: no 124 zero bytes after the export info of `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 2;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`: the client ends the negotiation.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`: list the exports.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_STARTTLS`: upgrade to TLS (refused: not offered).
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`: describe an export without entering transmission.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`: list the meta contexts matching a query.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`: select meta contexts for `NBD_CMD_BLOCK_STATUS`.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option replies.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`: one export of a list.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`: one piece of export information.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`: one selected or listed meta context.
pub const REP_META_CONTEXT: u32 = 4;
/// `NBD_REP_ERR_UNSUP`: the option is not supported.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// `NBD_REP_ERR_POLICY`: refused by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// `NBD_REP_ERR_INVALID`: the option is malformed.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// `NBD_REP_ERR_UNKNOWN`: no such export.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// `NBD_REP_ERR_TOO_BIG`: the option's payload is too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Information types of NBD_OPT_INFO/GO.
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`: the export's name.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`: the export's description.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1;
/// `NBD_FLAG_READ_ONLY`: the export is read-only.
pub const TF_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`: the server accepts `NBD_CMD_FLUSH`.
pub const TF_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`: the server accepts `NBD_CMD_FLAG_FUA`.
pub const TF_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_SEND_TRIM`: the server accepts `NBD_CMD_TRIM`.
pub const TF_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`: the server accepts `NBD_CMD_WRITE_ZEROES`.
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_SEND_DF`: the server accepts `NBD_CMD_FLAG_DF` on reads.
pub const TF_SEND_DF: u16 = 1 << 7;
/// `NBD_FLAG_CAN_MULTI_CONN`: several connections to the export see each other's writes.
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_FAST_ZERO`: the server accepts `NBD_CMD_FLAG_FAST_ZERO`.
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

/// Commands.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`: the client disconnects.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`: make completed writes durable.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`: the range's contents may be discarded.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_WRITE_ZEROES`: write zeros to the range.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`: the range's extents in the selected meta context.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1;
/// `NBD_CMD_FLAG_NO_HOLE`: write zeroes without punching a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_DF`: answer a read in one data chunk.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// `NBD_CMD_FLAG_REQ_ONE`: answer block status with one extent.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// `NBD_CMD_FLAG_FAST_ZERO`: fail write-zeroes rather than write slowly.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply chunks.
pub const REPLY_FLAG_DONE: u16 = 1;
/// `NBD_REPLY_TYPE_NONE`: a chunk with no payload (ends a reply).
pub const CHUNK_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`: read data at an offset.
pub const CHUNK_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_BLOCK_STATUS`: extents of one meta context.
pub const CHUNK_BLOCK_STATUS: u16 = 5;
/// `NBD_REPLY_TYPE_ERROR`: the request failed (an errno and a message).
pub const CHUNK_ERROR: u16 = (1 << 15) + 1;

/// Errors.
pub const EPERM: u32 = 1;
/// `EIO`: an I/O error.
pub const EIO: u32 = 5;
/// `EINVAL`: an invalid request.
pub const EINVAL: u32 = 22;
/// `ENOSPC`: a write past the end of the export.
pub const ENOSPC: u32 = 28;
/// `EOVERFLOW`: a read longer than the largest accepted.
pub const EOVERFLOW: u32 = 75;
/// `ENOTSUP`: the command is not supported.
pub const ENOTSUP: u32 = 95;
/// `ESHUTDOWN`: the server is shutting down.
pub const ESHUTDOWN: u32 = 108;

/// The meta context this server offers (everything reads as allocated data).
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` extent flags: unallocated, and reads as zeros.
pub const STATE_HOLE: u32 = 1;
/// `NBD_STATE_ZERO`: the extent reads as zeros.
pub const STATE_ZERO: u32 = 2;

/// Largest request payload accepted (advertised as the maximum block size).
pub const MAX_REQUEST: u32 = 32 << 20;
/// Preferred block size (the Solar block).
pub const PREFERRED_BLOCK: u32 = 4096;

/// Transmission flags of a writable export.
pub const EXPORT_FLAGS: u16 = TF_HAS_FLAGS
    | TF_SEND_FLUSH
    | TF_SEND_FUA
    | TF_SEND_TRIM
    | TF_SEND_WRITE_ZEROES
    | TF_SEND_DF
    | TF_CAN_MULTI_CONN
    | TF_SEND_FAST_ZERO;

/// A request header (28 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// The command (`CMD_*`).
    pub typ: u16,
    /// The client's handle, echoed in the reply.
    pub handle: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes (of the data, or of the range).
    pub length: u32,
}

/// A request header that cannot be answered: the connection must close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bad request magic {0:#010x}")]
pub struct BadMagic(pub u32);

impl Request {
    /// Bytes of a request header on the wire.
    pub const LEN: usize = 28;

    /// Parses a request header; [`BadMagic`] when it does not start with [`REQUEST_MAGIC`].
    pub fn parse(b: &[u8; 28]) -> Result<Request, BadMagic> {
        let magic = u32::from_be_bytes(b[0..4].try_into().expect("4"));
        if magic != REQUEST_MAGIC {
            return Err(BadMagic(magic));
        }
        Ok(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            typ: u16::from_be_bytes([b[6], b[7]]),
            handle: u64::from_be_bytes(b[8..16].try_into().expect("8")),
            offset: u64::from_be_bytes(b[16..24].try_into().expect("8")),
            length: u32::from_be_bytes(b[24..28].try_into().expect("4")),
        })
    }

    /// The request header as sent on the wire (big-endian).
    pub fn encode(&self) -> [u8; 28] {
        let mut b = [0u8; 28];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.typ.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Checks a request against an export of `size` bytes: `Err(errno)` is answered instead of
    /// running it. `structured` and `meta` say what was negotiated.
    pub fn check(&self, size: u64, structured: bool, meta: bool) -> Result<(), u32> {
        let allowed = match self.typ {
            CMD_READ => CMD_FLAG_DF,
            CMD_WRITE => CMD_FLAG_FUA,
            CMD_FLUSH | CMD_DISC => 0,
            CMD_TRIM => CMD_FLAG_FUA,
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
            _ => return Err(EINVAL),
        };
        if self.flags & !allowed != 0 {
            return Err(EINVAL);
        }
        if self.typ == CMD_BLOCK_STATUS && !(structured && meta) {
            return Err(EINVAL);
        }
        if matches!(self.typ, CMD_READ | CMD_WRITE) && self.length > MAX_REQUEST {
            return Err(if self.typ == CMD_READ { EOVERFLOW } else { EINVAL });
        }
        if matches!(self.typ, CMD_FLUSH) && (self.offset != 0 || self.length != 0) {
            return Err(EINVAL);
        }
        if matches!(
            self.typ,
            CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES | CMD_BLOCK_STATUS
        ) {
            if self.length == 0 && self.typ != CMD_WRITE_ZEROES && self.typ != CMD_TRIM {
                return Err(EINVAL);
            }
            if self.offset.checked_add(self.length as u64).is_none_or(|e| e > size) {
                return Err(if matches!(self.typ, CMD_WRITE | CMD_WRITE_ZEROES) {
                    ENOSPC
                } else {
                    EINVAL
                });
            }
        }
        Ok(())
    }
}

/// A simple reply header.
pub fn simple_reply(handle: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A structured reply chunk header.
pub fn chunk_header(out: &mut Vec<u8>, flags: u16, typ: u16, handle: u64, len: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&handle.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A final structured error chunk (with a message for the client's log).
pub fn structured_error(handle: u64, error: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    let mut out = Vec::with_capacity(26 + msg.len());
    chunk_header(&mut out, REPLY_FLAG_DONE, CHUNK_ERROR, handle, 6 + msg.len() as u32);
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
    out
}

/// An option reply.
pub fn option_reply(out: &mut Vec<u8>, opt: u32, typ: u32, data: &[u8]) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// The payload of NBD_OPT_INFO/GO: export name and requested information types.
pub fn parse_go(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let n = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(data.get(4..4 + n)?).ok()?.to_string();
    let rest = data.get(4 + n..)?;
    let k = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
    let infos = rest.get(2..)?;
    if infos.len() != 2 * k {
        return None;
    }
    Some((
        name,
        infos
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect(),
    ))
}

/// The payload of NBD_OPT_LIST/SET_META_CONTEXT: export name and queries.
pub fn parse_meta(data: &[u8]) -> Option<(String, Vec<String>)> {
    let n = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = std::str::from_utf8(data.get(4..4 + n)?).ok()?.to_string();
    let mut at = 4 + n;
    let k = u32::from_be_bytes(data.get(at..at + 4)?.try_into().ok()?) as usize;
    at += 4;
    let mut q = Vec::new();
    for _ in 0..k {
        let l = u32::from_be_bytes(data.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4;
        q.push(std::str::from_utf8(data.get(at..at + l)?).ok()?.to_string());
        at += l;
    }
    (at == data.len()).then_some((name, q))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(typ: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            typ,
            handle: 7,
            offset,
            length,
        }
    }

    #[test]
    fn requests_round_trip_and_bad_magic_is_refused() {
        let r = req(CMD_WRITE, CMD_FLAG_FUA, 1 << 33, 4096);
        assert_eq!(Request::parse(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] ^= 1;
        assert!(Request::parse(&b).is_err());
    }

    #[test]
    fn checks_give_the_protocol_errors() {
        let size = 1 << 20;
        assert_eq!(req(CMD_READ, 0, 0, 4096).check(size, false, false), Ok(()));
        assert_eq!(
            req(CMD_READ, 0, size - 512, 1024).check(size, false, false),
            Err(EINVAL)
        );
        assert_eq!(req(CMD_WRITE, 0, size, 1).check(size, false, false), Err(ENOSPC));
        assert_eq!(
            req(CMD_WRITE, 0, u64::MAX - 10, 4096).check(size, false, false),
            Err(ENOSPC)
        );
        assert_eq!(
            req(CMD_WRITE_ZEROES, 0, size, 4096).check(size, false, false),
            Err(ENOSPC)
        );
        assert_eq!(
            req(CMD_READ, 0, 0, MAX_REQUEST + 1).check(u64::MAX, false, false),
            Err(EOVERFLOW)
        );
        assert_eq!(
            req(CMD_READ, CMD_FLAG_FUA, 0, 4096).check(size, false, false),
            Err(EINVAL)
        );
        assert_eq!(req(99, 0, 0, 0).check(size, false, false), Err(EINVAL));
        assert_eq!(req(CMD_BLOCK_STATUS, 0, 0, 4096).check(size, true, false), Err(EINVAL));
        assert_eq!(req(CMD_BLOCK_STATUS, 0, 0, 4096).check(size, true, true), Ok(()));
        assert_eq!(req(CMD_FLUSH, 0, 0, 0).check(size, false, false), Ok(()));
        assert_eq!(req(CMD_FLUSH, 0, 4096, 0).check(size, false, false), Err(EINVAL));
        assert_eq!(req(CMD_READ, 0, 0, 0).check(size, false, false), Err(EINVAL));
    }

    #[test]
    fn option_payloads_parse_and_truncations_are_refused() {
        let mut go = Vec::new();
        go.extend_from_slice(&3u32.to_be_bytes());
        go.extend_from_slice(b"vol");
        go.extend_from_slice(&2u16.to_be_bytes());
        go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        go.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(parse_go(&go), Some(("vol".into(), vec![INFO_BLOCK_SIZE, INFO_NAME])));
        for cut in 0..go.len() {
            assert_eq!(parse_go(&go[..cut]), None, "cut at {cut}");
        }
        let mut m = Vec::new();
        m.extend_from_slice(&0u32.to_be_bytes());
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
        m.extend_from_slice(BASE_ALLOCATION.as_bytes());
        assert_eq!(parse_meta(&m), Some((String::new(), vec![BASE_ALLOCATION.to_string()])));
        for cut in 0..m.len() {
            assert_eq!(parse_meta(&m[..cut]), None, "cut at {cut}");
        }
        let e = structured_error(9, EIO, "boom");
        assert_eq!(e.len(), 20 + 6 + 4);
        assert_eq!(&e[4..6], &REPLY_FLAG_DONE.to_be_bytes());
    }
}
