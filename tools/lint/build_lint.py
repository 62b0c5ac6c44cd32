#!/usr/bin/env python3
"""A buildifier-equivalent check of Bazel files (Debian ships no buildifier).

For BUILD files and .bzl files: no tabs, no trailing whitespace, a final
newline and no blank line at the end, indentation in multiples of 4 spaces,
double-quoted strings, and every `deps` / `srcs` / `hdrs` / `data` list with
one item per line, each followed by a comma, sorted as buildifier sorts them
(local ":x" labels first, then "//" labels by package then name, then "@"
repositories). Prints "path:line: problem" for each finding and exits 1 if
there is any; with --fix, sorts the deps lists first (what buildifier would
rewrite) and reports what is left.

Usage: build_lint.py [--fix] FILE...
"""

import re
import sys

SORTED_ATTRS = ("deps", "srcs", "hdrs", "data")


def sort_key(label):
    group = 0 if label.startswith(":") else 1 if label.startswith("//") else 2
    package, _, name = label.partition(":")
    return (group, package, name)


def single_quoted_without_reason(line):
    """Whether `line` has a single-quoted string that holds no double quote
    (buildifier keeps single quotes only to avoid escaping double ones)."""
    i = 0
    while i < len(line):
        c = line[i]
        if c == "#":
            return False
        if c in "\"'":
            j = i + 1
            while j < len(line) and line[j] != c:
                j += 2 if line[j] == "\\" else 1
            if c == "'" and '"' not in line[i + 1:j]:
                return True
            i = j + 1
            continue
        i += 1
    return False


def check(path):
    problems = []
    text = open(path, encoding="utf-8").read()
    lines = text.split("\n")
    if not text:
        return []
    if not text.endswith("\n"):
        problems.append((len(lines), "no newline at the end of the file"))
    elif text.endswith("\n\n"):
        problems.append((len(lines) - 1, "blank line at the end of the file"))
    in_docstring = False
    for number, line in enumerate(lines, 1):
        if line.count('"""') % 2 == 1:
            in_docstring = not in_docstring
            continue
        if in_docstring:
            continue
        if "\t" in line:
            problems.append((number, "tab"))
        if line != line.rstrip():
            problems.append((number, "trailing whitespace"))
        indent = len(line) - len(line.lstrip(" "))
        previous = lines[number - 2].rstrip() if number > 1 else ""
        continued = previous.endswith(("+", "=", "and", "or"))
        if line.strip() and indent % 4 and not continued:
            problems.append((number, f"indentation of {indent} spaces"))
        if single_quoted_without_reason(line):
            problems.append((number, "single-quoted string (use double quotes)"))
    # Label lists: `    deps = [` ... `    ],`, one label per line.
    for match in re.finditer(
            r"^( +)(%s) = \[\n(.*?)^\1\]" % "|".join(SORTED_ATTRS), text,
            re.S | re.M):
        first_line = text[:match.start()].count("\n") + 1
        items = [l.strip() for l in match.group(3).split("\n") if l.strip()]
        labels = []
        for item in items:
            if item.startswith("#"):
                continue
            m = re.fullmatch(r'"([^"]*)",', item)
            if not m:
                problems.append((first_line, f"{match.group(2)}: item "
                                 f"{item!r} is not one quoted label and a "
                                 "comma"))
                labels = None
                break
            labels.append(m.group(1))
        if labels and match.group(2) == "deps" and labels != sorted(
                labels, key=sort_key):
            problems.append((first_line, "deps not sorted as buildifier "
                             "sorts them: " + ", ".join(
                                 sorted(labels, key=sort_key))))
        if labels and len(set(labels)) != len(labels):
            problems.append((first_line, f"{match.group(2)}: a duplicate"))
    return [f"{path}:{n}: {p}" for n, p in problems]


def fix(path):
    text = open(path, encoding="utf-8").read()

    def sorted_list(match):
        items = [l.strip() for l in match.group(3).split("\n") if l.strip()]
        if any(not re.fullmatch(r'"[^"]*",', i) for i in items):
            return match.group(0)
        labels = sorted({i[1:-2] for i in items}, key=sort_key)
        indent = match.group(1)
        body = "".join(f'{indent}    "{l}",\n' for l in labels)
        return f"{indent}{match.group(2)} = [\n{body}{indent}]"

    fixed = re.sub(r"^( +)(deps) = \[\n(.*?)^\1\]", sorted_list, text,
                   flags=re.S | re.M)
    if fixed != text:
        open(path, "w", encoding="utf-8").write(fixed)


def main(paths):
    if paths and paths[0] == "--fix":
        paths = paths[1:]
        for path in paths:
            fix(path)
    findings = []
    for path in paths:
        findings.extend(check(path))
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
