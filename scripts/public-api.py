#!/usr/bin/env python3
"""The public API of each library crate of the workspace, listed from stable rustdoc's HTML.

Called by scripts/public-api.sh after `cargo doc --no-deps --lib`. For each crate it reads
target/doc/<lib>/all.html (every public item: structs, enums, unions, traits, functions, macros,
constants, statics, type aliases) and each item's page:
- the item's declaration as rustdoc renders it (`<pre class="rust item-decl">`: a function's
  parameter and return types, a struct's public fields, an enum's variants, generic bounds);
- on struct, enum, union and trait pages, each inherent member (`method.`, `structfield.`,
  `variant.`, `associatedconstant.`, ...) with its signature (the member's `code-header`, or a
  field's `<code>`), cut off before the trait, auto-trait and blanket implementations (their
  members belong to the trait);
- the headers of the inherent impl blocks (their generic bounds) and of the trait and auto-trait
  implementations, one line per impl (blanket impls and a trait's implementors are left out).
Signatures are the rendered text: tags stripped, entities unescaped, whitespace collapsed (and
the spaces and trailing commas of rustdoc's multi-line layout removed), so they do not depend on
where rustdoc wraps a line. One sorted line per entry:
`netstack::verbs::Qp::post_send (method): pub fn post_send(&self, wr: &SendWr) -> Result<()>`.

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
# the impl sections listed one line per impl: after these headings, up to the next CUT heading
IMPL_SECTIONS = {"trait-implementations": "impl", "synthetic-implementations": "auto trait impl"}
SECTION = re.compile(r'<h3 id="([a-z-]+)">[^<]*</h3><ul class="all-items">(.*?)</ul>', re.S)
LINK = re.compile(r'<a href="([^"]+)">([^<]+)</a>')
# an element carrying a member's anchor: its tag, prefix, name and (variant fields) field name
ANCHOR = re.compile(
    r'<(section|span|div)\b[^>]*?\bid="([a-z]+)\.([A-Za-z0-9_]+)(?:-\d+)?'
    r'(?:\.field\.([A-Za-z0-9_]+))?"'
)
IMPL = re.compile(r'<section id="impl-[^"]*" class="impl">.*?<h3 class="code-header">(.*?)</h3>', re.S)
DECL = re.compile(r'<pre class="rust item-decl">(.*?)</pre>', re.S)
HEADER = re.compile(r'<(h[34]) class="code-header">(.*?)</\1>', re.S)
CODE = re.compile(r"<code>(.*?)</code>", re.S)


def text(fragment):
    """Rendered HTML as one line of text: tags stripped, entities unescaped, whitespace
    collapsed, rustdoc's multi-line layout (spaces inside brackets, trailing commas) undone."""
    t = html.unescape(re.sub(r"<[^>]+>", "", fragment))
    t = re.sub(r"\s+", " ", t).strip()
    t = re.sub(r"([(\[<]) ", r"\1", t)
    t = re.sub(r",? ([)\]>])", r"\1", t)
    return re.sub(r",? }", " }", t)


def signature(page, m):
    """The signature of the member whose anchor `m` matched in `page`: the `code-header` of a
    section, the `<code>` of a field's span."""
    pat = HEADER if m.group(1) == "section" else CODE
    found = pat.search(page, m.end())
    if found is None:
        raise SystemExit(f"public-api: no signature after {m.group(0)!r} (rustdoc's layout changed?)")
    return text(found.group(found.lastindex))


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
            with open(os.path.join(root, href), encoding="utf-8") as f:
                item = f.read()
            decl = DECL.search(item)
            if decl is None:
                raise SystemExit(f"public-api: {lib}/{href}: no item declaration (rustdoc's layout changed?)")
            lines.add(f"{path} ({kind}): {text(decl.group(1))}")
            if kind not in ("struct", "enum", "union", "trait"):
                continue
            cut = CUT.search(item)
            inherent, rest = (item[: cut.start()], item[cut.start():]) if cut else (item, "")
            for m in ANCHOR.finditer(inherent):
                _, prefix, member, field = m.groups()
                mkind = MEMBERS.get(prefix)
                if mkind is None:
                    continue
                sig = signature(inherent, m)
                if field:
                    lines.add(f"{path}::{member}::{field} (variant field): {sig}")
                else:
                    lines.add(f"{path}::{member} ({mkind}): {sig}")
            for header in IMPL.findall(inherent):
                lines.add(f"{path} (inherent impl): {text(header)}")
            # the trait and auto-trait sections, each up to the next heading CUT knows
            heads = list(CUT.finditer(rest))
            for i, h in enumerate(heads):
                ikind = IMPL_SECTIONS.get(h.group(1))
                if ikind is None:
                    continue
                end = heads[i + 1].start() if i + 1 < len(heads) else len(rest)
                for header in IMPL.findall(rest[h.start():end]):
                    lines.add(f"{path} ({ikind}): {text(header)}")
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
