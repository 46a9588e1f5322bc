"""The CreamFL experiment: clients, server, data, each round's metrics, the report.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/creamfl.py`` calls: :func:`fedjax_mm.runner.loop.run` of
:func:`experiment`, which trains every method of ``config.methods`` side by
side from the same initial server and clients, on the same data and seeds:
``local`` (the server alone on the public set), the ``reamFL`` variants,
``CreamFL`` and ``CreamFL+Muscle`` (:data:`fedjax_mm.algorithms.creamfl.VARIANTS`),
Table 1's distillation baselines ``FedMD``, ``FedET``, ``FedGEMS``
(:data:`fedjax_mm.algorithms.creamfl_baselines.BASELINES`), and its
model-homogeneous ``FedAvg`` and ``FedIoT`` (:data:`PARAMETER_ROWS`: clients of
the server's size on the same private data, the public set given to the
multimodal clients, towers averaged per modality;
:mod:`fedjax_mm.algorithms.creamfl_fedavg`), which send parameters (their
ledger counts the towers, both ways).
All federated methods share one compiled round (the variant is a runtime
argument); ``local`` has its own. The bytes of the selected clients go to each
method's ledger. Workdir, checkpoints, resume, NaN guard and the files written
are the loop's.

**Evaluation, as CreamFL's Table 1.** The paper tests the server on MS-COCO,
the distribution of its public set, on the "1K" and "5K" test sets of Karpathy
& Fei-Fei, and its ``R@1_sum`` adds four numbers: i2t and t2i R@1 on the 1K
and on the 5K test (CreamFL: 49.66 + 38.94 + 5K's two = 132.88). The
reference code computes exactly that (``MMFL.train``: ``n_fold`` i2t/t2i R@1
with ``n_crossfolds=5`` plus the full-set i2t/t2i R@1). Here the test set is
``N = max(test.sizes)`` held-out images of the embedded world drawn at
``test.shift`` (default 1.0, the public set's distribution), with 5 captions
each; for every size ``s`` of ``test.sizes`` (default ``(1000, 5000)``) the
"``s`` test" averages i2t / t2i Recall@1/5/10 over the ``N / s`` consecutive
folds of ``s`` images (:func:`fedjax_mm.metrics.image_text_recall`), so
``s = N`` is the full set, and ``R@1_sum`` (:func:`r1_sum`) adds i2t and t2i
R@1 over the sizes. Beside every table stands chance (:func:`chance_recall`,
``~K/s``). ``test.private_size`` images of the clients' private distribution
(shift 0) give a smaller, separately labelled table (0 turns it off); they are
not in ``R@1_sum``. After every ``eval_every`` rounds (and the last) every
method's server is evaluated.

**Data.** ``config.data.source`` picks where the sets come from: the embedded
world (``"world"``, the default: seeded draws, ``public.shift`` and ``test.shift``
apply) or the papers' datasets through TFDS (``"tfds"``: :func:`_tfds_sets`).
Then each client group's pool is ``num x train_size`` examples of the train split of
``data.clients.<group>`` (image: CIFAR-100, text: AG News, multimodal: COCO's
image-caption pairs, as TFDS has no Flickr30K), split among its clients by
Dirichlet(alpha) over its class label (multimodal: each image's first object class);
the public set is the next ``public.size`` examples of ``data.public``'s train split
(disjoint from the multimodal clients' when both read ``coco_captions``), and the
server's test set the first ``max(test.sizes)`` images of its test split (Karpathy's
5K test), scaled down with ``data.limit`` (:func:`num_test_images`). A TFDS run writes
what each set got (``results.json`` ``"data"``, a report section). The VQA analogue
and the private test are the world's and refuse ``"tfds"`` at validation.

**Token spaces.** Each text tower reads the captions of its own token space
(:mod:`fedjax_mm.runner.text`; :func:`token_space`, :func:`text_spaces`): an ``hf:``
tower its checkpoint's tokens (``caption:<checkpoint>``), a zoo tower (``gru``,
``transformer_t``, ...) the world's ids (``caption``) on the world, and on TFDS,
whose English it cannot read, the ids of ``data.text_tokenizer`` (:func:`zoo_tokenizer`,
under that checkpoint's key, shared with an ``hf:`` tower of the same checkpoint; its
embedding sized to that tokenizer, :func:`text_sizes`). The public set holds the
same captions once per space, each group's private data its own space's (and the
server's, for the FedAvg / FedIoT rows' server-sized clients), the test sets the
server's; the server and each group read their key (``ServerDef.text_key``,
``ClientGroup.text_key``). So ``:paper``'s GRU clients run beside its BERT server.
A run of one space computes exactly what it did before.

**VQA, as CreamFL's Table 2** (``config.vqa``; :mod:`fedjax_mm.algorithms.vqa`,
:mod:`fedjax_mm.data.vqa`). After the last round every method's server is frozen
and, for each, a small fusion head learns to answer template questions ("what
colour is the circle ?", "how many objects are there ?", ...) about
``vqa.train_images`` fresh scenes at ``test.shift``, from the server's image
feature and its text tower's feature of the question's argument phrase; its
accuracy on the questions about ``vqa.test_images`` other scenes, overall and
per question type, is the row's Table 2 entry. Beside it: the same head
trained blind (question only) and each type's majority answer. Every row gets
the same questions, head initialisation and minibatches, so rows differ only
by their servers' features. How this differs from the paper's VQA v2 protocol
(template questions, exact match over 38 answers, a server frozen throughout):
:mod:`fedjax_mm.algorithms.vqa`.

At the end it prints and writes tables like CreamFL's Table 1 / FedMuscle's
Table 3 and Table 2's analogue, plus bytes per round; :func:`summarize` gives the
same tables over seeds.

Everything is validated before anything is compiled: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints it
and exits with status 2).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import creamfl, creamfl_baselines, creamfl_fedavg, vqa
from fedjax_mm.core import ledger as ledger_lib
from fedjax_mm.core import optim, processes
from fedjax_mm.core.client import apply_in_batches
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner import text as text_lib
from fedjax_mm.runner.errors import ConfigError, SummaryError
from fedjax_mm.runner.tfds_sets import data_source, read_disjoint, reader

LOCAL = "local"
#: Every federated row: CreamFL's variants and Table 1's distillation baselines.
ROWS = {**creamfl.VARIANTS, **creamfl_baselines.BASELINES}
#: Table 1's model-homogeneous rows (clients of the server's size, parameters averaged per
#: modality; :mod:`fedjax_mm.algorithms.creamfl_fedavg`) -> is it FedIoT.
PARAMETER_ROWS = {"FedAvg": False, "FedIoT": True}
METHODS = (LOCAL, *ROWS, *PARAMETER_ROWS)
#: Client group -> (modalities, private task: kind, input key, target key, outputs, head).
GROUPS = {
  "image": (("image",), ("classification", "image", "label10", 10, "mlp")),
  "text": (("text",), ("classification", "caption", "caption_label", data.NUM_COLORS, "linear")),
  "multimodal": (("image", "text"), None),
}
RECALL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10")
#: What the VQA head reads (``config.vqa.features``): the server's representations, or
#: its encoders' pooled outputs.
VQA_FEATURES = ("representation", "pooled")


def _cream_config(config) -> creamfl.CreamConfig:
  return creamfl.CreamConfig(**config.creamfl.to_dict())


def text_encoders(config) -> tuple[str, str, str]:
  """The run's text encoders: the server's, the multimodal clients' and the text clients'.

  (Table 1's FedAvg / FedIoT clients take the server's.)
  """
  c = config.clients
  return (config.server.text_encoder, c.multimodal.text_encoder, c.text.encoder)


def zoo_tokenizer(config) -> str | None:
  """The ``hf:`` checkpoint whose ids the zoo's text encoders read, or None (the world's ids).

  On the world a zoo encoder (``gru``, ``transformer_t``, ...) reads the world's
  vocabulary. TFDS gives English text, which a zoo encoder cannot read: it reads the
  ids of ``data.text_tokenizer`` (the paper's GRU clients beside a BERT server: BERT's
  WordPieces), or, when that is empty, of the run's one ``hf:`` text encoder. None also
  when no zoo encoder reads text.

  Raises:
    ConfigError: on TFDS, ``data.text_tokenizer`` is not an ``hf:`` checkpoint, names a
      folder that is missing, or is empty while the run has no or several ``hf:`` text
      encoders.
  """
  names = text_encoders(config)
  zoo = sorted({n for n in names if not models.hf.is_hf(n)})
  if data_source(config) != "tfds" or not zoo:
    return None
  name = config.data.get("text_tokenizer", "")
  if not name:
    hf_names = sorted({n for n in names if models.hf.is_hf(n)})
    if len(hf_names) == 1:
      return hf_names[0]
    found = f"the run has {len(hf_names)} ({', '.join(hf_names)})" if hf_names else "it has none"
    raise ConfigError(
      f"data.text_tokenizer: the zoo text encoders ({', '.join(zoo)}) cannot read TFDS's "
      f"English text and read one hf: tokenizer's ids, the run's one hf: text encoder's by "
      f"default, but {found}: set data.text_tokenizer to an hf: checkpoint "
      "(e.g. hf:all-MiniLM-L6-v2)."
    )
  if not models.hf.is_hf(name):
    raise ConfigError(
      f"data.text_tokenizer must be an hf: checkpoint (hf:<folder> or a packaged name such as "
      f"hf:all-MiniLM-L6-v2) whose tokenizer the zoo text encoders read, got {name!r}."
    )
  try:
    models.hf.resolve(name)
  except models.hf.HfError as e:
    raise ConfigError(f"data.text_tokenizer: {e}") from None
  return name


def token_space(config, encoder: str) -> str | None:
  """The token space a text encoder reads in this run (:mod:`fedjax_mm.runner.text`).

  An ``hf:`` encoder's is its checkpoint; a zoo encoder's the world's ids (None), or
  on TFDS :func:`zoo_tokenizer`'s checkpoint: the paper's GRUs beside a BERT server
  whose tokenizer they read share its space, so the captions are held once for both.
  """
  if models.hf.is_hf(encoder):
    return encoder
  return zoo_tokenizer(config)


def text_key(config, encoder: str) -> str:
  """The data key of the captions ``encoder`` reads (:func:`fedjax_mm.runner.text.caption_key`)."""
  return text_lib.caption_key(token_space(config, encoder))


def text_spaces(config) -> tuple[str | None, ...]:
  """The distinct token spaces of a run: None (the world's ids) first, then checkpoints sorted.

  The public set holds its captions in each (:func:`fedjax_mm.runner.text.in_spaces` on
  the world, :func:`fedjax_mm.runner.text.joint_tokenizer` on TFDS).
  """
  return text_lib.token_spaces(text_encoders(config), lambda e: token_space(config, e))


def text_sizes(config) -> dict[str, int]:
  """``vocab_size`` and ``max_len`` of the zoo's text encoders: the world's vocabulary and
  caption length, or on TFDS :func:`zoo_tokenizer`'s vocabulary (30,522 for BERT's) and
  :data:`fedjax_mm.runner.text.HF_MAX_LEN`. (``hf:`` encoders take theirs from their folder.)"""
  checkpoint = zoo_tokenizer(config)
  if checkpoint is None:
    return {"vocab_size": data.VOCAB_SIZE, "max_len": _world(config).max_caption_len}
  return {"vocab_size": text_lib.vocab_size(checkpoint), "max_len": text_lib.HF_MAX_LEN}


def validate(config) -> None:
  """Checks a config. Raises :class:`ConfigError` with a one-line message."""
  validation.check_numbers(config, validation.CREAMFL)
  validation.check_client_map(config)
  validation.check_devices(config)
  faults = validation.check_faults(config)
  validation.check_methods(config.methods, METHODS)
  parameter_rows = [m for m in config.methods if m in PARAMETER_ROWS]
  if faults.enabled and parameter_rows:
    raise ConfigError(f"faults: {', '.join(parameter_rows)} simulate no client faults; drop them.")
  if config.rounds < 1:
    raise ConfigError(f"rounds must be >= 1, got {config.rounds}.")
  if config.eval_every < 1:
    raise ConfigError(f"eval_every must be >= 1, got {config.eval_every}.")
  if config.image_size < 16 or config.image_size % 4:
    raise ConfigError(f"image_size must be a multiple of 4 and >= 16, got {config.image_size}.")
  if config.pretrained:
    c = config.clients
    names = [c.image.encoder, c.text.encoder, c.multimodal.image_encoder]
    names += [c.multimodal.text_encoder, config.server.image_encoder, config.server.text_encoder]
    for name in names:
      if models.hf.is_hf(name):  # its own checkpoint
        continue
      try:
        cfg = models.pretrained.read_config(f"{config.pretrained}/{name}")
      except models.pretrained.PretrainedError as e:
        raise ConfigError(str(e)) from None
      if cfg["modality"] == "image" and cfg["image_size"] != config.image_size:
        raise ConfigError(
          f"{config.pretrained}/{name} was pretrained on {cfg['image_size']}x{cfg['image_size']} "
          f"images; set image_size={cfg['image_size']} or pretrained=''."
        )
  if config.rep_dim < 1:
    raise ConfigError(f"rep_dim must be positive, got {config.rep_dim}.")
  if not config.alpha > 0:
    raise ConfigError(f"alpha (Dirichlet concentration) must be > 0, got {config.alpha}.")
  for key in ("learning_rate", "server_learning_rate"):
    if not config[key] > 0:
      raise ConfigError(f"{key} must be > 0, got {config[key]}.")
  for key, choices in (
    ("server_optimizer", SERVER_OPTIMIZERS),
    ("server_lr_schedule", SERVER_LR_SCHEDULES),
  ):
    if config[key] not in choices:
      raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {config[key]!r}.")
  total = 0
  for name in GROUPS:
    spec = config.clients[name]
    if spec.num < 1 or spec.train_size < 1:
      raise ConfigError(f"clients.{name}: num and train_size must be >= 1.")
    total += spec.num
    if name == "multimodal":
      validation.check_encoder("clients.multimodal.image_encoder", spec.image_encoder, "image")
      validation.check_encoder("clients.multimodal.text_encoder", spec.text_encoder, "text")
    else:
      validation.check_encoder(f"clients.{name}.encoder", spec.encoder, name)
  validation.check_encoder("server.image_encoder", config.server.image_encoder, "image")
  validation.check_encoder("server.text_encoder", config.server.text_encoder, "text")
  c = config.creamfl
  if not 1 <= c.num_selected <= total:
    raise ConfigError(
      f"creamfl.num_selected ({c.num_selected}) must be between 1 and the number of clients ({total})."
    )
  if c.batch_size < 2:
    raise ConfigError(f"creamfl.batch_size (B={c.batch_size}) must be at least 2.")
  if config.public.size < c.batch_size or config.public.size % c.batch_size:
    raise ConfigError(
      f"public.size ({config.public.size}) must be a positive multiple of creamfl.batch_size ({c.batch_size})."
    )
  if not 0.0 <= config.public.shift <= 1.0 or not 0.0 <= config.test.shift <= 1.0:
    raise ConfigError("public.shift and test.shift must lie in [0, 1].")
  if c.lcr_weight < 0 or c.distill_weight < 0 or c.iot_weight < 0:
    raise ConfigError("creamfl.lcr_weight, distill_weight and iot_weight must be >= 0.")
  for key in ("server_temperature", "inter_temperature", "intra_temperature", "gca_temperature"):
    if not c[key] > 0:
      raise ConfigError(f"creamfl.{key} must be > 0, got {c[key]}.")
  if c.public_batch_size is not None and not 1 <= c.public_batch_size <= config.public.size:
    raise ConfigError(
      f"creamfl.public_batch_size ({c.public_batch_size}) must be between 1 and public.size ({config.public.size})."
    )
  if c.gca_chunk_size is not None and c.gca_chunk_size < 1:
    raise ConfigError(f"creamfl.gca_chunk_size must be positive, got {c.gca_chunk_size}.")
  if "CreamFL+Muscle" in config.methods:
    if not 1 <= c.muscle_partners <= c.num_selected:
      raise ConfigError(
        f"creamfl.muscle_partners (M={c.muscle_partners}) must be between 1 and creamfl.num_selected ({c.num_selected})."
      )
    if not 0 < c.muscle_tau_reduced < c.muscle_tau_full:
      raise ConfigError(
        f"creamfl.muscle_tau_reduced ({c.muscle_tau_reduced}) must be in (0, muscle_tau_full = {c.muscle_tau_full}) so that gamma > 0."
      )
  sizes = tuple(config.test.sizes)
  if not sizes or len(set(sizes)) != len(sizes) or min(sizes) < 2:
    raise ConfigError(f"test.sizes must be distinct sizes >= 2, got {sizes}.")
  if any(max(sizes) % n for n in sizes):
    raise ConfigError(
      f"test.sizes {sizes}: every size must divide the largest ({max(sizes)}), the test set's "
      "size, so that a smaller test is a mean over folds of it."
    )
  if config.test.private_size == 1:
    raise ConfigError("test.private_size must be 0 (no private test) or >= 2, got 1.")
  if config.vqa.features not in VQA_FEATURES:
    raise ConfigError(
      f"vqa.features must be one of {', '.join(VQA_FEATURES)}, got {config.vqa.features!r}."
    )
  # Last, so a missing checkpoint is named first; still before anything is built.
  tfds = data_source(config) == "tfds"
  validation.check_data(config, _tfds_reads(config) if tfds else None)


def _label_key(dataset: tfds_data.Reader) -> str | None:
  """The single-label class key of a dataset (CIFAR-100: its 100 fine classes), or None."""
  return next((k for k in dataset.classes if k != "multilabel"), None)


def _tfds_reads(config) -> list[tuple[str, str]]:
  """The ``(dataset, split)`` pairs a ``data.source = "tfds"`` run reads, checked.

  Each client group reads ``data.clients.<group>``'s train split: the image and
  text clients a dataset with their input (``image`` / ``caption``) and a
  single-label class key, the multimodal clients one with images and captions.
  The public set reads ``data.public``'s train split and the server's test set its
  test split, both image-caption pairs. What cannot run on these data is refused:
  the VQA analogue (questions about the world's scenes) and the private-distribution
  test (the multimodal clients' captioned data is the public set's dataset: TFDS's
  only image-caption set is ``coco_captions``). Raises :class:`ConfigError`.
  """
  block = config.data
  if config.vqa.enabled:
    raise ConfigError(
      "vqa asks template questions about the embedded world's scenes: it cannot run with "
      "data.source='tfds'; set vqa.enabled=False."
    )
  if config.test.private_size:
    raise ConfigError(
      "test.private_size: the clients' private test is the embedded world's (shift 0); with "
      "data.source='tfds' the server is tested on data.public's test split only: set "
      "test.private_size=0."
    )
  reads = []
  for name in GROUPS:
    where = f"data.clients.{name}"
    dataset = reader(where, block.clients.get(name) or "")
    _, task = GROUPS[name]
    if task is None:
      needed, label = ("image", "caption"), True
    else:
      needed, label = (task[1],), _label_key(dataset) is not None
    if not label or any(k not in dataset.keys for k in needed):
      what = "images and captions" if task is None else f"{task[1]!r} and a class label"
      raise ConfigError(
        f"{where}: {block.clients[name]} has no {what} for the {name} clients (it gives "
        f"{', '.join(dataset.keys)})."
      )
    reads.append((block.clients[name], dataset.splits[0]))
  dataset = reader("data.public", block.get("public", ""))
  if "image" not in dataset.keys or "caption" not in dataset.keys:
    raise ConfigError(
      f"data.public: {block.public} has no image-caption pairs for the public and test sets "
      f"(it gives {', '.join(dataset.keys)})."
    )
  reads += [(block.public, split) for split in dataset.splits]
  if zoo_tokenizer(config) is not None and config.pretrained:
    zoo = sorted({n for n in text_encoders(config) if not models.hf.is_hf(n)})
    raise ConfigError(
      f"pretrained: {config.pretrained}'s text encoders ({', '.join(zoo)}) read the world's "
      f"vocabulary, not {zoo_tokenizer(config)}'s ids (data.source='tfds'): set pretrained=''."
    )
  return reads


# ----------------------------------------------------------------------------
# Building clients, server and data


def _world(config) -> data.WorldConfig:
  return data.WorldConfig(image_size=config.image_size)


def _group_task(config, name: str) -> tuple | None:
  """A group's private task ``(kind, input key, target key, outputs, head)``; None: retrieval.

  On the world, :data:`GROUPS`'; with ``data.source = "tfds"`` the target is the
  class label of ``data.clients.<group>`` (:func:`_label_key`) and its classes.
  """
  task = GROUPS[name][1]
  if task is None or data_source(config) != "tfds":
    return task
  kind, input_key, _, _, head = task
  dataset = tfds_data.READERS[config.data.clients[name]]
  key = _label_key(dataset)
  return kind, input_key, key, dataset.classes[key], head


def _group_text_encoder(config, name: str, *, server_size: bool = False) -> str | None:
  """The text encoder of a group's clients (the server's for ``server_size``), None if none."""
  if "text" not in GROUPS[name][0]:
    return None
  if server_size:
    return config.server.text_encoder
  spec = config.clients[name]
  return spec.text_encoder if name == "multimodal" else spec.encoder


def _group_spaces(config, name: str) -> tuple[str | None, ...]:
  """The token spaces a group's private captions are held in: its text tower's, and the
  server's when Table 1's FedAvg / FedIoT rows run (clients with the server's towers on
  the same private data); ``()`` for the image clients."""
  encoders = [_group_text_encoder(config, name)]
  if any(m in PARAMETER_ROWS for m in config.methods):
    encoders.append(_group_text_encoder(config, name, server_size=True))
  spaces = []
  for encoder in encoders:
    if encoder is not None and token_space(config, encoder) not in spaces:
      spaces.append(token_space(config, encoder))
  return tuple(spaces)


def _client_data(config, name: str, group_index: int, pool=None):
  """The group's private sets: a Dirichlet(alpha) split of one pool, per client.

  ``pool`` None: drawn from the world (``4 num train_size`` samples, ``train_size``
  per client). Else the group's examples read through TFDS (:func:`_tfds_sets`),
  all of them split the standard way (``samples_per_client=None``: client sizes
  vary, ``train_size`` on average) by their class label, or for the multimodal
  clients by each image's first object class (COCO's id order; 0 when none).
  Captions are held in the group's token spaces (:func:`_group_spaces`), each under
  its key (:func:`fedjax_mm.runner.text.caption_key`).
  """
  spec = config.clients[name]
  modalities, _ = GROUPS[name]
  task = _group_task(config, name)
  label_key = task[2] if task else "label10"
  spaces = _group_spaces(config, name)
  keys = ["image"] * ("image" in modalities) + [text_lib.caption_key(s) for s in spaces]
  if task:
    keys.append(task[2])
  if pool is not None:
    labels = pool[label_key] if task else np.argmax(pool["multilabel"], axis=1)
    try:
      parts = data.dirichlet_partition(
        labels, spec.num, alpha=config.alpha, seed=config.seed * 1000 + group_index
      )
    except ValueError as e:
      raise ConfigError(
        f"data: the {name} clients' {len(labels)} examples (data.limit={config.data.limit}) "
        f"cannot be split among {spec.num} clients: {e}"
      ) from None
    clients = [{k: v for k, v in c.items() if k in keys} for c in data.split_clients(pool, parts)]
    stacked, mask = data.stack_clients(clients)
    return core.make_client_data(stacked, mask, user_ids=np.arange(spec.num))
  pool = data.generate(
    config.seed * 1000 + 10 + group_index, 4 * spec.num * spec.train_size, config=_world(config)
  )
  parts = data.dirichlet_partition(
    pool[label_key],
    spec.num,
    alpha=config.alpha,
    seed=config.seed * 1000 + group_index,
    samples_per_client=spec.train_size,
  )
  pool = text_lib.in_spaces(pool, spaces)
  clients = [{k: v for k, v in c.items() if k in keys} for c in data.split_clients(pool, parts)]
  stacked, mask = data.stack_clients(clients)
  return core.make_client_data(stacked, mask, user_ids=np.arange(spec.num))


def _test_set(
  seed: int, num: int, world: data.WorldConfig, shift: float, space: str | None = None
) -> dict[str, jax.Array]:
  """``num`` held-out images and all their captions (every caption is a query and a
  candidate), in the server's token space ``space``."""
  test = text_lib.in_spaces(data.generate(seed, num, config=world, shift=shift), (space,))
  key = text_lib.caption_key(space)
  return _retrieval_set(test["image"], test[key], key)  # captions [N, C, L]


def _retrieval_set(images: np.ndarray, captions: np.ndarray, key: str) -> dict[str, jax.Array]:
  """``image [N, S, S, 3]``, captions ``[N, C, L]`` -> the flat layout the recall reads,
  the captions under ``key`` (the server's text key)."""
  return {
    "image": jnp.asarray(images),
    key: jnp.asarray(captions.reshape(-1, captions.shape[-1])),
    "ids": jnp.asarray(np.repeat(np.arange(captions.shape[0]), captions.shape[1])),
  }


def num_test_images(config, available: int) -> int:
  """``N``, the test images used of ``available``: ``max(test.sizes)``, or fewer when
  ``data.limit`` leaves fewer.

  Every size ``s`` of ``test.sizes`` is scored as the mean over ``max(test.sizes) / s``
  folds, so a smaller ``N`` is cut to a multiple of every fold count and each fold
  holds ``N / folds`` images (the 1K and 5K protocols scaled down alike). Raises
  :class:`ConfigError` when a fold would hold fewer than 2 images.
  """
  sizes = tuple(config.test.sizes)
  if available >= max(sizes):
    return max(sizes)
  folds = [max(sizes) // n for n in sizes]
  step = int(np.lcm.reduce(folds))
  num = available // step * step
  if num < 2 * max(folds):
    raise ConfigError(
      f"data: the test split gives {available} images (data.limit={config.data.limit}), too "
      f"few for test.sizes {sizes}: {max(folds)} folds of at least 2 images."
    )
  return num


class VqaData(NamedTuple):
  """The VQA analogue's scenes and questions, as the server reads them.

  Attributes:
    images: ``float32 [N_train + N_test, S, S, 3]`` the training scenes, then the test scenes.
    arguments: ``int32 [U, L]`` every distinct argument phrase (:mod:`fedjax_mm.data.vqa`),
      as the server's text tower reads captions (world ids padded to ``L``, or the
      ``hf:`` checkpoint's tokens).
    train, test: ``{"image": [Q] row of images, "argument": [Q] row of arguments,
      "type": [Q], "answer": [Q]}``, int32 each.
  """

  images: jax.Array
  arguments: jax.Array
  train: dict[str, jax.Array]
  test: dict[str, jax.Array]


def vqa_data(config) -> VqaData:
  """Questions about ``vqa.train_images`` and ``vqa.test_images`` fresh scenes at ``test.shift``.

  The scenes come from seeds of their own (``1000 seed + 4`` and ``+ 5``), disjoint from
  the public set's, the clients' and the retrieval tests'. Each argument phrase is encoded
  once (there are about 130 distinct ones); questions point at it by row.
  """
  world = _world(config)
  splits, scenes = {}, []
  offset = 0
  for name, salt, num in (
    ("train", 4, config.vqa.train_images),
    ("test", 5, config.vqa.test_images),
  ):
    seed = config.seed * 1000 + salt
    scene = data.generate(seed, num, config=world, shift=config.test.shift)
    qa = data.vqa.questions(scene, seed)
    qa["image"] = qa["image"] + offset
    offset += num
    splits[name], scenes = qa, [*scenes, scene["image"]]
  phrases = np.concatenate([splits[n]["argument"] for n in ("train", "test")])
  unique, rows = np.unique(phrases, axis=0, return_inverse=True)
  rows = rows.reshape(-1).astype(np.int32)
  arguments = np.pad(unique, ((0, 0), (0, world.max_caption_len - unique.shape[1])))
  checkpoint = token_space(config, config.server.text_encoder)  # the server's text tower reads them
  if checkpoint is not None:
    arguments = text_lib.retokenize(arguments, checkpoint)
  num_train = len(splits["train"]["answer"])
  argument_rows = {"train": rows[:num_train], "test": rows[num_train:]}
  split = {
    name: {
      "image": jnp.asarray(qa["image"]),
      "argument": jnp.asarray(argument_rows[name]),
      "type": jnp.asarray(qa["type"]),
      "answer": jnp.asarray(qa["answer"]),
    }
    for name, qa in splits.items()
  }
  return VqaData(
    jnp.asarray(np.concatenate(scenes)), jnp.asarray(arguments), split["train"], split["test"]
  )


def vqa_features(model: creamfl.DualEncoder, images, arguments, features: str):
  """The frozen server's ``(image [N, h_v], argument [U, h_t])`` features for the VQA head."""
  if features == "representation":
    image = lambda x: model.represent(x, "image")
    text = lambda x: model.represent(x, "text")
  else:
    image = lambda x: model.image_encoder(x)[0]
    text = lambda x: model.text_encoder(x)[0]
  return apply_in_batches(image, images, 256), apply_in_batches(text, arguments, 256)


@functools.partial(jax.jit, static_argnames=("graphdef", "features", "head"))
def _vqa_step(graphdef, params, qa: VqaData, key, *, features: str, head: tuple):
  """Features of the frozen server, then :func:`fedjax_mm.algorithms.vqa.evaluate`.

  One program (module level, the graph and hyperparameters static): every row,
  and a second run in the same process, reuse it.
  """
  image, text = vqa_features(nnx.merge(graphdef, params), qa.images, qa.arguments, features)

  def qa_set(split):
    return vqa.QASet(image[split["image"]], text[split["argument"]], split["type"], split["answer"])

  return vqa.evaluate(
    key,
    qa_set(qa.train),
    qa_set(qa.test),
    num_types=data.vqa.NUM_TYPES,
    num_answers=data.vqa.NUM_ANSWERS,
    **dict(head),
  )


def vqa_accuracy(config, graphdef, params, qa: VqaData) -> dict[str, Any]:
  """CreamFL's Table 2 analogue for one server: accuracies (%) of the head and its baselines.

  Every server gets the same head initialisation and minibatches (the key is
  the seed's), so rows differ only by their features.

  Returns:
    ``{"accuracy", "blind_accuracy", "majority_accuracy": float, "per_type",
    "blind_per_type", "majority_per_type": {type: float}}``, percentages; the
    majority's depend on the data only.
  """
  c = config.vqa
  out = _vqa_step(
    graphdef,
    params,
    qa,
    jax.random.fold_in(jax.random.key(config.seed), 20_000),
    features=c.features,
    head=tuple((k, c[k]) for k in ("hidden", "steps", "batch_size", "learning_rate")),
  )
  result = {}
  for prefix in ("", "blind_", "majority_"):
    result[f"{prefix}accuracy"] = 100.0 * float(out[f"{prefix}accuracy"])
    per_type = np.asarray(out[f"{prefix}per_type"], np.float64)
    result[f"{prefix}per_type"] = {
      t: 100.0 * float(v) for t, v in zip(data.vqa.QUESTION_TYPES, per_type, strict=True)
    }
  return result


def _client_groups(config, root, *, server_size: bool = False, pools=None, train_data=None):
  """The three client groups, their stacked initial states, private data and display names.

  ``server_size``: every client's encoders are the server's (Table 1's FedAvg /
  FedIoT rows, :mod:`fedjax_mm.algorithms.creamfl_fedavg`); the private data
  are the same either way. ``pools``: each group's examples read through TFDS
  (:func:`_tfds_sets`), None on the world; ``train_data``: the groups' private
  data already built (then returned as given).
  """
  sizes = text_sizes(config)
  given = train_data
  clients, states, train_data, names = [], [], [], []
  for g, name in enumerate(GROUPS):
    spec = config.clients[name]
    modalities, _ = GROUPS[name]
    task = _group_task(config, name)
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    if task:
      kind, input_key, target_key, outputs, head = task
      uni = config.server[f"{name}_encoder"] if server_size else spec.encoder
      model_config = {
        "encoder": uni,
        "head": head,
        "num_outputs": outputs,
        "rep_dim": config.rep_dim,
      }
      model_config |= sizes if name == "text" else {"image_size": config.image_size}
      if config.pretrained and not models.hf.is_hf(uni):
        model_config["pretrained"] = f"{config.pretrained}/{uni}"
      make = lambda rngs, c=model_config: models.build(c, rngs=rngs)
      if name == "text":  # the captions of its own token space
        input_key = text_key(config, uni)
      group_task = core.Task(kind, input_key, target_key, outputs)
      encoder = uni
    else:
      pair = (spec.image_encoder, spec.text_encoder)
      if server_size:
        pair = (config.server.image_encoder, config.server.text_encoder)
      make = lambda rngs, pair=pair: creamfl.DualEncoder(
        *pair,
        rep_dim=config.rep_dim,
        image_size=config.image_size,
        rngs=rngs,
        pretrained=config.pretrained or None,
        **sizes,
      )
      group_task = creamfl.RetrievalTask(temperature=config.creamfl.server_temperature)
      encoder = "+".join(pair)
    group, state = core.init_group(
      make,
      name=f"{name} ({encoder})",
      tx=tx,
      task=group_task,
      key=jax.random.fold_in(root, g),
      num_clients=spec.num,
      local_epochs=config.local_epochs,
      batch_size=config.local_batch_size,
      client_map=validation.check_client_map(config),
    )
    encoder_t = _group_text_encoder(config, name, server_size=server_size)
    reads = {} if encoder_t is None else {"text_key": text_key(config, encoder_t)}
    clients.append(creamfl.ClientGroup(group, modalities, **reads))
    states.append(state)
    if given is not None:
      train_data.append(given[g])
    else:
      train_data.append(_client_data(config, name, g, None if pools is None else pools[name]))
    names += [f"{name} client {k + 1}" for k in range(spec.num)]
  return tuple(clients), tuple(states), tuple(train_data), names


def _tfds_sets(config) -> dict[str, Any]:
  """The clients' pools, the public set and the test set read through TFDS.

  Every ``(dataset, split)`` is read once and cut in disjoint, seeded slices
  (:func:`fedjax_mm.runner.tfds_sets.read_disjoint`; at most ``data.limit`` examples
  of a split, a pool smaller than what is asked of it shared in proportion): each
  client group asks ``num x train_size`` examples of ``data.clients.<group>``'s train
  split, the public set ``public.size`` of ``data.public``'s train split after them
  (so none is a multimodal client's when both read ``coco_captions``), the test set
  ``max(test.sizes)`` images of its test split, all their captions (5 per image,
  cycled). Images are resized to ``image_size``; text is read once through the
  tokenizer of every token space (:func:`text_spaces`: each ``hf:`` text tower's, and
  :func:`zoo_tokenizer`'s for the zoo's) and held under each space's key
  (:func:`fedjax_mm.runner.text.joint_tokenizer`, :func:`~fedjax_mm.runner.text.split_joint`).
  The public set is cut to a multiple of ``creamfl.batch_size``; the test set to
  :func:`num_test_images`, its captions the server's.

  Returns:
    ``{"image" | "text" | "multimodal": the group's pool, "public": {image, caption:<space>
    [P, C, L] per space}, "test": {"public": the retrieval test set}}``.
  """
  block = config.data
  spaces = text_spaces(config)  # checkpoints only: a zoo encoder reads zoo_tokenizer's
  tokenizer = text_lib.joint_tokenizer(spaces)
  wants: dict[tuple[str, str], list[tuple[str, int]]] = {}
  for name in GROUPS:
    spec = config.clients[name]
    read = (block.clients[name], tfds_data.READERS[block.clients[name]].splits[0])
    wants.setdefault(read, []).append((name, spec.num * spec.train_size))
  train_split, test_split = tfds_data.READERS[block.public].splits
  wants.setdefault((block.public, train_split), []).append(("public", config.public.size))
  wants.setdefault((block.public, test_split), []).append(("test", max(config.test.sizes)))
  image_only = (block.clients.image, tfds_data.READERS[block.clients.image].splits[0])
  sets = read_disjoint(
    wants,
    seed=config.seed,
    data_dir=block.get("data_dir") or None,
    limit=block.get("limit") or None,
    image_size=config.image_size,
    tokenizer=lambda name, split: None if (name, split) == image_only else tokenizer,
  )
  sets = {who: text_lib.split_joint(arrays, spaces) for who, arrays in sets.items()}
  c = config.creamfl
  num_public = len(sets["public"]["image"]) // c.batch_size * c.batch_size
  if num_public < max(c.batch_size, c.public_batch_size or 1):
    raise ConfigError(
      f"the public set read has {len(sets['public']['image'])} examples (data.limit="
      f"{block.limit}), fewer than one batch (creamfl.batch_size={c.batch_size}"
      + (f", public_batch_size={c.public_batch_size}" if c.public_batch_size else "")
      + ")."
    )
  sets["public"] = data.take(sets["public"], np.arange(num_public))
  test = sets.pop("test")
  num_test = num_test_images(config, len(test["image"]))
  key = text_key(config, config.server.text_encoder)
  sets["test"] = {"public": _retrieval_set(test["image"][:num_test], test[key][:num_test], key)}
  return sets


def build(config):
  """Validated client groups, server, initial states, private data, public and test sets.

  The public set holds ``image [P, S, S, 3]`` and the captions ``[P, C, L]`` of every
  token space of the run (:func:`text_spaces`), each under its key. The test sets
  are ``{"public": ..., "private": ...}`` (the latter only with
  ``test.private_size``), each ``image [N, S, S, 3]``, the server's captions
  ``[N C, L]`` (under its text key) and ``ids [N C]``. With ``data.source = "tfds"``
  the data are read by :func:`_tfds_sets` (no private test).
  """
  validate(config)
  world = _world(config)
  root = jax.random.key(config.seed)
  sets = _tfds_sets(config) if data_source(config) == "tfds" else None
  clients, states, train_data, names = _client_groups(config, root, pools=sets)

  server_model = creamfl.DualEncoder(
    config.server.image_encoder,
    config.server.text_encoder,
    rep_dim=config.rep_dim,
    image_size=config.image_size,
    rngs=nnx.Rngs(jax.random.fold_in(root, 100)),
    pretrained=config.pretrained or None,
    **text_sizes(config),
  )
  graphdef, server_params = nnx.split(server_model)
  server = creamfl.ServerDef(
    graphdef,
    server_optimizer(config),
    text_key=text_key(config, config.server.text_encoder),
    lr_factor=server_lr_factor(config),
  )

  spaces = text_spaces(config)
  keys = ("image", *(text_lib.caption_key(s) for s in spaces))
  if sets is not None:
    public = {k: jnp.asarray(sets["public"][k]) for k in keys}
    return clients, states, train_data, server, server_params, public, sets["test"], names
  public = data.generate(
    config.seed * 1000 + 1, config.public.size, config=world, shift=config.public.shift
  )
  public = text_lib.in_spaces(public, spaces)  # the same captions, once per token space
  public = {k: jnp.asarray(public[k]) for k in keys}
  # The test set of CreamFL's Table 1: the public distribution, N = max(test.sizes) images.
  server_space = token_space(config, config.server.text_encoder)
  test = {
    "public": _test_set(
      config.seed * 1000 + 2, max(config.test.sizes), world, config.test.shift, server_space
    )
  }
  if config.test.private_size:
    test["private"] = _test_set(
      config.seed * 1000 + 3, config.test.private_size, world, 0.0, server_space
    )
  return (
    clients,
    states,
    train_data,
    server,
    server_params,
    public,
    test,
    names,
  )


# ----------------------------------------------------------------------------
# The experiment


def _bytes_per_client(config, clients, num_public: int) -> tuple[np.ndarray, np.ndarray]:
  """Bytes one selected client sends and receives per round (``[num_clients]`` each), for a
  public set of ``num_public`` pairs (``public.size``, or fewer read through TFDS)."""
  matrix = jax.ShapeDtypeStruct((num_public, config.rep_dim), jnp.float32)
  down = ledger_lib.tree_bytes({m: matrix for m in creamfl.MODALITIES})  # I_glob, T_glob
  up, downs = [], []
  for client, spec_name in zip(clients, GROUPS, strict=True):
    sent = ledger_lib.tree_bytes({m: matrix for m in client.modalities})
    up += [sent] * config.clients[spec_name].num
    downs += [down] * config.clients[spec_name].num
  return np.asarray(up, np.int64), np.asarray(downs, np.int64)


def _tower_bytes(server_params, clients, config) -> np.ndarray:
  """Bytes of the server-sized towers each client holds (FedAvg / FedIoT send them both ways)."""
  out = []
  for client, name in zip(clients, GROUPS, strict=True):
    towers = creamfl_fedavg.client_towers(client)
    size = sum(ledger_lib.tree_bytes(server_params[a]) for pairs in towers.values() for a in pairs)
    out += [size] * config.clients[name].num
  return np.asarray(out, np.int64)


def size_label(size: int) -> str:
  """A test set's name by its number of images: ``1000 -> "1K"``, ``5000 -> "5K"``, ``250 -> "250"``."""
  return f"{size // 1000}K" if size % 1000 == 0 else str(size)


def r1_sum(recall: Mapping[str, Mapping[str, float]], sizes: Sequence[int]) -> float:
  """CreamFL's ``R@1_sum``: i2t R@1 + t2i R@1 on each test size (4 numbers for 1K and 5K).

  Args:
    recall: ``{size label: {"i2t_R@1": ..., "t2i_R@1": ..., ...}}`` (percentages).
    sizes: the test sizes (``config.test.sizes``).
  """
  return sum(recall[size_label(n)][k] for n in sizes for k in ("i2t_R@1", "t2i_R@1"))


def rsum(recall: Mapping[str, Mapping[str, float]], sizes: Sequence[int]) -> float:
  """All six recalls summed over the test sizes."""
  return sum(recall[size_label(n)][k] for n in sizes for k in RECALL_KEYS)


#: ``server_optimizer``'s choices: the default AdamW, or the paper's AdamP (Sec. 4.1).
SERVER_OPTIMIZERS = ("adamw", "adamp")
#: ``server_lr_schedule``'s: constant, or cosine annealing over the run's rounds (Sec. 4.1).
SERVER_LR_SCHEDULES = ("constant", "cosine")


def server_optimizer(config) -> optax.GradientTransformation:
  """The server's optimizer (steps 1 and 7): AdamW, or AdamP as the authors' code runs it.

  Both at ``server_learning_rate`` with decoupled weight decay ``server_weight_decay``;
  AdamP (:func:`fedjax_mm.core.optim.adamp`) with the ``adamp`` package's defaults
  (``delta = 0.1``, ``wd_ratio = 0.1``), as the code's ``optimizers.py`` builds it.
  """
  lr, wd = config.server_learning_rate, config.server_weight_decay
  if config.server_optimizer == "adamp":
    return optim.adamp(lr, weight_decay=wd)
  return optax.adamw(lr, weight_decay=wd)


def server_lr_factor(config):
  """``round -> factor`` of the server's rate: ``None`` (constant) or cosine annealing.

  ``cosine``: PyTorch's ``CosineAnnealingLR(T_max=rounds)`` stepped after every round,
  as the authors' code steps it (``T_max = 30``, its default number of rounds); here
  ``T_max`` is the run's ``rounds``.
  """
  if config.server_lr_schedule == "constant":
    return None
  rounds = int(config.rounds)
  return lambda r: optim.cosine_annealing(r, rounds)


def chance_recall(
  num_images: int, captions_per_image: int, ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
  """Recall@K (%) of a uniformly random ranking on ``num_images`` images x ``C`` captions.

  t2i: one correct image among ``N``, ``min(K / N, 1)``. i2t: ``C`` correct
  captions among ``C N``, found unless all ``K`` top candidates are wrong,
  ``1 - prod_{j<K} (C N - C - j) / (C N - j)`` (about ``K / N`` too).
  """
  n, c = num_images, captions_per_image
  out = {}
  for k in ks:
    miss = 1.0
    for j in range(min(k, c * n)):
      miss *= max(c * n - c - j, 0) / (c * n - j)
    out[f"i2t_R@{k}"] = 100.0 * (1.0 - miss)
  for k in ks:
    out[f"t2i_R@{k}"] = 100.0 * min(k / n, 1.0)
  return out


def _fold_images(config, num_test: int | None = None) -> dict[str, int]:
  """Images per fold of each test size: ``s`` itself, or ``N / folds`` when ``N < max(sizes)``."""
  sizes = tuple(config.test.sizes)
  num = max(sizes) if num_test is None else num_test
  return {size_label(n): num // (max(sizes) // n) for n in sizes}


def _chance(config, num_test: int | None = None) -> dict[str, dict[str, float]]:
  """Chance recall of every table: per test size (its fold size) and the private test.

  ``num_test``: the test images read (:func:`num_test_images`; None: ``max(test.sizes)``).
  """
  c = data.WorldConfig().captions_per_image
  out = {k: chance_recall(n, c) for k, n in _fold_images(config, num_test).items()}
  if config.test.private_size:
    out["private"] = chance_recall(config.test.private_size, c)
  return out


def experiment(config) -> loop.Experiment:
  """Every method of ``config.methods`` side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  Every method starts from a copy of the same initial server and clients.
  The federated methods share one compiled round (the variant is a runtime
  argument), ``local`` has its own; the server is evaluated every
  ``eval_every`` rounds and after the last, and selected clients' bytes go to
  each method's ledger.
  """
  clients, states, train_data, server, server_params, public, test, names = build(config)
  methods = tuple(config.methods)
  cc = _cream_config(config)
  # Each group's clients, padded to a multiple of the mesh's devices: padding clients
  # hold no samples, are never selected (draws by rank among the real clients) and are
  # sliced off every per-client output (real()).
  mesh = core.job_mesh(validation.check_devices(config))
  nums = [config.clients[name].num for name in GROUPS]
  padded = [core.padded_size(n, mesh) for n in nums]

  def pad(groups, place=False):
    out = tuple(g.pad(k) for g, k in zip(groups, padded, strict=True))
    return tuple(g.place(mesh) for g in out) if place else out

  def real(per_group) -> np.ndarray:
    """Per-group ``[K'_g]`` outputs -> ``[sum_g K_g]``, the real clients in order."""
    return np.concatenate([np.asarray(a)[:n] for a, n in zip(per_group, nums, strict=True)])

  fed_data, states = pad(train_data, place=True), pad(states)
  fed = creamfl.creamfl(clients, server, cc, faults=validation.check_faults(config))
  local = creamfl.server_only(server, cc)
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)
  # Traced with the mesh in context: a compiled loop over clients runs per device. The
  # clients' data are an argument: no jitted function may close over an array split over
  # several processes (job_mesh). So is the public set (replicated): closed over, it would
  # be a constant of the compiled round, copied into it and into every cache entry.
  fed_step = core.jit_round(lambda s, d, v, p: fed.round(s, d, p, v))
  local_step = core.jit_round(lambda s, p: local.round(s, p))
  on_mesh = core.replicate(public, mesh)
  variants = {m: creamfl.variant(**ROWS[m]) for m in methods if m in ROWS}
  rounds = {m: functools.partial(fed_step, d=fed_data, v=variants[m], p=on_mesh) for m in variants}
  if LOCAL in methods:
    rounds[LOCAL] = functools.partial(local_step, p=on_mesh)
  inits = {m: lambda: fed.init(server_params, states, init_key) for m in methods}
  if any(m in PARAMETER_ROWS for m in methods):
    # Clients of the server's size on the same private data; the public set goes to the
    # multimodal clients (CreamFL, Sec. 4.1).
    avg_clients, avg_states, avg_data, _ = _client_groups(
      config, jax.random.key(config.seed), server_size=True, train_data=train_data
    )
    avg_data = pad(
      tuple(
        creamfl_fedavg.with_public(d, public) if c.multimodal else d
        for c, d in zip(avg_clients, avg_data, strict=True)
      ),
      place=True,
    )
    avg_states = pad(avg_states)
    avg = creamfl_fedavg.fedavg_towers(avg_clients, cc)
    avg_step = core.jit_round(lambda s, d, f: avg.round(s, d, f))
    for m, iot in PARAMETER_ROWS.items():
      if m in methods:
        weight = jnp.float32(cc.iot_weight if iot else 1.0)
        rounds[m] = functools.partial(avg_step, d=avg_data, f=weight)
        inits[m] = lambda: avg.init(server_params, avg_states, init_key)
    avg_up = _tower_bytes(server_params, avg_clients, config)
  rounds = {m: rounds[m] for m in methods}

  sizes = tuple(config.test.sizes)
  # Each size is a mean over max(sizes) / size folds of the test set (of N <= max(sizes)
  # images when data.limit cut a TFDS one: num_test_images).
  folds = [max(sizes) // n for n in sizes]
  data_note = None
  if data_source(config) == "tfds":  # what was read, beside what the config asked
    data_note = _data_note(config, train_data, public, test)

  @jax.jit
  def embed(params, images, captions):  # The test set is an argument, not a baked constant.
    model = server.merge(params)
    images = apply_in_batches(lambda x: model.represent(x, "image"), images, 256)
    texts = apply_in_batches(lambda x: model.represent(x, "text"), captions, 256)
    return images, texts

  def recall_of(params, test_set, folds):
    images, texts = embed(params, test_set["image"], test_set[server.text_key])
    return [
      {k: float(r[k]) for k in RECALL_KEYS}
      for r in (metrics.image_text_recall(images, texts, test_set["ids"], folds=f) for f in folds)
    ]

  qa = vqa_data(config) if config.vqa.enabled else None

  def evaluate(s) -> dict[str, dict[str, float]]:
    """``{size label: recall, ...}`` on the public-distribution test, ``"private"`` too if any;
    after the last round also ``"vqa"`` (:func:`vqa_accuracy`), when ``vqa.enabled``."""
    params = processes.gather(s.server_params)  # This process's copy, in a job of several.
    public = recall_of(params, test["public"], folds)
    out = {size_label(n): r for n, r in zip(sizes, public, strict=True)}
    if "private" in test:
      out["private"] = recall_of(params, test["private"], [None])[0]
    # The state's own round count says whether this is the final server, so a rerun of a
    # finished run (the loop evaluates it anew) gets its VQA entry too.
    if qa is not None and int(s.round) == config.rounds:
      out["vqa"] = vqa_accuracy(config, server.graphdef, params, qa)
    return out

  def nonfinite(out) -> list[str]:
    bad = [] if bool(out["server_finite"]) else ["the server"]
    if "client_finite" in out:
      bad += [names[i] for i in np.flatnonzero(~real(out["client_finite"]))]
    return bad

  up_bytes, down_bytes = _bytes_per_client(config, clients, public["image"].shape[0])

  def traffic(m, out):
    if m == LOCAL:
      return None
    active = real(out["active"])
    if m in PARAMETER_ROWS:  # Towers down and up, the same bytes each way.
      return np.where(active, avg_up, 0), np.where(active, avg_up, 0)
    sent = active
    if "dropped" in out:  # Dropped clients received I_glob, T_glob but sent nothing.
      sent = active & ~real(out["dropped"])
    return np.where(sent, up_bytes, 0), np.where(active, down_bytes, 0)

  def scalars(r, outs, evals):
    values = {}
    for m in methods:
      if m in PARAMETER_ROWS:
        client_loss = real(outs[m]["client_loss"])
        active = real(outs[m]["active"])
        values[f"{m}/client_loss"] = float(client_loss[active].mean())
      else:
        values[f"{m}/server_loss"] = float(outs[m]["server_loss"])
      if m in ROWS:
        values[f"{m}/kd_loss"] = float(outs[m]["kd_loss"])
        values |= loop.fault_scalars(outs[m], prefix=f"{m}/")
      if m in evals:
        values[f"{m}/R@1_sum"] = r1_sum(evals[m], sizes)
        for test_name, recall in evals[m].items():
          if test_name != "vqa":
            values |= {f"{m}/{test_name}/{k}": v for k, v in recall.items()}
        if "vqa" in evals[m]:
          values[f"{m}/vqa/accuracy"] = evals[m]["vqa"]["accuracy"]
          values[f"{m}/vqa/blind_accuracy"] = evals[m]["vqa"]["blind_accuracy"]
    return [("creamfl", values)]

  def postfix(evals):
    if not evals:
      return {}
    best = max(evals, key=lambda m: r1_sum(evals[m], sizes))
    return {"best": f"{best} {r1_sum(evals[best], sizes):.1f}"}

  return loop.Experiment(
    init=lambda: {m: jax.tree.map(jnp.copy, inits[m]()).place(mesh) for m in methods},
    methods=rounds,
    evaluate=evaluate,
    nonfinite=nonfinite,
    scalars=scalars,
    runs=("creamfl",),
    report=lambda outcome: _report(
      config, methods, outcome, None if qa is None else _vqa_protocol(config, qa), data_note
    ),
    traffic=traffic,
    eval_every=config.eval_every,
    postfix=postfix,
  )


def _recall_table(rows: Sequence[Sequence[Any]], chance: Mapping[str, float]) -> str:
  """``method | six recalls`` rows and a last row at chance."""
  rows = [*rows, ["chance (random ranking)", *(chance[k] for k in RECALL_KEYS)]]
  return report_lib.format_table(["method", *RECALL_KEYS], rows)


def _protocol(config, num_test: int | None = None) -> dict[str, Any]:
  sizes = list(config.test.sizes)
  out = {
    "test_sizes": sizes,
    "test_images": max(sizes) if num_test is None else num_test,
    "folds": {size_label(n): max(sizes) // n for n in sizes},
    "captions_per_image": data.WorldConfig().captions_per_image,
    "shift": config.test.shift,
    "public_shift": config.public.shift,
    "private_size": config.test.private_size,
    "r1_sum": " + ".join(f"{d}_R@1({size_label(n)})" for n in sizes for d in ("i2t", "t2i")),
  }
  if num_test is not None and num_test < max(sizes):  # data.limit scaled the protocols down
    out["fold_images"] = _fold_images(config, num_test)
  return out


def _vqa_protocol(config, qa: VqaData) -> dict[str, Any]:
  """How the VQA analogue was run: scenes, questions per type, the head's training."""
  test_types = np.bincount(np.asarray(qa.test["type"]), minlength=data.vqa.NUM_TYPES)
  return {
    "train_images": config.vqa.train_images,
    "test_images": config.vqa.test_images,
    "train_questions": int(qa.train["answer"].shape[0]),
    "test_questions": int(qa.test["answer"].shape[0]),
    "test_questions_per_type": dict(zip(data.vqa.QUESTION_TYPES, test_types.tolist(), strict=True)),
    "shift": config.test.shift,
    "answers": data.vqa.NUM_ANSWERS,
    "templates": dict(data.vqa.TEMPLATES),
    "features": config.vqa.features,
    "head": {k: config.vqa[k] for k in ("hidden", "steps", "batch_size", "learning_rate")},
  }


def _vqa_table(methods, results) -> str:
  """Table 2's analogue: each row's accuracy, its blind head's, and per question type."""
  types = data.vqa.QUESTION_TYPES
  rows = []
  for m in methods:
    r = results[m]["vqa"]
    gain = r["accuracy"] - r["blind_accuracy"]
    rows.append(
      [m, r["accuracy"], r["blind_accuracy"], f"{gain:+.2f}", *(r["per_type"][t] for t in types)]
    )
  majority = results[methods[0]]["vqa"]
  rows.append(
    [
      "majority answer per type",
      majority["majority_accuracy"],
      None,
      "",
      *(majority["majority_per_type"][t] for t in types),
    ]
  )
  return report_lib.format_table(["method", "accuracy", "blind", "vs blind", *types], rows)


def _describe_tests(config, data_note: Mapping[str, Any] | None = None) -> str:
  """The retrieval tests in words: images, captions, where they come from, folds."""
  sizes = tuple(config.test.sizes)
  num = max(sizes) if data_note is None else data_note["test_images"]
  c = data.WorldConfig().captions_per_image
  per_fold = _fold_images(config, num)
  parts = [
    f"{size_label(n)} = mean over {max(sizes) // n} folds of {per_fold[size_label(n)]} images"
    if n < max(sizes)
    else f"{size_label(n)} = all {num} images"
    for n in sizes
  ]
  if data_note is not None:
    lead = (
      f"{num} test images x {c} captions of {data_note['datasets']['test']} (the public "
      "set's dataset)"
    )
  else:
    where = (
      "the public set's distribution"
      if config.test.shift == config.public.shift
      else "NOT the public set's distribution"
    )
    lead = f"{num} held-out test images x {c} captions at shift {config.test.shift} ({where})"
  return f"{lead}; " + "; ".join(parts)


def _data_note(config, train_data, public, test) -> dict[str, Any]:
  """What a TFDS run read: datasets and splits, each client's examples, public and test sizes."""
  block = config.data
  names = {**{g: block.clients[g] for g in GROUPS}, "public": block.public, "test": block.public}
  splits = {k: tfds_data.READERS[v].splits[0] for k, v in names.items()}
  splits["test"] = tfds_data.READERS[block.public].splits[1]
  num_test = int(test["public"]["image"].shape[0])
  return {
    "source": "tfds",
    "datasets": names,
    "splits": splits,
    "limit": block.limit,
    "image_size": config.image_size,
    "train_sizes": {
      g: [int(n) for n in np.asarray(d.num_samples)]
      for g, d in zip(GROUPS, train_data, strict=True)
    },
    "public_size": int(public["image"].shape[0]),
    "test_images": num_test,
    "fold_images": _fold_images(config, num_test),
  }


def _data_section(note: Mapping[str, Any]) -> tuple[str, str]:
  """The report's section: one row per set, the dataset and split it read, its examples."""
  rows = [
    [f"{g} clients ({len(sizes)})", f"{note['datasets'][g]} ({note['splits'][g]})", sizes]
    for g, sizes in note["train_sizes"].items()
  ]
  rows = [[name, where, " / ".join(map(str, sizes))] for name, where, sizes in rows]
  for key, size in (("public", note["public_size"]), ("test", note["test_images"])):
    what = "public set" if key == "public" else "test set (images, 5 captions each)"
    rows.append([what, f"{note['datasets'][key]} ({note['splits'][key]})", str(size)])
  table = report_lib.format_table(["set", "dataset (split)", "examples"], rows)
  return (
    f"Data (TFDS, data.limit={note['limit']}, images {note['image_size']} px)",
    table + "\n\nClients' examples per client (a Dirichlet split of the group's pool).",
  )


def _report(
  config,
  methods,
  outcome: loop.Outcome,
  vqa_protocol: Mapping[str, Any] | None = None,
  data_note: Mapping[str, Any] | None = None,
) -> loop.Report:
  """CreamFL's Table 1 (one table per test size, R@1_sum over all), plus bytes per round;
  Table 2's analogue when ``vqa_protocol`` (the VQA analogue ran) is given; what each
  set read when ``data_note`` (a TFDS run, :func:`_data_note`) is given."""
  results, rounds = outcome.final, config.rounds
  sizes = tuple(config.test.sizes)
  num_test = None if data_note is None else data_note["test_images"]
  num_public = config.public.size if data_note is None else data_note["public_size"]
  chance = _chance(config, num_test)
  fmt = report_lib.format_table
  local_sum = r1_sum(results[LOCAL], sizes) if LOCAL in results else None
  summary_rows, traffic = [], {}
  for m in methods:
    ledger = outcome.ledgers.get(m)  # None: the method sent nothing.
    up, down = (ledger.total_up, ledger.total_down) if ledger else (0, 0)
    traffic[m] = {"up_per_round": up / rounds, "down_per_round": down / rounds}
    total = r1_sum(results[m], sizes)
    gain = "" if local_sum is None else f"{total - local_sum:+.2f}"
    summary_rows.append(
      [m, total, rsum(results[m], sizes), gain, ledger_lib.format_bytes((up + down) / rounds)]
    )
  chance_sum = r1_sum(chance, sizes)
  summary_rows.append(["chance (random ranking)", chance_sum, rsum(chance, sizes), "", ""])
  summary = fmt(["method", "R@1_sum", "RSUM", "vs local", "bytes/round"], summary_rows)
  tables = {
    size_label(n): _recall_table(
      [[m, *(results[m][size_label(n)][k] for k in RECALL_KEYS)] for m in methods],
      chance[size_label(n)],
    )
    for n in sizes
  }
  private = None
  if config.test.private_size:
    private = _recall_table(
      [[m, *(results[m]["private"][k] for k in RECALL_KEYS)] for m in methods], chance["private"]
    )
  wall, start_round = outcome.wall_time_s, outcome.resumed_at
  protocol = _protocol(config, num_test)
  description = (
    f"Server ({config.server.image_encoder} + {config.server.text_encoder}) after {rounds} rounds; "
    f"Recall@K (%) on {_describe_tests(config, data_note)}. R@1_sum = {protocol['r1_sum']} (CreamFL's "
    f"Table 1; RSUM adds all {6 * len(sizes)} recalls). "
    f"{sum(config.clients[g].num for g in GROUPS)} clients, "
    f"{config.creamfl.num_selected} per round, P={num_public}, d={config.rep_dim}, "
    f"gamma={config.creamfl.lcr_weight}, seed {config.seed}; wall time {wall:.0f} s"
    + (f" (resumed at round {start_round})" if start_round else "")
  )
  history = {
    m: [
      (record["round"], record[f"{m}/R@1_sum"])
      for record in outcome.history
      if f"{m}/R@1_sum" in record
    ]
    for m in methods
  }
  sections = [("Result", description), ("R@1_sum (public-distribution tests)", summary)]
  for n in sizes:
    label = size_label(n)
    sections.append((f"{label} test: Recall@K (%)", tables[label]))
  if data_note is not None:
    sections.append(_data_section(data_note))
  if private is not None:
    sections.append(
      (
        f"Private distribution (shift 0, {config.test.private_size} images, full set; not in "
        "R@1_sum): Recall@K (%)",
        private,
      )
    )
  vqa_text = None
  if vqa_protocol is not None:
    p = vqa_protocol
    vqa_text = _vqa_table(methods, results)
    sections.append(
      (
        "Table 2 analogue (VQA accuracy %)",
        vqa_text
        + "\n\n"
        + (
          f"Each row's server frozen after {rounds} rounds; a fusion head (hidden {p['head']['hidden']}, "
          f"{p['head']['steps']} Adam steps of {p['head']['batch_size']} questions, lr "
          f"{p['head']['learning_rate']}) on its {p['features']} features, trained on "
          f"{p['train_questions']} questions about {p['train_images']} scenes, tested on "
          f"{p['test_questions']} questions about {p['test_images']} other scenes at shift "
          f"{p['shift']}; top-1 exact-match accuracy over {p['answers']} answers. blind: the same "
          "head without the image (question only); vs blind: accuracy minus blind; majority: "
          "each type's most frequent training answer. Not VQA v2: template questions about "
          "the embedded world's scenes (fedjax_mm.data.vqa)."
        ),
      )
    )
  sections.append(("Curves", "![R@1_sum](curves.png)"))
  result = {
    "protocol": protocol,
    "recall": {m: {size_label(n): results[m][size_label(n)] for n in sizes} for m in methods},
    "r1_sum": {m: r1_sum(results[m], sizes) for m in methods},
    "rsum": {m: rsum(results[m], sizes) for m in methods},
    "chance": chance,
    "traffic": traffic,
    "gamma": config.creamfl.lcr_weight,
    "rounds": rounds,
    "seed": config.seed,
    "wall_time_s": wall,
  }
  if private is not None:
    result["private_recall"] = {m: results[m]["private"] for m in methods}
  if data_note is not None:
    result["data"] = dict(data_note)
  if vqa_protocol is not None:
    first = results[methods[0]]["vqa"]
    result["vqa"] = {
      "protocol": dict(vqa_protocol),
      "majority": {k: first[f"majority_{k}"] for k in ("accuracy", "per_type")},
      "methods": {
        m: {
          k: results[m]["vqa"][k]
          for k in ("accuracy", "per_type", "blind_accuracy", "blind_per_type")
        }
        for m in methods
      },
    }
  parts = [summary] + [f"{size_label(n)} test:\n{tables[size_label(n)]}" for n in sizes]
  if vqa_text is not None:
    parts.append(f"VQA (Table 2 analogue), accuracy %:\n{vqa_text}")
  text = "\n\n".join(parts + [description])
  return loop.Report(
    title="CreamFL and its variants: server image-text retrieval",
    sections=sections,
    plots={
      "curves.png": loop.Curves(
        {"server R@1_sum": history},
        "Server retrieval on the public-distribution test",
        "R@1_sum (%)",
      )
    },
    results=result,
    text=text,
  )


def summarize(workdirs) -> str:
  """Mean ± sample std over runs (seeds) of the final tables, from their ``results.json``.

  The runs must share every config key but the seed
  (:func:`fedjax_mm.runner.report.load_seed_runs`).
  """
  runs, _ = report_lib.load_seed_runs(workdirs)
  for w, r in zip(workdirs, runs, strict=True):
    if "protocol" not in r:
      raise SummaryError(
        f"{w}: results.json predates the public-distribution 1K/5K protocol; run it again."
      )
  sizes = runs[0]["protocol"]["test_sizes"]
  if any(r["protocol"]["test_sizes"] != sizes for r in runs):
    raise SummaryError("the runs were evaluated on different test sizes.")
  methods = [m for m in runs[0]["recall"] if all(m in r["recall"] for r in runs)]

  cell = functools.partial(report_lib.seed_cell, digits=2)
  chance = runs[0]["chance"]
  local = [r["r1_sum"][LOCAL] for r in runs] if LOCAL in methods else None
  rows = []
  for m in methods:
    row = [m, cell([r["r1_sum"][m] for r in runs]), cell([r["rsum"][m] for r in runs])]
    if local is not None:
      row.append(cell([r["r1_sum"][m] - lo for r, lo in zip(runs, local, strict=True)]))
    rows.append(row)
  rows.append(
    ["chance (random ranking)", f"{r1_sum(chance, sizes):.2f}", f"{rsum(chance, sizes):.2f}"]
    + ([""] if local is not None else [])
  )
  headers = ["method", "R@1_sum", "RSUM"] + (["vs local"] if local is not None else [])
  parts = [report_lib.format_table(headers, rows)]
  for n in sizes:
    label = size_label(n)
    rows = [
      [m] + [cell([r["recall"][m][label][k] for r in runs]) for k in RECALL_KEYS] for m in methods
    ]
    rows.append(["chance (random ranking)", *(f"{chance[label][k]:.2f}" for k in RECALL_KEYS)])
    parts.append(f"{label} test:\n" + report_lib.format_table(["method", *RECALL_KEYS], rows))
  if all("vqa" in r for r in runs):  # Table 2's analogue (runs from before it have none)
    types = data.vqa.QUESTION_TYPES
    rows = []
    for m in methods:
      blocks = [r["vqa"]["methods"][m] for r in runs]
      rows.append(
        [m, cell([b["accuracy"] for b in blocks]), cell([b["blind_accuracy"] for b in blocks])]
        + [cell([b["per_type"][t] for b in blocks]) for t in types]
      )
    majority = [r["vqa"]["majority"] for r in runs]
    rows.append(
      ["majority answer per type", cell([b["accuracy"] for b in majority]), ""]
      + [cell([b["per_type"][t] for b in majority]) for t in types]
    )
    table = report_lib.format_table(["method", "accuracy", "blind", *types], rows)
    parts.append("VQA (Table 2 analogue), accuracy %:\n" + table)
  seeds = ", ".join(str(r["seed"]) for r in runs)
  protocol = runs[0]["protocol"]
  note = runs[0].get("data")  # a TFDS run: its test set is a dataset's split, not a shift
  where = (
    f"at shift {protocol['shift']}"
    if note is None
    else f"of {note['datasets']['test']} ({note['splits']['test']} split)"
  )
  return "\n\n".join(parts) + (
    f"\n\nmean ± std (sample, ddof=1) over {len(runs)} runs (seeds {seeds}), Recall@K in %; "
    f"{protocol['test_images']} test images {where}; "
    f"R@1_sum = {protocol['r1_sum']}."
  )


#: CreamFL as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="creamfl",
  methods=METHODS,
  validate=validate,
  experiment=experiment,
  summarize=summarize,
)
run = SYSTEM.run
