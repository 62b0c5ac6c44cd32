"""Counts test cases from a `bazel test` log and the test.xml files it made.

Every test target named in Bazel's summary contributes its test cases (from
bazel-testlogs/<package>/<name>/test.xml): passed, failed, or skipped
(GTEST_SKIP, e.g. CUDA tests on a machine without a GPU). A target that failed
to build, timed out or left no usable XML counts as one failed case. Each
--extra-xml report (JUnit-style, e.g. the fuzz runs' from
checkpoint/fuzz/run_fuzzers.sh) adds its test cases the same way; a missing or
unparsable one, or one without test cases, counts as one failed case. Prints
"N passed, N failed, N skipped" as the last line.

Usage: python3 count_tests.py TEST_LOG CUDA_BUILD_FAILED(0|1)
           [--testlogs DIR] [--extra-log LABEL:LOG:TESTLOGS]...
           [--extra-xml PATH]...

--extra-log adds another `bazel test` run's cases (a sanitizer build, whose
test.xml files live in its own output tree), failures marked with LABEL.
"""

import argparse
import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

SUMMARY = re.compile(
    r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|"
    r"NO STATUS|FLAKY|INCOMPLETE|SKIPPED)")


def count_xml(path):
    passed = failed = skipped = 0
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif (case.get("result") == "skipped" or case.get("status") == "notrun"
              or case.find("skipped") is not None):
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def count_log(log_path, testlogs, label):
    """(passed, failed, skipped, targets seen) of one `bazel test` log whose
    test.xml files are under `testlogs`."""
    passed = failed = skipped = 0
    seen = set()
    with open(log_path, errors="replace") as log:
        for line in log:
            m = SUMMARY.match(line.strip())
            if not m or m.group(1) in seen:
                continue
            target, result = m.group(1), m.group(2)
            seen.add(target)
            if result == "SKIPPED":  # Incompatible target (e.g. CUDA-only).
                continue
            package, name = target[2:].split(":")
            # One test.xml, or one per shard (shard_K_of_N/test.xml).
            base = os.path.join(testlogs, package, name)
            xmls = [os.path.join(base, "test.xml")]
            if not os.path.exists(xmls[0]):
                xmls = sorted(glob.glob(os.path.join(base, "shard_*", "test.xml")))
            counts = None
            if result in ("PASSED", "FAILED", "FLAKY") and xmls and all(
                    os.path.exists(x) for x in xmls):
                try:
                    per_file = [count_xml(x) for x in xmls]
                    counts = tuple(sum(c[k] for c in per_file) for k in range(3))
                except ET.ParseError:
                    counts = None
            if counts is None or sum(counts) == 0:
                ok = result in ("PASSED", "FLAKY")
                counts = (1, 0, 0) if ok else (0, 1, 0)
            elif result not in ("PASSED", "FLAKY") and counts[1] == 0:
                counts = (counts[0], 1, counts[2])  # Crashed after its cases.
            passed += counts[0]
            failed += counts[1]
            skipped += counts[2]
            if result not in ("PASSED", "FLAKY"):
                print(f"failed{label}: {target} ({result})")
    if not seen:
        print(f"no test results found in {log_path}")
        failed += 1
    return passed, failed, skipped


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("test_log")
    parser.add_argument("cuda_failed", type=int, choices=(0, 1))
    parser.add_argument("--testlogs", default="bazel-testlogs",
                        help="bazel-testlogs of the test_log's run")
    parser.add_argument("--extra-log", action="append", default=[],
                        metavar="LABEL:LOG:TESTLOGS",
                        help="another bazel test run (e.g. a sanitizer's)")
    parser.add_argument("--extra-xml", action="append", default=[],
                        metavar="PATH")
    args = parser.parse_args()
    cuda_failed = args.cuda_failed
    passed, failed, skipped = count_log(args.test_log, args.testlogs, "")
    for spec in args.extra_log:
        label, log_path, testlogs = spec.split(":", 2)
        counts = count_log(log_path, testlogs, f" ({label})")
        passed += counts[0]
        failed += counts[1]
        skipped += counts[2]
    if cuda_failed:
        print("failed: bazel build --config=cuda //...")
        failed += 1
    for path in args.extra_xml:
        try:
            counts = count_xml(path)
            problem = None if sum(counts) else "no test cases"
        except (OSError, ET.ParseError) as e:
            problem = str(e)
        if problem:
            print(f"failed: {path} ({problem})")
            failed += 1
            continue
        passed += counts[0]
        failed += counts[1]
        skipped += counts[2]
        for case in ET.parse(path).getroot().iter("testcase"):
            if (case.find("failure") is not None
                    or case.find("error") is not None):
                print(f"failed: {case.get('classname')}.{case.get('name')}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
