"""Skips are reported where the project's test command lists them (FLEXNS_SKIP_LOG)."""

import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not report.skipped:
        return
    path = os.environ.get("FLEXNS_SKIP_LOG")
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if path:
        with open(path, "a") as f:
            f.write(f"python {report.nodeid}: {reason}\n")


@pytest.fixture(params=["flexns", "tcp"])
def protocol(request):
    return request.param
