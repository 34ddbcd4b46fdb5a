//! `flexnsd-bench` end to end: it starts a real `flexnsd` (application drive, as
//! deploy/config/flexnsd.toml), runs the same work in-process and through the daemon with either
//! in-process waiting discipline, and prints one ratio line per pair. No timing is asserted
//! (figures come from running the bench itself, docs/FLEXNSD.md); this checks that the
//! measuring tool works and says which discipline it measured.

use std::process::Command;

/// The WRITE and SEND p50 ratios of a `WRITE a  SEND p50 b  CPU/WRITE c  CPU/SEND d` line.
fn ratios(line: &str) -> Option<(f64, f64)> {
    let w: Vec<&str> = line.split_whitespace().collect();
    let after = |name: &str| -> Option<f64> {
        let i = w.iter().position(|x| *x == name)?;
        w.get(i + 1)?.parse().ok()
    };
    // the CPU ratios must be there, as numbers (NaN where a run used less than a clock tick)
    after("CPU/WRITE")?;
    after("CPU/SEND")?;
    Some((after("WRITE")?, after("p50")?))
}

#[test]
fn bench_compares_both_sides_with_either_in_process_wait() {
    let dir = std::env::temp_dir().join(format!("flexnsd-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("daemon.toml");
    std::fs::write(&cfg, "[context]\nbind = \"127.0.0.1:0\"\ndrive = \"application\"\n").unwrap();
    for spin in ["0", "50"] {
        let out = Command::new(env!("CARGO_BIN_EXE_flexnsd-bench"))
            .args([
                "--pairs",
                "1",
                "--writes",
                "3",
                "--sends",
                "20",
                "--inproc-spin-us",
                spin,
            ])
            .arg("--flexnsd")
            .arg(env!("CARGO_BIN_EXE_flexnsd"))
            .arg("--daemon-config")
            .arg(&cfg)
            .output()
            .expect("run flexnsd-bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "flexnsd-bench --inproc-spin-us {spin} failed: {}\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            stdout.contains(&format!(
                "in-process application polls its CQ {spin} us before sleeping"
            )),
            "the bench does not say which discipline it measured:\n{stdout}"
        );
        assert!(
            stdout.contains("every run's WRITEs verified at the target"),
            "the bench does not say its data was checked:\n{stdout}"
        );
        let lines: Vec<&str> = stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("WRITE "))
            .collect();
        assert_eq!(lines.len(), 1, "one ratio line per pair:\n{stdout}");
        let (write, send) = ratios(lines[0]).unwrap_or_else(|| panic!("unparsable ratio line {:?}", lines[0]));
        // CPU ratios of three WRITEs can be 0/0 at the kernel's tick; bandwidth and latency
        // are measured with a monotonic clock and are always positive
        for (name, v) in [("WRITE", write), ("SEND p50", send)] {
            assert!(v.is_finite() && v > 0.0, "{name} ratio {v} in {:?}", lines[0]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--json` (what `flexns bench` reads): only JSON lines on stdout, a verified line per run
/// (in-process and flexnsd alternating), then the WRITE and SEND ratio lines over the pairs.
#[test]
fn bench_json_lines_are_what_flexns_bench_reads() {
    let dir = std::env::temp_dir().join(format!("flexnsd-bench-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("daemon.toml");
    std::fs::write(&cfg, "[context]\nbind = \"127.0.0.1:0\"\ndrive = \"application\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flexnsd-bench"))
        .args(["--json", "--pairs", "2", "--writes", "3", "--sends", "20"])
        .arg("--flexnsd")
        .arg(env!("CARGO_BIN_EXE_flexnsd"))
        .arg("--daemon-config")
        .arg(&cfg)
        .output()
        .expect("run flexnsd-bench");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "flexnsd-bench --json failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l:?}")))
        .collect();
    assert_eq!(lines.len(), 6, "4 runs and 2 ratios:\n{stdout}");
    for (i, l) in lines[..4].iter().enumerate() {
        let want = if i % 2 == 0 { "flexns-inproc" } else { "flexns-flexnsd" };
        assert_eq!(l["bench"], "flexnsd", "{l}");
        assert_eq!(l["system"], want, "{l}");
        assert_eq!(l["verified"], true, "{l}");
        for k in ["gbps", "p50_us"] {
            assert!(l[k].as_f64().is_some_and(|v| v > 0.0), "{k} in {l}");
        }
    }
    for (l, (case, metric)) in lines[4..].iter().zip([("WRITE-1MiB", "gbps"), ("SEND-64B", "p50_us")]) {
        assert_eq!(l["bench"], "ratio", "{l}");
        assert_eq!(l["case"], case, "{l}");
        assert_eq!(l["metric"], metric, "{l}");
        let ratios: Vec<f64> = l["ratios"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_f64())
            .collect();
        assert_eq!(ratios.len(), 2, "one ratio per pair: {l}");
        let median = l["ratio"].as_f64().unwrap();
        assert!(ratios.contains(&median) && median > 0.0, "{l}");
    }
}
