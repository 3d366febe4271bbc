"""The tuning cache: tuned configurations per device kind and shape, on disk.

`jflash.autotune` (jflash/_src/autotune.py, above the public function)
writes entries; a backend's configuration reads them (`tuned`). This module
sits below the backends: it imports none of them, nor anything above them.

Cache file: `$JFLASH_AUTOTUNE_CACHE` if set (the value "off" disables the
cache), else `~/.cache/jflash/autotune.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp

from jflash._src import platform
from jflash._src.spec import CallSpec

CACHE_ENV_VAR = "JFLASH_AUTOTUNE_CACHE"
_DEFAULT_CACHE = os.path.join("~", ".cache", "jflash", "autotune.json")


def cache_path() -> str | None:
  """The autotune cache file, or None when disabled."""
  path = os.environ.get(CACHE_ENV_VAR, "").strip()
  if path.lower() == "off":
    return None
  return os.path.expanduser(path or _DEFAULT_CACHE)


def shape_key(*, q_len: int, kv_len: int, num_heads: int, num_kv_heads: int,
              head_dim: int, dtype: Any, is_causal: bool,
              device_kind: str, backend: str = "triton") -> str:
  """The cache key of one problem shape on one kind of device, for one
  backend's tiles (Triton's keys carry no backend name: they predate the
  others)."""
  key = (f"{device_kind}|{jnp.dtype(dtype).name}|T={q_len}|S={kv_len}|"
         f"N={num_heads}|K={num_kv_heads}|D={head_dim}|causal={is_causal}")
  return key if backend == "triton" else f"{backend}|{key}"


def call_key(spec: CallSpec, backend: str) -> str:
  """The cache key of a call's shape on this device, for `backend`'s tiles."""
  return shape_key(q_len=spec.q_len, kv_len=spec.kv_len,
                   num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, dtype=spec.dtype,
                   is_causal=spec.mask.is_causal,
                   device_kind=platform.device_kind(), backend=backend)


_read_memo: dict[str, tuple[float, dict[str, Any]]] = {}


def _read(path: str | None) -> dict[str, Any]:
  """The cache file's entries (re-read only when the file changed)."""
  if path is None or not os.path.exists(path):
    return {}
  mtime = os.path.getmtime(path)
  memo = _read_memo.get(path)
  if memo is None or memo[0] != mtime:
    with open(path) as f:
      memo = (mtime, json.load(f))
    _read_memo[path] = memo
  return memo[1]


def tuned(spec: CallSpec, backend: str, block_sizes_type: type,
          path: str | None = None) -> Any:
  """`backend`'s tuned tiles for the call on this device, or None.

  Args:
    spec: the call.
    backend: whose tiles (a registry name).
    block_sizes_type: the class of its tiles; an entry holds its fields.
    path: the cache file; default `cache_path()`.
  """
  path = cache_path() if path is None else path
  entry = _read(path).get(call_key(spec, backend))
  return None if entry is None else block_sizes_type(**entry["block_sizes"])


def store(path: str, key: str, entry: dict[str, Any]) -> None:
  """Adds or replaces one entry (the file is replaced atomically)."""
  entries = dict(_read(path))
  entries[key] = entry
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(entries, f, indent=1, sort_keys=True)
  os.replace(temporary, path)  # Atomic: readers never see a partial file.
