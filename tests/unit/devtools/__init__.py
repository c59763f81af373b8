"""Unit tests of devtools/."""
