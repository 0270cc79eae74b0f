"""Generate the config reference and Pulumi.yaml's `config:` declarations from the schema.

Both are derived from :class:`infra.config.StackConfig`, so documentation and
the Pulumi project file cannot drift from what the program accepts; a test
fails when either file is stale (`specdeploy config reference` rewrites them).
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from infra.config.project import PROJECT, REPO_ROOT
from infra.config.stack import SECRET_FIELDS, StackConfig, config_key

REFERENCE_PATH = REPO_ROOT / "docs" / "config-reference.md"
PULUMI_YAML_PATH = REPO_ROOT / "Pulumi.yaml"

_PULUMI_YAML_HEADER = """\
name: specdeploy
description: LLM inference service from weights in object storage to validated production traffic.
runtime:
  name: python
  options:
    toolchain: pip
    virtualenv: .venv
main: infra/
stackConfigDir: stacks
# Generated from infra/config/ by `specdeploy config reference`; do not edit by hand.
"""


def _model_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `X | None` or `list[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_class(arg)
        if found is not None:
            return found
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    if str(get_origin(annotation)) == "typing.Literal":
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    if get_origin(annotation) is Annotated:  # a bounded type: its base
        return _type_name(get_args(annotation)[0])
    args = get_args(annotation)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " (optional)"
    if get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    text = re.sub(r"(?:infra|serving)\.config\.(?:\w+\.)*", "", str(annotation).replace("typing.", ""))
    return text.replace("|", "or")


def _default(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        return PydanticUndefined
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _pulumi_type(annotation: Any) -> str:
    origin = get_origin(annotation)
    if _model_class(annotation) is not None and origin is not list:
        return "object"
    if annotation is bool:
        return "boolean"
    if annotation is int:
        return "integer"
    if origin is list:
        return "array"
    return "string"


def _field_rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        default = _default(field)
        shown = "required" if default is PydanticUndefined else f"`{json.dumps(default)}`"
        nested = _model_class(field.annotation)
        kind = f"`{nested.__name__}`" if nested is not None else f"`{_type_name(field.annotation)}`"
        rows.append(f"| `{prefix}{name}` | {kind} | {shown} | {field.description or ''} |")
        if nested is not None and nested is not model:
            rows.extend(_field_rows(nested, f"{prefix}{name}{'[]' if get_origin(field.annotation) is list else ''}."))
    return rows


def render_reference() -> str:
    lines = [
        "# Stack configuration reference",
        "",
        "Generated from `infra/config/` by `specdeploy config reference`; a test fails when it is stale.",
        "Each top-level key is written `specdeploy:<key>` in `stacks/Pulumi.<stack>.yaml`.",
        "Unknown keys and impossible values are errors naming the key (`specdeploy config validate`).",
        "",
    ]
    for name, field in StackConfig.model_fields.items():
        key = config_key(name)
        default = _default(field)
        required = "required" if default is PydanticUndefined else "optional"
        secret = ", secret: set with `pulumi config set --secret`" if name in SECRET_FIELDS else ""
        lines += [f"## `{PROJECT}:{key}`", "", f"{field.description} ({required}{secret})", ""]
        nested = _model_class(field.annotation)
        if nested is None:
            lines += [f"Type `{_type_name(field.annotation)}`.", ""]
            continue
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines += _field_rows(nested, f"{key}.")
        lines.append("")
    return "\n".join(lines)


def render_pulumi_yaml() -> str:
    declarations: dict[str, Any] = {}
    for name, field in StackConfig.model_fields.items():
        entry: dict[str, Any] = {"type": _pulumi_type(field.annotation), "description": field.description}
        default = _default(field)
        if name in SECRET_FIELDS:
            entry["secret"] = True
        if default is PydanticUndefined:
            pass  # required: every stack must set it
        elif default is None:
            # Optional section: an empty value means "not configured" (infra.config reads it so).
            entry["default"] = {} if entry["type"] == "object" else ""
        else:
            entry["default"] = default
        declarations[config_key(name)] = entry
    return _PULUMI_YAML_HEADER + yaml.safe_dump({"config": declarations}, sort_keys=False, width=110)


def write_or_check(check: bool) -> list[Path]:
    """Write both generated files, or with check=True only report which are stale."""
    stale = []
    for path, text in ((REFERENCE_PATH, render_reference()), (PULUMI_YAML_PATH, render_pulumi_yaml())):
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return stale
