//! The `#[repr(C)]` types of `flexns_ibverbs::abi` against the real `<infiniband/verbs.h>`: a C
//! program compiled against the header prints `offsetof`/`sizeof` of every entry of
//! `abi::layout()`, and each must match. A wrong field type or order in the Rust types (what
//! the inline functions of `verbs.h` and every program read) fails here.

use std::process::Command;

#[test]
fn layouts_match_the_real_header() {
    let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
    if !header.exists() {
        test_support::skip(
            "abi_layout",
            test_support::Missing::Tool,
            "no /usr/include/infiniband/verbs.h (libibverbs-dev; scripts/install-test-deps.sh installs it)",
        );
        return;
    }
    let table = flexns_ibverbs::abi::layout();
    let mut c = String::from("#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\n");
    c.push_str("int main(void) {\n");
    for (name, _) in &table {
        let (ty, field) = match name.split_once('.') {
            Some((t, f)) => (t, Some(f)),
            None => (*name, None),
        };
        let ty = format!("struct {ty}");
        match field {
            Some(f) => c.push_str(&format!("  printf(\"%s %zu\\n\", \"{name}\", offsetof({ty}, {f}));\n")),
            None => c.push_str(&format!("  printf(\"%s %zu\\n\", \"{name}\", sizeof({ty}));\n")),
        }
    }
    c.push_str("  return 0;\n}\n");
    let dir = std::env::temp_dir().join(format!("flexns-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let bin = dir.join("layout");
    std::fs::write(&src, c).unwrap();
    let out = Command::new("cc")
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("cc runs");
    assert!(
        out.status.success(),
        "compiling the layout program: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&bin).output().expect("the layout program runs");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut wrong = Vec::new();
    for (line, (name, rust)) in text.lines().zip(&table) {
        let (n, v) = line.split_once(' ').unwrap();
        assert_eq!(n, *name);
        let c: usize = v.parse().unwrap();
        if c != *rust {
            wrong.push(format!("{name}: header {c}, Rust {rust}"));
        }
    }
    assert_eq!(text.lines().count(), table.len());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(wrong.is_empty(), "layouts differ:\n{}", wrong.join("\n"));
}
