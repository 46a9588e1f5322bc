"""Pretrained encoder checkpoints as Hugging Face-style folders.

A checkpoint is a folder holding

* ``config.json``: ``model_type`` (``"world-clip"``), ``encoder`` (a name in
  :data:`fedjax_mm.models.ENCODERS`), ``modality``, the constructor's size
  keys (``image_size``, ``channels`` or ``vocab_size``, ``max_len``),
  ``features``, ``torch_dtype``-style ``dtype`` of the stored tensors, and free
  provenance (``pretraining``: data, seed, partner tower, steps; ``quality``:
  the probe and retrieval figures measured when it was written);
* ``model.safetensors``: one tensor per parameter, named by its dotted module
  path (``blocks.0.attn.query.kernel``), as PyTorch state dicts name theirs.
  A ``projection.kernel`` tensor, when present, is the CLIP projection into the
  joint space that the encoder was pretrained with (used for zero-shot
  retrieval; user models build their own projector). ``pooled.mean`` and
  ``pooled.std``, when present, are the per-feature mean and standard deviation
  of the encoder's pooled output over its pretraining data
  (:func:`feature_stats`), which a user model may standardise its features with
  (``standardize`` in :func:`fedjax_mm.models.build`; :func:`read_feature_stats`).

Checkpoints are found by name or by path: ``"world-clip/vit_s"`` is the folder
of that name shipped in the package (:data:`WEIGHTS_DIR`), anything containing
a path separator that exists on disk is a folder. Loading checks the config
against the module it fills and reports missing, unexpected or mis-shaped
tensors by name. LoRA adapters are not stored: the adapted model's base paths
equal the plain model's (:func:`fedjax_mm.models.lora.dense`), so a base
checkpoint fills a LoRA-adapted encoder and leaves its adapters as initialised.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from fedjax_mm.models import hf

__all__ = [
  "STATS_KEYS",
  "WEIGHTS_DIR",
  "PretrainedError",
  "add_feature_stats",
  "available",
  "feature_stats",
  "load_into",
  "read_config",
  "read_feature_stats",
  "read_tensors",
  "resolve",
  "save",
  "size_keys",
]

#: Folder of the checkpoints shipped with the package: ``WEIGHTS_DIR / "world-clip" / name``.
WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "weights"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: The tensors holding the pooled features' statistics (mean, std) over the pretraining data.
STATS_KEYS = ("pooled.mean", "pooled.std")
_SIZE_KEYS = {"image": ("image_size", "channels"), "text": ("vocab_size", "max_len")}


class PretrainedError(ValueError):
  """A checkpoint that cannot be found or does not fit the module it should fill."""


def available() -> list[str]:
  """Names of the shipped checkpoints (``"world-clip/vit_s"``, ...)."""
  if not WEIGHTS_DIR.is_dir():
    return []
  return sorted(
    f"{p.parent.name}/{p.name}" for p in WEIGHTS_DIR.glob("*/*") if (p / CONFIG_FILE).is_file()
  )


def resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
  """The folder of a checkpoint given by shipped name or by path.

  Raises:
    PretrainedError: no such folder, or one without ``config.json`` /
      ``model.safetensors``.
  """
  path = pathlib.Path(name_or_path).expanduser()
  if not path.is_dir():
    shipped = WEIGHTS_DIR / str(name_or_path)
    if not shipped.is_dir():
      names = ", ".join(available()) or "none"
      raise PretrainedError(
        f"no pretrained checkpoint {str(name_or_path)!r}: not a folder, nor a shipped name "
        f"(shipped: {names}); rebuild them with "
        "`python -m experiments.main --config=experiments/pretrain.py`."
      )
    path = shipped
  for file in (CONFIG_FILE, WEIGHTS_FILE):
    if not (path / file).is_file():
      raise PretrainedError(f"checkpoint folder {path} has no {file}.")
  return path


#: What to do about a checkpoint file that cannot be read.
_REBUILD = (
  "a copy cut short? Copy it again, or rebuild it with "
  "`python -m experiments.main --config=experiments/pretrain.py`"
)


def read_config(name_or_path: str | pathlib.Path) -> dict[str, Any]:
  """The checkpoint's ``config.json``.

  Raises:
    PretrainedError: as :func:`resolve`, or the file is not a JSON object.
  """
  return hf.read_json(resolve(name_or_path) / CONFIG_FILE, PretrainedError, _REBUILD)


def read_tensors(name_or_path: str | pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint, by dotted name, as float32 numpy arrays.

  Raises:
    PretrainedError: as :func:`resolve`, or ``model.safetensors`` is damaged.
  """
  tensors = hf.read_safetensors(resolve(name_or_path) / WEIGHTS_FILE, PretrainedError, _REBUILD)
  return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _dotted(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def _base_params(module: nnx.Module) -> dict[str, nnx.Variable]:
  """Dotted path -> variable of every ``nnx.Param`` that is not a LoRA adapter."""
  flat = nnx.to_flat_state(nnx.state(module, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
  return {_dotted(path): var for path, var in flat}


def save(
  path: str | pathlib.Path,
  encoder: nnx.Module,
  config: Mapping[str, Any],
  *,
  projection: np.ndarray | None = None,
  feature_stats: tuple[np.ndarray, np.ndarray] | None = None,
  dtype: str = "float32",
) -> pathlib.Path:
  """Writes ``encoder``'s base parameters and ``config`` as a checkpoint folder.

  Args:
    path: the folder (created; files in it are replaced).
    encoder: the encoder module (LoRA adapters, if any, are not stored).
    config: ``config.json``'s content; must hold ``encoder`` and ``modality``
      and the modality's size keys.
    projection: optional ``[features, d]`` CLIP projection, stored as
      ``projection.kernel``.
    feature_stats: optional ``(mean, std)``, each ``[features]``, of the pooled
      features over the pretraining data (:func:`feature_stats`), stored as
      :data:`STATS_KEYS`.
    dtype: ``"float32"`` or ``"float16"`` for the stored tensors (loading
      always returns float32).

  Returns:
    The folder.
  """
  from safetensors.numpy import save_file

  if dtype not in ("float32", "float16"):
    raise ValueError(f"dtype must be float32 or float16, got {dtype!r}.")
  missing = [k for k in ("encoder", "modality") if k not in config]
  if missing:
    raise ValueError(f"config lacks {missing}.")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {k: np.asarray(v[...], dtype) for k, v in _base_params(encoder).items()}
  if projection is not None:
    tensors["projection.kernel"] = np.asarray(projection, dtype)
  if feature_stats is not None:
    tensors |= _stats_tensors(encoder, feature_stats, dtype)
  save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "np"})
  (path / WEIGHTS_FILE).chmod(0o644)
  body = {"model_type": "world-clip", **dict(config), "dtype": dtype}
  (path / CONFIG_FILE).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
  return path


def load_into(
  encoder: nnx.Module, name_or_path: str | pathlib.Path, *, expect: Mapping[str, Any] = ()
) -> dict[str, Any]:
  """Fills ``encoder``'s base parameters from a checkpoint, in place.

  Args:
    encoder: the module to fill (built with the checkpoint's encoder name and
      sizes; LoRA adapters are left as they are).
    name_or_path: a shipped name or a folder.
    expect: config keys that must match the checkpoint's (e.g. ``encoder``,
      ``image_size``); a mismatch raises.

  Returns:
    The checkpoint's config.

  Raises:
    PretrainedError: the folder is missing, a config key differs from
      ``expect``, or tensors are missing, unexpected or of the wrong shape.
  """
  folder = resolve(name_or_path)
  config = read_config(folder)
  wrong = {k: (v, config.get(k)) for k, v in dict(expect).items() if config.get(k) != v}
  if wrong:
    detail = ", ".join(f"{k}: wanted {a!r}, checkpoint has {b!r}" for k, (a, b) in wrong.items())
    raise PretrainedError(f"checkpoint {folder} does not fit: {detail}.")
  tensors = read_tensors(folder)
  for key in ("projection.kernel", *STATS_KEYS):
    tensors.pop(key, None)
  params = _base_params(encoder)
  missing = sorted(set(params) - set(tensors))
  unexpected = sorted(set(tensors) - set(params))
  if missing or unexpected:
    raise PretrainedError(
      f"checkpoint {folder} does not match the {config.get('encoder')} module: "
      f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
      f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}."
    )
  for name, var in params.items():
    if tuple(var[...].shape) != tensors[name].shape:
      raise PretrainedError(
        f"checkpoint {folder}: {name} has shape {tensors[name].shape}, "
        f"the module wants {tuple(var[...].shape)}."
      )
    var[...] = jnp.asarray(tensors[name], var[...].dtype)
  return config


def _stats_tensors(encoder, stats, dtype) -> dict[str, np.ndarray]:
  mean, std = (np.asarray(v, np.float32) for v in stats)
  if mean.shape != (encoder.features,) or std.shape != (encoder.features,):
    raise ValueError(
      f"feature statistics must be two [{encoder.features}] arrays, got {mean.shape} and {std.shape}."
    )
  if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std >= 0)):
    raise ValueError("feature statistics must be finite, with std >= 0.")
  return dict(zip(STATS_KEYS, (mean.astype(dtype), std.astype(dtype)), strict=True))


def feature_stats(
  encoder: nnx.Module, inputs: np.ndarray, *, batch_size: int = 500
) -> tuple[np.ndarray, np.ndarray]:
  """Per-feature mean and standard deviation of ``encoder``'s pooled output over ``inputs``.

  Args:
    encoder: an image or text encoder (``encoder(x) -> (pooled [b, h], spatial)``).
    inputs: ``[n, ...]`` images or token ids, e.g. a prefix of its pretraining data.
    batch_size: inputs per forward pass.

  Returns:
    ``(mean, std)``, float32 ``[h]`` each (population std, over the ``n`` inputs).
  """
  if len(inputs) < 2:
    raise ValueError(f"feature statistics need at least 2 inputs, got {len(inputs)}.")
  pooled = np.concatenate(
    [
      np.asarray(encoder(jnp.asarray(inputs[i : i + batch_size]))[0], np.float64)
      for i in range(0, len(inputs), batch_size)
    ]
  )
  return pooled.mean(0).astype(np.float32), pooled.std(0).astype(np.float32)


def read_feature_stats(name_or_path: str | pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  """The checkpoint's ``(mean, std)`` of its pooled features (:data:`STATS_KEYS`).

  Raises:
    PretrainedError: the checkpoint carries no statistics.
  """
  tensors = read_tensors(name_or_path)
  if not all(k in tensors for k in STATS_KEYS):
    raise PretrainedError(
      f"checkpoint {resolve(name_or_path)} carries no feature statistics ({', '.join(STATS_KEYS)}); "
      "rebuild it with `python -m experiments.main --config=experiments/pretrain.py` "
      "(a rerun over finished folders adds them) or build the model with standardize=False."
    )
  return tensors[STATS_KEYS[0]], tensors[STATS_KEYS[1]]


def add_feature_stats(
  name_or_path: str | pathlib.Path, encoder: nnx.Module, stats: tuple[np.ndarray, np.ndarray]
) -> pathlib.Path:
  """Writes ``stats`` into an existing checkpoint's ``model.safetensors``, every other tensor kept.

  The stored dtype is the checkpoint's (``config.json``'s ``dtype``); existing
  statistics are replaced.
  """
  from safetensors.numpy import save_file

  folder = resolve(name_or_path)
  dtype = read_config(folder).get("dtype", "float32")
  tensors = hf.read_safetensors(folder / WEIGHTS_FILE, PretrainedError, _REBUILD)
  tensors |= _stats_tensors(encoder, stats, dtype)
  save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "np"})
  return folder


def size_keys(modality: str) -> tuple[str, ...]:
  """The constructor keys a checkpoint of ``modality`` records."""
  return _SIZE_KEYS[modality]
