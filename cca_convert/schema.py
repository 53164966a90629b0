"""The one base of every recipe section (pydantic): unknown keys are errors, assignments (``--set``) are validated,
numbers are numbers (``true`` is not 1) and finite (``.inf`` and ``.nan`` are refused)."""

import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _admits_bool(annotation) -> bool:
    if annotation is bool or annotation is typing.Any:
        return True
    return any(a is bool or a is True or a is False or _admits_bool(a) for a in typing.get_args(annotation))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value, info: ValidationInfo):
        # pydantic's lax mode reads true as 1: `--set cca.group_size=true` would silently mean g=1
        if isinstance(value, bool) and not _admits_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expects {_kind(cls.model_fields[info.field_name].annotation)}, not {str(value).lower()}")
        return value


def _kind(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return "a number" if any(t in text for t in ("int", "float")) else text
