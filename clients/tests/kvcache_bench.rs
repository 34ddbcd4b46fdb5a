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
    // the ratio line is the quotient of the two runs (not merely present), and each run
    // accounts for both processes' CPU: this prefill process and the decode child
    let ratio = lines.iter().find(|l| l["bench"] == "ratio").expect("ratio line");
    assert_eq!(ratio["reference"], "tcp");
    let g = |sys: &str| {
        lines
            .iter()
            .find(|l| l["bench"] == "kvcache_write" && l["system"] == sys)
            .unwrap()["gbps"]
            .as_f64()
            .unwrap()
    };
    let want = g("flexns") / g("tcp");
    let got = ratio["ratio"].as_f64().unwrap();
    assert!(
        (got - want).abs() <= 0.002 + 0.01 * want,
        "ratio {got}, runs say {want}: {ratio}"
    );
    assert!(ratio["cpu_us_per_op_ratio"].as_f64().is_some(), "{ratio}");
    for l in lines.iter().filter(|l| l["bench"] == "kvcache_write") {
        let roles: Vec<&str> = l["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["prefill", "decode"], "{l}");
        assert!(l["cpu_us_per_op"].as_f64().unwrap() > 0.0, "{l}");
    }
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
