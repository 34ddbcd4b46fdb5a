//! `flexns bench` end to end, on one fast comparison: it runs the benchmark program beside it
//! and writes the folder (every line tagged with its comparison, the Markdown table with a
//! verified ratio row, the two charts).

use std::process::Command;

#[test]
fn flexns_bench_writes_its_folder() {
    let out = std::env::temp_dir().join(format!("flexns-bench-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = Command::new(env!("CARGO_BIN_EXE_flexns"))
        .args(["bench", "--quick", "--only", "offload-redn-get", "--out"])
        .arg(&out)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let jsonl = std::fs::read_to_string(out.join("results.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = jsonl.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() >= 7, "3 pairs and a ratio line: {jsonl}");
    assert!(lines.iter().all(|l| l["comparison"] == "offload-redn-get"));
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| offload-redn-get |"))
        .unwrap_or_else(|| panic!("no row: {md}"));
    assert!(row.contains("p50_us") && row.ends_with("| yes |"), "{row}");
    if std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for png in ["speedup.png", "cpu.png"] {
            let b = std::fs::read(out.join(png)).unwrap();
            assert!(b.starts_with(b"\x89PNG"), "{png}");
        }
    } else {
        test_support::skip(
            "flexns bench charts",
            test_support::Missing::Tool,
            "no DejaVu font (scripts/install-test-deps.sh installs fonts-dejavu-core)",
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
