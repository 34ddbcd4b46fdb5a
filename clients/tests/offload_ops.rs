//! `nsperf client --op batch-read | list-walk | redn-get` against a real `nsperf server` child:
//! every run verifies its data and prints the ratio against its reference.

use std::process::Command;

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let o = Command::new(env!("CARGO_BIN_EXE_nsperf"))
        .args(["client", "--duration", "0.3", "--pairs", "1", "--json"])
        .args(args)
        .output()
        .expect("nsperf runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "nsperf {args:?} failed: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect()
}

fn check(lines: &[serde_json::Value], bench: &str) -> f64 {
    let runs: Vec<&serde_json::Value> = lines.iter().filter(|l| l["bench"] != "ratio").collect();
    assert_eq!(runs.len(), 2, "the run and its reference: {lines:?}");
    assert_eq!(runs[0]["bench"], bench, "{}", runs[0]);
    for r in &runs {
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["ops"].as_u64().unwrap() > 0, "{r}");
    }
    // the ratio is the quotient of the run and its reference (p50 for latency, Mop/s for rates)
    let ratio = lines.iter().find(|l| l["bench"] == "ratio").expect("a ratio line");
    let metric = if bench.ends_with("_lat") { "p50_us" } else { "mops" };
    assert_eq!(ratio["metric"], metric, "{ratio}");
    let want = runs[0][metric].as_f64().unwrap() / runs[1][metric].as_f64().unwrap();
    let got = ratio["ratio"].as_f64().unwrap();
    assert!(
        (got - want).abs() <= 0.002 + 0.01 * want,
        "ratio {got}, runs say {want}: {ratio}"
    );
    for r in &runs {
        assert_eq!(
            r["processes"].as_array().unwrap().len(),
            2,
            "client and server accounted: {r}"
        );
    }
    got
}

#[test]
fn batched_read_list_walk_and_redn_get_verify_and_report_ratios() {
    let b = run(&["--op", "batch-read", "--batch", "32", "--size", "64", "--depth", "8"]);
    check(&b, "batch_read_rate");
    let w = run(&["--op", "list-walk", "--hops", "8", "--mode", "offload"]);
    check(&w, "list_walk_lat");
    let rt = w.iter().find(|l| l["system"] == "flexns walk=client").unwrap();
    assert_eq!(rt["round_trips_per_lookup"], 8.0, "the client walk READs each node");
    let g = run(&["--op", "redn-get"]);
    check(&g, "redn_get_lat");
}
