"""Helpers shared by test modules (never a test module itself: tests import these, not each
other): daemon processes, fake peers, fakes of the decode's and the prefill's parts, clients,
checkpoints, waits. The one part of tests/ that other modules import (tests/test_suite_layout.py
holds that); a conftest.py is never imported either, and holds fixtures (and hooks) only."""
