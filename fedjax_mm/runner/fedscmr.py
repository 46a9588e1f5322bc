"""The FedSCMR experiment: features, clients, the ten systems, each round's metrics.

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
both protocols, the chance level of each (a random ranking), plots of the test
mAP and of the aggregation weights ``lambda^k_t`` per round, and
``results.json`` (:mod:`fedjax_mm.runner.fedscmr_report`, whose
:func:`~fedjax_mm.runner.fedscmr_report.summarize` gives them over seeds).

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
from collections.abc import Sequence
from typing import NamedTuple

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
from fedjax_mm.runner import fedscmr_report, loop, validation
from fedjax_mm.runner.errors import ConfigError
from fedjax_mm.runner.fedscmr_report import METHODS, _headline

#: Text feature extractors: ``"bow"`` (numpy, a fixed random projection of word counts) or a
#: frozen, randomly initialised text encoder of :mod:`fedjax_mm.models`.
TEXT_ENCODERS = ("bow",) + tuple(
  name for name, (modality, _) in models.ENCODERS.items() if modality == "text"
)


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
  validation.check_common(config, validation.FEDSCMR, config.methods, METHODS)
  validation.check_devices(config)
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
    num_classes = data.NUM_SHAPES
    for c in clients:
      if not 1 <= c["classes"] <= num_classes:
        raise ConfigError(
          f"client {c['name']}: classes must be in [1, {num_classes}], got {c['classes']}."
        )
  if not config.ns:
    raise ConfigError(f"ns must be a non-empty list of positive N, got {tuple(config.ns)}.")
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
  World-CLIP checkpoints (:mod:`fedjax_mm.zoo.pretrain`), pretrained on the
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

  aggregates = [m for m in methods if method_config(config, m, 2).aggregation != "none"]
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
    report=lambda outcome: fedscmr_report.report(
      config, names, setup.classes, ns, chance, outcome, aggregates
    ),
    postfix=postfix,
  )


#: FedSCMR as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="fedscmr",
  methods=tuple(METHODS),
  validate=validate,
  experiment=experiment,
  tables=fedscmr_report.tables,
)
run = SYSTEM.run
