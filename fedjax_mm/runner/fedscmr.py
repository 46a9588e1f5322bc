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

Features: :func:`fedjax_mm.core.features.pretrained_features` (frozen World-CLIP
encoders, the default) or :func:`fedjax_mm.core.features.world_features` (the stand-in).
"""

from __future__ import annotations

import pathlib
import zipfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_mm import core, data, metrics, models
from fedjax_mm.algorithms import fedscmr as alg_lib
from fedjax_mm.core import features as features_lib
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
    if f.text_encoder not in features_lib.TEXT_FEATURES:
      raise ConfigError(
        f"features.text_encoder: unknown {f.text_encoder!r}; known: {', '.join(features_lib.TEXT_FEATURES)}."
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
    pool = features_lib.pretrained_features(
      config.seed * 1000 + 31, num, image_encoder=f.image_encoder, text_encoder=f.text_encoder
    )
  else:
    pool = features_lib.world_features(
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
  group, state = core.client.init_identical_group(
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


# ---------------------------------------------------------------------------
# The experiment


def _floats(values: dict[str, jax.Array]) -> dict[str, float]:
  return {k: float(v) for k, v in values.items()}


def _chance(setup: Setup, ns, seed: int) -> dict[str, dict[str, float]]:
  """Chance levels of both protocols (own-class: the mean over clients)."""
  key = jax.random.fold_in(jax.random.key(seed), 20_000)
  labels = setup.shared_test["label"]
  shared = _floats(
    metrics.retrieval.random_ranking(labels, jnp.ones(labels.shape, bool), ns=ns, key=key)
  )
  own = [
    _floats(
      metrics.retrieval.random_ranking(
        setup.test.arrays["label"][k], setup.test.sample_mask[k], ns=ns, key=key
      )
    )
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
