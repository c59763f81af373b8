"""Pydantic's validation errors as pdserve reports them: one line per problem, the field's path
first (`spec.render.workers: ...`), for the operator's events and the gateway's start-up alike."""

from __future__ import annotations

from pydantic import ValidationError


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
