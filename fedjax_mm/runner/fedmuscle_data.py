"""FedMuscle's users and what they read: tasks, data sets, models.

The side of :mod:`fedjax_mm.runner.fedmuscle` that turns a config into its
users (:class:`User`), their private train and test sets and the public set
(on the embedded world, :func:`_world_sets`, or through TFDS,
:func:`_tfds_sets`), and each user's model config (architecture, pretrained
checkpoint, frozen base with LoRA adapters or full fine-tuning).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from fedjax_mm import core, data, models
from fedjax_mm.algorithms import (
  fedhenn,
)
from fedjax_mm.core import text as text_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import validation
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.validation import data_source
from fedjax_mm.runner.validation import reader as _reader

#: Task name -> (kind, input key, target key, outputs on the world, head). With
#: ``data.source = "tfds"`` the outputs are the classes of the task's dataset
#: (:func:`_outputs`).
TASKS: dict[str, tuple[str, str, str, int, str]] = {
  "mlc": ("multilabel", "image", "multilabel", data.NUM_SHAPES, "mlp"),
  "ic10": ("classification", "image", "label10", 10, "mlp"),
  "ic100": ("classification", "image", "label100", 100, "mlp"),
  "ss": ("segmentation", "image", "mask", data.NUM_SEG_CLASSES, "segmentation"),
  "tc": ("classification", "caption", "caption_label", data.NUM_COLORS, "linear"),
}


#: Every method ``config.methods`` may name, in the report's column order.
METHODS = (
  "fedmuscle",
  "sage",
  "cofed",
  "feddf",
  "fedhenn",
  "fedrcl",
  "simclr",
  "pseudo_label",
  "local",
)

#: What ``config.methods`` runs when the config has no such key.
DEFAULT_METHODS = ("fedmuscle", "local")


def methods_of(config) -> tuple[str, ...]:
  """``config.methods`` (a comma-separated string or a tuple) in report order, checked.

  Raises :class:`ConfigError` for an unknown or repeated name, or a list
  without ``local`` (every Delta is measured against it).
  """
  spec = config.get("methods", DEFAULT_METHODS) if hasattr(config, "get") else DEFAULT_METHODS
  if isinstance(spec, str):  # "a,b" or a tuple's repr, "('a', 'b')"
    spec = spec.strip("()[] ").split(",")
  names = [str(m).strip().strip("'\"") for m in spec]
  names = validation.check_methods([m for m in names if m], METHODS)
  if "local" not in names or len(names) < 2:
    raise ConfigError(
      "methods must include local and at least one other method (Delta is measured against local)."
    )
  return tuple(m for m in METHODS if m in names)


def _baseline_config(config, name: str) -> dict[str, Any]:
  """``config.baselines.<name>`` as keyword arguments (empty for configs without the block)."""
  block = config.get("baselines") if hasattr(config, "get") else None
  if block is None or name not in block:
    return {}
  return dict(block[name].to_dict() if hasattr(block[name], "to_dict") else block[name])


#: The public set's key of each modality.
_MODALITY_KEY = {"image": "image", "text": "caption"}


#: How a user with a pretrained encoder fine-tunes (``config.fine_tune``, or a
#: user's own ``fine_tune``): "adapters" freezes the encoder's base and trains
#: LoRA adapters where it has dense layers (none in a CNN) plus the projector and
#: head; "full" trains every parameter. From scratch, every parameter trains.
FINE_TUNE = ("adapters", "full")


@dataclasses.dataclass(frozen=True)
class User:
  """One user as the report names it."""

  index: int
  encoder: str
  task: str

  @property
  def name(self) -> str:
    return f"user {self.index + 1}"


def test_sizes(config) -> dict[str, int]:
  """Each task's test set size: ``config.test_sizes.<task>``, or ``config.test_size`` where unset.

  The paper tests each task on its own number of samples; ``test_sizes`` maps a task of
  :data:`TASKS` to a positive int (None, or a config without the block: ``test_size``).
  Raises :class:`ConfigError` for an unknown task or a size that is not a positive int.
  """
  block = config.get("test_sizes") if hasattr(config, "get") else None
  given = {} if block is None else dict(block.to_dict() if hasattr(block, "to_dict") else block)
  unknown = sorted(set(given) - set(TASKS))
  if unknown:
    raise ConfigError(
      f"test_sizes: unknown task {', '.join(map(repr, unknown))}; known: {', '.join(TASKS)}."
    )
  for task, size in given.items():
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
      raise ConfigError(f"test_sizes.{task} must be an int >= 1 (or None), got {size!r}.")
  return {t: config.test_size if given.get(t) is None else given[t] for t in TASKS}


def _tfds_reads(config, users: Sequence[User], methods: Sequence[str]) -> list[tuple[str, str]]:
  """The ``(dataset, split)`` pairs a ``data.source = "tfds"`` run reads, checked.

  Each task reads ``data.tasks.<task>``'s train and test splits
  (:attr:`~fedjax_mm.data.tfds.Reader.splits`), which must hold the task's input
  and target keys; the public set reads ``data.public``'s train split, which must
  hold every modality of ``public.modalities``. Raises :class:`ConfigError`.
  """
  block = config.data
  if "cofed" in methods:  # its statements are the world's class hierarchy
    raise ConfigError(
      "cofed votes through the world's classes: it cannot run with data.source='tfds'."
    )
  reads = []
  for task in sorted({u.task for u in users}):
    _, input_key, target_key, _, _ = TASKS[task]
    name = block.get("tasks", {}).get(task) or ""
    if not name:
      raise ConfigError(f"data.tasks.{task} names no dataset for the {task} users.")
    reader = _reader(f"data.tasks.{task}", name)
    if target_key not in reader.classes or input_key not in reader.keys:
      raise ConfigError(
        f"data.tasks.{task}: {name} has no {input_key!r} and {target_key!r} for the {task} "
        f"task (it gives {', '.join(reader.keys)})."
      )
    reads += [(name, split) for split in reader.splits]
  reader = _reader("data.public", block.get("public", ""))
  for m in config.public.modalities:
    if _MODALITY_KEY[m] not in reader.keys:
      raise ConfigError(
        f"data.public: {block.public} has no {m} for the public set (it gives "
        f"{', '.join(reader.keys)})."
      )
  reads.append((block.public, reader.splits[0]))
  spaces = text_spaces(users)
  texts = bool(spaces) or "text" in config.public.modalities
  if texts and (not spaces or None in spaces):
    raise ConfigError(
      "data.source='tfds' reads English text, which needs the tokenizer of an hf: text "
      "encoder: give every text user one (or drop text from public.modalities)."
    )
  return reads


def _reads_text(u: User) -> bool:
  return TASKS[u.task][1] == "caption"


def text_spaces(users: Sequence[User]) -> tuple[str | None, ...]:
  """The token spaces the text users read (:func:`fedjax_mm.core.text.token_spaces`).

  Each is held as its own tokenisation of the same captions, the public set's once per
  space; None is the world's ids, a checkpoint's name its tokenizer's.
  """
  return text_lib.token_spaces(u.encoder for u in users if _reads_text(u))


def _own_captions(u: User, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A text user's set with the captions of its own token space only (others' dropped)."""
  if not _reads_text(u):
    return arrays
  own = text_lib.caption_key(text_lib.token_space(u.encoder))
  return {k: v for k, v in arrays.items() if k == own or not core.tasks.is_caption_key(k)}


def _user_data(config, users: Sequence[User]):
  """Per-user train/test sets (disjoint, uniform split per task) and the public set.

  From the world (:func:`_world_sets`) or, with ``data.source = "tfds"``, from
  the papers' datasets (:func:`_tfds_sets`).
  """
  sets = _tfds_sets if data_source(config) == "tfds" else _world_sets
  train, test, public = sets(config, users)
  keys = []
  for m in config.public.modalities:
    if m == "text":  # once per token space the text users read (the world's if none)
      keys += [text_lib.caption_key(s) for s in text_spaces(users) or (None,)]
    else:
      keys.append(_MODALITY_KEY[m])
  public = {k: jnp.asarray(public[k]) for k in keys}
  return dict(sorted(train)), dict(sorted(test)), public


def _public_scenes(config) -> dict[str, Any]:
  """The public scenes' :class:`~fedjax_mm.data.WorldConfig` fields that the config sets.

  ``public.max_objects`` and ``public.min_visible`` (the world's defaults, 3 and 0.4,
  where a config lacks them: the users' scenes).
  """
  world = data.WorldConfig()
  return {
    "max_objects": int(config.public.get("max_objects", world.max_objects)),
    "min_visible_fraction": float(config.public.get("min_visible", world.min_visible_fraction)),
  }


def _world_sets(config, users: Sequence[User]):
  """``(train, test, public)`` drawn from the world: one pool per task, cut in disjoint slices."""
  seed = config.seed
  train, test = [], []
  by_task: dict[str, list[User]] = {}
  for u in users:
    by_task.setdefault(u.task, []).append(u)
  for t, (task, members) in enumerate(sorted(by_task.items())):
    sizes = [config.users[u.index]["train_size"] for u in members]
    test_size = test_sizes(config)[task]
    pool = data.generate(seed * 1000 + 10 + t, sum(sizes) + test_size * len(members))
    start = 0
    for u, n in zip(members, sizes, strict=True):
      train.append((u.index, data.take(pool, np.arange(start, start + n))))
      start += n
    for u in members:
      test.append((u.index, data.take(pool, np.arange(start, start + test_size))))
      start += test_size
  scenes = data.WorldConfig(**_public_scenes(config))
  try:
    public = data.generate(
      seed * 1000 + 1, config.public.size, config=scenes, shift=config.public.shift
    )
  except RuntimeError as e:  # the objects do not fit: a config error, said in one line
    raise ConfigError(f"public.max_objects / public.min_visible: {e}") from None
  # Each text user's captions in its own token space; the public set's in every one read.
  space = {u.index: (text_lib.token_space(u.encoder),) for u in users if _reads_text(u)}
  train = [(i, text_lib.in_spaces(d, space.get(i, ()))) for i, d in train]
  test = [(i, text_lib.in_spaces(d, space.get(i, ()))) for i, d in test]
  public = text_lib.in_spaces(public, text_spaces(users))
  return train, test, public


def _tfds_sets(config, users: Sequence[User]):
  """``(train, test, public)`` read through TFDS (:mod:`fedjax_mm.data.tfds`).

  Every ``(dataset, split)`` is read once. Its first ``data.limit`` examples (0:
  all) form a pool, shuffled by a key of the seed, the dataset and the split; the
  users of a task take consecutive, disjoint slices of it (their ``train_size``
  from the task's train split, its task's test size (:func:`test_sizes`) from its
  test split), and the public
  set (``public.size``) the next slice of ``data.public``'s train split, so it
  shares no example with a task that reads the same split. A pool smaller than
  what is asked of it is shared in proportion (each set at least one example:
  else :class:`ConfigError`). Images are resized to ``data.image_size``; text
  goes through the tokenizer of every hf: checkpoint the text users read, each
  under its own key (:func:`fedjax_mm.core.text.caption_key`; a text user
  keeps its own), from one read of the dataset.
  """
  block = config.data
  data_dir, limit = block.get("data_dir") or None, block.get("limit") or None
  spaces = text_spaces(users)  # checkpoints only: _tfds_reads refuses the world's ids
  tokenizer = text_lib.joint_tokenizer(spaces) if spaces else None
  wants: dict[tuple[str, str], list[tuple[tuple[str, int], int]]] = {}
  by_task: dict[str, list[User]] = {}
  for u in users:
    by_task.setdefault(u.task, []).append(u)
  for task, members in sorted(by_task.items()):
    name = block.tasks[task]
    train_split, test_split = tfds_data.READERS[name].splits
    for u in members:
      size = config.users[u.index]["train_size"]
      wants.setdefault((name, train_split), []).append((("train", u.index), size))
    for u in members:
      size = test_sizes(config)[task]
      wants.setdefault((name, test_split), []).append((("test", u.index), size))
  public_read = (block.public, tfds_data.READERS[block.public].splits[0])
  wants.setdefault(public_read, []).append((("public", -1), config.public.size))

  def reads_text(name, split):
    texts = name in tfds_data.NEEDS_TOKENIZER or (
      (name, split) == public_read and "text" in config.public.modalities
    )
    return tokenizer if texts else None

  sets = validation.read_disjoint(
    wants,
    seed=config.seed,
    data_dir=data_dir,
    limit=limit,
    image_size=block.image_size,
    tokenizer=reads_text,
  )
  sets = {who: text_lib.split_joint(arrays, spaces) for who, arrays in sets.items()}
  public = sets.pop(("public", -1))
  num_public = len(public["image" if "image" in public else "caption"])
  needed = {"one batch (muscle.batch_size)": config.muscle.batch_size}
  if "fedhenn" in methods_of(config):
    needed["FedHeNN's alignment set"] = _baseline_config(config, "fedhenn").get(
      "rad_size", fedhenn.FedHeNNConfig.rad_size
    )
  for what, n in needed.items():
    if num_public < n:
      raise ConfigError(
        f"the public set read has {num_public} examples (data.limit={block.limit}), fewer "
        f"than {what}: {n}."
      )
  train = [(i, _own_captions(users[i], d)) for (kind, i), d in sets.items() if kind == "train"]
  test = [(i, _own_captions(users[i], d)) for (kind, i), d in sets.items() if kind == "test"]
  return train, test, public


def _fine_tune(config, spec) -> str:
  """How a pretrained user fine-tunes: a user's own ``fine_tune`` key wins."""
  return spec.get("fine_tune", config.get("fine_tune", "adapters"))


def _frozen_base(config, u: User) -> bool:
  """Whether a user's encoder base stays frozen: pretrained, fine-tuned with "adapters".

  LoRA adapters train where the encoder has dense layers; a CNN has none, so
  its projector and head train alone.
  """
  spec = config.users[u.index]
  pretrained = bool(_pretrained(config, spec, u.encoder)) or models.hf.is_hf(u.encoder)
  return pretrained and _fine_tune(config, spec) == "adapters"


def unaligned_users(config, users: Sequence[User]) -> tuple[User, ...]:
  """Users whose predictions the contrastive epochs cannot change.

  The Muscle loss trains what lies under the representation ``z``: LoRA adapters
  and the projector (a frozen base), or the whole encoder. A head that reads
  ``z`` (classification, multi-label) always sees that change. A segmentation
  head reads the encoder's feature map, under the projector: on a frozen base
  with no adapters (a CNN, which has no dense layers for LoRA) nothing it reads
  ever trains in the contrastive epochs, so the user's FedMuscle scores equal its
  local training's. The paper's segmentation users are SegFormers with LoRA,
  whose adapters both paths share.
  """
  out = []
  for u in users:
    spatial = models.HEADS[TASKS[u.task][4]].reads == "spatial"
    if spatial and _frozen_base(config, u) and not _model_config(config, u)["lora_rank"]:
      out.append(u)
  return tuple(out)


def _architecture(config, u: User) -> str:
  """A user's model config and frozen base as one string: equal strings, equal parameter trees."""
  return json.dumps(
    _model_config(config, u) | {"frozen_base": _frozen_base(config, u)}, sort_keys=True
  )


def _model_config(config, u: User) -> dict[str, Any]:
  """The :func:`fedjax_mm.models.build` config of a user's model (its architecture)."""
  _, input_key, _, _, head = TASKS[u.task]
  spec = config.users[u.index]
  model_config = {
    "encoder": u.encoder,
    "head": head,
    "num_outputs": _outputs(config, u.task),
    "rep_dim": config.rep_dim,
  }
  if input_key == "caption":
    model_config |= {"vocab_size": data.VOCAB_SIZE, "max_len": data.WorldConfig().max_caption_len}
  elif data_source(config) == "tfds":  # the world's images are the zoo's default 32 x 32
    model_config["image_size"] = config.data.image_size
  checkpoint = _pretrained(config, spec, u.encoder)
  hf = models.hf.is_hf(u.encoder)  # weights from its folder, fine-tuned with LoRA
  lora_ok = hf or u.encoder in models.LORA_ENCODERS
  lora_rank = spec.get("lora_rank", config.lora_rank) if lora_ok else 0
  model_config |= {
    "pretrained": None if hf else checkpoint,
    "standardize": _standardize(config, spec, u.encoder),
    "lora_rank": lora_rank if _frozen_base(config, u) else 0,
  }
  if hf:
    model_config["modality"] = "text" if input_key == "caption" else "image"
  return model_config


def _pretrained(config, spec, encoder: str) -> str | None:
  """The checkpoint a user's encoder starts from, or None (from scratch).

  A user's own ``pretrained`` key wins; otherwise ``config.pretrained`` names a
  collection of shipped checkpoints (``"world-clip"`` -> ``world-clip/<encoder>``)
  or, if empty, every user trains from scratch.
  """
  if models.hf.is_hf(encoder):  # the checkpoint is the encoder itself
    return None
  if "pretrained" in spec:
    return spec["pretrained"] or None
  return f"{config.pretrained}/{encoder}" if config.pretrained else None


def _standardize(config, spec, encoder: str) -> bool:
  """Whether a user standardises its pooled features with its checkpoint's statistics.

  ``standardize`` (a user's own key wins over the config's), for users that start
  from a World-CLIP checkpoint; never for ``hf:`` encoders or from scratch.
  """
  if not _pretrained(config, spec, encoder):
    return False
  return bool(spec.get("standardize", config.get("standardize", False)))


def _task(u: User, config=None) -> core.Task:
  """A user's task (what :func:`build` gives its group); ``config`` None: on the world.

  A text user reads the captions of its token space (``caption`` for the world's ids,
  ``caption:<checkpoint>`` for an hf: encoder's), in its own sets and in the public set.
  """
  kind, input_key, target_key, _, _ = TASKS[u.task]
  if input_key == "caption":
    input_key = text_lib.caption_key(text_lib.token_space(u.encoder))
  background = None
  if kind == "segmentation":  # the world's mask class 0 is background; a TFDS reader says
    tfds = config is not None and data_source(config) == "tfds"
    background = tfds_data.READERS[config.data.tasks[u.task]].background if tfds else 0
  return core.Task(kind, input_key, target_key, _outputs(config, u.task), background)


def _outputs(config, task: str) -> int:
  """A task's outputs: the world's classes, or with ``data.source = "tfds"`` its dataset's."""
  _, _, target_key, outputs, _ = TASKS[task]
  if config is None or data_source(config) != "tfds":
    return outputs
  return tfds_data.READERS[config.data.tasks[task]].classes[target_key]
