"""Unit tests of pdserve.contract."""
