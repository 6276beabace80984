"""Writing calibration outputs so that an interrupted run leaves the old output or the new one, never a mix.

A file is written under a temporary name beside it and renamed over the target (``os.replace``: atomic
on one file system). A plan directory is filled under a temporary name beside it, then put in place with
two renames (old -> a hidden ``.<name>.old-*`` name, new -> the name) and the old one deleted: a reader
sees the complete old plan or the complete new one; a run killed between the two renames leaves the old
plan under its hidden name. Leftover temporaries are hidden (dot-prefixed) and never read.

The checksums of stats.safetensors and plan.json are sha256 digests of canonical JSON (sorted keys,
compact) and raw bytes (:func:`sha256`, :func:`canonical`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hidden_sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


def write_file(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary sibling renamed over it)."""
    path = Path(path)
    temporary = _hidden_sibling(path, "tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def write_directory(directory: str | Path, fill: Callable[[Path], None]) -> Path:
    """Make ``directory`` by ``fill(temporary directory)`` and renames (module docstring); an existing
    ``directory`` is replaced as a whole."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = _hidden_sibling(directory, "tmp")
    temporary.mkdir()
    try:
        fill(temporary)
        old = None
        if directory.exists():
            old = _hidden_sibling(directory, "old")
            directory.rename(old)
        temporary.rename(directory)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary)
    if old is not None:
        shutil.rmtree(old)
    return directory
