"""Helpers for tests/test_packaging.py: the image's dependency lock and the chart renderer."""
