"""What every part of the router's settings model is made of (settings.py): ``setting`` (a field with its
help, flag and whether a reload may change it), the ``_Settings`` base (strict, frozen, ``replace``) and
the one-line error message naming each bad field."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polychip.errors import ConfigError

PRIORITY_CLASSES = ("high", "normal", "low")


def setting(default: Any = None, help: str = "", *, flag: str | None = None, live: bool = True,
            default_factory=None, alias: str | None = None, flag_type: str | None = None, **limits):
    """A settings field: its help, its flag (default: from its name), whether a reload may change it,
    and for a mapping flag how its values parse (``int_map``: CLASS=INT; default CLASS=NUMBER)."""
    extra = {"flag": flag, "live": live, "flag_type": flag_type}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra, alias=alias,
                     **limits)
    return Field(default, description=help, json_schema_extra=extra, alias=alias, **limits)


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    def replace(self, **changes) -> "_Settings":
        """A copy with ``changes``, validated again; a ConfigError naming each bad field."""
        try:
            return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None


def settings_message(err: ValidationError) -> str:
    """``health_check.interval: Input should be greater than 0; got -1``, one line per problem."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "router"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + ("" if isinstance(e.get("input"), (dict, list)) else f"; got {e['input']!r}"))
    return "router settings: " + "; ".join(lines)
