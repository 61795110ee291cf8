"""A pytest plugin for the GPU session's test steps (benchmarks/gpu_session.py): one JSON line per event,
appended and flushed as it happens, so a step stopped at its timeout still says which tests ended how and
which one was running.

    GPU_SESSION_TEST_LINES=a.jsonl:b.jsonl GPU_SESSION_STEP=cuda-tests \
        python -m pytest -p gpu_session_pytest ...

(benchmarks/ on PYTHONPATH.) Each line goes to every file of GPU_SESSION_TEST_LINES (os.pathsep between
them) and carries "step" (GPU_SESSION_STEP) and "event":
    collected   "tests": the node ids that will run, in order
    start       "test": a test begins (its setup)
    end         "test", "when" (setup, call or teardown), "outcome" (passed, failed, skipped), "seconds",
                and for a failure the end of its report ("report", at most 3000 characters); one line per
                test: its call, or the phase that failed or skipped it, or a failed teardown after a call
Without GPU_SESSION_TEST_LINES the plugin does nothing.
"""

from __future__ import annotations

import json
import os

REPORT_CHARS = 3000


def _write(record: dict) -> None:
    paths = [p for p in os.environ.get("GPU_SESSION_TEST_LINES", "").split(os.pathsep) if p]
    record = {"step": os.environ.get("GPU_SESSION_STEP"), **record}
    for path in paths:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def pytest_collection_finish(session) -> None:
    _write({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report) -> None:
    # a passed setup or teardown is not an end; a skip or failure in setup is the test's only report
    if report.when != "call" and report.outcome == "passed":
        return
    record = {"event": "end", "test": report.nodeid, "when": report.when, "outcome": report.outcome,
              "seconds": round(report.duration, 3)}
    if report.failed:
        record["report"] = str(report.longrepr)[-REPORT_CHARS:]
    _write(record)
