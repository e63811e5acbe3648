"""Helpers shared by test modules (never a test module itself: tests import these, not each
other)."""
