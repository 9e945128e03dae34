"""pytest plugin loaded by every pytest suite that ctest registers (`-p cellblock_no_skips`, see tests/CMakeLists.txt).

A green suite must mean its tests ran: a skipped test (pytest.skip, skip/skipif markers, importorskip) and an xfail
(expected or unexpectedly passing) are reported as failures, unless the skip reason starts with one of
ALLOWED_SKIP_REASONS, the reasons a fresh Debian 12 machine run as root cannot meet. tests/README.md lists them; the
list is empty, and adding to it needs the same entry there.
"""
import pytest

ALLOWED_SKIP_REASONS: tuple[str, ...] = ()


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (f"cellblock: xfail is not allowed in this suite (reason: {report.wasxfail or 'none'}); "
                           "a test passes or fails")
        del report.wasxfail
    elif report.skipped:
        reason = _skip_reason(report)
        if not reason.startswith(ALLOWED_SKIP_REASONS):
            report.outcome = "failed"
            report.longrepr = (f"cellblock: a skipped test is a failure in this suite (tests/README.md, skip policy). "
                               f"Skip reason: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module that skips itself at import (pytest.skip(allow_module_level=True), importorskip) never reaches
    # pytest_runtest_makereport; its collection report is turned into an error instead.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not _skip_reason(report).startswith(ALLOWED_SKIP_REASONS):
        report.outcome = "failed"
        report.longrepr = (f"cellblock: a module skipped at collection is a failure in this suite "
                           f"(tests/README.md, skip policy). Skip reason: {_skip_reason(report)}")
