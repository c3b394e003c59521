"""What every model of the API is made of: the schema hints the walker reads (K8sSchema,
Quantity, Opaque), the cross-field Rule, and the base model that checks the rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True, eq=False)  # eq=False: hashable by identity, as Annotated needs
class K8sSchema:
    """``Annotated[..., K8sSchema({...})]``: use this OpenAPI fragment for the type as is."""

    schema: dict


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, stated once for the API server (CEL) and for Python (check)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None


_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    int | str,
    K8sSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
# Opaque core/v1 objects (affinity, volumes, ...): kept as given, validated by the API server
# when the operator applies the Deployment.
Opaque = Annotated[
    dict[str, Any], K8sSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
DNS1123Subdomain = Annotated[
    str,
    Field(
        max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=True,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def to_api(self) -> dict:
        """The object as the API server stores it (camelCase, defaults filled, None dropped)."""
        return self.model_dump(by_alias=True, exclude_none=True)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


class CamelModel(_Model):
    model_config = ConfigDict(alias_generator=_camel)
