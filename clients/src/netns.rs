//! Two network namespaces joined by a veth pair, for benchmarks whose bytes must cross a link
//! between two "hosts" (`flexns bench`'s `netns-*` rows): the client runs in namespace A
//! ([`A_IP`]), the servers in namespace B ([`B_IP`]).
//!
//! Each namespace is held by a child process (`unshare --net sleep infinity`) rather than by a
//! name under `/run/netns`: a namespace lives while a process is in it, and every process in
//! these (the holders, the servers, the client) is started by [`crate::procs::command`], so
//! the kernel kills it when this program ends, however it ends (an error, a panic, SIGINT, a
//! second signal, SIGKILL). The namespaces, and the veth pair in them, go with their last
//! process; nothing is ever created in this program's own namespace. [`Pair`]'s drop stops
//! the holders at once on the orderly paths.
//!
//! Processes enter a namespace with `nsenter --net`, which executes the program in place (the
//! process id a run accounts CPU for is the program's). Needs root (`CAP_SYS_ADMIN`) and the
//! tools `ip` (iproute2), `unshare` and `nsenter` (util-linux).

use anyhow::{bail, Context as _, Result};
use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Namespace A's address on the veth (the client's side).
pub const A_IP: &str = "10.78.0.1";
/// Namespace B's address on the veth (the servers' side).
pub const B_IP: &str = "10.78.0.2";
/// The veth's name in namespace A (its peer in B is [`VETH_B`]).
pub const VETH_A: &str = "fxva";
/// The veth's name in namespace B.
pub const VETH_B: &str = "fxvb";
/// The veth's MTU: a jumbo frame, as on a RoCE network, so that a 4096-byte RDMA MTU packet
/// (and the references' datagrams) crosses unfragmented.
pub const MTU: u32 = 9000;

/// Why the namespaces cannot be made here, or None when they can (root and the tools).
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (network namespaces and a veth pair)".into());
    }
    for (tool, arg, pkg) in [
        ("ip", "-V", "iproute2"),
        ("unshare", "--version", "util-linux"),
        ("nsenter", "--version", "util-linux"),
    ] {
        let ran = Command::new(tool)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ran {
            return Some(format!("needs `{tool}` ({pkg})"));
        }
    }
    None
}

/// One namespace: the process holding it.
struct Holder {
    child: Option<Child>,
    pid: u32,
}

impl Holder {
    fn start() -> Result<Holder> {
        let mut cmd = crate::procs::command("unshare");
        cmd.args(["--net", "sleep", "infinity"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = crate::procs::spawn(&mut cmd).context("starting `unshare --net`")?;
        let pid = child.id();
        let mine = std::fs::read_link("/proc/self/ns/net").context("reading /proc/self/ns/net")?;
        // `unshare` enters its new namespace, then executes sleep: wait for the first
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                crate::procs::reaped(pid);
                bail!("`unshare --net` exited ({st}): cannot make a network namespace");
            }
            match std::fs::read_link(format!("/proc/{pid}/ns/net")) {
                Ok(ns) if ns != mine => break,
                _ if Instant::now() > deadline => {
                    crate::procs::terminate(child, Duration::ZERO);
                    bail!("`unshare --net` made no namespace within 5 s");
                }
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        Ok(Holder {
            child: Some(child),
            pid,
        })
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(c) = self.child.take() {
            crate::procs::terminate(c, Duration::ZERO);
        }
    }
}

/// Which of the two namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The client's ([`A_IP`]).
    A,
    /// The servers' ([`B_IP`]).
    B,
}

/// Bytes a veth end has sent and received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// Packets received.
    pub rx_packets: u64,
}

/// Two network namespaces joined by a veth pair ([`VETH_A`] `A_IP/24` in A, [`VETH_B`]
/// `B_IP/24` in B, MTU [`MTU`], the kernel's default offloads), both loopbacks up.
pub struct Pair {
    a: Holder,
    b: Holder,
}

impl Pair {
    /// Makes the namespaces and the link (see [`unavailable`] for what it needs).
    pub fn create() -> Result<Pair> {
        let pair = Pair {
            a: Holder::start()?,
            b: Holder::start()?,
        };
        let (mtu, bpid) = (MTU.to_string(), pair.b.pid.to_string());
        let a_cidr = format!("{A_IP}/24");
        let b_cidr = format!("{B_IP}/24");
        // made inside A with its peer moved straight into B: nothing appears in this namespace
        #[rustfmt::skip]
        let steps: [(Side, Vec<&str>); 7] = [
            (Side::A, vec!["link", "add", VETH_A, "mtu", &mtu, "type", "veth", "peer", "name", VETH_B, "mtu", &mtu, "netns", &bpid]),
            (Side::A, vec!["addr", "add", &a_cidr, "dev", VETH_A]),
            (Side::B, vec!["addr", "add", &b_cidr, "dev", VETH_B]),
            (Side::A, vec!["link", "set", VETH_A, "up"]),
            (Side::B, vec!["link", "set", VETH_B, "up"]),
            (Side::A, vec!["link", "set", "lo", "up"]),
            (Side::B, vec!["link", "set", "lo", "up"]),
        ];
        for (side, args) in steps {
            pair.ip(side, &args)?;
        }
        Ok(pair)
    }

    fn pid(&self, side: Side) -> u32 {
        match side {
            Side::A => self.a.pid,
            Side::B => self.b.pid,
        }
    }

    /// A command (made by [`crate::procs::command`]) that runs `program` in namespace `side`.
    pub fn command(&self, side: Side, program: impl AsRef<OsStr>) -> Command {
        let mut c = crate::procs::command("nsenter");
        c.arg("--net")
            .arg(format!("--target={}", self.pid(side)))
            .arg("--")
            .arg(program);
        c
    }

    /// Runs `ip ARGS` in namespace `side`; its stdout.
    fn ip(&self, side: Side, args: &[&str]) -> Result<String> {
        let o = crate::procs::output(self.command(side, "ip").args(args), libc::SIGKILL).context("running ip")?;
        if !o.status.success() {
            bail!(
                "ip {} (in namespace {side:?}): {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// The byte and packet counters of the veth end in namespace `side`.
    pub fn counters(&self, side: Side) -> Result<Counters> {
        let dev = match side {
            Side::A => VETH_A,
            Side::B => VETH_B,
        };
        let out = self.ip(side, &["-j", "-s", "link", "show", "dev", dev])?;
        let v: serde_json::Value = serde_json::from_str(&out).with_context(|| format!("ip -j -s link: {out}"))?;
        let s = &v[0]["stats64"];
        let n = |dir: &str, k: &str| -> Result<u64> {
            s[dir][k]
                .as_u64()
                .with_context(|| format!("ip -j -s link show {dev}: no stats64.{dir}.{k} in {out}"))
        };
        Ok(Counters {
            tx_bytes: n("tx", "bytes")?,
            rx_bytes: n("rx", "bytes")?,
            tx_packets: n("tx", "packets")?,
            rx_packets: n("rx", "packets")?,
        })
    }

    /// Starts `exe ARGS` in namespace B as a server child (its first stdout line is its
    /// banner, see [`crate::bench::ChildServer`]).
    pub fn server(&self, exe: &Path, args: &[String]) -> Result<crate::bench::ChildServer> {
        let mut all = vec![
            "--net".to_string(),
            format!("--target={}", self.b.pid),
            "--".into(),
            exe.display().to_string(),
        ];
        all.extend(args.iter().cloned());
        crate::bench::ChildServer::start(Path::new("nsenter"), &all)
            .with_context(|| format!("starting {} in namespace B", exe.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_is_in_namespaces_of_its_own_that_go_with_their_holders() {
        if let Some(why) = unavailable() {
            let m = if why.contains("root") {
                test_support::Missing::Root
            } else {
                test_support::Missing::Tool
            };
            test_support::skip("netns pair", m, &why);
            return;
        }
        let p = Pair::create().unwrap();
        // each end is in its namespace, none in this one
        p.counters(Side::A).unwrap();
        p.counters(Side::B).unwrap();
        assert!(!Path::new(&format!("/sys/class/net/{VETH_A}")).exists());
        assert!(p.ip(Side::A, &["link", "show", "dev", VETH_B]).is_err());
        let (a, b) = (p.a.pid, p.b.pid);
        drop(p);
        assert!(!crate::procs::exists(a) && !crate::procs::exists(b));
    }
}
