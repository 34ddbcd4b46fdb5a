//! Reading a log file's records a chunk at a time. A log file holds up to `log_limit` bytes
//! (256 MiB by default) and a volume has two, so replay at open reads each through a window
//! of [`CHUNK`] bytes instead of holding whole files in memory.

use super::{decode_any, Check, Rec, StoreError, BLOCK, REC_HDR};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Bytes of a log read at a time by replay.
pub(super) const CHUNK: usize = 4 << 20;
/// The longest record: a data record's header and block.
const MAX_REC: usize = REC_HDR + BLOCK;

/// Passes `each` every whole, intact record of `file` from byte `start` on, in order (the
/// records that [`super::records`] yields over the same bytes), reading `chunk` bytes at a
/// time (at least one record's worth). Stops at the end of the file or at the first record
/// that is torn, damaged or of another generation than `check`'s. Returns how many it passed.
pub(super) fn for_each_record(
    file: &File,
    start: u64,
    check: Check,
    chunk: usize,
    volume: u32,
    mut each: impl FnMut(&Rec<'_>) -> Result<(), StoreError>,
) -> Result<u64, StoreError> {
    let chunk = chunk.max(MAX_REC);
    let mut buf: Vec<u8> = Vec::with_capacity(chunk + MAX_REC);
    // the file offset of the next byte to read, and the next record's offset in `buf`
    let (mut pos, mut off) = (start, 0);
    let mut eof = false;
    let mut n = 0;
    loop {
        // a record is only judged torn with a whole record's worth of bytes in view, or at
        // the end of the file
        if !eof && buf.len() - off < MAX_REC {
            buf.drain(..off);
            off = 0;
            let have = buf.len();
            buf.resize(have + chunk, 0);
            let got = read_full_at(file, &mut buf[have..], pos).map_err(|source| StoreError::Io {
                volume,
                what: "reading the log".into(),
                source,
            })?;
            pos += got as u64;
            eof = got < chunk;
            buf.truncate(have + got);
        }
        let Some((r, len)) = decode_any(&buf[off..], check) else {
            return Ok(n);
        };
        each(&r)?;
        off += len;
        n += 1;
    }
}

/// Reads into `buf` from byte `pos` until it is full or the file ends; returns how many bytes
/// it read (fewer than `buf.len()` only at the end of the file).
pub(super) fn read_full_at(file: &File, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], pos + got as u64) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::super::{encode_record, encode_zero_record, records, stamp_generation};
    use super::*;

    /// What a record is, owned: (lba, version, crc, first byte of the block or None for zeros).
    fn key(r: &Rec<'_>) -> (u64, u64, u32, Option<u8>) {
        match *r {
            Rec::Data {
                lba,
                version,
                crc,
                data,
            } => (lba, version, crc, Some(data[0])),
            Rec::Zero { lba, count, version } => (lba, version, count, None),
        }
    }

    #[test]
    fn chunked_reads_pass_the_records_a_whole_read_does_and_stop_where_it_stops() {
        let generation = 7;
        let mut log = vec![0xAB; 32]; // stands for the header
        let mut batch = Vec::new();
        for i in 0..40u64 {
            if i % 7 == 3 {
                encode_zero_record(&mut batch, i * 10, 3, 100 + i);
            } else {
                let block = vec![i as u8; BLOCK];
                encode_record(&mut batch, i, 100 + i, crc32c::crc32c(&block), &block);
            }
        }
        stamp_generation(&mut batch, generation);
        log.extend_from_slice(&batch);
        let whole = log.len();
        // a torn record after the last whole one, then an older generation's record
        let mut older = Vec::new();
        let block = vec![9u8; BLOCK];
        encode_record(&mut older, 999, 1, crc32c::crc32c(&block), &block);
        stamp_generation(&mut older, generation - 1);
        let (path, f) = super::super::scratch_file("logread");
        let expect: Vec<_> = records(&log[32..], Check::Log(generation)).map(|r| key(&r)).collect();
        assert_eq!(expect.len(), 40);
        for (tail, want) in [
            (Vec::new(), expect.len()),
            (batch[..REC_HDR + 100].to_vec(), expect.len()),
            (older, expect.len()),
        ] {
            let mut bytes = log[..whole].to_vec();
            bytes.extend_from_slice(&tail);
            f.set_len(0).unwrap();
            f.write_all_at(&bytes, 0).unwrap();
            // chunks below a record, not a multiple of one, and larger than the file
            for chunk in [1, MAX_REC + 1, 3 * MAX_REC - 17, 1 << 20] {
                let mut got = Vec::new();
                let n = for_each_record(&f, 32, Check::Log(generation), chunk, 1, |r| {
                    got.push(key(r));
                    Ok(())
                })
                .unwrap();
                assert_eq!(n as usize, want, "chunk {chunk}");
                assert_eq!(got, expect, "chunk {chunk}");
            }
        }
        // damage one record's block: everything before it, nothing from it on
        let mut bytes = log.clone();
        // records 0-4 are four data records and a zero record (i = 3); the sixth is data
        let at = 32 + 4 * (REC_HDR + BLOCK) + REC_HDR + REC_HDR + 10;
        bytes[at] ^= 1;
        f.set_len(0).unwrap();
        f.write_all_at(&bytes, 0).unwrap();
        let n = for_each_record(&f, 32, Check::Log(generation), MAX_REC + 1, 1, |_| Ok(())).unwrap();
        assert_eq!(n, 5);
        // `each` failing stops the read with its error
        let e = for_each_record(&f, 32, Check::Log(generation), 1 << 20, 1, |_| {
            Err(StoreError::Invalid("stop".into(), 1))
        })
        .unwrap_err();
        assert!(e.to_string().contains("stop"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }
}
