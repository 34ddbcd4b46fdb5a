//! What the ibverbs tests share: the built libraries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The directory with the built `libibverbs.so.1` and its companions (`scripts/build-ibverbs.sh`,
/// run once per test process: two builds at once race on the output files).
pub fn libdir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
        let out = Command::new(root.join("scripts/build-ibverbs.sh"))
            .current_dir(&root)
            .output()
            .expect("scripts/build-ibverbs.sh runs");
        assert!(
            out.status.success(),
            "build-ibverbs.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        assert!(
            dir.join("libibverbs.so.1").exists(),
            "{} has no libibverbs.so.1",
            dir.display()
        );
        dir
    })
}
