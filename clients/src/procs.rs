//! Processes: children that never outlive the program that started them, and the program's
//! own orderly stop on SIGINT and SIGTERM.
//!
//! Every child a program of this crate starts (a benchmark's servers, a local cluster's
//! daemons, redis-server, qemu-nbd, fio, qemu-img) is made by [`command`] and started by
//! [`spawn`] or [`output`]:
//! - it gets `PR_SET_PDEATHSIG(SIGKILL)`, so the kernel kills it when the thread that started
//!   it ends, however this process ends (a panic, `exit`, SIGKILL). Start children from a
//!   thread that lives as long as they should (the main thread, or a test's thread).
//! - it runs in its own process group, so a terminal's Ctrl-C reaches only this program, which
//!   then stops its children itself, after printing what it measured.
//! - it is registered until reaped, so the stop watchdog can find it.
//!
//! [`install_stop_handler`]: the first SIGINT or SIGTERM sets [`stopping`]; run loops check it,
//! end early and print their results marked incomplete, and the children's owners stop them as
//! on any exit. If the program is still running [`STOP_GRACE`] later, or on a second signal, the
//! watchdog kills every registered child's process group and exits with 128 + the signal.
//!
//! Daemons a user starts on purpose to outlive the command (`blkctl cluster up`) are made with
//! [`detached_command`] instead and are not registered.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an orderly stop may take before the watchdog kills the children and exits.
pub const STOP_GRACE: Duration = Duration::from_millis(600);

static STOPPING: AtomicBool = AtomicBool::new(false);
static SIGNAL: AtomicI32 = AtomicI32::new(0);
static LIVE: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// A command for a child that dies with this program (see the module notes).
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new(program);
    c.process_group(0);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure calls only prctl, getppid and _exit, which are
    // async-signal-safe, and touches no memory of the parent.
    unsafe {
        c.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // the parent may have died before the prctl: then nothing would ever kill us
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    c
}

/// A command for a daemon meant to outlive this program: its own session, no parent-death
/// signal, not registered.
pub fn detached_command(program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new(program);
    // SAFETY: setsid in the child between fork and exec is async-signal-safe and touches no
    // memory of the parent.
    unsafe {
        c.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    c
}

/// Starts `cmd` (made by [`command`]) and registers the child until [`reaped`].
pub fn spawn(cmd: &mut Command) -> std::io::Result<Child> {
    // hold the registry across the spawn, so a stop in between still sees the child
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let child = cmd.spawn()?;
    live.insert(child.id());
    Ok(child)
}

/// Forgets a child this program has waited for.
pub fn reaped(pid: u32) {
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).remove(&pid);
}

/// Children started by [`spawn`] and not yet reaped.
pub fn live_children() -> Vec<u32> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
}

/// Whether a SIGINT or SIGTERM asked this program to stop.
pub fn stopping() -> bool {
    STOPPING.load(Ordering::Relaxed)
}

/// Whether a timed run should go on: before `end` and not asked to stop.
pub fn running_until(end: Instant) -> bool {
    !stopping() && Instant::now() < end
}

/// What a program returns after its work: the interrupted error if it was asked to stop.
pub fn finish() -> anyhow::Result<()> {
    if stopping() {
        return Err(interrupted_error());
    }
    Ok(())
}

/// The signal that asked this program to stop, if one did.
pub fn stop_signal() -> Option<i32> {
    match SIGNAL.load(Ordering::Relaxed) {
        0 => None,
        s => Some(s),
    }
}

/// The error a program ends with after an orderly stop (its results so far were printed,
/// marked incomplete).
pub fn interrupted_error() -> anyhow::Error {
    let name = match stop_signal() {
        Some(libc::SIGTERM) => "SIGTERM",
        _ => "SIGINT",
    };
    anyhow::anyhow!("interrupted by {name}: the results above are incomplete")
}

fn kill_all_and_exit(sig: i32) -> ! {
    for pid in live_children() {
        // SAFETY: signalling a process group and a process by id; no memory is involved.
        unsafe {
            libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    std::process::exit(128 + sig)
}

/// Installs the SIGINT/SIGTERM handling described in the module notes (once per process).
pub fn install_stop_handler(program: &'static str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut signals = match signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM]) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("cannot handle SIGINT/SIGTERM: {e}");
                return;
            }
        };
        let spawned = std::thread::Builder::new().name("stop-signals".into()).spawn(move || {
            for sig in signals.forever() {
                if STOPPING.swap(true, Ordering::SeqCst) {
                    kill_all_and_exit(sig);
                }
                SIGNAL.store(sig, Ordering::SeqCst);
                eprintln!("{program}: stopping; what was measured so far is reported as incomplete");
                let _ = std::thread::Builder::new().name("stop-watchdog".into()).spawn(move || {
                    std::thread::sleep(STOP_GRACE);
                    eprintln!("{program}: not stopped within {STOP_GRACE:?}; killing its children");
                    kill_all_and_exit(sig);
                });
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the signal thread: {e}");
        }
    });
}

/// CPU seconds and peak RSS (KiB) of a reaped child.
pub type Usage = (f64, u64);

fn wait4(pid: u32, flags: libc::c_int) -> Option<(ExitStatus, Usage)> {
    use std::os::unix::process::ExitStatusExt;
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid out-value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child with valid out-pointers.
    let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, flags, &mut ru) };
    if r != pid as libc::pid_t {
        return None;
    }
    reaped(pid);
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    Some((
        ExitStatus::from_raw(status),
        (t(ru.ru_utime) + t(ru.ru_stime), ru.ru_maxrss as u64),
    ))
}

/// Stops a child: SIGTERM, then SIGKILL if it has not exited within `grace`; reaps it and
/// returns its CPU seconds and peak RSS.
pub fn terminate(child: Child, grace: Duration) -> Option<Usage> {
    let pid = child.id();
    // a std Child does nothing on drop; we reap it ourselves below
    drop(child);
    // our own child, unreaped, so the pid is still its
    signal(pid, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        match wait4(pid, libc::WNOHANG) {
            Some((_, u)) => return Some(u),
            None if Instant::now() >= deadline => {
                signal(pid, libc::SIGKILL);
                return wait4(pid, 0).map(|(_, u)| u);
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Kills a child with SIGKILL (a crash, for tests and benchmarks) and reaps it.
pub fn kill9(child: Child) {
    let pid = child.id();
    drop(child);
    // SAFETY: signalling our own unreaped child.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let _ = wait4(pid, 0);
}

/// Runs `cmd` (made by [`command`]) to its end and collects its output, like
/// [`Command::output`]; when this program is asked to stop meanwhile, the child gets
/// `on_stop` (fio, for one, ends its jobs on SIGINT and still prints its report), and SIGKILL
/// if it is still running [`STOP_GRACE`] / 2 later.
pub fn output(cmd: &mut Command, on_stop: libc::c_int) -> std::io::Result<Output> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = spawn(cmd)?;
    let pid = child.id();
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    drop(child);
    let mut signalled: Option<Instant> = None;
    let status = loop {
        if let Some((st, _)) = wait4(pid, libc::WNOHANG) {
            break st;
        }
        match signalled {
            None if stopping() => {
                // SAFETY: signalling our own unreaped child.
                unsafe { libc::kill(pid as libc::pid_t, on_stop) };
                signalled = Some(Instant::now());
            }
            Some(t) if t.elapsed() > STOP_GRACE / 2 => {
                signal(pid, libc::SIGKILL);
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Sends signal `sig` (a `libc::SIG*` number) to process `pid`; false when it is gone (or the
/// number is no signal).
pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    let (Some(p), Some(s)) = (
        rustix::process::Pid::from_raw(pid as i32),
        rustix::process::Signal::from_named_raw(sig),
    ) else {
        return false;
    };
    rustix::process::kill_process(p, s).is_ok()
}

/// Whether a process with id `pid` exists (signal 0: the kernel checks, sends nothing).
pub fn exists(pid: u32) -> bool {
    rustix::process::Pid::from_raw(pid as i32).is_some_and(|p| rustix::process::test_kill_process(p).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_dies_with_the_thread_that_started_it() {
        // a thread starts a long sleep and ends; the kernel kills the sleep
        let pid = std::thread::spawn(|| spawn(command("sleep").arg("30")).unwrap().id())
            .join()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some((st, _)) = wait4(pid, libc::WNOHANG) {
                break st;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the child outlived its parent thread"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(!live_children().contains(&pid));
    }

    #[test]
    fn terminate_escalates_to_sigkill() {
        // a child that ignores SIGTERM is killed after the grace period
        let c = spawn(command("sh").args(["-c", "trap '' TERM; sleep 30"])).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert!(terminate(c, Duration::from_millis(200)).is_some());
        assert!(t.elapsed() >= Duration::from_millis(200));
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn output_collects_what_the_child_printed() {
        let o = output(
            command("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            libc::SIGINT,
        )
        .unwrap();
        assert_eq!(o.stdout, b"out\n");
        assert_eq!(o.stderr, b"err\n");
        assert_eq!(o.status.code(), Some(3));
    }
}
