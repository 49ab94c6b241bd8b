"""The on-disk kernel-module cache: a compiled module survives the process, so the next one does not recompile.

One file per module, `<fingerprint>.module` in `module_cache_dir()`: a magic line, the module's entry (what a bundle
manifest records for it: key, target, layouts, avals, ...) as one JSON line, then the module bytes. The fingerprint
(`_runtime`) already holds everything a module depends on (problem without m, config, arch, kernel sources, cutlass
DSL version), so an entry is never stale; the recorded avals and the bytes' sha256 are checked on every read.

Concurrency: an entry is written to a temporary file in the same folder and renamed over the old one (os.replace is
atomic), so a reader sees the old entry or the new one, never a torn file, whatever other processes write at the
same time (two processes compiling the same module both write it; the last rename wins, both are whole). A bad entry
(truncated by a crash, hand-edited, another format) is ignored and rewritten by the next compile. Writing failures
(read-only or full disk) only log: the cache is an optimisation. Nothing here imports jax or cutlass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger("cudnn_moe_jax.runtime")

MAGIC = b"cudnn_moe_jax kernel module 1"
SUFFIX = ".module"
OFF = ("0", "off", "false", "no", "none")


def cache_dir() -> Path:
    """CUDNN_MOE_JAX_CACHE, else $XDG_CACHE_HOME/cudnn_moe_jax, else ~/.cache/cudnn_moe_jax."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("CUDNN_MOE_JAX_CACHE") or os.path.join(root, "cudnn_moe_jax"))


def module_cache_dir() -> Optional[Path]:
    """CUDNN_MOE_JAX_MODULE_CACHE (a folder; 0/off/false/no/none: no disk cache), else `cache_dir()/modules`."""
    env = os.environ.get("CUDNN_MOE_JAX_MODULE_CACHE", "")
    if env.strip().lower() in OFF:
        return None
    return Path(env) if env else cache_dir() / "modules"


def entry_path(fp: str) -> Optional[Path]:
    folder = module_cache_dir()
    return None if folder is None else folder / f"{fp}{SUFFIX}"


def read(fp: str, avals_key: Optional[str], notes: list[str]) -> Optional[tuple[dict, bytes]]:
    """(entry, module bytes) stored under fingerprint `fp`, built for `avals_key` (None: any), bytes checked against
    the entry's size and sha256. Anything wrong -> None, with a note saying why."""
    path = entry_path(fp)
    if path is None or not path.is_file():
        return None
    try:
        parts = path.read_bytes().split(b"\n", 2)
        if len(parts) != 3 or parts[0] != MAGIC:
            raise ValueError("not a module-cache file, or a truncated one")
        _, header, data = parts
        entry = json.loads(header)
        if entry["fingerprint"] != fp:
            raise ValueError("entry is for another fingerprint")
        if avals_key is not None and entry["avals_key"] != avals_key:
            notes.append(f"module cache {path}: entry is for other avals {entry['in_avals']} -> {entry['out_avals']}")
            return None
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["key"]:
            raise ValueError(f"the {len(data)} module bytes are not the entry's ({entry['size']}, sha256)")
        return entry, data
    except (OSError, ValueError, KeyError, TypeError) as err:
        notes.append(f"module cache {path}: ignored ({err})")
        log.warning("ignoring module-cache entry %s (%s); it is rebuilt when compiling", path, err)
        return None


def write(fp: str, entry: dict, data: bytes) -> Optional[Path]:
    """Store `data` with `entry` under fingerprint `fp` atomically; the entry's path, or None (off, or failed)."""
    path = entry_path(fp)
    if path is None:
        return None
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{fp[:16]}-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + b"\n" + json.dumps({**entry, "fingerprint": fp}, sort_keys=True).encode() + b"\n")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the rename must not reach the disk before the data (power loss)
        os.replace(tmp, path)
        return path
    except OSError as err:
        log.warning("kernel module not written to the module cache %s (%s)", path.parent, err)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return None
