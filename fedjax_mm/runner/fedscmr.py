"""The FedSCMR experiment: features, clients, the ten systems, each round's metrics, the tables.

``run(config, workdir)`` is what ``python -m experiments.main
--config=experiments/fedscmr.py`` calls: :func:`fedjax_mm.runner.loop.run` of
:func:`experiment`. It builds labelled image-text feature pairs (the embedded
world through fixed, seeded encoders, or real precomputed features from an
``.npz``), splits them over the clients by class subsets (each client's
training, validation and test pairs) plus one shared test set over every
class, and trains every system of :data:`METHODS` side by side from the same
initial models, for ``config.rounds`` rounds. Each round is one jitted call per
system (compiled once). After every round it evaluates every client under two
protocols (mAP@N and NDCG@N, image-to-text and text-to-image):

* **own-class test**: the client's own test pairs, of its own classes only;
* **shared test**: one test set over all classes, the same for every client
  and every system (FedCMR's code scores its clients this way). A client that
  never saw a class can only retrieve it through what federation brought it,
  so this protocol shows what the own-class test hides.

Workdir, checkpoints, resume, NaN guard and the files written are the loop's.
At the end it prints and writes the tables of the paper's Tables 1-4 under
both protocols (:func:`tables`), the chance level of each (a random ranking),
plots of the test mAP and of the aggregation weights ``lambda^k_t`` per round,
and ``results.json``; :func:`summarize` gives them over seeds.

Everything is validated before anything is computed: a bad config raises
:class:`ConfigError` with a one-line message (``experiments/main.py`` prints
it and exits with status 2).

Features of the embedded world. The paper feeds 4096-d VGG-19 fc7 image
features and 1024-d sentence-BERT text features, from networks pretrained
elsewhere. By default (``features.image_encoder="world-clip/cnn_m"``), both come
from frozen World-CLIP encoders pretrained on the world's web split
(:func:`pretrained_features`): cnn_m, the shipped encoder that knows the primary
object's shape (this benchmark's label), and transformer_t. The earlier
stand-in remains (``features.image_encoder="" features.text_encoder=transformer_t``,
:func:`world_features`):
the text side is a frozen, randomly initialised text encoder of
:mod:`fedjax_mm.models` (``features.text_encoder``) applied to one caption
per image (chosen at random, seeded), mean-pooled. The image side cannot be a
randomly initialised image encoder: with the world's random textures, colours,
sizes and positions, pooled features of a frozen random ``cnn_s`` / ``cnn_m`` /
``resnet_t`` (or a random projection of the pixels) let a logistic regression
find the primary shape no better than chance (11-15% for 10 classes, measured
on 1,000 / 500 pairs), where VGG features of real photos are strongly
informative. The image features therefore simulate a pretrained extractor: a
fixed seeded random projection of the image's per-shape pixel areas (read from
its segmentation mask, so several objects mix, the largest dominating) plus
Gaussian noise; the same logistic regression reaches about 86% on them, the
text features about 82%.
"""

from __future__ import annotations

import math
import pathlib
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import fedscmr as alg_lib
from fedjax_mm.core import processes
from fedjax_mm.data.cross_modal import (
  PairedFeatures,
  class_demand,
  class_subset_split,
  shared_test_split,
)
from fedjax_mm.models.scmr import ScmrModel
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.errors import ConfigError

#: System id -> name in the tables.
METHODS: dict[str, str] = {
  "dscmr": "DSCMR",
  "fedavg": "FedAvg",
  "fedprox": "FedProx",
  "fedavg_common": "FedAvg (common)",
  "fedprox_common": "FedProx (common)",
  "fedcmr": "FedCMR",
  "fedscmr": "FedSCMR",
  "fedscmr_no_lcs": "FedSCMR -L_cs",
  "fedscmr_no_lccs": "FedSCMR -L_ccs",
  "fedscmr_no_phi": "FedSCMR -Phi",
}
#: Rows of the paper's Tables 1-2 (with two of ours: FedAvg / FedProx of the common layer
#: only) and 3-4.
MAIN_TABLE = ("dscmr", "fedavg", "fedprox", "fedavg_common", "fedprox_common", "fedcmr", "fedscmr")
ABLATION_TABLE = ("fedscmr_no_lcs", "fedscmr_no_lccs", "fedscmr_no_phi", "fedscmr")
#: Text feature extractors: ``"bow"`` (numpy, a fixed random projection of word counts) or a
#: frozen, randomly initialised text encoder of :mod:`fedjax_mm.models`.
TEXT_ENCODERS = ("bow",) + tuple(
  name for name, (modality, _) in models.ENCODERS.items() if modality == "text"
)
DIRECTIONS = (("img2txt", "Img2Txt"), ("txt2img", "Txt2Img"))
#: Test protocols: results.json key of the per-client metrics, and the name in the report.
PROTOCOLS = {
  "global": ("methods_global", "shared test (all classes)"),
  "own": ("methods", "own-class test"),
}


def method_config(config, method: str, num_classes: int) -> alg_lib.ScmrConfig:
  """The :class:`~fedjax_mm.algorithms.fedscmr.ScmrConfig` of one system."""
  f, d = config.fedscmr, config.dscmr
  dscmr = dict(loss="dscmr", alpha=d.alpha, beta=d.beta, num_classes=num_classes, map_n=f.map_n)
  full = dict(
    loss="fedscmr",
    aggregation="fedscmr",
    alpha=f.alpha,
    beta=f.beta,
    gamma=f.gamma,
    num_classes=num_classes,
    map_n=f.map_n,
  )
  whole = {"aggregation": "fedavg", "federated": "all"}
  fedcmr = {"aggregation": "fedcmr", "split": config.fedcmr.split}
  table = {
    "dscmr": dscmr | {"aggregation": "none"},
    "fedavg": dscmr | whole,
    "fedprox": dscmr | whole | {"prox_mu": config.fedprox_mu},
    "fedavg_common": dscmr | {"aggregation": "fedavg"},
    "fedprox_common": dscmr | {"aggregation": "fedavg", "prox_mu": config.fedprox_mu},
    "fedcmr": dscmr | fedcmr | {"correction": config.fedcmr.correction},
    "fedscmr": full,
    "fedscmr_no_lcs": full | {"alpha": 0.0},
    "fedscmr_no_lccs": full | {"beta": 0.0},
    "fedscmr_no_phi": full | {"gamma": 0.0},
  }
  return alg_lib.ScmrConfig(**table[method])


def validate(config) -> None:
  """Checks a whole config before any work. Raises :class:`ConfigError`."""
  validation.check_numbers(config, validation.FEDSCMR)
  validation.check_client_map(config)
  validation.check_devices(config)
  validation.check_faults(config)
  clients = config.clients
  if len(clients) < 2:
    raise ConfigError(f"FedSCMR needs at least 2 clients, the config has {len(clients)}.")
  for i, c in enumerate(clients):
    missing = {"name", "classes", "train_size"} - set(c)
    if missing:
      raise ConfigError(f"clients[{i}] lacks {', '.join(sorted(missing))}.")
  names = [c["name"] for c in clients]
  if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
    raise ConfigError(f"client names must be distinct non-empty strings, got {names}.")
  f = config.features
  if f.path:
    if not pathlib.Path(f.path).is_file():
      raise ConfigError(f"features.path {f.path!r} is not a file.")
  elif f.image_encoder:
    for key in ("image_encoder", "text_encoder"):
      try:
        cfg = models.pretrained.read_config(f[key])
      except models.pretrained.PretrainedError as e:
        raise ConfigError(f"features.{key}: {e}") from None
      if cfg["modality"] != key.split("_")[0]:
        raise ConfigError(f"features.{key}: {f[key]!r} is a {cfg['modality']} encoder.")
  else:
    if f.text_encoder not in TEXT_ENCODERS:
      raise ConfigError(
        f"features.text_encoder: unknown {f.text_encoder!r}; known: {', '.join(TEXT_ENCODERS)}."
      )
    if f.image_dim < 1 or f.image_noise < 0:
      raise ConfigError("features.image_dim must be >= 1 and features.image_noise >= 0.")
    num_classes = data.NUM_SHAPES
    for c in clients:
      if not 1 <= c["classes"] <= num_classes:
        raise ConfigError(
          f"client {c['name']}: classes must be in [1, {num_classes}], got {c['classes']}."
        )
  for c in clients:
    if c["train_size"] < 1:
      raise ConfigError(f"client {c['name']}: train_size must be >= 1, got {c['train_size']}.")
  for key in ("rounds", "local_epochs", "batch_size", "test_size", "val_size", "global_test_size"):
    if config[key] < 1:
      raise ConfigError(f"{key} must be >= 1, got {config[key]}.")
  if config.learning_rate <= 0:
    raise ConfigError(f"learning_rate must be > 0, got {config.learning_rate}.")
  if config.model.hidden < 1 or config.model.dim < 1:
    raise ConfigError("model.hidden and model.dim must be >= 1.")
  if not config.ns or any(n < 1 for n in config.ns):
    raise ConfigError(f"ns must be a non-empty list of positive N, got {tuple(config.ns)}.")
  validation.check_methods(config.methods, METHODS)
  for method in config.methods:
    try:
      method_config(config, method, 2).validate()
    except ValueError as e:
      raise ConfigError(f"{method}: {e}") from None


# ---------------------------------------------------------------------------
# Features


def world_features(
  seed: int, num: int, *, image_dim: int = 64, image_noise: float = 0.5, text_encoder: str
) -> PairedFeatures:
  """``num`` labelled pairs of the embedded world as fixed feature vectors.

  See the module docstring. Deterministic in ``seed``; labels are the world's
  ``retrieval_label`` (the primary object's shape, 10 classes).

  Args:
    seed: integer seed of the world, the projection, the noise, the caption
      choice and the text encoder's initialisation.
    num: number of pairs.
    image_dim: dimension of the image features.
    image_noise: standard deviation of the noise on the image features, whose
      noise-free norm is about 1.
    text_encoder: ``"bow"`` or the name of a text encoder in
      :data:`fedjax_mm.models.ENCODERS` (see :data:`TEXT_ENCODERS`).

  Returns:
    :class:`~fedjax_mm.data.cross_modal.PairedFeatures`.
  """
  world = data.generate(seed, num)
  rng = np.random.default_rng([seed, 7])
  masks = world["mask"].reshape(num, -1)
  areas = np.stack([(masks == 1 + s).mean(1) for s in range(data.NUM_SHAPES)], axis=1)
  areas /= np.maximum(areas.sum(1, keepdims=True), 1e-12)
  projection = rng.normal(size=(data.NUM_SHAPES, image_dim)) / math.sqrt(image_dim)
  image = areas @ projection + image_noise * rng.normal(size=(num, image_dim)) / math.sqrt(
    image_dim
  )
  choice = rng.integers(0, world["caption"].shape[1], size=num)
  captions = world["caption"][np.arange(num), choice]
  if text_encoder == "bow":
    return PairedFeatures(
      image=image, text=_bag_of_words(rng, captions), labels=world["retrieval_label"]
    )
  graphdef, params = _init_jitted(
    lambda rngs: models.build_encoder(
      text_encoder, rngs=rngs, vocab_size=data.VOCAB_SIZE, max_len=captions.shape[1]
    ),
    jax.random.key(seed),
  )
  encode = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])
  text = np.asarray(core.client.apply_in_batches(lambda x: encode(params, x), captions, 512))
  return PairedFeatures(image=image, text=text, labels=world["retrieval_label"])


def pretrained_features(
  seed: int, num: int, *, image_encoder: str, text_encoder: str
) -> PairedFeatures:
  """``num`` labelled pairs of the world through frozen pretrained encoders.

  The paper's setting: VGG-19 fc7 image features and sentence-BERT text
  features, both from networks pretrained elsewhere. Here both come from the
  World-CLIP checkpoints (:mod:`fedjax_mm.runner.pretrain`), pretrained on the
  web split, which shares no seed with this pool: the pooled output of the
  frozen image encoder on each image, and of the frozen text encoder on one
  caption per image (chosen at random, seeded).

  Args:
    seed: integer seed of the world and of the caption choice.
    num: number of pairs.
    image_encoder: a checkpoint name or folder (``"world-clip/vit_s"``).
    text_encoder: a checkpoint name or folder (``"world-clip/transformer_s"``).
  """
  world = data.generate(seed, num)
  rng = np.random.default_rng([seed, 7])
  choice = rng.integers(0, world["caption"].shape[1], size=num)
  captions = world["caption"][np.arange(num), choice]
  return PairedFeatures(
    image=_frozen_features(image_encoder, world["image"]),
    text=_frozen_features(text_encoder, captions),
    labels=world["retrieval_label"],
  )


def _frozen_features(checkpoint: str, x: np.ndarray) -> np.ndarray:
  """Pooled outputs ``[n, h]`` of the checkpoint's encoder on ``x``, in batches of 512."""
  cfg = models.pretrained.read_config(checkpoint)
  sizes = {k: cfg[k] for k in models.pretrained.size_keys(cfg["modality"])}
  encoder = models.build_encoder(cfg["encoder"], rngs=nnx.Rngs(0), **sizes)
  models.pretrained.load_into(encoder, checkpoint)
  graphdef, params = nnx.split(encoder)
  encode = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])
  return np.asarray(core.client.apply_in_batches(lambda x: encode(params, x), x, 512))


def _bag_of_words(rng: np.random.Generator, captions: np.ndarray, dim: int = 64) -> np.ndarray:
  """``[n, dim]`` text features: ReLU of a fixed random projection of word counts (no PAD)."""
  counts = np.zeros((captions.shape[0], data.VOCAB_SIZE), np.float32)
  np.add.at(counts, (np.arange(captions.shape[0])[:, None], captions), 1.0)
  counts[:, data.PAD_ID] = 0
  projection = rng.normal(size=(data.VOCAB_SIZE, dim)) / math.sqrt(dim)
  return np.maximum(counts @ projection, 0)


def _feature_file(path: str) -> tuple[PairedFeatures, int]:
  """The pairs of a ``features.path`` ``.npz`` and their number of classes.

  Raises:
    ConfigError: the file is no ``.npz`` NumPy can read without pickle, lacks one
      of ``image``, ``text``, ``labels``, or holds arrays :class:`PairedFeatures`
      refuses (shapes, row counts, non-integer labels, NaN features).
  """
  keys = ("image", "text", "labels")
  held, arrays = None, {}
  try:
    z = np.load(path, allow_pickle=False)
    if isinstance(z, np.lib.npyio.NpzFile):  # Not an .npy's single array.
      with z:
        held = sorted(z.files)
        arrays = {k: z[k] for k in keys if k in held}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise ConfigError(f"features.path {path!r} is not a readable .npz ({e}).") from None
  if held is None or len(arrays) < len(keys):
    raise ConfigError(
      f"features.path {path!r} must hold arrays image [n, d_img], text [n, d_txt] and "
      f"labels [n]; it holds {held if held is not None else 'one array (an .npy)'}."
    )
  try:
    pool = PairedFeatures(**arrays)
  except ValueError as e:
    raise ConfigError(f"features.path {path!r}: {e}") from None
  if not len(pool):
    raise ConfigError(f"features.path {path!r} holds no pairs.")
  return pool, int(pool.labels.max()) + 1


def _features(config) -> tuple[PairedFeatures, int]:
  """The pool of pairs and the number of classes."""
  f = config.features
  if f.path:
    return _feature_file(f.path)
  num_classes = data.NUM_SHAPES
  sizes = [c["train_size"] + config.val_size + config.test_size for c in config.clients]
  demand = class_demand(
    num_classes, [c["classes"] for c in config.clients], sizes, seed=config.seed
  )
  demand += -(-config.global_test_size // num_classes)  # the shared test set, every class
  # Labels are close to uniform: draw enough for the most demanded class, with margin.
  num = int(1.4 * num_classes * demand.max()) + 50
  if f.image_encoder:
    pool = pretrained_features(
      config.seed * 1000 + 31, num, image_encoder=f.image_encoder, text_encoder=f.text_encoder
    )
  else:
    pool = world_features(
      config.seed * 1000 + 31,
      num,
      image_dim=f.image_dim,
      image_noise=f.image_noise,
      text_encoder=f.text_encoder,
    )
  return pool, num_classes


class Setup(NamedTuple):
  """What :func:`build` makes of a config.

  Attributes:
    group: the clients' static definition.
    state: their identical initial :class:`~fedjax_mm.core.ClientState`.
    train: each client's training pairs.
    val: each client's validation pairs (``v^k_t`` of eq. 12), of its classes.
    test: each client's own-class test pairs.
    shared_test: ``{"image", "text", "label"}`` arrays of the shared test set
      over every class (no client axis).
    num_classes: number of classes.
    classes: each client's classes.
  """

  group: core.GroupDef
  state: core.ClientState
  train: core.ClientData
  val: core.ClientData
  test: core.ClientData
  shared_test: dict[str, jax.Array]
  num_classes: int
  classes: list[np.ndarray]


def build(config) -> Setup:
  """Validated config -> group, initial state, the data of both test protocols, client classes.

  Each client takes ``train_size + val_size + test_size`` pairs of its classes
  (:func:`~fedjax_mm.data.cross_modal.class_subset_split`), split at random
  into training, validation and test pairs; the shared test set takes
  ``global_test_size`` pairs over every class from the rest of the pool
  (:func:`~fedjax_mm.data.cross_modal.shared_test_split`).
  """
  validate(config)
  pool, num_classes = _features(config)
  for c in config.clients:
    if config.features.path and not 1 <= c["classes"] <= num_classes:
      raise ConfigError(
        f"client {c['name']}: classes must be in [1, {num_classes}], got {c['classes']}."
      )
  try:
    train_idx, held_idx, classes = class_subset_split(
      pool.labels,
      num_classes=num_classes,
      classes_per_client=[c["classes"] for c in config.clients],
      train_sizes=[c["train_size"] for c in config.clients],
      test_size=config.val_size + config.test_size,
      seed=config.seed,
    )
    shared_idx = shared_test_split(
      pool.labels,
      num_classes=num_classes,
      size=config.global_test_size,
      exclude=train_idx + held_idx,
      seed=config.seed,
    )
  except ValueError as e:
    raise ConfigError(str(e)) from None
  rng = np.random.default_rng([config.seed, 17])
  val_idx, test_idx = [], []
  for held in held_idx:
    held = rng.permutation(held)
    val_idx.append(np.sort(held[: config.val_size]))
    test_idx.append(np.sort(held[config.val_size :]))
  client_data = []
  for parts in (train_idx, val_idx, test_idx):
    stacked, mask = data.stack_clients([pool.take(idx).as_dict() for idx in parts])
    client_data.append(
      core.make_client_data(stacked, mask, user_ids=np.arange(len(config.clients)))
    )
  image_dim, text_dim = pool.image.shape[1], pool.text.shape[1]
  make = lambda rngs: ScmrModel(
    image_dim, text_dim, num_classes, hidden=config.model.hidden, dim=config.model.dim, rngs=rngs
  )
  group, state = init_clients(
    make,
    tx=optax.adam(config.learning_rate),
    task=core.Task("classification", "image", "label", num_classes),
    key=jax.random.key(config.seed),
    num_clients=len(config.clients),
    local_epochs=config.local_epochs,
    batch_size=config.batch_size,
    client_map=validation.check_client_map(config),
  )
  shared_test = {k: jnp.asarray(v) for k, v in pool.take(shared_idx).as_dict().items()}
  return Setup(group, state, *client_data, shared_test, num_classes, classes)


def _init_jitted(make, key):
  """``(graphdef, params)`` of ``make(nnx.Rngs(key))``, initialised in one compiled call.

  Built eagerly, a model's initialisation dispatches (and on CPU compiles) one
  small computation per operation, seconds for a few layers; under ``jit`` it
  is one.
  """
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  params = jax.jit(lambda k: nnx.split(make(nnx.Rngs(k)))[1])(key)
  return graphdef, params


def init_clients(make, *, tx, task, key, num_clients, local_epochs, batch_size, client_map="auto"):
  """A group of ``num_clients`` identical models: :func:`fedjax_mm.core.init_group`
  with ``same_init=True`` (same key use, so the same parameters), jitted."""
  init_key, rng_key = jax.random.split(key)
  graphdef, params = _init_jitted(make, init_key)
  stack = jax.jit(
    lambda p: jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + x.shape), p)
  )
  params = stack(params)
  state = core.ClientState(
    params=params,
    opt_state=jax.jit(jax.vmap(tx.init))(params),
    rng=jax.random.split(rng_key, num_clients),
    shared=nnx.State({}),
  )
  group = core.GroupDef(
    name="scmr",
    graphdef=graphdef,
    tx=tx,
    task=task,
    local_epochs=local_epochs,
    batch_size=batch_size,
    client_map=client_map,
  )
  return group, state


# ---------------------------------------------------------------------------
# The experiment


def _headline(client_metrics: Mapping[str, Mapping[str, float]], n: int) -> float:
  """Mean over clients and both directions of mAP@n."""
  return float(
    np.mean(
      [m[f"mAP@{n}/{d}"] for m in client_metrics.values() for d, _ in DIRECTIONS],
    )
  )


def chance_level(
  labels: jax.Array, mask: jax.Array, *, ns: Sequence[int], key: jax.Array, draws: int = 32
) -> dict[str, float]:
  """mAP@N and NDCG@N of a random ranking on ONE test set, averaged over ``ns`` and draws.

  Queries and database are i.i.d. Gaussian embeddings (cosine similarity then
  ranks the database uniformly at random), scored with the same metrics as
  the systems; both directions are the same in distribution.

  Args:
    labels: ``int [n]`` labels of the test pairs.
    mask: ``bool [n]`` valid pairs.
    ns: the ``N`` of mAP@N / NDCG@N.
    key: PRNG key.
    draws: random rankings averaged.

  Returns:
    ``{"mAP": m, "NDCG": g}``.
  """

  def one(k):
    q, d = jax.random.normal(k, (2, labels.shape[0], 8))
    kw = dict(query_where=mask, database_where=mask)
    maps = [metrics.map_at_n(q, d, labels, labels, n=n, **kw) for n in ns]
    ndcgs = [metrics.ndcg_at_n(q, d, labels, labels, n=n, **kw) for n in ns]
    return jnp.mean(jnp.stack(maps)), jnp.mean(jnp.stack(ndcgs))

  maps, ndcgs = jax.jit(jax.vmap(one))(jax.random.split(key, draws))
  return {"mAP": float(jnp.mean(maps)), "NDCG": float(jnp.mean(ndcgs))}


def _chance(setup: Setup, ns, seed: int) -> dict[str, dict[str, float]]:
  """Chance levels of both protocols (own-class: the mean over clients)."""
  key = jax.random.fold_in(jax.random.key(seed), 20_000)
  labels = setup.shared_test["label"]
  shared = chance_level(labels, jnp.ones(labels.shape, bool), ns=ns, key=key)
  own = [
    chance_level(setup.test.arrays["label"][k], setup.test.sample_mask[k], ns=ns, key=key)
    for k in range(setup.test.num_clients)
  ]
  return {
    "global_test": shared,
    "own_test": {m: float(np.mean([o[m] for o in own])) for m in ("mAP", "NDCG")},
  }


def experiment(config) -> loop.Experiment:
  """Every configured system side by side, as :func:`fedjax_mm.runner.loop.run` drives them.

  Every system starts from a copy of the same initial clients; each round is
  one jitted call per system; after every round every client is evaluated on
  its own test pairs and on the shared test set (mAP@N and NDCG@N in both
  directions).
  """
  setup = build(config)  # Validates first.
  group = setup.group
  names = [c["name"] for c in config.clients]
  methods = tuple(config.methods)
  ns = tuple(int(n) for n in config.ns)
  # The clients, padded to a multiple of the mesh's devices (padding clients carry
  # client_mask False: no samples, no aggregation weight, sliced off every output).
  mesh = core.job_mesh(validation.check_devices(config))
  num_clients = core.padded_size(len(names), mesh)
  train, val, test = (d.pad(num_clients).place(mesh) for d in (setup.train, setup.val, setup.test))
  faults = validation.check_faults(config)
  algs = {
    m: alg_lib.fedscmr(group, method_config(config, m, setup.num_classes), faults=faults)
    for m in methods
  }
  init_key = jax.random.fold_in(jax.random.key(config.seed), 10_000)
  chance = _chance(setup, ns, config.seed)

  def step(m):
    def fn(s, train, val):
      s, stats = algs[m].round(s, train, val)
      return s, stats | {"finite": core.finite_per_client(s.groups[0].params)}

    # Traced with the mesh in context: a compiled loop over clients runs per device. The
    # data are arguments, not constants: a jitted function may not close over an array
    # split over several processes (job_mesh).
    jitted = core.jit_round(fn)
    return lambda s: jitted(s, train, val)

  shared_mask = jnp.ones(setup.shared_test["label"].shape, bool)
  evaluate_own = jax.jit(lambda s, test: alg_lib.evaluate_group(group, s.groups[0], test, ns=ns))
  # The shared test set an argument, as the clients' own: closed over, it would be a
  # constant of the compiled program.
  evaluate_shared = jax.jit(
    lambda s, test, mask: alg_lib.evaluate_shared(group, s.groups[0], test, mask, ns=ns)
  )

  def per_client(values) -> dict[str, dict[str, float]]:
    values = {k: np.asarray(v) for k, v in values.items()}
    return {name: {k: float(v[i]) for k, v in values.items()} for i, name in enumerate(names)}

  def evaluate(s) -> dict[str, dict[str, dict[str, float]]]:
    """``{"own" | "global": {client name: its metrics}}``."""
    own, shared = processes.gather(
      (evaluate_own(s, test), evaluate_shared(s, setup.shared_test, shared_mask))
    )
    return {"own": per_client(own), "global": per_client(shared)}

  def scalars(r, outs, evals):
    rows = []
    for m in methods:
      values = {}
      weights = np.asarray(outs[m]["weight"])
      for i, name in enumerate(names):
        values |= {f"{name}/{k}": v for k, v in evals[m]["own"][name].items()}
        values |= {f"{name}/global/{k}": v for k, v in evals[m]["global"][name].items()}
        values[f"{name}/train_loss"] = float(outs[m]["loss"][i])
        values[f"{name}/val_map"] = float(outs[m]["map"][i])
        values[f"{name}/weight"] = float(weights[i])
      values |= loop.fault_scalars(outs[m])
      rows.append((m, values))
    return rows

  def postfix(evals):
    if "fedscmr" not in evals:
      return {}
    return {f"FedSCMR shared mAP@{ns[-1]}": f"{_headline(evals['fedscmr']['global'], ns[-1]):.3f}"}

  return loop.Experiment(
    init=lambda: {
      m: jax.tree.map(jnp.copy, alg.init(setup.state.pad(num_clients), init_key)).place(mesh)
      for m, alg in algs.items()
    },
    methods={m: step(m) for m in methods},
    evaluate=evaluate,
    nonfinite=lambda out: [
      f"client {names[i]}" for i in np.flatnonzero(~np.asarray(out["finite"])[: len(names)])
    ],
    scalars=scalars,
    runs=methods,
    report=lambda outcome: _report(config, names, setup.classes, ns, chance, outcome),
    postfix=postfix,
  )


# ---------------------------------------------------------------------------
# Tables


def _cell(values: Sequence[float], *, signed: bool = False) -> str:
  fmt = "+.4f" if signed else ".4f"
  if len(values) == 1:
    return f"{values[0]:{fmt}}"
  return f"{np.mean(values):{fmt}} ± {np.std(values, ddof=1):.4f}"


def _value(result, key, method, client, metric, direction, n) -> float:
  cm = result[key][method][client]
  if direction == "average":
    return 0.5 * (cm[f"{metric}@{n}/img2txt"] + cm[f"{metric}@{n}/txt2img"])
  return cm[f"{metric}@{n}/{direction}"]


def _protocols(results: Sequence[Mapping[str, Any]]) -> list[str]:
  """The protocols every run holds, shared test first (runs older than it have only own)."""
  return [p for p, (key, _) in PROTOCOLS.items() if all(key in r for r in results)]


def tables(results: Sequence[Mapping[str, Any]], *, protocol: str = "own") -> dict[str, str]:
  """The paper's Tables 1-2 (systems) and 3-4 (ablations) from one or more runs.

  Rows: metric (mAP, NDCG) x task (Img2Txt, Txt2Img, Average) x system;
  columns: ``N`` x client. A cell is one run's value, or ``mean ± std`` (sample
  standard deviation) over several runs (seeds); ``Average`` is the mean of
  the two directions within each run. Systems missing from the runs are left
  out.

  Args:
    results: ``results.json`` contents of runs with the same clients and ``ns``.
    protocol: ``"own"`` (each client's own-class test pairs) or ``"global"``
      (the shared test set over every class); see :data:`PROTOCOLS`.

  Returns:
    ``{"main": table, "ablation": table}`` (markdown; an entry is absent when
    none of its systems ran).
  """
  key = PROTOCOLS[protocol][0]
  first = results[0]
  names, ns = first["clients"], first["ns"]
  headers = ["Metric", "Task", "Method"] + [f"N={n} {c}" for n in ns for c in names]
  out = {}
  for table, rows_of in (("main", MAIN_TABLE), ("ablation", ABLATION_TABLE)):
    present = [m for m in rows_of if all(m in r[key] for r in results)]
    if present in ([], ["fedscmr"]):
      continue
    rows = []
    for metric in ("mAP", "NDCG"):
      for direction, title in DIRECTIONS + (("average", "Average"),):
        for m in present:
          row = [metric, title, METHODS[m]]
          for n in ns:
            for c in names:
              row.append(_cell([_value(r, key, m, c, metric, direction, n) for r in results]))
          rows.append(row)
    out[table] = report_lib.format_table(headers, rows)
  return out


def _mean_over_cells(result, method, metric, key: str = "methods") -> float:
  return float(
    np.mean(
      [
        result[key][method][c][f"{metric}@{n}/{d}"]
        for c in result["clients"]
        for n in result["ns"]
        for d, _ in DIRECTIONS
      ]
    )
  )


def ranking(
  results: Sequence[Mapping[str, Any]], *, protocol: str = "own", baseline: str = "dscmr"
) -> str:
  """One row per system: mAP and NDCG averaged over clients, ``N`` and directions.

  ``mean ± std`` over runs; systems sorted by mean average mAP, best first. The
  last column is the **paired** difference in mean mAP to ``baseline`` (each
  run minus the baseline of the same run, then mean ± std), which removes the
  run-to-run variation the systems share (same data, same initial models).
  When the runs hold it, a last row gives the chance level: a random ranking
  of the same test pairs (:func:`chance_level`).
  """
  key = PROTOCOLS[protocol][0]
  rows = []
  for m in METHODS:
    if not all(m in r[key] for r in results):
      continue
    maps = [_mean_over_cells(r, m, "mAP", key) for r in results]
    ndcgs = [_mean_over_cells(r, m, "NDCG", key) for r in results]
    row = [METHODS[m], _cell(maps), _cell(ndcgs)]
    if all(baseline in r[key] for r in results):
      diffs = [
        x - _mean_over_cells(r, baseline, "mAP", key) for x, r in zip(maps, results, strict=True)
      ]
      row.append(_cell(diffs, signed=True))
    rows.append((np.mean(maps), row))
  rows.sort(key=lambda x: -x[0])
  rows = [row for _, row in rows]
  headers = ["Method", "mean mAP@N", "mean NDCG@N"]
  if rows and len(rows[0]) == 4:
    headers.append(f"mAP - {METHODS[baseline]} (paired)")
  chance_key = {"own": "own_test", "global": "global_test"}[protocol]
  if rows and all(chance_key in r.get("chance", {}) for r in results):
    chance = [r["chance"][chance_key] for r in results]
    row = ["random ranking (chance)", _cell([c["mAP"] for c in chance])]
    row.append(_cell([c["NDCG"] for c in chance]))
    rows.append(row + [""] * (len(headers) - len(row)))
  return report_lib.format_table(headers, rows)


def weights_table(results: Sequence[Mapping[str, Any]], *, last: int | None = None) -> str:
  """Mean aggregation weight ``lambda^k`` of each client over the last rounds, per system.

  ``last`` rounds (default: the second half of the run) are averaged within
  each run, then ``mean ± std`` over runs. A flat row (every client near
  ``1 / K``) means the rule did not tell the clients apart; the data shares
  ``n^k / sum_j n^j`` (FedAvg's weights) are the reference. Empty string when
  no run recorded weights.
  """
  if not all("weights" in r for r in results):
    return ""
  names = results[0]["clients"]
  rows = []
  for m in METHODS:
    if not all(m in r["weights"] for r in results):
      continue
    row = [METHODS[m]]
    for c in names:
      values = []
      for r in results:
        series = r["weights"][m][c]
        k = last or max(1, len(series) // 2)
        values.append(float(np.mean(series[-k:])))
      row.append(_cell(values))
    rows.append(row)
  if not rows:
    return ""
  return report_lib.format_table(["Method"] + [f"lambda {c}" for c in names], rows)


def _history(outcome: loop.Outcome, names, prefix: str, key: str) -> dict[str, dict[str, list]]:
  """method -> client -> ``[(round, value)]`` of ``{client}/{prefix}{key}``."""
  out = {m: {name: [] for name in names} for m in outcome.final}
  for record in sorted(outcome.history, key=lambda r: r["round"]):
    for name in names:
      value = record.get(f"{name}/{prefix}{key}")
      if value is not None and record["run"] in out:
        out[record["run"]][name].append((record["round"], float(value)))
  return out


def _mean_map_history(outcome, names, n, prefix):
  """method -> client -> ``[(round, mean of both directions' mAP@n)]``."""
  per_dir = [_history(outcome, names, prefix, f"mAP@{n}/{d}") for d, _ in DIRECTIONS]
  return {
    m: {
      name: [
        (r, 0.5 * (a + b)) for (r, a), (_, b) in zip(*(h[m][name] for h in per_dir), strict=True)
      ]
      for name in names
    }
    for m in outcome.final
  }


def _summary(result, key: str) -> dict[str, dict[str, float]]:
  """method -> ``{"mAP", "NDCG"}`` means over clients, ``N`` and directions."""
  return {
    m: {metric: _mean_over_cells(result, m, metric, key) for metric in ("mAP", "NDCG")}
    for m in result[key]
  }


def _report(config, names, classes, ns, chance, outcome: loop.Outcome) -> loop.Report:
  """Rankings and the paper's Tables 1-4 under both protocols, curves, ``results.json``.

  The per-round aggregation weights and validation mAPs come from the run's
  ``metrics.jsonl`` lines, so a run resumed after its last round reports them too.
  """
  n = ns[-1]
  aggregating = [m for m in outcome.final if method_config(config, m, 2).aggregation != "none"]
  weight_history = _history(outcome, names, "", "weight")
  val_history = _history(outcome, names, "", "val_map")
  result = {
    "clients": names,
    "classes": {name: [int(c) for c in cs] for name, cs in zip(names, classes, strict=True)},
    "methods": {m: e["own"] for m, e in outcome.final.items()},
    "methods_global": {m: e["global"] for m, e in outcome.final.items()},
    "ns": list(ns),
  }
  result |= {
    "global_test": _summary(result, "methods_global"),
    "own_test": _summary(result, "methods"),
    "chance": chance,
    "weights": {m: {c: [w for _, w in weight_history[m][c]] for c in names} for m in aggregating},
    "last_weights": {m: [weight_history[m][c][-1][1] for c in names] for m in aggregating},
    "val_map": {m: {c: [v for _, v in val_history[m][c]] for c in names} for m in outcome.final},
    "sizes": {
      "train": [int(c["train_size"]) for c in config.clients],
      "val": int(config.val_size),
      "test": int(config.test_size),
      "global_test": int(config.global_test_size),
    },
    "rounds": config.rounds,
    "seed": config.seed,
    "wall_time_s": outcome.wall_time_s,
  }
  counts = ", ".join(f"{name}: {len(result['classes'][name])}" for name in names)
  summary = (
    f"{len(names)} clients (classes {counts}; train sizes "
    f"{', '.join(str(c['train_size']) for c in config.clients)}; {config.val_size} validation "
    f"and {config.test_size} own-class test pairs each; a shared test set of "
    f"{config.global_test_size} pairs over every class) after {config.rounds} rounds of "
    f"E={config.local_epochs} local epochs; seed {config.seed}; wall time "
    f"{outcome.wall_time_s:.0f} s"
    + (f" (resumed at round {outcome.resumed_at})" if outcome.resumed_at else "")
  )
  sections = [("Setup", summary)]
  for protocol, (_, title) in PROTOCOLS.items():
    sections.append(
      (
        f"Ranking on the {title} (mean over clients, N and directions)",
        ranking([result], protocol=protocol),
      )
    )
  weights = weights_table([result])
  if weights:
    sections.append(
      ("Aggregation weights lambda (mean over the second half of the rounds)", weights)
    )
  for protocol, (_, title) in PROTOCOLS.items():
    t = tables([result], protocol=protocol)
    if "main" in t:
      sections.append(
        (
          f"Systems on the {title} (the paper's Tables 1-2, with FedAvg / FedProx (common))",
          t["main"],
        )
      )
    if "ablation" in t:
      sections.append((f"Ablations on the {title} (as the paper's Tables 3-4)", t["ablation"]))
  plots = {}
  for file, prefix, title in (
    ("global.png", "global/", "shared test set, all classes"),
    ("metrics.png", "", "own-class test"),
  ):
    history = _mean_map_history(outcome, names, n, prefix)
    series = {f"client {c}": {METHODS[m]: history[m][c] for m in history} for c in names}
    plots[file] = loop.Curves(
      series, f"Test mAP@{n} per round ({title}; mean of img2txt and txt2img)", f"mAP@{n}"
    )
  figures = ["![mAP on the shared test set](global.png)", "![mAP per own-class test](metrics.png)"]
  if aggregating:
    series = {METHODS[m]: {f"client {c}": weight_history[m][c] for c in names} for m in aggregating}
    plots["lambda.png"] = loop.Curves(series, "Aggregation weight lambda^k per round", "lambda")
    figures.append("![aggregation weights](lambda.png)")
  return loop.Report(
    title="FedSCMR and its baselines",
    sections=[*sections, ("Curves", "\n\n".join(figures))],
    plots=plots,
    results=result,
    text="\n\n".join(f"{h}\n\n{b}" for h, b in sections),
  )


def summarize(workdirs: Sequence[str | pathlib.Path]) -> str:
  """Mean ± std over the ``results.json`` of several runs (seeds): rankings and tables.

  Rankings under both protocols (with the chance level), the mean aggregation
  weights, then Tables 1-4 under both protocols. The runs must share every config
  key but the seed (:func:`fedjax_mm.runner.report.load_seed_runs`).
  """
  results, _ = report_lib.load_seed_runs(workdirs)
  seeds = ", ".join(str(r.get("seed")) for r in results)
  parts = [f"{len(results)} runs (seeds {seeds}); cells are mean ± std over runs."]
  protocols = _protocols(results)
  for protocol in protocols:
    parts += [f"Ranking on the {PROTOCOLS[protocol][1]}:", ranking(results, protocol=protocol)]
  weights = weights_table(results)
  if weights:
    parts += ["Aggregation weights lambda (mean over the second half of the rounds):", weights]
  for protocol in protocols:
    t = tables(results, protocol=protocol)
    for k in ("main", "ablation"):
      if k in t:
        parts += [f"Tables ({k}) on the {PROTOCOLS[protocol][1]}:", t[k]]
  return "\n\n".join(parts)


#: FedSCMR as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="fedscmr",
  methods=tuple(METHODS),
  validate=validate,
  experiment=experiment,
  summarize=summarize,
)
run = SYSTEM.run
