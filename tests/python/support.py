"""Shared by the Python tests: where things are, and a main() that tells ctest when everything was skipped."""

import os
import sys
import unittest

SOURCE = os.environ.get("PIPETRAIN_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
DATA = os.path.join(SOURCE, "data")
PIPETRAIN_BIN = os.environ.get("PIPETRAIN_BIN", os.path.join(SOURCE, "build", "pipetrain"))


def main():
    """unittest.main, exiting 77 (ctest's SKIP_RETURN_CODE) when every test was skipped, so a skip shows."""
    program = unittest.main(exit=False, verbosity=2)
    result = program.result
    if not result.wasSuccessful():
        sys.exit(1)
    if result.testsRun > 0 and len(result.skipped) == result.testsRun:
        sys.exit(77)
    sys.exit(0)
