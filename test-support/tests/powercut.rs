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
