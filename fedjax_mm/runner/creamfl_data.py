"""CreamFL's names and data: its rows, the text spaces of its towers, every set a run reads.

The side of :mod:`fedjax_mm.runner.creamfl` that turns a config into arrays:
the rows ``config.methods`` may name (:data:`METHODS`), which text encoder and
token space each client group and the server use, the three client groups'
private data and stacked initial states (:func:`_client_groups`), the public
set and the retrieval tests (on the world or read through TFDS,
:func:`_tfds_sets`), and the VQA analogue's scenes and questions
(:func:`vqa_data`) with the frozen server's probe (:func:`vqa_accuracy`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm import core, data, models
from fedjax_mm.algorithms import creamfl, creamfl_baselines, vqa
from fedjax_mm.core import text as text_lib
from fedjax_mm.data import tfds as tfds_data
from fedjax_mm.runner import validation
from fedjax_mm.runner.creamfl_report import GROUPS, LOCAL
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.validation import data_source, reader

#: Every federated row: CreamFL's variants and Table 1's distillation baselines.
ROWS = {**creamfl.VARIANTS, **creamfl_baselines.BASELINES}


#: Table 1's model-homogeneous rows (clients of the server's size, parameters averaged per
#: modality; :mod:`fedjax_mm.algorithms.creamfl_fedavg`) -> is it FedIoT.
PARAMETER_ROWS = {"FedAvg": False, "FedIoT": True}


METHODS = (LOCAL, *ROWS, *PARAMETER_ROWS)


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
  """The token space a text encoder reads in this run (:mod:`fedjax_mm.core.text`).

  An ``hf:`` encoder's is its checkpoint; a zoo encoder's the world's ids (None), or
  on TFDS :func:`zoo_tokenizer`'s checkpoint: the paper's GRUs beside a BERT server
  whose tokenizer they read share its space, so the captions are held once for both.
  """
  if models.hf.is_hf(encoder):
    return encoder
  return zoo_tokenizer(config)


def text_key(config, encoder: str) -> str:
  """The data key of the captions ``encoder`` reads (:func:`fedjax_mm.core.text.caption_key`)."""
  return text_lib.caption_key(token_space(config, encoder))


def text_spaces(config) -> tuple[str | None, ...]:
  """The distinct token spaces of a run: None (the world's ids) first, then checkpoints sorted.

  The public set holds its captions in each (:func:`fedjax_mm.core.text.in_spaces` on
  the world, :func:`fedjax_mm.core.text.joint_tokenizer` on TFDS).
  """
  return text_lib.token_spaces(text_encoders(config), lambda e: token_space(config, e))


def text_sizes(config) -> dict[str, int]:
  """``vocab_size`` and ``max_len`` of the zoo's text encoders: the world's vocabulary and
  caption length, or on TFDS :func:`zoo_tokenizer`'s vocabulary (30,522 for BERT's) and
  :data:`fedjax_mm.core.text.HF_MAX_LEN`. (``hf:`` encoders take theirs from their folder.)"""
  checkpoint = zoo_tokenizer(config)
  if checkpoint is None:
    return {"vocab_size": data.VOCAB_SIZE, "max_len": _world(config).max_caption_len}
  return {"vocab_size": text_lib.vocab_size(checkpoint), "max_len": text_lib.HF_MAX_LEN}


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
  its key (:func:`fedjax_mm.core.text.caption_key`).
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


def vqa_data(config) -> vqa.VqaData:
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
  return vqa.VqaData(
    jnp.asarray(np.concatenate(scenes)), jnp.asarray(arguments), split["train"], split["test"]
  )


def vqa_accuracy(config, graphdef, params, qa: vqa.VqaData) -> dict[str, Any]:
  """CreamFL's Table 2 analogue for one server: accuracies (%) of the head and its baselines.

  Every server gets the same head initialisation and minibatches (the key is
  the seed's), so rows differ only by their features.

  Returns:
    Percentages, a dict of ``accuracy``, ``blind_accuracy`` and ``majority_accuracy``
    (floats) and of ``per_type``, ``blind_per_type`` and ``majority_per_type``
    (``{type: float}`` each); the majority's depend on the data only.
  """
  c = config.vqa
  out = vqa.server_accuracy(
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
  (:func:`fedjax_mm.data.tfds.read_disjoint`; at most ``data.limit`` examples
  of a split, a pool smaller than what is asked of it shared in proportion): each
  client group asks ``num x train_size`` examples of ``data.clients.<group>``'s train
  split, the public set ``public.size`` of ``data.public``'s train split after them
  (so none is a multimodal client's when both read ``coco_captions``), the test set
  ``max(test.sizes)`` images of its test split, all their captions (5 per image,
  cycled). Images are resized to ``image_size``; text is read once through the
  tokenizer of every token space (:func:`text_spaces`: each ``hf:`` text tower's, and
  :func:`zoo_tokenizer`'s for the zoo's) and held under each space's key
  (:func:`fedjax_mm.core.text.joint_tokenizer`, :func:`~fedjax_mm.core.text.split_joint`).
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
  sets = validation.read_disjoint(
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
