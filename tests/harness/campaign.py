"""The fault campaign: every test that injects a fault says which, and the run prints one line
per fault with what was expected, what was observed and how long the job took to notice it
and to train again.

A test joins the campaign with a marker (on the test, or on one ``pytest.param`` of it)::

    @pytest.mark.fault("open-file limit too low", phase="startup", framework="DeepSpeed ZeRO-1",
                       expect="refuses with a reason")

``expect`` starts with one of :data:`PROMISES`. A test that takes ``fault_clock`` marks the
moments it saw (:class:`FaultClock`), and its line carries the seconds from the injection to
the detection and to the first step after it.

Every run prints the lines; ``--fault-report PATH`` writes them as JSON too, and
``python -m tests.harness.campaign PATH`` puts them into the table of
docs/design/fault-matrix.md (``make test-faults`` does both, with the random-kill loops at
full length; ``make test`` runs them in their short, seeded form).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import pytest

# What ftmem promises for a fault: the first words of every marker's ``expect``.
PROMISES = ("resumes bitwise from memory", "resumes bitwise from disk", "refuses with a reason",
            "ends every rank within", "goes on")
MATRIX = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "design", "fault-matrix.md")
BEGIN, END = "<!-- campaign: begin -->", "<!-- campaign: end -->"


def register(config) -> None:
    config.addinivalue_line("markers", "fault(kind, phase, framework, expect): a test of the fault campaign "
                                       "(tests/harness/campaign.py)")


class FaultClock:
    """The moments a test saw: the fault injected, then noticed (a rank ended by it, an error
    that names it), then the first training step after it (the restarted job's)."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    def injected(self) -> None:
        self.marks["injected"] = time.monotonic()

    def detected(self) -> None:
        self.marks.setdefault("detected", time.monotonic())

    def stepped(self) -> None:
        self.marks.setdefault("stepped", time.monotonic())

    def since_injection(self, moment: str) -> Optional[float]:
        if "injected" not in self.marks or moment not in self.marks:
            return None
        return round(self.marks[moment] - self.marks["injected"], 1)


@dataclass
class Line:
    kind: str
    phase: str
    framework: str
    expect: str
    test: str  # file::name, without the parameters
    observed: str = "not run"
    detected_s: Optional[float] = None
    stepped_s: Optional[float] = None

    def text(self) -> str:
        seconds = lambda s: "-" if s is None else f"{s:g} s"  # noqa: E731
        return (f"{self.kind} | {self.phase} | {self.framework} | expected: {self.expect} | observed: {self.observed}"
                f" | detected after {seconds(self.detected_s)} | first step after {seconds(self.stepped_s)}")


def marker_of(item) -> Optional[pytest.Mark]:
    return item.get_closest_marker("fault")


def line_of(item, mark: pytest.Mark) -> Line:
    kind, = mark.args
    expect = mark.kwargs["expect"]
    if not expect.startswith(PROMISES):
        raise pytest.UsageError(f"{item.nodeid}: a fault's expect must start with one of {PROMISES}, not {expect!r}")
    path = os.path.relpath(str(item.fspath), os.path.join(os.path.dirname(__file__), ".."))
    return Line(kind, mark.kwargs["phase"], mark.kwargs["framework"], expect,
                f"{path}::{item.originalname if hasattr(item, 'originalname') else item.name}")


def collected(session) -> None:
    """A line, not run yet, for each marked test the session will run: a test that never
    reports (a crash of the run, ``--collect-only``) still has its line."""
    lines = session.config.__dict__.setdefault("_fault_lines", {})
    for item in session.items:
        mark = marker_of(item)
        if mark is not None:
            lines.setdefault(item.nodeid, line_of(item, mark))


@pytest.fixture
def fault_clock() -> FaultClock:
    return FaultClock()


def record(item, report) -> None:
    """Keep the campaign line of ``item`` once its outcome is known."""
    mark = marker_of(item)
    if mark is None:
        return
    line = item.config.__dict__.setdefault("_fault_lines", {}).setdefault(item.nodeid, line_of(item, mark))
    if report.skipped:  # at its setup, or in its body (a machine without what the fault needs)
        line.observed = "not run: " + str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "skipped")
    elif report.when == "call" or (report.when == "setup" and report.failed):
        line.observed = "as expected" if report.passed else "NOT as expected: " + first_line(report)
        clock = getattr(item, "funcargs", {}).get("fault_clock")
        if clock is not None:
            line.detected_s, line.stepped_s = clock.since_injection("detected"), clock.since_injection("stepped")


def first_line(report) -> str:
    """What failed, and where: the exception's type and the test's line (its message, often a
    rank's log, is in the test's report)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return "failed"
    return f"{crash.message.split(':', 1)[0].split()[0]} at {os.path.basename(crash.path)}:{crash.lineno}"


def summary(terminalreporter, config) -> None:
    lines = list(config.__dict__.get("_fault_lines", {}).values())
    if not lines:
        return
    terminalreporter.section("fault campaign")
    for line in lines:
        terminalreporter.line(line.text())
    passed = sum(line.observed == "as expected" for line in lines)
    not_run = sum(line.observed.startswith("not run") for line in lines)
    kinds = len({line.kind for line in lines})
    terminalreporter.line(f"{len(lines)} faults of {kinds} kinds: {passed} as expected, {not_run} not run, "
                          f"{len(lines) - passed - not_run} NOT as expected")
    path = config.getoption("--fault-report")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": machine(),
                       "lines": [asdict(line) for line in lines]}, f, indent=1)


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return f"{platform.machine()}, {os.cpu_count()} cores, {memory:.0f} GiB, Python {platform.python_version()}"


# -- the table in docs/design/fault-matrix.md ----------------------------------------------------
HEADER = ("| fault | phase | framework | ftmem promises | test | last run |\n"
          "| --- | --- | --- | --- | --- | --- |\n")


def table(report: dict) -> str:
    """The campaign's table: a row per fault, phase, framework and promise, with the last run's
    result."""
    rows: dict[tuple, list[dict]] = {}
    for line in report["lines"]:
        rows.setdefault((line["kind"], line["phase"], line["framework"], line["expect"]), []).append(line)
    out = [f"Last run: {report['date']}, {report['machine']}.\n\n", HEADER]
    for (kind, phase, framework, expect), lines in sorted(rows.items()):
        tests = ", ".join(f"`{t}`" for t in dict.fromkeys(line["test"] for line in lines))
        out.append(f"| {kind} | {phase} | {framework} | {expect} | {tests} | {result(lines)} |\n")
    return "".join(out)


def result(lines: list[dict]) -> str:
    """One row's outcome: how many of its runs were as expected, the seconds they took to
    detect the fault and to step again (the range), and what any other run saw."""
    passed = sum(line["observed"] == "as expected" for line in lines)
    said = [f"{passed} of {len(lines)} as expected"]
    for name, column in (("detected after", "detected_s"), ("first step after", "stepped_s")):
        seconds = sorted(line[column] for line in lines if line[column] is not None)
        if seconds:
            said.append(f"{name} {seconds[0]:g}" + (f"-{seconds[-1]:g}" if seconds[-1] != seconds[0] else "") + " s")
    said += sorted({line["observed"] for line in lines} - {"as expected"})
    return "; ".join(said)


def table_rows(markdown: str) -> list[dict]:
    """The rows of the campaign's table in ``markdown`` (the docs' fault matrix)."""
    section = markdown.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = []
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("| ") and cells[0] not in ("fault", "---"):
            rows.append({"kind": cells[0], "phase": cells[1], "framework": cells[2], "expect": cells[3],
                         "tests": re.findall(r"`([^`]+)`", cells[4])})
    return rows


def write_table(report_path: str, matrix: str = MATRIX) -> None:
    with open(report_path) as f:
        report = json.load(f)
    with open(matrix) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    with open(matrix, "w") as f:
        f.write(head + BEGIN + "\n" + table(report) + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    write_table(sys.argv[1])
