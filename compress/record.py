"""Typed values that travel between packages and to disk as JSON (manifests, measurements).

Contract: `from_json(record.to_json()) == record`; `to_json` gives plain JSON values (NaN and
infinities kept as JSON's constants, fields marked `Omitted` left out when None), so a file a
record writes has the bytes the same dict had before the type existed. Reading validates:
a stored value of another shape raises `pydantic.ValidationError` (callers treat it as stale).
"""

from __future__ import annotations

from typing import Annotated, Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

Omitted = Annotated[T | None, Field(exclude_if=lambda v: v is None)]
"""An optional field (give it `= None`) that is absent from the JSON, rather than null, when unset."""


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls.model_validate(data)
