"""Model aliases from configuration: callers name a role ("chat"), configuration names the models behind it.

    aliases:
      chat:
        primary: family-a-5.5
        fallbacks: [family-a-5.4]     # tried in order when the primary fails in a retryable way
      summaries: family-a-5.4         # shorthand: a primary without fallbacks
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml


@dataclass(frozen=True)
class Route:
    primary: str
    fallbacks: tuple[str, ...] = ()

    @property
    def models(self) -> tuple[str, ...]:
        return (self.primary, *self.fallbacks)


@dataclass(frozen=True)
class ModelAliases:
    """alias -> Route. A name that is not an alias is used as a model id, alone."""

    routes: Mapping[str, Route] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))

    def models(self, name: str) -> tuple[str, ...]:
        route = self.routes.get(name)
        return route.models if route else (name,)

    @classmethod
    def from_config(cls, aliases: Mapping) -> ModelAliases:
        """From a mapping such as YAML's `aliases:` section (see the module docstring)."""
        if not isinstance(aliases, Mapping):
            raise ValueError("aliases must be a mapping of alias -> model or {primary, fallbacks}")
        return cls({str(alias): _route(str(alias), entry) for alias, entry in aliases.items()})

    @classmethod
    def from_yaml(cls, text: str, *, section: str | None = "aliases") -> ModelAliases:
        document = yaml.safe_load(text) or {}
        if section is not None:
            if not isinstance(document, Mapping) or section not in document:
                raise ValueError(f"no `{section}:` section in the aliases configuration")
            document = document[section]
        return cls.from_config(document or {})

    @classmethod
    def load(cls, path: str | Path, *, section: str | None = "aliases") -> ModelAliases:
        return cls.from_yaml(Path(path).read_text(), section=section)


def _route(alias: str, entry: object) -> Route:
    if isinstance(entry, str):
        entry = {"primary": entry}
    if not isinstance(entry, Mapping) or set(entry) - {"primary", "fallbacks"}:
        raise ValueError(f"alias {alias!r}: expected a model id or {{primary, fallbacks}}, got {entry!r}")
    primary, fallbacks = entry.get("primary"), entry.get("fallbacks") or []
    if not isinstance(primary, str) or not primary:
        raise ValueError(f"alias {alias!r}: `primary` must be a model id")
    if not isinstance(fallbacks, list) or not all(isinstance(m, str) and m for m in fallbacks):
        raise ValueError(f"alias {alias!r}: `fallbacks` must be a list of model ids")
    if len({primary, *fallbacks}) != 1 + len(fallbacks):
        raise ValueError(f"alias {alias!r}: a model appears twice in its chain")
    return Route(primary, tuple(fallbacks))
