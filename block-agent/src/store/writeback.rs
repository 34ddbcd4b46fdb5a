//! A checkpoint's writeback of the data and metadata files, in pieces.
//!
//! Commits place blocks into the page cache without a sync; the files are synced when a log
//! is checkpointed. The kernel writes nothing back before that on its own (its dirty
//! thresholds are a tenth of memory, its expiry 30 s), so a checkpoint finds a whole log's
//! worth of random blocks dirty (256 MiB by default). One `fdatasync` submits all of them at
//! once: the device queue fills, and every log sync that comes while it drains waits behind
//! it (in `ecmp.sh block` both systems stalled 64-80 ms at each checkpoint). [`write_back`]
//! writes the file back one range at a time instead, waiting for each
//! (`sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`), so a log sync waits behind one
//! range's writes at most; the checkpoint's `fdatasync` then has nothing left but the device's
//! cache flush. The ranges keep the file's order, so the kernel merges neighbouring blocks and
//! allocates them together, as the one `fdatasync` did. (Starting writeback as blocks are
//! placed, RocksDB's `bytes_per_sync`, was tried and dropped: a few hundred scattered blocks
//! at a time cost ext4 an allocation each, and randwrite lost 15-25 % of its IOPS.)
//!
//! The one `unsafe` block of `block-agent` is here: `rustix` has no `sync_file_range`.

use std::fs::File;
use std::os::fd::AsRawFd;

/// About this many dirty bytes per range: a log sync waits behind at most this much.
const RANGE_DIRTY_BYTES: u64 = 1 << 20;
/// At most this many ranges per file and checkpoint (each is a system call).
const MAX_RANGES: u64 = 1024;

/// `sync_file_range` over `len` bytes from `off`: starts their writeback and waits for it.
fn write_range(file: &File, off: u64, len: u64) -> std::io::Result<()> {
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    let (off, len) = (off as libc::off64_t, len as libc::off64_t);
    // SAFETY: a plain system call on a descriptor that `file` keeps open for the call; it
    // reads and writes no memory of this process.
    let r = unsafe { libc::sync_file_range(file.as_raw_fd(), off, len, flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The ranges [`write_back`] takes for a file of `len` bytes with about `dirty` bytes to
/// write: `(offset, length)`, in order, covering the file, each page-aligned.
fn ranges(len: u64, dirty: u64) -> impl Iterator<Item = (u64, u64)> {
    let pieces = (dirty / RANGE_DIRTY_BYTES).clamp(1, MAX_RANGES);
    let step = len.div_ceil(pieces).next_multiple_of(4096).max(4096);
    (0..len)
        .step_by(step as usize)
        .map(move |off| (off, step.min(len - off)))
}

/// Writes `file`'s dirty pages back to the device, one range at a time, waiting for each;
/// `dirty` is about how many bytes were written to it since its last sync. It does not flush
/// the device's cache or the file's metadata: an `fdatasync` after it does, with little left.
pub(super) fn write_back(file: &File, dirty: u64) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    for (off, n) in ranges(len, dirty) {
        write_range(file, off, n)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_file_in_order_page_aligned_and_bounded_in_number() {
        for (len, dirty) in [
            (0, 0),
            (4096, 1 << 30),
            (1 << 30, 256 << 20),
            (1 << 30, 0),
            ((1 << 40) + 4096 * 3, 256 << 20),
            (12_288, 8 << 20),
            (5 << 20, 1 << 40),
        ] {
            let r: Vec<_> = ranges(len, dirty).collect();
            let mut at = 0;
            for &(off, n) in &r {
                assert_eq!(off, at, "{len} {dirty}: contiguous, in order");
                assert!(n > 0 && off % 4096 == 0, "{len} {dirty}: {off}+{n}");
                at += n;
            }
            assert_eq!(at, len, "{len} {dirty}: the whole file");
            assert!(r.len() as u64 <= MAX_RANGES, "{len} {dirty}: {} ranges", r.len());
        }
        // 256 MiB dirty in a 1 GiB file: 256 ranges of 4 MiB
        assert_eq!(ranges(1 << 30, 256 << 20).count(), 256);
    }

    #[test]
    fn a_file_written_back_in_ranges_reads_back_whole() {
        use std::os::unix::fs::FileExt;
        let (path, f) = super::super::scratch_file("writeback");
        f.set_len(64 << 20).unwrap();
        for k in 0..512u64 {
            let lba = (k * 7919) % (16 << 10);
            f.write_all_at(&[(k % 251) as u8 + 1; 4096], lba * 4096).unwrap();
        }
        write_back(&f, 2 << 20).unwrap();
        f.sync_data().unwrap();
        for k in 0..512u64 {
            let lba = (k * 7919) % (16 << 10);
            let mut b = [0u8; 4096];
            f.read_exact_at(&mut b, lba * 4096).unwrap();
            assert!(b.iter().all(|&x| x == (k % 251) as u8 + 1), "block {lba}");
        }
        std::fs::remove_file(&path).unwrap();
    }
}
