"""Helpers the test packages share (the conftest files hold only fixtures)."""
