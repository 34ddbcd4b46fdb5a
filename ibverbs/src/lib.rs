//! flexns as `libibverbs.so.1`: unmodified RDMA programs (perftest, ibverbs-utils, ...) load
//! this library instead of rdma-core's through `LD_LIBRARY_PATH` and find one device,
//! `flexns0`, whose verbs run on an in-process flexns engine ([`netstack::verbs::Context`]).
//!
//! `scripts/build-ibverbs.sh` links the crate's staticlib into `libibverbs.so.1` with the
//! versioned symbols rdma-core exports (IBVERBS_1.0, 1.1, 1.6, 1.8, 1.11, IBVERBS_PRIVATE_34;
//! see `ibverbs.map`), and the same archive into small `libmlx5.so.1`, `libefa.so.1` and
//! `librdmacm.so.1` whose functions fail cleanly ([`stubs`]), since perftest's binaries need
//! them at load time. See `docs/IBVERBS.md`.
//!
//! Addressing: each process has its own loopback address (`127.a.b.c` from its pid, or
//! `FLEXNS_IBV_ADDR`), binds UDP 4791 there, and offers it as its RoCEv2 GID `::ffff:a.b.c.d`;
//! a QP's peer is the address in `ah_attr.grh.dgid`, port 4791.
//!
//! Every exported function catches panics ([`guard`]): a bug answers with an error, never an
//! unwind across the C boundary.

#![warn(unreachable_pub, missing_docs)]

pub mod abi;
pub mod stubs;
// The verbs are `#[no_mangle] pub extern "C"`: C programs reach them by symbol through the
// staticlib, not by a Rust path, so they are public on purpose.
#[allow(unreachable_pub)]
mod verbs;

pub use verbs::process_addr;

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f`, answering `fail` (and reporting the panic on stderr) if it panics: no unwind
/// crosses an exported function.
pub(crate) fn guard<T>(what: &str, fail: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            report(&format!("{what}: internal error (panic caught); failing the call"));
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: libc::c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for writes for
    // the thread's lifetime.
    unsafe { *libc::__errno_location() = e };
}

/// Writes a line about a refused call on stderr (the only channel an unmodified program's user
/// sees), unless `FLEXNS_IBV_QUIET` is set.
pub(crate) fn report(msg: &str) {
    if std::env::var_os("FLEXNS_IBV_QUIET").is_none() {
        use std::io::Write;
        // a failed write to stderr is ignored: `eprintln!` would panic (and panic again in the
        // guard that reports a panic)
        let _ = writeln!(std::io::stderr(), "flexns-ibverbs: {msg}");
    }
}

/// [`report`] for the refusals of a post (a program may repeat one per request, millions of
/// times): at most one line per second, the next one saying how many were left out.
pub(crate) fn report_post(msg: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_S: AtomicU64 = AtomicU64::new(u64::MAX);
    static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let now = EPOCH.get_or_init(std::time::Instant::now).elapsed().as_secs();
    let last = LAST_S.load(Ordering::Relaxed);
    if last != u64::MAX && now <= last
        || LAST_S
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match SUPPRESSED.swap(0, Ordering::Relaxed) {
        0 => report(msg),
        n => report(&format!("{msg} ({n} similar lines left out in the last second)")),
    }
}
