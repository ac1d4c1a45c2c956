#!/usr/bin/env python3
"""Checks a JUnit XML file written by `llmdiff gate --junit` with a real XML parser
(xml.etree.ElementTree, standard library) and the structure CI systems (Jenkins, GitLab, GitHub
test reporters) read: <testsuites> of <testsuite name tests failures errors skipped time> of
<testcase name classname time> with at most one <failure message>/<error>/<skipped>, and counts
that add up. If `junitparser` is installed it is used as well.

Usage: check_junit.py FILE.xml [--expect-failures | --expect-pass]
Exit 0 when the file is well formed (and matches the expectation), 1 otherwise."""
import sys
import xml.etree.ElementTree as ET


def fail(msg):
    print(f"check_junit: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    if len(sys.argv) < 2:
        fail("usage: check_junit.py FILE.xml [--expect-failures|--expect-pass]")
    path, expect = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        fail(f"{path}: not well-formed XML: {e}")
    if root.tag != "testsuites":
        fail(f"root element is <{root.tag}>, expected <testsuites>")
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    suites = root.findall("testsuite")
    if not suites:
        fail("no <testsuite>")
    for s in suites:
        for attr in ("name", "tests", "failures", "errors", "time"):
            if attr not in s.attrib:
                fail(f"<testsuite> without {attr}")
        float(s.get("time"))
        cases = s.findall("testcase")
        counted = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0}
        for c in cases:
            if not c.get("name") or not c.get("classname"):
                fail(f"suite {s.get('name')}: <testcase> without name/classname")
            float(c.get("time", "0"))
            kids = [k.tag for k in c]
            if len(kids) > 1 or any(k not in ("failure", "error", "skipped") for k in kids):
                fail(f"testcase {c.get('name')}: unexpected children {kids}")
            for k in c:
                if k.tag in ("failure", "error") and not k.get("message"):
                    fail(f"testcase {c.get('name')}: <{k.tag}> without a message")
                counted[{"failure": "failures", "error": "errors", "skipped": "skipped"}[k.tag]] += 1
        for key, n in counted.items():
            if int(s.get(key, "0")) != n:
                fail(f"suite {s.get('name')}: {key}={s.get(key)} but {n} counted")
            total[key] += n
    for key, n in total.items():
        if int(root.get(key, "0")) != n:
            fail(f"<testsuites> {key}={root.get(key)} but {n} counted")
    try:
        import junitparser  # optional second opinion
        xml = junitparser.JUnitXml.fromfile(path)
        n = sum(1 for suite in xml for _ in suite)
        if n != total["tests"]:
            fail(f"junitparser reads {n} testcases, expected {total['tests']}")
    except ImportError:
        pass
    bad = total["failures"] + total["errors"]
    if expect == "--expect-failures" and bad == 0:
        fail("expected failures, found none")
    if expect == "--expect-pass" and bad:
        fail(f"expected a pass, found {bad} failures/errors")
    print(f"check_junit: {path}: {len(suites)} suites, {total['tests']} testcases, {total['failures']} failures, {total['errors']} errors: well formed")


if __name__ == "__main__":
    main()
