"""Helpers shared by the test modules (importable as ``helpers`` from tests/)."""
