//! The same-host one-copy path between two real processes: `nsperf client --link shm` against
//! the `nsperf server` child it starts (which gets `--link shm` too), and `kvcache-bench --link
//! shm` against its decode child. Each run verifies its data where it landed, and its counters
//! (nsperf's client context, kvcache-bench's prefill engine) say which path the bytes took: one
//! copy into the peer's memory (almost nothing sent as packets), or, with
//! `--no-same-host-copy`, packets through the shm rings.

use serde_json::Value;
use std::process::Command;

fn run(exe: &str, args: &[&str]) -> Vec<Value> {
    let o = Command::new(exe)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the program runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{exe} {args:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The flexns run line of `nsperf client --size 1MiB --duration 0.3 --json` with `extra`.
fn nsperf(extra: &[&str]) -> Value {
    let mut args = vec!["client", "--size", "1MiB", "--duration", "0.3", "--json"];
    args.extend_from_slice(extra);
    let lines = run(env!("CARGO_BIN_EXE_nsperf"), &args);
    let r = lines
        .iter()
        .find(|l| l["system"] == "flexns" && l["bench"] != "ratio")
        .unwrap_or_else(|| panic!("no flexns line in {lines:?}"))
        .clone();
    assert_eq!(r["verified"], true, "{r}");
    assert!(r["bytes"].as_u64().unwrap() >= 1 << 20, "{r}");
    r
}

fn n(r: &Value, k: &str) -> u64 {
    r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {r}"))
}

/// Every payload byte went by one copy into (or out of) the server's registered memory: the
/// counter covers the run's bytes (and the verifying transfers), and what went as packets is
/// the connection's few control messages, not a thousandth of the payload.
fn by_one_copy(r: &Value) {
    let bytes = n(r, "bytes");
    assert!(n(r, "same_host_copy_bytes") >= bytes, "{r}");
    assert!(n(r, "tx_bytes") < bytes / 1000, "payload went as packets: {r}");
}

#[test]
fn a_write_over_the_shm_link_is_one_copy_into_the_servers_memory() {
    by_one_copy(&nsperf(&["--op", "write", "--link", "shm"]));
}

#[test]
fn a_read_over_the_shm_link_is_one_copy_out_of_the_servers_memory() {
    by_one_copy(&nsperf(&["--op", "read", "--link", "shm"]));
}

#[test]
fn without_the_same_host_copy_the_bytes_go_as_packets_through_the_rings() {
    let r = nsperf(&["--op", "write", "--link", "shm", "--no-same-host-copy"]);
    assert_eq!(n(&r, "same_host_copy_bytes"), 0, "{r}");
    assert_eq!(n(&r, "same_host_cma_bytes"), 0, "{r}");
    // every payload byte was sent as a packet, and through the rings: a ring message holds
    // at most 64 KiB, and only the first few datagrams, before the rings attach, go by UDP
    assert!(n(&r, "tx_bytes") >= n(&r, "bytes"), "{r}");
    assert!(n(&r, "shm_tx_messages") >= n(&r, "bytes") / (128 << 10), "{r}");
}

#[test]
fn kvcache_bench_over_the_shm_link_verifies_and_says_so() {
    let lines = run(
        env!("CARGO_BIN_EXE_kvcache-bench"),
        &[
            "--size",
            "1MiB",
            "--link",
            "shm",
            "--compare",
            "tcp",
            "--pairs",
            "1",
            "--duration",
            "0.3",
            "--json",
        ],
    );
    let flexns = lines
        .iter()
        .find(|l| l["bench"] == "kvcache_write" && l["system"] == "flexns")
        .unwrap_or_else(|| panic!("no flexns line in {lines:?}"));
    assert_eq!(flexns["verified"], true, "{flexns}");
    assert_eq!(flexns["link"], "shm", "{flexns}");
    // the prefill engine's counters: its WRITEs (and verifying READs) went by one copy
    by_one_copy(flexns);
    let tcp = lines
        .iter()
        .find(|l| l["bench"] == "kvcache_write" && l["system"] == "tcp")
        .unwrap_or_else(|| panic!("no tcp line in {lines:?}"));
    assert_eq!(tcp["verified"], true, "{tcp}");
    assert!(tcp.get("link").is_none(), "the tcp transport has no link: {tcp}");
    let ratio = lines.iter().find(|l| l["bench"] == "ratio").expect("a ratio line");
    assert_eq!(ratio["link"], "shm", "{ratio}");
}
