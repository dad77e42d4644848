"""Noise calibrations remembered across processes, and checked again before they are used.

A calibration (the smallest noise multiplier z that meets an (epsilon, delta) target, found by a root search over
the accountant) costs a device or a server about a second of CPU, and every new process pays it again: each
simulation worker, each ClientApp process of a deployment, each run's ServerApp. This cache keeps the results in
one small JSON file per machine, so a later process with the same target reads z instead of searching for it.

**A cached value is never trusted.** The caller passes the check the search itself guarantees (for DP-SGD: the
target is met at z, and missed at z / (1 + 1e-4), the search's tolerance); a value that fails it is searched
again and overwritten. A damaged, stale or tampered file can therefore cost time, never privacy: the device's
accountant re-derives every epsilon it reports from z as before.

**Where.** ``$FEDPDM_CALIBRATION_CACHE`` names the file; unset, it is ``$XDG_CACHE_HOME/fedpdm-flower/
calibrations.json`` (``~/.cache/...`` without XDG_CACHE_HOME). ``FEDPDM_CALIBRATION_CACHE=off`` (or ``0``) turns
the cache off. A file that cannot be read or written is skipped without a word: the calibration runs as before.
Entries are keyed by the kind of calibration, its exact arguments, and the versions of this library and of Opacus
(whose RDP analysis the DP-SGD accountant runs), so an upgrade starts afresh.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

__all__ = ["CACHE_VAR", "cache_path", "calibrated"]

#: the environment variable naming the cache file ("off" or "0": no cache)
CACHE_VAR = "FEDPDM_CALIBRATION_CACHE"
_OFF = {"0", "off", "false", "no", "none"}
#: at most this many entries are kept (the oldest go first): a file, not a database
_MAX_ENTRIES = 512


def cache_path() -> Path | None:
    """The cache file this process uses, or None when the cache is off."""
    value = os.environ.get(CACHE_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF or not value.strip() else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedpdm-flower" / "calibrations.json"


@functools.cache
def _versions() -> str:
    found = []
    for dist in ("fedpdm-flower", "opacus"):
        try:
            found.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist}=?")
    return " ".join(found)


def _read(path: Path) -> dict[str, float]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {k: float(v) for k, v in entries.items() if isinstance(k, str) and isinstance(v, int | float)}


def _write(path: Path, key: str, value: float) -> None:
    """Add one entry (atomically: a temporary file renamed over the old one; a concurrent writer's entry may be
    lost, never half-written)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read(path)
        entries.pop(key, None)
        entries[key] = value
        kept = dict(list(entries.items())[-_MAX_ENTRIES:])
        fd, tmp = tempfile.mkstemp(prefix=".calibrations-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"entries": kept}, f)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def calibrated(kind: str, args: tuple[float | int, ...], search: Callable[[], float],
               holds: Callable[[float], bool]) -> float:
    """``search()``'s result for ``kind`` at ``args``, from the cache when an entry there passes ``holds`` (the
    search's own guarantee, checked again), else searched and stored. ``args`` are the calibration's exact inputs
    (their ``repr`` is the key)."""
    path = cache_path()
    if path is None:
        return search()
    key = f"{kind} {' '.join(repr(a) for a in args)} {_versions()}"
    cached = _read(path).get(key)
    if cached is not None:
        try:
            if holds(cached):
                return cached
        except (ValueError, ArithmeticError):  # not even a valid input to the check: searched again below
            pass
    value = search()
    _write(path, key, value)
    return value
