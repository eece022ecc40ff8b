"""The fault matrix's campaign table (docs/design/fault-matrix.md) and the tests marked
``fault`` agree: every row is a marked test's fault, phase, framework and promise, and every
marked test has its row (tests/harness/campaign.py)."""
import json
import os
import subprocess
import sys

from harness import campaign
from harness.common import REPO


def marked_tests(tmp_path) -> set:
    """(kind, phase, framework, expect, test) of every test pytest collects with the marker."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "fault", "--fault-report", str(report), "tests"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = json.loads(report.read_text())["lines"]
    assert lines, done.stdout[-3000:]
    return {(line["kind"], line["phase"], line["framework"], line["expect"], line["test"]) for line in lines}


def table_entries() -> set:
    with open(campaign.MATRIX) as f:
        rows = campaign.table_rows(f.read())
    return {(row["kind"], row["phase"], row["framework"], row["expect"], test) for row in rows for test in row["tests"]}


def test_the_fault_matrix_table_has_a_row_for_each_marked_test_and_none_other(tmp_path):
    """(A promise that starts with none of campaign.PROMISES fails the collection itself.)"""
    marked, table = marked_tests(tmp_path), table_entries()
    for entry in marked:
        assert "|" not in "".join(entry[:4]), (entry[4], "a cell of the table cannot hold '|'")
    rerun = "; run `make test-faults`, which rewrites the table from the marked tests"
    assert not table - marked, f"rows of {os.path.relpath(campaign.MATRIX, REPO)} no test injects: " \
                               f"{sorted(table - marked)}{rerun}"
    assert not marked - table, f"marked tests without their row: {sorted(marked - table)}{rerun}"
