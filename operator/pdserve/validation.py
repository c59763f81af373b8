"""Pydantic's validation errors as pdserve reports them: one line per problem, the field's path
first (`spec.render.workers: ...`), for the operator's events and the gateway's start-up alike."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ValidationError


def field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


UNKNOWN_SPEC_FIELD = "unknown field; check its spelling (kubectl explain disaggregatedmodel.spec)"


def format_validation_error(
    error: ValidationError, prefix: str = "", unknown_field: str = UNKNOWN_SPEC_FIELD
) -> list[str]:
    """One line per problem: `spec.render.workers: Input should be greater than or equal to 1`;
    `unknown_field` is what a field the model does not have is reported as."""
    problems = []
    for item in error.errors(include_url=False):
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = unknown_field
        path = field_path(tuple(item["loc"]))
        path = f"{prefix}.{path}" if prefix and path else (path or prefix)
        # Whole-object validators already name their fields in full ("spec.prefill.extraArgs...").
        if not path or message.startswith(f"{path}.") or message.startswith("spec."):
            problems.append(message)
        else:
            problems.append(f"{path}: {message}")
    return problems


def without_unknown_fields(model: type[BaseModel], body: Any) -> tuple[Any, list[str]]:
    """`body` less every field `model` does not know (a newer writer's), and those fields'
    paths; `body` itself is left as it was. Other problems are left for the caller's own
    validation to report."""
    known = copy.deepcopy(body)
    unknown: list[str] = []
    try:
        model.model_validate(known)
    except ValidationError as error:
        for item in error.errors(include_url=False):
            if item["type"] == "extra_forbidden" and _drop(known, tuple(item["loc"])):
                unknown.append(field_path(tuple(item["loc"])))
    return known, unknown


def _drop(body: Any, loc: tuple[int | str, ...]) -> bool:
    """Remove the field at `loc` from `body`; False when the path does not lead to it."""
    node = body
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(node, dict) and loc and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False
