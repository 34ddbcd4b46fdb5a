//! The `ccsim` experiments run end to end (quick sizes) and write their JSON and PNG.

use std::process::Command;

#[test]
fn incast_and_loop_delay_write_json_and_png() {
    if !std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        test_support::skip(
            "ccsim plots",
            test_support::Missing::Tool,
            "no DejaVu font (scripts/install-test-deps.sh installs fonts-dejavu-core as root)",
        );
        return;
    }
    let out = std::env::temp_dir().join(format!("ccsim-test-{}", std::process::id()));
    for exp in ["incast", "loop-delay"] {
        let o = Command::new(env!("CARGO_BIN_EXE_ccsim"))
            .args([exp, "--quick", "--cc", "dcqcn,hpcc,homa", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "one line per algorithm");
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join(format!("{exp}.json"))).unwrap()).unwrap();
        assert_eq!(json["experiment"], exp);
        let png = std::fs::read(out.join(format!("{exp}.png"))).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        if exp == "incast" {
            for l in &lines {
                assert_eq!(l["all_finished"], true, "{l}");
            }
            // HPCC and Homa keep the incast lossless
            assert!(
                lines.iter().filter(|l| l["cc"] != "dcqcn").all(|l| l["drops"] == 0),
                "{lines:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}
