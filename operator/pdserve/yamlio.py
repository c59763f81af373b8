"""YAML output for generated files: no anchors, multi-line strings as readable blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class ReadableDumper(yaml.SafeDumper):
    """Shared sub-objects are written out in full (anchors confuse readers and diff tools), and
    multi-line strings (embedded JSON, chat templates) as `|` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def looks_numeric(value: str) -> bool:
    """Would a YAML 1.2 reader (kubectl, Argo CD, Flux: all Go) take this string for a number?
    PyYAML (YAML 1.1) leaves e.g. a hash like "123e4567" unquoted, and Go reads a float."""
    try:
        float(value.replace("_", ""))
    except ValueError:
        try:
            int(value, 0)
        except ValueError:
            return False
    return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style: str | None = None
    if "\n" in value:
        style = "|"
    elif looks_numeric(value):
        style = "'"
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


ReadableDumper.add_representer(str, _represent_str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=ReadableDumper, sort_keys=False, width=100)


def dump_documents(objects: Iterable[dict[str, Any]]) -> str:
    return "".join("---\n" + dump(obj) for obj in objects)
