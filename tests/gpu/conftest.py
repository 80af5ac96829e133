"""The GPU tests run on a lent machine under a time limit that kills pytest, and with it the failures it would
report at the end (the CUDA-graph test's failure of 2026-11-26 was lost so once): here each failure is printed the
moment it happens."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}\n", flush=True)
