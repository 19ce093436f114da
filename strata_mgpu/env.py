"""Every STRATA_* environment variable, typed, with its default and meaning. Nothing else reads os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    meaning: str

    def raw(self) -> str | None:
        v = os.environ.get(self.name)
        return self.default if v is None or v == "" else v


CACHE_DIR = EnvVar("STRATA_CACHE_DIR", None, "where the built-in demo model is written (default: the user cache dir)")
LOG_LEVEL = EnvVar("STRATA_LOG_LEVEL", "INFO", "logging level of the server and engine (DEBUG, INFO, WARNING, ...)")

ALL = (CACHE_DIR, LOG_LEVEL)


def cache_dir() -> Path:
    raw = CACHE_DIR.raw()
    if raw:
        return Path(raw).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("strata-mgpu"))


def log_level() -> str:
    raw = (LOG_LEVEL.raw() or "INFO").upper()
    if raw not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise EnvError(f"{LOG_LEVEL.name}={raw!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return raw
