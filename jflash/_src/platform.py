"""What machine we are on: decides the default implementation and tiles."""

from __future__ import annotations

import functools

import jax


@functools.cache
def cuda_gpu_available() -> bool:
  """True when JAX's default backend is an NVIDIA (CUDA) GPU."""
  if jax.default_backend() != "gpu":
    return False
  device = jax.devices()[0]
  version = getattr(device.client, "platform_version", "") or ""
  return "rocm" not in version.lower()


def device_kind() -> str:
  """`device_kind` of the default device, e.g. "NVIDIA H100 80GB HBM3"."""
  return jax.devices()[0].device_kind


def cuda_compute_capability() -> str | None:
  """The default device's CUDA compute capability ("9.0"), or None when
  it is no CUDA GPU."""
  if not cuda_gpu_available():
    return None
  return str(getattr(jax.devices()[0], "compute_capability", "")) or None


# Hopper's count (H100 SXM, H200), for machines that report none (CPU).
DEFAULT_MULTIPROCESSORS = 132


def multiprocessor_count() -> int:
  """The default GPU's streaming multiprocessors (DEFAULT_MULTIPROCESSORS
  off a GPU or where JAX does not report it)."""
  if not cuda_gpu_available():
    return DEFAULT_MULTIPROCESSORS
  count = getattr(jax.devices()[0], "core_count", None)
  return int(count) if count else DEFAULT_MULTIPROCESSORS
