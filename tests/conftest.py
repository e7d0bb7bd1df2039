"""Shared pytest setup: the repository root on sys.path and a guard against empty runs."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_sessionfinish(session, exitstatus):
    # pytest exits 5 when nothing was collected; make sure CI can never pass on an empty selection.
    if exitstatus == 0 and session.testscollected == 0:
        session.exitstatus = 1
