#!/usr/bin/env python3
"""Checks that what README.md and docs/**/*.md name exists; the test command runs it.

Checked, each failure printed as `DOC:LINE: what is missing` (exit status 1 if any):
- repository paths (`netstack/src/...`, `scripts/...`, `docs/...`, `deploy/...`, any top-level
  directory of the repository; `{a,b}` and `*` are expanded): the file or directory exists;
  `PATH:N` and `PATH:N-M` references: the file has that many lines; a path that leaves the
  repository (`../...`) is an error;
- file names and relative paths of source files (`hostile.rs`, `engine/mod.rs`, `pipe.rs`):
  some file of the repository ends with that path;
- Rust paths rooted at a workspace crate (`netstack::transport::solar`,
  `kvcache_engine::TransferEngine`): each segment is a module file of the crate, or an item the
  crate (or, for netstack, its protocol core flexns-proto) defines or re-exports;
- `cargo test|bench|build|run|clippy -p P [--test T] [--bench B] [--bin N] [--features F]`:
  the package, its test, bench and bin targets and its features exist;
- commands of the project's binaries (`target/release/nsperf client --op write ...`,
  `flexns demo`, `cargo run --bin flexns -- demo`, `blkctl cluster up --replicas 3`): each
  subcommand and flag is one the binary's `--help` lists (the binaries are built here,
  debug, when missing);
- `scripts/*.sh` and `deploy/**/*.sh`: executable, and every `--flag` a command passes to one
  appears in the script;
- `python3 -m flexns.X`: the module exists in python/pysrc/flexns/.

Usage: scripts/check-docs.py [DOC.md ...]   (default: README.md and docs/**/*.md)
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
os.chdir(ROOT)

# Names in the docs that stand for something the reader supplies, not a file of the project.
# (A path whose first directory is no directory name of this repository, `vllm/...`, is taken
# for another project's and not checked; a bare file name of another project goes here.)
PLACEHOLDERS = {"your_server.py", "disk.img", "shm.toml"}
# Source-file extensions: a token ending in one of these names a file of the repository.
SOURCE_EXT = (".rs", ".sh", ".py", ".c", ".proto", ".toml", ".service", ".yml", ".yaml")

errors = []


def error(doc, line, msg):
    errors.append(f"{doc}:{line}: {msg}")


def git_files():
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")
    return [f for f in out if f and os.path.exists(f)]


FILES = git_files()
FILESET = set(FILES)
DIRS = set()
for f in FILES:
    parts = f.split("/")
    for i in range(1, len(parts)):
        DIRS.add("/".join(parts[:i]))
TOP = {f.split("/")[0] for f in FILES}
DIRNAMES = {d.split("/")[-1] for d in DIRS}

META = json.loads(subprocess.run(
    ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
    capture_output=True, text=True, check=True,
).stdout)
PACKAGES = {}
for p in META["packages"]:
    targets = {}
    for t in p["targets"]:
        for k in t["kind"]:
            targets.setdefault(k, set()).add(t["name"])
    PACKAGES[p["name"]] = {
        "targets": targets,
        "features": set(p["features"]),
        "dir": os.path.relpath(os.path.dirname(p["manifest_path"]), ROOT),
        "lib": next((t for t in p["targets"] if set(t["kind"]) & {"lib", "rlib", "cdylib"}), None),
    }
BINS = {}
for name, p in PACKAGES.items():
    for b in p["targets"].get("bin", ()):
        BINS[b] = name
# Rust crate name -> source directory
CRATES = {}
PACKAGES_BY_CRATE = {}
for name, p in PACKAGES.items():
    if p["lib"] is not None:
        CRATES[p["lib"]["name"].replace("-", "_")] = os.path.relpath(
            os.path.dirname(p["lib"]["src_path"]), ROOT)
        PACKAGES_BY_CRATE[p["lib"]["name"].replace("-", "_")] = p


def expand(path):
    """`a/{b,c}.rs` -> [a/b.rs, a/c.rs]"""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    out = []
    for alt in m.group(1).split(","):
        out += expand(path[: m.start()] + alt + path[m.end():])
    return out


def exists(path):
    path = path.rstrip("/")
    if "*" in path or "?" in path:
        return bool(glob.glob(path, recursive=True))
    return path in FILESET or path in DIRS


def line_count(path):
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def check_lines(doc, n, path, lo, hi):
    if not os.path.isfile(path):
        return
    count = line_count(path)
    top = int(hi or lo)
    if top > count:
        error(doc, n, f"`{path}:{lo}{'-' + hi if hi else ''}`: the file has {count} lines")


def suffix_matches(rel):
    rel = rel.rstrip("/")
    return [f for f in FILES if f == rel or f.endswith("/" + rel)] + [
        d for d in DIRS if d.endswith("/" + rel)
    ]


PATH_RE = re.compile(
    r"(?<![\w.:/@<>-])((?:\.\./)*[A-Za-z0-9_.*-]+(?:/[A-Za-z0-9_.*{},-]+)*/?)"
    r"(?::(\d+)(?:-(\d+))?)?(?![\w/])"
)


def check_paths(doc, n, text):
    for m in PATH_RE.finditer(text):
        token, lo, hi = m.group(1), m.group(2), m.group(3)
        token = token.rstrip(".,")
        if token.startswith("../"):
            error(doc, n, f"`{token}` is outside the repository")
            continue
        first = token.split("/")[0]
        if "/" in token and first in TOP and first not in (".",):
            for p in expand(token):
                if not exists(p):
                    error(doc, n, f"path `{p}` does not exist")
                elif lo:
                    check_lines(doc, n, p, lo, hi)
            continue
        if "/" in token and first == "target":
            continue
        if "/" in token and first not in DIRNAMES:
            continue  # a path of another project (`vllm/...`), not one of ours
        if token.endswith(SOURCE_EXT) and token not in PLACEHOLDERS and "{" not in token \
                and "*" not in token:
            found = suffix_matches(token)
            if not found:
                error(doc, n, f"file `{token}` is not in the repository")
            elif lo:
                counts = [line_count(f) for f in found if os.path.isfile(f)]
                if counts and max(counts) < int(hi or lo):
                    error(doc, n, f"`{token}:{lo}{'-' + hi if hi else ''}`: "
                                  f"{found[0]} has {max(counts)} lines")


RUST_RE = re.compile(r"(?<![\w:])([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
DEF_RE = "(?:mod|fn|struct|enum|trait|type|const|static|union|macro_rules!)\\s+{}\\b"
_src_cache = {}


def crate_sources(crate):
    if crate not in _src_cache:
        dirs = [CRATES[crate]]
        if crate == "netstack":
            dirs.append(CRATES["flexns_proto"])
        text = []
        for d in dirs:
            for f in glob.glob(os.path.join(d, "**", "*.rs"), recursive=True):
                with open(f, encoding="utf-8", errors="replace") as fh:
                    text.append(fh.read())
        _src_cache[crate] = "\n".join(text)
    return _src_cache[crate]


def defined(crate, name):
    src = crate_sources(crate)
    if re.search(DEF_RE.format(re.escape(name)), src):
        return True
    # a re-export: `pub use x::name`, `pub use x::{a, name}`, `pub use x::y as name`
    for m in re.finditer(r"pub(?:\([^)]*\))?\s+use\s+([^;]*);", src):
        if re.search(r"\b" + re.escape(name) + r"\b", m.group(1)):
            return True
    return False


def at_root(crate, name):
    """`name` is declared or re-exported by the crate's root (lib.rs) itself."""
    src_path = PACKAGES_BY_CRATE[crate]["lib"]["src_path"]
    with open(src_path, encoding="utf-8", errors="replace") as fh:
        src = fh.read()
    if re.search(r"pub(?:\([^)]*\))?\s+use\s+[^;]*\*\s*;", src):
        return True  # a glob re-export: anything may be there
    if re.search(r"pub(?:\([^)]*\))?\s+" + DEF_RE.format(re.escape(name)), src):
        return True
    if re.search(r"^\s*mod\s+" + re.escape(name) + r"\s*;", src, re.M):
        return True  # a private module: the docs may name where code lives
    for m in re.finditer(r"pub(?:\([^)]*\))?\s+use\s+([^;]*);", src):
        if re.search(r"\b" + re.escape(name) + r"\b", m.group(1)):
            return True
    return False


def check_rust(doc, n, text):
    for m in RUST_RE.finditer(text):
        crate = m.group(1)
        if crate not in CRATES:
            continue
        segs = m.group(2).split("::")[1:]
        if not at_root(crate, segs[0]):
            error(doc, n, f"`{crate}{m.group(2)}`: {crate} has no module or item `{segs[0]}`")
            continue
        d = CRATES[crate]
        in_files = True
        for seg in segs:
            if in_files and (os.path.isfile(os.path.join(d, seg + ".rs"))
                             or os.path.isfile(os.path.join(d, seg, "mod.rs"))):
                d = os.path.join(d, seg)
                continue
            in_files = False
            if not defined(crate, seg):
                error(doc, n, f"`{crate}{m.group(2)}`: `{seg}` is not an item of {crate}")
                break


_help_cache = {}


def binary(name):
    path = os.path.join("target", "debug", name)
    if not os.path.exists(path):
        subprocess.run(["cargo", "build", "--quiet", "-p", BINS[name], "--bin", name], check=True)
    return path


def help_of(bin_name, subs):
    key = (bin_name, tuple(subs))
    if key not in _help_cache:
        out = subprocess.run([binary(bin_name), *subs, "--help"], capture_output=True, text=True,
                             timeout=60)
        text = out.stdout + out.stderr
        commands, options = set(), {}
        section = None
        for line in text.split("\n"):
            if re.match(r"^\S.*:\s*$", line):
                section = line.strip().rstrip(":").lower()
                continue
            if section == "commands":
                mm = re.match(r"^\s{2}(\S+)", line)
                if mm:
                    commands.update(mm.group(1).split("|"))
            elif section and "option" in section:
                om = re.match(r"^ {2,6}(?:(-[A-Za-z0-9]), )?(--[A-Za-z0-9][A-Za-z0-9-]*)?"
                              r"(?:[ =](<[^>]+>|\[[^\]]+\]))?", line)
                if om:
                    takes = bool(om.group(3)) and om.group(3).startswith("<")
                    for flag in (om.group(1), om.group(2)):
                        if flag:
                            options[flag] = takes
        _help_cache[key] = (out.returncode == 0, commands, options)
    return _help_cache[key]


STOP = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1", "#", "...", "\\"}


def check_invocation(doc, n, bin_name, args):
    subs = []
    ok, commands, options = help_of(bin_name, subs)
    if not ok:
        error(doc, n, f"`{bin_name} --help` fails")
        return
    i = 0
    while i < len(args):
        a = args[i]
        if a in STOP or a.startswith("#") or a.startswith("<") or a.startswith(">") \
                or a.startswith("|") or a.startswith("("):
            return
        if a == "--":
            return
        if a.startswith("-") and len(a) > 1 and not re.match(r"^-\d", a):
            flag = a.split("=", 1)[0]
            if flag not in options:
                error(doc, n, f"`{' '.join([bin_name] + subs)}` has no flag `{flag}`")
                return
            if options[flag] and "=" not in a:
                i += 1
            i += 1
            continue
        if commands:
            if not re.match(r"^[A-Za-z][\w|-]*$", a):
                return  # not a word: a placeholder or prose
            for alt in a.split("|"):
                # a hidden subcommand is not listed but has its own help
                if alt not in commands and not help_of(bin_name, subs + [alt])[0]:
                    error(doc, n, f"`{' '.join([bin_name] + subs)}` has no subcommand `{alt}`")
                    return
            if "|" in a:
                return  # alternatives: each checked above, their flags differ
            subs.append(a)
            ok, commands, options = help_of(bin_name, subs)
        i += 1


def check_script_flags(doc, n, script, args):
    with open(script, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not os.access(script, os.X_OK):
        # a file without `#!` is a library the scripts source, not a command
        if text.startswith("#!") or args:
            error(doc, n, f"`{script}` is not executable")
        return
    if '"$@"' in text:
        return  # it hands its arguments on (to cargo, say): any flag may be meant
    for a in args:
        if a in STOP or a.startswith("#"):
            return
        if a.startswith("--") and len(a) > 2:
            flag = a.split("=", 1)[0]
            if flag not in text:
                error(doc, n, f"`{script}` does not take `{flag}`")


def words(cmd):
    try:
        return shlex.split(cmd, comments=True)
    except ValueError:
        return cmd.split()


def check_cargo(doc, n, w):
    sub = w[1] if len(w) > 1 else ""
    pkg, tests, benches, bins, feats = None, [], [], [], []
    i = 2
    while i < len(w):
        a = w[i]
        if a in STOP or a == "--":
            break
        val = w[i + 1] if i + 1 < len(w) else ""
        if a in ("-p", "--package"):
            pkg = val
        elif a == "--test":
            tests.append(val)
        elif a == "--bench":
            benches.append(val)
        elif a == "--bin":
            bins.append(val)
        elif a in ("--features", "-F"):
            feats += val.split(",")
        else:
            i += 1
            continue
        i += 2
    if sub not in ("test", "bench", "build", "run", "clippy", "fmt", "check", "doc", "fuzz"):
        return
    if pkg is not None and pkg not in PACKAGES:
        error(doc, n, f"`cargo {sub} -p {pkg}`: no package `{pkg}` in the workspace")
        return
    pkgs = [PACKAGES[pkg]] if pkg else list(PACKAGES.values())
    for kind, names in (("test", tests), ("bench", benches), ("bin", bins)):
        for t in names:
            if not any(t in p["targets"].get(kind, ()) for p in pkgs):
                error(doc, n, f"`cargo {sub}`: no {kind} target `{t}`"
                      + (f" in package `{pkg}`" if pkg else ""))
    for f in feats:
        if not any(f in p["features"] for p in pkgs):
            error(doc, n, f"`cargo {sub}`: no feature `{f}`" + (f" in `{pkg}`" if pkg else ""))
    if sub == "run" and bins and "--" in w:
        check_invocation(doc, n, bins[0], w[w.index("--") + 1:])


def check_command(doc, n, cmd):
    w = words(cmd)
    while w and w[0] in ("sudo", "$", "env") or (w and re.match(r"^[A-Z_]+=", w[0])):
        w = w[1:]
    if not w:
        return
    head = w[0]
    if head == "cargo":
        check_cargo(doc, n, w)
        return
    if head in ("python", "python3") and len(w) > 2 and w[1] == "-m" \
            and w[2].startswith("flexns."):
        mod = w[2].split(".")[1:]
        base = os.path.join("python", "pysrc", "flexns", *mod)
        if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
            error(doc, n, f"python module `{w[2]}` does not exist")
        return
    m = re.match(r"^(?:\./)?target/(?:release|debug)/([\w-]+)$", head)
    if m:
        if m.group(1) not in BINS:
            error(doc, n, f"`{head}`: no binary `{m.group(1)}` in the workspace")
            return
        check_invocation(doc, n, m.group(1), w[1:])
        return
    if head in BINS:
        check_invocation(doc, n, head, w[1:])
        return
    if head.endswith(".sh") and (head.startswith("scripts/") or head.startswith("deploy/")):
        if os.path.isfile(head):
            check_script_flags(doc, n, head, w[1:])
        return


def check_spans(doc, para):
    """The `code spans` of a paragraph (a span may run over a line break) as commands."""
    text = " ".join(line for _, line in para)
    starts, pos = [], 0
    for n, line in para:
        starts.append((pos, n))
        pos += len(line) + 1
    for m in re.finditer(r"`([^`]+)`", text):
        n = [ln for p, ln in starts if p <= m.start()][-1]
        check_command(doc, n, m.group(1))


def check_doc(doc):
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fenced = None
    pending, pending_line = "", 0
    para = []
    for n, line in enumerate(lines, 1):
        if fenced is not None or not line.strip() or line.lstrip().startswith(("```", "#", "|", "- ")):
            if para:
                check_spans(doc, para)
                para = []
        if line.lstrip().startswith("```"):
            fenced = None if fenced is not None else line.strip()[3:]
            continue
        check_paths(doc, n, line)
        check_rust(doc, n, line)
        if fenced is not None and fenced in ("sh", "bash", "console", "shell", ""):
            if not pending:
                pending_line = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            cmd, pending = pending + line, ""
            for part in re.split(r"\s(?:&&|\|\||;)\s", cmd):
                check_command(doc, pending_line, part)
        elif fenced is None:
            if line.lstrip().startswith(("#", "|")):
                check_spans(doc, [(n, line)])
            elif line.strip():
                para.append((n, line))
    if para:
        check_spans(doc, para)


def main():
    docs = sys.argv[1:] or ["README.md"] + sorted(glob.glob("docs/**/*.md", recursive=True))
    for doc in docs:
        check_doc(doc)
    for e in errors:
        print(e)
    if errors:
        print(f"check-docs: {len(errors)} problem(s) in {len(docs)} document(s)")
        sys.exit(1)
    print(f"check-docs: {len(docs)} documents, every path and command they name exists")


if __name__ == "__main__":
    main()
