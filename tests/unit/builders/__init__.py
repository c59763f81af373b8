"""Unit tests of pdserve.builders."""
