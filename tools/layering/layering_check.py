#!/usr/bin/env python3
"""Checks fsdpp's dependency graph against its floors (floors.bzl).

Inputs: floors.bzl and the `dependencies.txt` file that record_dependencies()
writes for every package (one line per reference: rule, kind, attribute,
label). Fails, listing every offending edge, when a package depends on a
package of a higher floor, on another package of its own floor, or across a
FORBIDDEN pair; and when a package of the source tree is missing from the
floors or has no dependencies file.

  layering_check.py FLOORS_BZL SOURCE_ROOT DEPENDENCIES_TXT...
  layering_check.py --self-test FLOORS_BZL
"""
import ast
import os
import sys


def load_floors(path):
    """FLOORS, FORBIDDEN and FORBIDDEN_EXCEPT from a floors.bzl file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            values[node.targets[0].id] = ast.literal_eval(node.value)
    for key in ("FLOORS", "FORBIDDEN", "FORBIDDEN_EXCEPT"):
        if key not in values:
            raise SystemExit("%s: no %s assignment" % (path, key))
    floor_of = {}
    for index, floor in enumerate(values["FLOORS"]):
        for package in floor:
            if package in floor_of:
                raise SystemExit("%s: package %s is on two floors" %
                                 (path, package))
            floor_of[package] = index
    return floor_of, values["FORBIDDEN"], values["FORBIDDEN_EXCEPT"]


def under(package, prefix):
    return package == prefix or package.startswith(prefix + "/")


def floor_of_package(package, floor_of):
    """The floor of `package` or of its closest listed parent; None if none."""
    p = package
    while p:
        if p in floor_of:
            return floor_of[p]
        p = p.rpartition("/")[0]
    return None


def package_of_label(label):
    """'//a/b:c' -> 'a/b', '//a/b' -> 'a/b'; None for external labels."""
    if not label.startswith("//"):
        return None
    return label[2:].split(":")[0]


def check_edges(edges, floor_of, forbidden, forbidden_except):
    """Problems (strings) for (package, rule, kind, attr, label) edges."""
    problems = []
    for package, rule, kind, attr, label in edges:
        used = package_of_label(label)
        if used is None or used in (package, "", "conditions"):
            continue  # External, same package, root settings, select keys.
        where = "//%s:%s (%s, %s) -> %s" % (package, rule, kind, attr, label)
        user_floor = floor_of_package(package, floor_of)
        used_floor = floor_of_package(used, floor_of)
        if user_floor is None:
            problems.append("%s: package %s is on no floor" % (where, package))
            continue
        if used_floor is None:
            problems.append("%s: package %s is on no floor" % (where, used))
            continue
        if used_floor > user_floor:
            problems.append("%s: %s (floor %d) may not depend on %s, a "
                            "higher floor (%d)" %
                            (where, package, user_floor, used, used_floor))
        elif used_floor == user_floor:
            problems.append("%s: %s and %s share floor %d; packages of one "
                            "floor may not depend on each other" %
                            (where, package, used, user_floor))
        for a, b in forbidden:
            if under(package, a) and under(used, b):
                if not any(under(package, x) and under(used, y)
                           for x, y in forbidden_except):
                    problems.append("%s: %s -> %s is a forbidden pair" %
                                    (where, a, b))
    return problems


def read_dependencies(path):
    """Edges of one dependencies.txt; its package from its path."""
    package = os.path.dirname(path)
    marker = "/bin/"
    if marker in package:  # bazel-out/.../bin/<package>/dependencies.txt
        package = package.split(marker, 1)[1]
    edges = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) != 4:
                continue
            rule, kind, attr, label = fields
            edges.append((package, rule, kind, attr, label))
    return package, edges


def source_packages(root):
    """Packages of the source tree (directories with a BUILD file), leaving
    out bazel-* output links, third_party's nested repositories, and the
    directories .bazelignore names."""
    ignored = set()
    ignore_file = os.path.join(root, ".bazelignore")
    if os.path.exists(ignore_file):
        with open(ignore_file) as f:
            ignored = {l.strip().rstrip("/") for l in f
                       if l.strip() and not l.startswith("#")}
    packages = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        dirnames[:] = [
            d for d in dirnames
            if not d.startswith(".") and not d.startswith("bazel-") and
            d != "node_modules" and
            os.path.join(rel, d) not in ignored and
            not os.path.exists(os.path.join(dirpath, d, "WORKSPACE"))
        ]
        if rel and ("BUILD" in filenames or "BUILD.bazel" in filenames):
            packages.append(rel)
    return packages


def self_test(floors_path):
    """The checker catches what it must and passes what it may."""
    floor_of, forbidden, forbidden_except = load_floors(floors_path)
    bad = [
        ("core", "x", "cc_library", "deps", "//tensor:tensor"),  # up
        ("fsdp", "x", "cc_test", "deps", "//models:transformer"),  # up
        ("optim", "x", "cc_library", "deps", "//checkpoint:checkpoint"),
        ("models", "x", "cc_library", "deps", "//fsdp:fully_shard"),
        ("comm", "x", "sh_test", "data", "//tools/launch:launch"),
    ]
    good = [
        ("tensor", "x", "cc_library", "deps", "//core:status"),
        ("models/gpt2", "x", "cc_library", "deps", "//fsdp:fully_shard"),
        ("trainer", "x", "cc_binary", "deps", "@absl//:flags"),
        ("core", "x", "cc_library", "target_compatible_with",
         "//:never_without_cuda"),
        ("core", "x", "cc_library", "deps", "//core:status"),
    ]
    failures = 0
    for edge in bad:
        if not check_edges([edge], floor_of, forbidden, forbidden_except):
            print("self-test: not caught: %s" % (edge,))
            failures += 1
    for edge in good:
        problems = check_edges([edge], floor_of, forbidden, forbidden_except)
        if problems:
            print("self-test: wrongly caught: %s" % problems)
            failures += 1
    print("self-test: %d bad edges caught, %d good edges passed, %d failures"
          % (len(bad), len(good), failures))
    return 1 if failures else 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--self-test":
        return self_test(argv[2])
    if len(argv) < 4:
        print(__doc__)
        return 2
    floor_of, forbidden, forbidden_except = load_floors(argv[1])
    root = argv[2]
    edges, recorded = [], set()
    for path in argv[3:]:
        package, package_edges = read_dependencies(path)
        recorded.add(package)
        edges.extend(package_edges)
    problems = check_edges(edges, floor_of, forbidden, forbidden_except)
    for package in source_packages(root):
        if package.startswith("third_party"):
            continue  # BUILD files of external libraries, below every floor.
        if floor_of_package(package, floor_of) is None:
            problems.append("package %s is on no floor: add it to floors.bzl"
                            % package)
        elif package not in recorded:
            problems.append(
                "package %s has no dependencies file: end its BUILD with "
                "record_dependencies() and list it in floors.bzl" % package)
    print("layering: %d packages, %d references checked against %s" %
          (len(recorded), len(edges), argv[1]))
    for p in problems:
        print("layering violation: " + p)
    if problems:
        print("layering: %d violations" % len(problems))
        return 1
    print("layering: no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
