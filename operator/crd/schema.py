"""The pydantic models walked into a structural OpenAPI v3 schema (no $ref, no nulls), with
the K8sSchema hints as given and the rules as x-kubernetes-validations."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from batchpilot.operator.crd.base import K8sSchema


def _schema_for(annotation: Any, metadata: list, extra: dict | None) -> dict:
    hinted = any(isinstance(m, K8sSchema) for m in metadata)
    out = {} if hinted else _schema_for_type(annotation)
    for m in metadata:
        out.update(_constraint(m, out))
    if extra:
        out.update(extra)
    return out


def _constraint(m: Any, out: dict) -> dict:
    is_array = out.get("type") == "array"
    is_object = out.get("type") == "object"
    match m:
        case annotated_types.Ge(ge=v):
            return {"minimum": v}
        case annotated_types.Le(le=v):
            return {"maximum": v}
        case annotated_types.Gt(gt=v):
            return {"minimum": v, "exclusiveMinimum": True}
        case annotated_types.Lt(lt=v):
            return {"maximum": v, "exclusiveMaximum": True}
        case annotated_types.MinLen(min_length=v):
            key = "minItems" if is_array else "minProperties" if is_object else "minLength"
            return {key: v}
        case annotated_types.MaxLen(max_length=v):
            key = "maxItems" if is_array else "maxProperties" if is_object else "maxLength"
            return {key: v}
        case K8sSchema(schema=s):
            return dict(s)
    pattern = getattr(m, "pattern", None)
    if pattern is not None:
        return {"pattern": pattern}
    raise TypeError(f"unsupported constraint in the CRD schema: {m!r}")


def _schema_for_type(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        base, *meta = args
        flat = []
        for m in meta:  # Annotated[str, Field(...)] carries a FieldInfo
            flat.extend(m.metadata if isinstance(m, FieldInfo) else [m])
        return _schema_for(base, flat, None)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unions other than Optional need a K8sSchema hint: {tp!r}")
        return _schema_for_type(rest[0])
    if origin is Literal:
        kinds = {type(a) for a in args}
        if kinds == {str}:
            return {"type": "string", "enum": list(args)}
        if kinds == {int}:
            return {"type": "integer", "enum": list(args)}
        raise TypeError(f"mixed Literal: {tp!r}")
    if origin is list:
        return {"type": "array", "items": _schema_for_type(args[0])}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"map keys must be str: {tp!r}")
        if args[1] is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": _schema_for_type(args[1])}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_schema(tp)
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"unsupported type in the CRD schema: {tp!r}")


def prune_empty(value: Any) -> Any:
    if isinstance(value, dict):
        pruned = {k: prune_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    return value


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def model_schema(model: type[BaseModel]) -> dict:
    """The structural OpenAPI v3 schema of a pydantic model (no $ref, no nulls)."""
    props: dict[str, dict] = {}
    required: list[str] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        extra = info.json_schema_extra
        schema = _schema_for(info.annotation, list(info.metadata), extra)  # type: ignore[arg-type]
        if info.description:  # the field's docstring wins over its type's
            schema = {"description": " ".join(info.description.split())} | {
                k: v for k, v in schema.items() if k != "description"
            }
        if info.default is not PydanticUndefined and info.default is not None:
            schema["default"] = info.default
        elif info.default_factory is not None and _is_model(info.default_factory):
            # Expanded: the API server checks a default against the CEL rules as it stands,
            # before nested defaulting.
            schema["default"] = prune_empty(info.default_factory().to_api())
        elif info.is_required():
            required.append(key)
        props[key] = schema
    out: dict[str, Any] = {}
    doc = model.__dict__.get("__doc__")
    if doc:
        out["description"] = " ".join(doc.split())
    out["type"] = "object"
    out["properties"] = props
    if required:
        out["required"] = required
    rules = getattr(model, "rules", ())
    if rules:
        out["x-kubernetes-validations"] = [
            {"rule": r.cel, "message": r.message}
            | ({"fieldPath": r.field_path} if r.field_path else {})
            for r in rules
        ]
    return out
