#!/usr/bin/env python3
"""The public API of each library crate of the workspace, listed from stable rustdoc's HTML.

Called by scripts/public-api.sh after `cargo doc --no-deps --lib`. For each crate it reads
target/doc/<lib>/all.html (every public item: structs, enums, unions, traits, functions, macros,
constants, statics, type aliases) and, on each struct, enum, union and trait page, the anchors of
the inherent members (`method.`, `structfield.`, `variant.`, `associatedconstant.`, ...), cut off
before the trait, auto-trait and blanket implementations (their members belong to the trait).
One sorted line per item: `netstack::verbs::Qp::post_send (method)`.

Usage: public-api.py [--bless] TARGET_DOC_DIR API_DIR CRATE...   (CRATE: a package name)
Without --bless it compares with API_DIR/<package>.txt and exits 1 with a unified diff.
"""

import difflib
import html
import os
import re
import sys

# all.html's section ids -> the kind written on each line
KINDS = {
    "structs": "struct",
    "enums": "enum",
    "unions": "union",
    "traits": "trait",
    "trait-aliases": "trait alias",
    "functions": "fn",
    "macros": "macro",
    "attributes": "attribute macro",
    "derives": "derive macro",
    "constants": "constant",
    "statics": "static",
    "types": "type",
    "foreign-types": "foreign type",
}

# item-page anchor prefixes -> kind of the member
MEMBERS = {
    "method": "method",
    "tymethod": "required method",
    "structfield": "field",
    "variant": "variant",
    "associatedconstant": "associated constant",
    "associatedtype": "associated type",
}

# where the inherent part of an item page ends: trait impls, auto traits, blanket impls, a
# trait's implementors, and methods reached through Deref (they are the target's)
CUT = re.compile(
    r'id="(trait-implementations|synthetic-implementations|blanket-implementations|'
    r'implementors|object-safety|dyn-compatibility|foreign-impls|deref-methods[^"]*)"'
)
SECTION = re.compile(r'<h3 id="([a-z-]+)">[^<]*</h3><ul class="all-items">(.*?)</ul>', re.S)
LINK = re.compile(r'<a href="([^"]+)">([^<]+)</a>')
ANCHOR = re.compile(r'id="([a-z]+)\.([A-Za-z0-9_]+)(?:-\d+)?(?:\.field\.([A-Za-z0-9_]+))?"')


def crate_api(doc_dir, lib):
    """The sorted lines of one crate (its lib name, e.g. `flexns_proto`)."""
    root = os.path.join(doc_dir, lib)
    with open(os.path.join(root, "all.html"), encoding="utf-8") as f:
        page = f.read()
    lines = set()
    for section, body in SECTION.findall(page):
        kind = KINDS.get(section)
        if kind is None:
            raise SystemExit(f"public-api: {lib}/all.html: unknown section {section!r}")
        for href, name in LINK.findall(body):
            path = f"{lib}::{html.unescape(name)}"
            lines.add(f"{path} ({kind})")
            if kind not in ("struct", "enum", "union", "trait"):
                continue
            with open(os.path.join(root, href), encoding="utf-8") as f:
                item = f.read()
            cut = CUT.search(item)
            if cut:
                item = item[: cut.start()]
            for prefix, member, field in ANCHOR.findall(item):
                mkind = MEMBERS.get(prefix)
                if mkind is None:
                    continue
                if field:
                    lines.add(f"{path}::{member}::{field} (variant field)")
                else:
                    lines.add(f"{path}::{member} ({mkind})")
    if not lines:
        # an all.html this parser does not understand (another rustdoc's layout) must not pass
        raise SystemExit(f"public-api: {lib}/all.html: no items found (rustdoc's HTML layout changed?)")
    return sorted(lines)


def main(argv):
    bless = False
    if argv and argv[0] == "--bless":
        bless, argv = True, argv[1:]
    if len(argv) < 3:
        raise SystemExit(__doc__)
    doc_dir, api_dir, crates = argv[0], argv[1], argv[2:]
    failed = []
    for crate in crates:
        lines = crate_api(doc_dir, crate.replace("-", "_"))
        text = "".join(line + "\n" for line in lines)
        path = os.path.join(api_dir, f"{crate}.txt")
        if bless:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"public-api: wrote {path} ({len(lines)} items)")
            continue
        try:
            with open(path, encoding="utf-8") as f:
                old = f.read()
        except FileNotFoundError:
            old = ""
        if old != text:
            sys.stdout.writelines(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=path,
                    tofile=f"{crate} (as built now)",
                )
            )
            failed.append(crate)
    if failed:
        sys.stdout.flush()
        print(
            f"public-api: the public API of {', '.join(failed)} differs from docs/api/; "
            "run scripts/public-api.sh --bless if the change is on purpose",
            file=sys.stderr,
        )
        return 1
    if not bless:
        print(f"public-api: the public API of {len(crates)} crates matches docs/api/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
