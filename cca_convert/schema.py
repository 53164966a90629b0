"""The one base of every recipe section (pydantic): unknown keys are errors, assignments (``--set``) are validated."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
