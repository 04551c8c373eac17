#!/usr/bin/env python3
"""Checks that every section (§X.Y) and property id (P-SYNC-1, P-U7, ...) cited anywhere in the
repository exists in docs/ALGORITHMS.md, as a numbered heading or a bold property definition, and
that nothing cites ALGORITHMS.md by another path (e.g. outside the repository); a bare
"ALGORITHMS.md" (without docs/) is reported as a note.

  python3 scripts/check_algorithms_refs.py [--list] [SOURCE_DIR]

Exit status 1 with the missing ones named; --list prints every citation and where it is defined."""
import os
import re
import subprocess
import sys

args = [a for a in sys.argv[1:] if a != "--list"]
root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
doc_path = os.path.join(root, "docs", "ALGORITHMS.md")
doc = open(doc_path, encoding="utf-8").read()

sections = {}  # "4.4.1" -> heading line
for n, line in enumerate(doc.splitlines(), 1):
    m = re.match(r"#{2,6} (\d+(?:\.\d+)*)\.?\s", line)
    if m:
        sections[m[1]] = n
props = {}
for n, line in enumerate(doc.splitlines(), 1):
    for m in re.finditer(r"\*\*(P-[A-Z0-9]+(?:-[0-9]+)?)\*\*", line):
        props.setdefault(m[1], n)

SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
PROP = re.compile(r"\bP-(?:U\d+|[A-Z0-9]+-\d+)\b")
try:
    files = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True, check=True).stdout.split()
except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
    files = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
             if "/build" not in d and "/.git" not in d for f in fs]
TEXT = (".h", ".hpp", ".cpp", ".cc", ".md", ".py", ".sh", ".txt", ".cmake")
cited, bad_paths, bare = {}, [], []
for f in files:
    if f in ("docs/ALGORITHMS.md", "scripts/check_algorithms_refs.py") or f.startswith(("bench/results/", "data/")) \
            or not f.endswith(TEXT):
        continue
    try:
        text = open(os.path.join(root, f), encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        continue
    for n, line in enumerate(text.splitlines(), 1):
        for m in re.finditer(r"(\S*)ALGORITHMS\.md", line):
            prefix = m[1].lstrip("`(")
            if prefix == "":
                bare.append(f"{f}:{n}")
            elif prefix not in ("", "docs/"):
                bad_paths.append(f"{f}:{n}: {line.strip()}")
        for m in SECTION.finditer(line):
            cited.setdefault("§" + m[1], []).append(f"{f}:{n}")
        for m in PROP.finditer(line):
            cited.setdefault(m[0], []).append(f"{f}:{n}")

missing = []
def key(c):
    return [int(x) if x.isdigit() else x for x in re.split(r"[§.\-]", c) if x]
for c in sorted(cited, key=lambda c: (c.startswith("P"), key(c))):
    where = sections.get(c[1:]) if c.startswith("§") else props.get(c)
    if where is None:
        missing.append(c)
    if "--list" in sys.argv:
        print(f"{c:10} {'docs/ALGORITHMS.md:' + str(where) if where else 'MISSING':24} cited {len(cited[c])}x, "
              f"e.g. {cited[c][0]}")
for c in missing:
    print(f"missing in docs/ALGORITHMS.md: {c}, cited at {', '.join(cited[c])}", file=sys.stderr)
for b in bad_paths:
    print(f"cites ALGORITHMS.md by another path: {b}", file=sys.stderr)
for b in bare:  # the old form; a warning only (some files belong to others at the moment)
    print(f"note: cites ALGORITHMS.md without docs/: {b}", file=sys.stderr)
print(f"{len(cited)} cited sections and properties, {len(missing)} missing, {len(bad_paths)} bad paths")
sys.exit(1 if missing or bad_paths else 0)
