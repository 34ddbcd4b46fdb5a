//! `kvcache-bench` end to end: it starts decode engines as child processes, moves data over
//! flexns and kernel TCP, verifies it by reading back, and prints result and ratio lines (plain
//! transfers and request mode: one request's paged KV blocks with a notification).

use std::process::Command;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let o = Command::new(env!("CARGO_BIN_EXE_kvcache-bench"))
        .args(args)
        .args(["--pairs", "1", "--duration", "0.3", "--json"])
        .output()
        .expect("kvcache-bench runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "kvcache-bench {args:?} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn transfers_over_both_transports_verify_and_compare() {
    let lines = run(&["--size", "1MiB", "--compare", "tcp"]);
    for sys in ["flexns", "tcp"] {
        let r = lines
            .iter()
            .find(|l| l["bench"] == "kvcache_write" && l["system"] == sys)
            .unwrap_or_else(|| panic!("{sys} line in {lines:?}"));
        assert_eq!(r["verified"], true, "{r}");
        assert!(
            r["gbps"].as_f64().unwrap() > 0.0 && r["p50_us"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
    let ratio = lines.iter().find(|l| l["bench"] == "ratio").expect("ratio line");
    assert_eq!(ratio["reference"], "tcp");
    assert!(ratio["ratio"].as_f64().unwrap() > 0.0, "{ratio}");
}

#[test]
fn request_mode_moves_paged_blocks_with_a_notification() {
    // 40 tokens of a small model: 3 blocks of 16 tokens
    let lines = run(&["--tokens", "40", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"]);
    let r = lines
        .iter()
        .find(|l| l["bench"] == "kvcache_request")
        .expect("request line");
    assert_eq!(r["blocks"], 3, "{r}");
    assert_eq!(r["verified"], true, "{r}");
    // 3 blocks × 2 layers × K,V × 16 tokens × 2 heads × 64 × fp16
    assert_eq!(r["msg_bytes"], 3 * 2 * 2 * 16 * 2 * 64 * 2, "{r}");
}

#[test]
fn bad_flags_are_named() {
    let o = Command::new(env!("CARGO_BIN_EXE_kvcache-bench"))
        .args(["--size", "12 parsecs"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--size"));
    let o = Command::new(env!("CARGO_BIN_EXE_kvcache-bench"))
        .args(["--system", "infiniband"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("flexns, tcp"));
}
