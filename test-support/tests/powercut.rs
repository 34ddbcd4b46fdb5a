//! The power-cut disk keeps exactly what was made durable: synced bytes and synced directory
//! entries survive a cut, everything else is gone, and nothing works while the power is off.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use test_support::powercut::Disk;

fn read(p: &std::path::Path) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    File::open(p).ok()?.read_to_end(&mut v).ok()?;
    Some(v)
}

fn sync_dir(p: &std::path::Path) {
    File::open(p).unwrap().sync_all().unwrap();
}

#[test]
fn a_cut_keeps_what_was_synced_and_nothing_else() {
    if let Err(why) = Disk::available() {
        test_support::skip(
            "a_cut_keeps_what_was_synced_and_nothing_else",
            test_support::Missing::Root,
            &why,
        );
        return;
    }
    let at = std::env::temp_dir().join(format!("powercut-{}", std::process::id()));
    let mut disk = Disk::mount(&at).unwrap();
    let root = disk.path().to_path_buf();

    // durable: created, written, synced, directory synced
    std::fs::create_dir(root.join("d")).unwrap();
    let mut f = File::create(root.join("d/kept")).unwrap();
    f.write_all(&[1u8; 10_000]).unwrap();
    f.sync_data().unwrap();
    // written after the sync: lost, and so is the growth
    f.write_all_at(&[2u8; 100], 5000).unwrap();
    f.write_all(&[3u8; 100]).unwrap();
    sync_dir(&root.join("d"));
    sync_dir(&root);
    // synced bytes, but the directory entry never synced: the file is gone
    let mut g = File::create(root.join("d/orphan")).unwrap();
    g.write_all(b"synced, unnamed").unwrap();
    g.sync_all().unwrap();
    // a rename not synced: the old name comes back; a truncate not synced: undone
    std::fs::write(root.join("tmp"), b"new contents").unwrap();
    File::open(root.join("tmp")).unwrap().sync_all().unwrap();
    std::fs::rename(root.join("tmp"), root.join("d/kept")).unwrap();
    let h = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(root.join("len"))
        .unwrap();
    h.set_len(8192).unwrap();
    h.sync_all().unwrap();
    sync_dir(&root);
    h.set_len(0).unwrap();
    assert!(
        disk.stats().file_syncs >= 4 && disk.stats().dir_syncs >= 3,
        "{:?}",
        disk.stats()
    );

    let report = disk.power_cut();
    // while the power is off nothing works: not even through files opened before the cut
    assert!(f.write_all_at(b"x", 0).is_err());
    drop((f, g, h));
    // "kept" (grown and overwritten) and "len" (truncated) go back; d loses "orphan" and the
    // renamed-in "kept"
    assert_eq!((report.files_reverted, report.entries_lost), (2, 2), "{report:?}");
    assert!(report.pages_lost >= 3, "{report:?}");
    disk.power_on().unwrap();

    assert_eq!(read(&root.join("d/kept")).unwrap(), vec![1u8; 10_000]);
    assert_eq!(read(&root.join("d/orphan")), None);
    assert_eq!(read(&root.join("tmp")), None, "tmp was never named durably");
    assert_eq!(read(&root.join("len")).unwrap(), vec![0u8; 8192]);
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["d", "len"]);
    drop(disk);
    let _ = std::fs::remove_dir(&at);
}

#[test]
fn a_failed_sync_drops_the_dirty_pages_and_a_failed_write_changes_nothing() {
    const NAME: &str = "a_failed_sync_drops_the_dirty_pages_and_a_failed_write_changes_nothing";
    if let Err(why) = Disk::available() {
        test_support::skip(NAME, test_support::Missing::Mount, &why);
        return;
    }
    use test_support::powercut::Fault;
    let at = std::env::temp_dir().join(format!("powercut-faults-{}", std::process::id()));
    let mut disk = Disk::mount(&at).unwrap();
    let root = disk.path().to_path_buf();
    let open = |name: &str| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(root.join(name))
            .unwrap()
    };
    let (log, other) = (open("vol-1.log"), open("other"));
    sync_dir(&root);
    log.write_all_at(&[1u8; 8192], 0).unwrap();
    log.sync_data().unwrap();

    // the second sync of a "vol-1.log*" file fails; syncs of other files are not counted
    disk.inject(Fault::sync(Some("vol-1.log"), 2));
    log.write_all_at(&[2u8; 4096], 0).unwrap();
    other.write_all_at(b"other", 0).unwrap();
    other.sync_data().unwrap();
    log.sync_data().unwrap();
    // fsyncgate: the page written since, and the growth past the durable end, are dropped
    log.write_all_at(&[3u8; 100], 4096).unwrap();
    log.write_all_at(&[4u8; 4096], 8192).unwrap();
    let e = log.sync_data().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EIO), "{e}");
    let mut now = vec![0u8; 12_288];
    log.read_exact_at(&mut now, 0).unwrap();
    assert!(now[..4096].iter().all(|&b| b == 2), "the page synced before stays");
    assert!(
        now[4096..8192].iter().all(|&b| b == 1),
        "a dropped page reads as it was durable"
    );
    assert!(
        now[8192..].iter().all(|&b| b == 0),
        "a dropped page past the durable end is zeros"
    );
    // the pages are clean: the next sync "succeeds", and what it dropped is not durable
    log.sync_data().unwrap();
    let st = disk.stats();
    assert_eq!((st.failed_syncs, st.pages_dropped), (1, 2), "{st:?}");

    // the 2nd write to any file fails with EIO and changes nothing; the fault is once only
    disk.inject(Fault::write(None, 2));
    other.write_all_at(b"A", 0).unwrap();
    let e = other.write_all_at(b"B", 1).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(EIO), "{e}");
    other.write_all_at(b"C", 2).unwrap();
    let mut o = [0u8; 5];
    other.read_exact_at(&mut o, 0).unwrap();
    assert_eq!(&o, b"AtCer");
    // a sticky fault fails every matching call from its nth on, until healed
    disk.inject(Fault::write(Some("oth"), 1).sticky());
    assert!(other.write_all_at(b"x", 0).is_err());
    assert!(other.write_all_at(b"y", 0).is_err());
    log.write_all_at(b"z", 0).unwrap();
    disk.heal();
    other.write_all_at(b"D", 3).unwrap();
    other.sync_data().unwrap();
    assert_eq!(disk.stats().failed_writes, 3, "{:?}", disk.stats());

    disk.power_cut();
    drop((log, other));
    disk.power_on().unwrap();
    let log = read(&root.join("vol-1.log")).unwrap();
    assert_eq!(log.len(), 12_288, "the size was synced after the failure");
    assert!(
        log[..4096].iter().all(|&b| b == 2),
        "the write after the last sync is lost"
    );
    assert!(log[4096..8192].iter().all(|&b| b == 1));
    assert!(log[8192..].iter().all(|&b| b == 0));
    assert_eq!(read(&root.join("other")).unwrap(), b"AtCDr");
    drop(disk);
    let _ = std::fs::remove_dir(&at);
}

/// `EIO` on Linux.
const EIO: i32 = 5;
