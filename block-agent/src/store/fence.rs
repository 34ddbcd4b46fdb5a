//! A volume's fence on this node: the lowest attachment epoch whose requests it serves. The
//! controller gives each attachment of a volume a higher epoch; the agent that gets it fences
//! every replica at it before its first I/O, so an agent the volume was taken from (cut off,
//! hung, or not told) can neither write nor read it any more. The fence is kept in
//! `vol-N.fence` (its decimal value), replaced whole and synced, so it holds after a restart.

use super::{sync_dir, StoreError};
use parking_lot::Mutex;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// The fence file of volume `volume` in `dir`.
pub(super) fn path(dir: &Path, volume: u32) -> PathBuf {
    dir.join(format!("vol-{volume}.fence"))
}

/// A volume's fence: read without a lock, raised under one.
pub(super) struct Fence {
    epoch: AtomicU32,
    raise: Mutex<()>,
}

impl Fence {
    /// The fence kept in `dir` (0, none, when no file is there).
    pub(super) fn load(dir: &Path, volume: u32) -> Result<Fence, StoreError> {
        let p = path(dir, volume);
        let epoch = match std::fs::read_to_string(&p) {
            Ok(s) => s
                .trim()
                .parse()
                .map_err(|_| StoreError::Invalid(format!("{}: {:?} is not an epoch", p.display(), s.trim()), volume))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(source) => {
                return Err(StoreError::Io {
                    volume,
                    what: format!("reading {}", p.display()),
                    source,
                })
            }
        };
        Ok(Fence {
            epoch: AtomicU32::new(epoch),
            raise: Mutex::new(()),
        })
    }

    /// The lowest epoch served.
    pub(super) fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Raises the fence to `epoch` durably (a lower one changes nothing); the fence in effect.
    pub(super) fn raise(&self, dir: &Path, volume: u32, epoch: u32) -> Result<u32, StoreError> {
        let _one = self.raise.lock();
        let now = self.epoch();
        if epoch <= now {
            return Ok(now);
        }
        let p = path(dir, volume);
        let tmp = p.with_extension("fence.new");
        (|| {
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{epoch}")?;
            f.sync_all()?;
            std::fs::rename(&tmp, &p)?;
            sync_dir(dir)
        })()
        .map_err(|source| StoreError::Io {
            volume,
            what: format!("writing {}", p.display()),
            source,
        })?;
        self.epoch.store(epoch, Ordering::Release);
        Ok(epoch)
    }
}
