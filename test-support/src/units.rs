//! The systemd units in `deploy/systemd/`: what their `ExecStart=` runs, with `Environment=`'s
//! defaults and `%H` filled in, so a test can hand the arguments to the daemon's own flag
//! parser (a unit naming a flag the daemon does not have fails there, not on a server).

use std::collections::HashMap;
use std::path::PathBuf;

/// The unit file `name` (`block-server.service`...) under `deploy/systemd/`.
pub fn unit_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/systemd")
        .join(name)
}

/// The program (file name only) and arguments of `name`'s `ExecStart=`, with every `${VAR}`
/// replaced by the unit's `Environment=` default and `%H` by `host`. Panics, naming the unit,
/// when it has no `ExecStart=` or uses a variable it does not define.
pub fn exec_start(name: &str) -> (String, Vec<String>) {
    let text = std::fs::read_to_string(unit_path(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut env = HashMap::new();
    for l in text.lines().filter_map(|l| l.strip_prefix("Environment=")) {
        for kv in l.split_whitespace() {
            if let Some((k, v)) = kv.split_once('=') {
                env.insert(k.to_string(), v.to_string());
            }
        }
    }
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{name}: no ExecStart="));
    let mut words = line.split_whitespace().map(|w| {
        let mut w = w.replace("%H", "host");
        while let Some(i) = w.find("${") {
            let j = w[i..]
                .find('}')
                .map(|j| i + j)
                .unwrap_or_else(|| panic!("{name}: unclosed ${{ in {w}"));
            let var = &w[i + 2..j];
            let v = env
                .get(var)
                .unwrap_or_else(|| panic!("{name}: ${{{var}}} has no Environment= default"));
            w = format!("{}{v}{}", &w[..i], &w[j + 1..]);
        }
        w
    });
    let prog = words.next().unwrap_or_else(|| panic!("{name}: empty ExecStart="));
    let prog = prog.rsplit('/').next().unwrap_or(&prog).to_string();
    (prog, words.collect())
}
