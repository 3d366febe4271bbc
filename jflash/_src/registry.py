"""The backends, what each supports (as data), and the choice per pass.

A backend is registered as a `Backend`: a name, its `Capabilities`, the
options it accepts, a function that turns a call and the user's options into
its configuration, and its forward and backward functions. Which backend
runs a pass of a call is decided here, once, before anything is traced:

- `implementation=None`: for each pass separately, the first backend in
  priority order whose capabilities cover the call and that is a default on
  this device (a backend supplying only a forward, or only some options,
  leaves the rest to the next one);
- `implementation="name"`: that backend for both passes, or a
  NotImplementedError naming, in one sentence, what it cannot do.

`jflash.implementations()` lists the backends and their capabilities.

FP8 calls (q, k, v in an FP8 dtype with their descales, spec.py) are
decided here too, once: a backend that lists the call's FP8 dtype in its
`Capabilities.dtypes` runs it natively (its forward receives the FP8
operands, the descales and `spec.out_dtype`); any other backend is judged,
configured and run on `CallSpec.dequantized()` (`runs_as`), and the plan
says so (`Plan.dequantize`): api.py then dequantizes the operands before
the binding. No backend has an FP8 backward.

Forward functions return (out, lse2) with lse2 the base-2 log-sum-exp,
float32 [batch, num_heads, q_len] (numerics.py); backward functions take
that residual, so any forward pairs with any backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable
import warnings

import jax

from jflash._src import platform
from jflash._src.spec import BackendOptions
from jflash._src.spec import CallSpec
from jflash._src.spec import FP8_DTYPES
from jflash._src.tuning import route
from jflash._src.tuning.space import TuningSpace

_PLATFORM_NAMES = {"cuda": "a CUDA GPU"}

FORWARD = "forward"
BACKWARD = "backward"
PASSES = (FORWARD, BACKWARD)

# Every mask feature and option a call can use, as capabilities name them.
MASK_FEATURES = ("causal", "bottom_right", "window", "lengths", "segments",
                 "dense_mask", "paged")
OPTIONS = ("bias", "soft_cap", "sinks", "alibi", "dropout", "return_lse")


# Why differentiating an FP8 call raises (api.run, `Plan.backward_error`).
FP8_FORWARD_ONLY = (
    "jflash.flash_attention: FP8 attention has a forward pass only (for "
    "inference): an FP8 call cannot be differentiated, with respect to any "
    "argument (the descales included). Train with 16-bit inputs and "
    "quantize for inference.")


def runs_natively(backend: Backend, spec: CallSpec) -> bool:
  """Whether `backend` takes the call's dtype as is (always for non-FP8
  calls; for an FP8 call, whether its capabilities list the FP8 dtype)."""
  return not spec.is_fp8 or spec.dtype in backend.capabilities.dtypes


def runs_as(backend: Backend, spec: CallSpec) -> CallSpec:
  """The call as `backend` runs it: an FP8 call on a backend without FP8
  kernels (`runs_natively` is False) runs dequantized
  (`CallSpec.dequantized`); every other call as it is."""
  return spec if runs_natively(backend, spec) else spec.dequantized()


def call_features(spec: CallSpec) -> tuple[frozenset[str], frozenset[str]]:
  """(mask features, options) a call uses, named as in `Capabilities`."""
  mask = spec.mask
  masks = {"causal": mask.is_causal, "bottom_right": mask.bottom_right,
           "window": mask.window is not None, "lengths": mask.has_lengths,
           "segments": mask.has_segments, "dense_mask": mask.has_dense_mask,
           "paged": mask.paged}
  mods = spec.modifiers
  options = {"bias": spec.has_bias,
             "soft_cap": spec.logits_soft_cap is not None,
             "sinks": mods.has_sinks, "alibi": mods.has_alibi,
             "dropout": mods.has_dropout, "return_lse": spec.return_lse}
  return (frozenset(k for k, v in masks.items() if v),
          frozenset(k for k, v in options.items() if v))


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a backend can run, per pass: the limits several backends share.

  A backend's own limits (exact head dims, query rows, a GPU generation)
  are its `Backend.check` and `Backend.unavailable` instead.

  Attributes:
    passes: the passes it implements ("forward", "backward").
    dtypes: names of the q/k/v dtypes it takes.
    max_head_dim: the largest head dimension, or None for any.
    mask_features: the mask features it supports (`MASK_FEATURES`).
    options: the options it supports (`OPTIONS`).
    platforms: JAX platforms it runs on ("cuda", "cpu", ...); None: any.
    interpretable: whether `interpret=True` runs it on any platform.
  """

  passes: frozenset[str]
  dtypes: tuple[str, ...]
  max_head_dim: int | None
  mask_features: frozenset[str]
  options: frozenset[str]
  platforms: frozenset[str] | None = None
  interpretable: bool = False


# How `implementation=None` may choose a backend on a platform.
DEFAULT = "default"  # In priority order, for the passes it supports.
FALLBACK = "fallback"  # Only for a pass no default backend runs; warns.
NAMED_ONLY = "named only"  # Never; it runs when named.


def _always_default(platform_name: str) -> str:
  del platform_name
  return DEFAULT


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered implementation.

  Attributes:
    name: what `implementation=` calls it.
    capabilities: what it supports.
    configure: (spec, **options) -> its hashable configuration for the
      call, e.g. a frozen dataclass (`TritonConfig.for_call`). It takes as
      keywords the user options it takes (`takes`), each passed only when
      set: `block_sizes` (an instance of `block_sizes_type`) and, where
      its capabilities are `interpretable`, `interpret`. May raise
      ValueError for bad option values.
    forward: (spec, config, operands) -> (out, lse2).
    backward: (spec, config, operands, out, lse2, dout, dlse2 or None) ->
      `spec.Operands` of cotangents (None for non-differentiable operands).
      It takes the probabilities' normalizer from `lse2` and delta =
      rowsum(dout * out) from `out`, never recomputing them: ring attention
      passes the residuals of whole rows with one key shard's operands.
    differentiable: whether its passes are plain JAX that can be
      differentiated again (higher-order derivatives); kernels are not.
    direct: for a backend written in plain differentiable JAX, (spec,
      config, operands) -> out or (out, natural lse), used as is (JAX's
      autodiff, any order, forward mode too) when it runs both passes.
    check: its own limits beyond `capabilities`: (spec, pass) -> why it
      cannot run that pass of the call, in one sentence, or None.
    limits: what `check` enforces, in words (`jflash.implementations()`).
    unavailable: () -> why it cannot run on this machine beyond its
      platforms (a GPU generation, a library), or None.
    role: platform -> DEFAULT, FALLBACK or NAMED_ONLY: how
      `implementation=None` may choose it there.
    block_sizes_type: the class of the `block_sizes` it takes (its tiles),
      or None: a call with tiles of another class never runs here.
    keywords: the other `spec.BackendOptions` it takes (decode's
      `num_splits`); a call that sets one runs only on a backend taking it.
    tuning: what `jflash.autotune` searches for it, or None (no search).
  """

  name: str
  capabilities: Capabilities
  configure: Callable[..., Any]
  forward: Callable[..., Any] | None
  backward: Callable[..., Any] | None
  differentiable: bool = False
  direct: Callable[..., Any] | None = None
  check: Callable[[CallSpec, str], str | None] | None = None
  limits: str = ""
  unavailable: Callable[[], str | None] | None = None
  role: Callable[[str], str] = _always_default
  block_sizes_type: type | None = None
  tuning: TuningSpace | None = None
  keywords: frozenset[str] = frozenset()

  @property
  def option_names(self) -> frozenset[str]:
    """The backend keyword arguments of `flash_attention` it takes."""
    return frozenset(
        name for name, taken in (
            ("block_sizes", self.block_sizes_type is not None),
            ("interpret", self.capabilities.interpretable)) if taken
    ) | self.keywords

  def takes(self, options: BackendOptions) -> bool:
    """Whether every option set is one of its own: tiles of its
    `block_sizes_type`, `interpret` where it can be interpreted, the
    others among its `keywords`."""
    tiles = options.block_sizes
    others = set(options.given()) - {"block_sizes", "interpret"}
    return ((tiles is None or (self.block_sizes_type is not None
                               and isinstance(tiles, self.block_sizes_type)))
            and (not options.interpret or self.capabilities.interpretable)
            and others <= self.keywords)


_REGISTRY: dict[str, Backend] = {}
_PRIORITY: list[str] = []


def register(backend: Backend, *, priority: int | None = None) -> None:
  """Adds a backend; `priority`: its place in the order (default: last)."""
  _REGISTRY[backend.name] = backend
  if backend.name in _PRIORITY:
    _PRIORITY.remove(backend.name)
  _PRIORITY.insert(len(_PRIORITY) if priority is None else priority,
                   backend.name)


def get(name: str) -> Backend:
  return _REGISTRY[name]


def names() -> tuple[str, ...]:
  """Registered backends, in priority order."""
  return tuple(_PRIORITY)


def current_platform() -> str:
  """"cuda" on an NVIDIA GPU, else JAX's default backend ("cpu", ...)."""
  return "cuda" if platform.cuda_gpu_available() else jax.default_backend()


def unavailable_reason(backend: Backend, interpreted: bool = False
                       ) -> str | None:
  """Why `backend` cannot run on this machine, in one sentence, or None.

  Args:
    backend: the candidate.
    interpreted: whether the call asks for the Pallas interpreter (which
      runs an interpretable backend anywhere).
  """
  caps, name = backend.capabilities, backend.name
  interpreted = interpreted and caps.interpretable
  where = current_platform()
  if (caps.platforms is not None and where not in caps.platforms
      and not interpreted):
    needs = " or ".join(_PLATFORM_NAMES.get(p, p) for p in
                        sorted(caps.platforms))
    hint = ("; pass interpret=True to run its kernels through the Pallas "
            "interpreter" if caps.interpretable else "")
    return (f"{name} needs {needs}, and JAX's default backend is "
            f"{jax.default_backend()!r}{hint}.")
  if backend.unavailable is not None and not interpreted:
    return backend.unavailable()
  return None


def unsupported_reason(backend: Backend, spec: CallSpec, pass_: str,
                       options: dict[str, Any]) -> str | None:
  """Why `backend` cannot run `pass_` of the call, in one sentence, or None.

  Args:
    backend: the candidate.
    spec: the call.
    pass_: "forward" or "backward".
    options: the user's backend options that are set (e.g. interpret).
  """
  caps, name = backend.capabilities, backend.name
  if pass_ not in caps.passes:
    return f"{name} has no {pass_} pass."
  reason = unavailable_reason(backend, bool(options.get("interpret", False)))
  if reason is not None:
    return reason
  if spec.is_fp8 and pass_ == BACKWARD:
    # FP8 serves inference: no backend differentiates an FP8 call (api.run
    # raises FP8_FORWARD_ONLY).
    return f"{name} has no backward pass for FP8 inputs ({spec.dtype})."
  given_dtype, spec = spec.dtype, runs_as(backend, spec)
  if spec.dtype not in caps.dtypes:
    via = ("" if spec.dtype == given_dtype else
           f" (it would run the {given_dtype} call dequantized)")
    return (f"{name} supports dtypes {', '.join(caps.dtypes)}; got "
            f"{spec.dtype}{via}.")
  if caps.max_head_dim is not None and spec.head_dim > caps.max_head_dim:
    return (f"{name} supports head_dim <= {caps.max_head_dim}; got "
            f"head_dim={spec.head_dim}.")
  masks, opts = call_features(spec)
  missing = sorted((masks - caps.mask_features) | (opts - caps.options))
  if missing:
    return f"{name} does not support {', '.join(missing)}."
  if spec.mask.paged and pass_ == BACKWARD:
    # No backend differentiates through a paged cache (a served model's
    # cache is never differentiated): differentiating such a call raises.
    return (f"{name} reads a paged cache (block_table) in the forward pass "
            "only.")
  if backend.check is not None:
    return backend.check(spec, pass_)
  return None


def _is_default_here(backend: Backend) -> bool:
  return backend.role(current_platform()) == DEFAULT


def _is_fallback_here(backend: Backend) -> bool:
  return backend.role(current_platform()) == FALLBACK


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which backend runs each pass, with its configuration (hashable).

  `backward` is None when the named implementation cannot run the backward
  pass of the call: differentiating it raises `backward_error`.
  `dequantize`: the forward backend has no kernels for the call's FP8
  dtype; it runs `CallSpec.dequantized()` (its configuration is for that
  spec) on `fp8.dequantize_operands`.
  """

  forward: str
  forward_config: Any
  backward: str | None
  backward_config: Any
  backward_error: str | None = None
  dequantize: bool = False


def plan(spec: CallSpec, implementation: str | None,
         options: BackendOptions) -> Plan:
  """Chooses the backend of each pass.

  Args:
    spec: the call.
    implementation: a backend's name, or None to choose.
    options: the user's backend options.

  Raises:
    ValueError: for an unknown implementation, or options the named backend
      does not take.
    NotImplementedError: when no backend (or not the named one) can run a
      pass, with the reason in one sentence per candidate.
  """
  # `unsupported_reason` reads the options set by name ("interpret").
  given = options.given()
  if implementation is not None:
    if implementation not in _REGISTRY:
      raise ValueError(f"implementation must be one of {names()} or None; "
                       f"got {implementation!r}.")
    backend = _REGISTRY[implementation]
    for option, value in given.items():
      alone = BackendOptions(**{option: value})
      if not backend.takes(alone):
        owners = [n for n in names() if get(n).takes(alone)]
        raise ValueError(
            f"{option} ({type(value).__name__}) configures the "
            f"{'/'.join(owners) or 'no'} backend; it cannot be combined with "
            f"implementation={implementation!r}.")
    candidates = [backend]
  else:
    candidates = [get(n) for n in names() if get(n).takes(options)]
  chosen = {}
  backward_error = None
  for pass_ in PASSES:
    if pass_ == BACKWARD and spec.is_fp8:
      # Every backend says so (`unsupported_reason`); one message for all.
      chosen[pass_], backward_error = None, FP8_FORWARD_ONLY
      continue
    if implementation is not None:
      reason = unsupported_reason(candidates[0], spec, pass_, given)
      error = reason and (
          f"jflash.flash_attention: implementation={implementation!r} "
          f"cannot run the {pass_} pass of this call: {reason}")
      if error and pass_ == FORWARD:
        raise NotImplementedError(error)
      if error:
        # The forward runs; differentiating the call raises this (a named
        # forward-only backend serves calls that are never differentiated).
        backward_error = error
        chosen[pass_] = None
        continue
      chosen[pass_] = candidates[0]
      continue
    defaults = [b for b in candidates if _is_default_here(b)]
    chosen[pass_], reasons = _first_supporting(defaults, spec, pass_, given)
    if chosen[pass_] is not None and pass_ == FORWARD:
      # Where the priority order was measured not to be the fastest.
      preferred = route.preferred(spec, [
          b.name for b in defaults
          if unsupported_reason(b, spec, pass_, given) is None])
      if preferred is not None:
        chosen[pass_] = get(preferred)
    if chosen[pass_] is None:
      chosen[pass_], more = _first_supporting(
          [b for b in candidates if _is_fallback_here(b)], spec, pass_,
          given)
      if chosen[pass_] is None:
        error = (f"jflash.flash_attention: no implementation can run the "
                 f"{pass_} pass of this call: {' '.join(reasons + more)}")
        if pass_ == FORWARD:
          raise NotImplementedError(error)
        # Forward only (a paged cache, say): differentiating raises this.
        backward_error = error
        continue
      warnings.warn(
          f"jflash.flash_attention: running the {pass_} pass on the "
          f"{chosen[pass_].name!r} fallback: {' '.join(reasons)}",
          stacklevel=4)
  configs = {None: None}
  for backend in chosen.values():
    if backend is not None:
      # Every option set is the backend's own (`takes`).
      configs[backend.name] = backend.configure(runs_as(backend, spec),
                                                **given)
  backward = chosen[BACKWARD] and chosen[BACKWARD].name
  return Plan(forward=chosen[FORWARD].name,
              forward_config=configs[chosen[FORWARD].name],
              backward=backward, backward_config=configs[backward],
              backward_error=backward_error,
              dequantize=not runs_natively(chosen[FORWARD], spec))


def _first_supporting(backends, spec, pass_, options):
  """(first backend that can run the pass or None, reasons of the rest)."""
  reasons = []
  for backend in backends:
    reason = unsupported_reason(backend, spec, pass_, options)
    if reason is None:
      return backend, reasons
    reasons.append(reason)
  return None, reasons


class Implementations(list):
  """`jflash.implementations()`: a list of one dict per backend that prints
  as a table: a row per backend (whether it runs here, passes, dtypes, head
  dims, arguments), then its masks and options and its own limits."""

  _COLUMNS = (("name", "backend"), ("here", "here"), ("passes", "passes"),
              ("dtypes", "dtypes"), ("fp8", "fp8"),
              ("head_dims", "head dims"), ("arguments", "arguments"))

  @staticmethod
  def _here(entry) -> str:
    if entry["available"]:
      return entry["role_here"]
    reason = entry["unavailable_reason"].removeprefix(entry["name"] + " ")
    reason = reason.split(", and ")[0].split("; ")[0].rstrip(".")
    if entry["interpretable"]:
      reason += " (interpret=True runs it)"
    return f"no: {reason}"

  def __str__(self) -> str:
    rows = [dict(
        name=e["name"], here=self._here(e), passes=" + ".join(e["passes"]),
        dtypes=" ".join(e["dtypes"]), fp8=e["fp8"],
        head_dims=("any" if e["max_head_dim"] is None
                   else f"<= {e['max_head_dim']}"),
        arguments=", ".join(e["arguments"]) or "-") for e in self]
    widths = {key: max(len(title), *(len(r[key]) for r in rows))
              for key, title in self._COLUMNS}
    line = lambda cells: "  ".join(
        cells[key].ljust(widths[key]) for key, _ in self._COLUMNS).rstrip()
    indent = " " * (widths["name"] + 2)
    lines = [line(dict(self._COLUMNS))]
    for row, entry in zip(rows, self):
      lines.append(line(row))
      lines.append(f"{indent}supports: "
                   + ", ".join(entry["mask_features"] + entry["options"]))
      if entry["limits"]:
        lines.append(f"{indent}limits: {entry['limits']}")
    return "\n".join(lines)

  def __repr__(self) -> str:
    return str(self)


def implementations() -> Implementations:
  """The registered backends, in priority order, and what each supports.

  Returns:
    An `Implementations` (a list that prints as a table) of one dict per
    backend: "name"; "available": whether it can run on this machine
    (without `interpret`), and "unavailable_reason" (one sentence, or None);
    "role_here": how `implementation=None` may choose it here ("default",
    "fallback": only for what no default backend runs, "named only");
    "default_here": available and "default"; "arguments": the
    backend-specific keyword arguments of `flash_attention` it takes;
    "limits": its own limits in words; "fp8": how it runs FP8 calls'
    forward, "native" (its kernels take the FP8 dtypes listed in "dtypes")
    or "dequantized" (to `spec.DEQUANTIZED_DTYPE`, then its usual kernels);
    and its capabilities ("passes", "dtypes", "max_head_dim",
    "mask_features", "options", "platforms", "interpretable").
  """
  result = Implementations()
  for name in names():
    backend = get(name)
    caps = backend.capabilities
    reason = unavailable_reason(backend)
    role = backend.role(current_platform())
    result.append(dict(
        name=name, available=reason is None, unavailable_reason=reason,
        role_here=role, default_here=reason is None and role == DEFAULT,
        arguments=sorted(backend.option_names), limits=backend.limits,
        fp8=("native" if set(FP8_DTYPES) & set(caps.dtypes)
             else "dequantized"),
        passes=sorted(caps.passes, key=PASSES.index),
        dtypes=list(caps.dtypes), max_head_dim=caps.max_head_dim,
        mask_features=sorted(caps.mask_features, key=MASK_FEATURES.index),
        options=sorted(caps.options, key=OPTIONS.index),
        platforms=None if caps.platforms is None else sorted(caps.platforms),
        interpretable=caps.interpretable))
  return result
