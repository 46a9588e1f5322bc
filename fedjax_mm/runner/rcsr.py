r"""RCSR, RCSR-p and FedAvg / FedProx side by side on the embedded world (issue 20).

  python -m experiments.main --config=experiments/rcsr.py

Data (Sec. 5.1, scaled): the world's image-caption pairs; pseudo-labels by K-Means
(``kmeans_k`` clusters, scikit-learn, ``n_init = 10``) on the *frozen* text encoder's
pooled caption embeddings (caption 0); each client draws cluster proportions from
Dirichlet(``alpha``) (:func:`fedjax_mm.data.partition.dirichlet_partition` with fixed
client sizes). ``missing_rate`` of the clients (``round(MR N)``, seeded) are
single-modality, image-only or text-only with probability 1/2 each; their missing
arrays are zeroed. Each client's samples split into train and a held-out part; the
held-out part keeps both modalities for every client (an evaluation oracle: retrieval
needs pairs, Sec. 5.1 "per-client R@1") so per-client scores are the global (RCSR-p:
personalised) model on the client's own held-out pairs. A shared test set of pairs
from the same world gives the global Recall@K. FedMEKT's proxy (public) set is the
next ``public_size`` pairs held by no client, after the shared test set (caption 0),
also CreamFL's public set; MFCPL's classes are the K-Means pseudo-labels above (``train["label"]``).

Metrics: R@1/5/10 image->text and text->image, Rbar@K = (I2T + T2I) / 2; fairness: std
of per-client Rbar@1, worst client Rbar@1, best - worst gap; chance level R@K = K / n.

Client faults (``config.faults``, :mod:`fedjax_mm.core.faults`, off by default) are
simulated in every method's round as :mod:`fedjax_mm.algorithms.rcsr` describes; each
round logs their counts per method (``faults/dropped``, ``faults/stragglers``,
``faults/byzantine``), and the ledger charges a dropped client the round's download but
no upload.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fedjax_mm import core
from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.core import processes
from fedjax_mm.core.sharding import replicated, traced_in
from fedjax_mm.data import partition, world
from fedjax_mm.models import image as image_models
from fedjax_mm.models import pretrained
from fedjax_mm.models import text as text_models
from fedjax_mm.runner import loop, validation
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.errors import ConfigError

KS = (1, 5, 10)


#: The image encoders ``config.image_encoder`` may name: the zoo's ViTs, whose blocks
#: take the adapters (the CNNs have no token blocks).
IMAGE_ENCODERS = ("vit_t", "vit_s", "vit_b", "vitc_t", "vitc_s", "vitc_b")
#: The text encoder every RCSR row shares (frozen, like the image one; adapters and
#: heads train) and, with ``pretrained``, its World-CLIP checkpoint.
TEXT_ENCODER = "transformer_t"


def validate(config) -> None:
  """One-line :class:`ConfigError` naming the key; before any work.

  Ranges of every number are :data:`fedjax_mm.runner.validation.RCSR`; the checks
  here are names and relations between fields.
  """
  validation.check_common(config, validation.RCSR, config.methods, alg.METHODS)
  n = int(config.num_clients)
  per_round = int(float(config.participation) * n)
  if per_round < 1:
    raise ConfigError(
      f"participation * num_clients must be >= 1 (one client per round), got "
      f"{config.participation} * {config.num_clients}."
    )
  size, named = validation.mesh_size(config)
  if per_round % size:
    raise ConfigError(
      f"{named} must divide the {per_round} clients a round trains "
      f"(floor(participation * num_clients)): each device trains an equal share."
    )
  # The pool holds 2 N (train + test) pairs per client; half of it is held by no client.
  spare = n * (int(config.train_per_client) + int(config.test_per_client))
  if int(config.global_test) + int(config.public_size) > spare:
    raise ConfigError(
      f"global_test + public_size must be <= {spare} (the pairs no client holds), got "
      f"{config.global_test} + {config.public_size}."
    )
  if int(config.kmeans_k) > 2 * spare:
    raise ConfigError(
      f"kmeans_k ({config.kmeans_k}) must be at most the {2 * spare} captions it clusters "
      f"(2 num_clients (train_per_client + test_per_client))."
    )
  r = config.rcsr
  if int(r.router_width) % int(r.router_heads):
    raise ConfigError(
      f"rcsr.router_width ({r.router_width}) must be a multiple of rcsr.router_heads "
      f"({r.router_heads}): each head reads width / heads of it."
    )
  name = str(config.image_encoder)
  if name not in IMAGE_ENCODERS:
    raise ConfigError(
      f"image_encoder must be one of {', '.join(IMAGE_ENCODERS)} (a ViT: the adapters "
      f"follow its blocks), got {name!r}."
    )
  if config.image_size % 4:
    raise ConfigError(
      f"image_size must be a multiple of {name}'s patch (4), got {config.image_size}."
    )
  if config.pretrained:
    for encoder, key, field in (
      (name, "image_size", "image_size"),
      (TEXT_ENCODER, "max_len", "max_caption_len"),
    ):
      validation.check_pretrained(
        f"world-clip/{encoder}", key, config[field], field=field, instead="pretrained=False"
      )


def _encoders(config):
  rngs = nnx.Rngs(config.seed)
  name = str(config.image_encoder)
  img = getattr(image_models, name)(image_size=config.image_size, rngs=rngs)
  txt = text_models.transformer_t(
    vocab_size=len(world.VOCAB), max_len=config.max_caption_len, rngs=rngs
  )
  if config.pretrained:
    pretrained.load_into(
      img,
      f"world-clip/{name}",
      expect={"encoder": name, "image_size": config.image_size},
    )
    pretrained.load_into(
      txt,
      f"world-clip/{TEXT_ENCODER}",
      expect={"encoder": TEXT_ENCODER, "max_len": config.max_caption_len},
    )
  return img, txt


def build(config):
  """Data, modality masks, model parts and the static spec."""
  validate(config)
  n = int(config.num_clients)
  per_round = int(float(config.participation) * n)
  wcfg = world.WorldConfig(
    image_size=config.image_size, captions_per_image=2, max_caption_len=config.max_caption_len
  )
  per_client = config.train_per_client + config.test_per_client
  pool = world.generate(config.seed, n * per_client * 2, config=wcfg)
  img_enc, txt_enc = _encoders(config)
  # Pseudo-labels: K-Means on the frozen text encoder's caption embeddings (Sec. 5.1, which
  # clusters the training captions; here the whole pool: the clients' pairs and the shared
  # test and proxy pairs, drawn from the same world).
  txt_def, txt_state = nnx.split(txt_enc)  # The weights an argument, not a constant.
  encode = jax.jit(lambda state, x: nnx.merge(txt_def, state)(x)[0])
  text_feats = np.asarray(encode(txt_state, jnp.asarray(pool["caption"][:, 0])), np.float64)
  from sklearn.cluster import KMeans  # noqa: PLC0415 (only here)

  labels = KMeans(config.kmeans_k, n_init=10, random_state=config.seed).fit_predict(text_feats)
  parts = partition.dirichlet_partition(
    labels, n, alpha=config.alpha, seed=config.seed, samples_per_client=per_client
  )
  rng = np.random.default_rng(config.seed + 1)
  single = np.zeros(n, bool)
  single[rng.permutation(n)[: int(round(config.missing_rate * n))]] = True
  image_only = rng.random(n) < 0.5
  modality = np.stack([~single | image_only, ~single | ~image_only], axis=1)
  idx = np.stack([np.asarray(p)[rng.permutation(len(p))] for p in parts])
  tr, te = idx[:, : config.train_per_client], idx[:, config.train_per_client :]
  train = {
    "image": pool["image"][tr],
    "caption": pool["caption"][tr],
    "label": labels[tr].astype(np.int32),  # MFCPL's classes (the pseudo-labels)
  }
  train["image"] = train["image"] * modality[:, 0, None, None, None, None]
  train["caption"] = train["caption"] * modality[:, 1, None, None, None]
  test = {"image": pool["image"][te], "caption": pool["caption"][te, 0]}
  used = np.zeros(len(labels), bool)
  used[idx.ravel()] = True
  spare = np.flatnonzero(~used)
  gt = spare[: config.global_test]
  global_test = {"image": pool["image"][gt], "caption": pool["caption"][gt, 0]}
  # FedMEKT's proxy set: the next unused pairs (disjoint from every client and the test).
  pub = spare[config.global_test : config.global_test + config.public_size]
  public = {"image": pool["image"][pub], "caption": pool["caption"][pub, 0]}
  graphdef, glob, personal, frozen = alg.build_model(
    img_enc,
    txt_enc,
    adapter_dim=config.adapter_dim,
    head_hidden=config.head_hidden,
    dim=config.dim,
    personal_hidden=config.personal_hidden,
    key=jax.random.key(config.seed + 2),
  )
  r = config.rcsr
  spec = alg.RcsrDef(
    graphdef=graphdef,
    num_clients=n,
    per_round=per_round,
    rounds=int(config.rounds),
    dim=config.dim,
    batch_size=config.batch_size,
    local_epochs=config.local_epochs,
    lr=config.learning_rate,
    lr_warmup=config.lr_warmup,
    router_width=r.router_width,
    router_layers=r.router_layers,
    router_heads=r.router_heads,
    warmup_rounds=r.warmup_rounds,
    lambda_p=r.lambda_p,
    personal_start=r.personal_start,
    personal_lr_ratio=r.personal_lr_ratio,
    client_map=config.client_map,
    num_classes=int(config.kmeans_k),
    mekt_temperature=r.mekt_temperature,
    cream_decay=r.creamfl_ema,
  )
  return {
    "spec": spec,
    "glob": glob,
    "personal": personal,
    "frozen": frozen,
    "train": jax.tree.map(jnp.asarray, train),
    "mask": jnp.ones(tr.shape, bool),
    "modality": jnp.asarray(modality),
    "test": jax.tree.map(jnp.asarray, test),
    "global_test": jax.tree.map(jnp.asarray, global_test),
    "public": jax.tree.map(jnp.asarray, public),
  }


def experiment(config) -> loop.Experiment:
  setup = build(config)
  spec, frozen = setup["spec"], setup["frozen"]
  methods = tuple(config.methods)
  n = spec.num_clients
  meths = {
    m: alg.method(
      m,
      lambda_a=config.rcsr.lambda_align,
      lambda_s=config.rcsr.lambda_s,
      mu=0.1,
      mfcpl_mu=config.rcsr.mfcpl_weight,
      mekt_mu=config.rcsr.mekt_weight,
      cream_mu=config.rcsr.creamfl_weight,
    )
    for m in methods
  }
  faults = validation.check_faults(config)  # static: the round closes over it
  algs = {m: alg.algorithm(spec, m, meths[m], faults=faults) for m in methods}
  # Every method's initial state is the same but for its switches (state.method, set per
  # run below): one init for all of them.
  init = jax.jit(algs[methods[0]].init)
  state0 = init(
    setup["glob"],
    setup["personal"],
    frozen,
    setup["train"],
    setup["mask"],
    setup["modality"],
    jax.random.key(config.seed + 3),
    public=setup["public"],
  )
  # The round is traced with the job's mesh in context (traced_in), so core.map_clients
  # runs one loop over clients per device of it. config.devices > 1: the state replicated
  # over that many devices, each trains its share of the round's sampled clients; the rest
  # of the round is replicated.
  mesh = core.job_mesh(validation.check_devices(config))
  devices = mesh.size  # Every process's devices, in a job of several.
  # The round and the evaluation take the data and the frozen encoders as arguments: closed
  # over, each would be a constant of the compiled program (a copy for XLA to fold at compile
  # time, and in every entry of the compilation cache).
  names = ("train", "mask", "modality", "public", "test", "global_test", "frozen")
  data = {k: setup[k] for k in names}
  if devices > 1:
    state0 = core.replicate(state0, mesh)
    data = core.replicate(data, mesh)

  def round_and_check(round_fn, s, d):
    s, out = round_fn(s, d)
    finite = core.all_finite(s.params)
    return s, out | {"finite": finite}

  # One compiled round for every method (the method is a traced argument, state.method;
  # equal rounds, alg.RcsrRound, share a compile); MOON, which also runs its clients'
  # previous local models, FedPer, whose clients start from their own, MFCPL (class
  # prototypes), FedMEKT (the proxy set) and CreamFL (the public set's representations)
  # have their own.
  round_jit = jax.jit(
    traced_in(mesh, round_and_check),  # on one device too: "auto" is that device's loop
    donate_argnums=1,
    static_argnums=0,
    # On several devices the state stays replicated from round to round.
    **({} if devices == 1 else {"out_shardings": (replicated(mesh), None)}),
  )

  def step(m):
    return lambda s: round_jit(algs[m].round, s, data)

  evaluate_jit = jax.jit(functools.partial(alg.evaluate, spec, ks=KS))

  def evaluate(s) -> dict[str, Any]:
    # Run on the state's mesh, read whole here (gathered, in a job of several processes).
    own, glob = processes.gather(evaluate_jit(s, data["test"], data["global_test"], data["frozen"]))
    own = {k: np.asarray(v).tolist() for k, v in own.items()}
    r1 = np.asarray(own["R@1"])
    return {
      "global": {k: float(v) for k, v in glob.items()},
      "own": own,
      "fairness": {
        "mean_R@1": float(r1.mean()),
        "std_R@1": float(r1.std()),
        "worst_R@1": float(r1.min()),
        "gap_R@1": float(r1.max() - r1.min()),
      },
      "q": np.asarray(s.fair.q).tolist(),
      "personal_shift": float(np.mean(own["personal_shift"])),
    }

  def scalars(r, outs, evals):
    rows = []
    for m in methods:
      values = {
        "mean_train_loss": float(np.nanmean(np.asarray(outs[m]["loss"]))),
        "router_loss": float(outs[m]["router_loss"]),
      }
      values |= loop.fault_scalars(outs[m])
      if m in evals:
        values |= {f"global/{k}": v for k, v in evals[m]["global"].items()}
        values |= {f"fair/{k}": v for k, v in evals[m]["fairness"].items()}
      rows.append((m, values))
    return rows

  # (up, down) per method and number of held modalities (MFCPL, FedMEKT, CreamFL send per
  # held modality).
  sent = {
    m: {
      h: alg.traffic_bytes(
        m,
        setup["glob"],
        spec.dim,
        held=h,
        num_classes=spec.num_classes,
        public_size=int(config.public_size),
      )
      for h in (1, 2)
    }
    for m in methods
  }
  held = np.asarray(setup["modality"]).sum(1)

  def traffic(m, out):
    sampled = np.asarray(out["sampled"])
    uploaded = sampled
    if "dropped" in out:  # A dropped client received the round's model but sent nothing.
      uploaded = sampled & ~np.asarray(out["dropped"])
    up = np.where(held == 2, sent[m][2][0], sent[m][1][0])
    return np.where(uploaded, up, 0), np.where(sampled, sent[m][2][1], 0)

  chance = {f"R@{k}": 100 * min(1.0, k / config.test_per_client) for k in KS}
  chance_global = {f"R@{k}": 100 * min(1.0, k / config.global_test) for k in KS}

  def report(outcome: loop.Outcome) -> loop.Report:
    text = (
      f"RCSR on the world: N={n}, C={config.participation}, MR={config.missing_rate}, "
      f"alpha={config.alpha}, {config.rounds} rounds, seed {config.seed}"
      + (f" (resumed at round {outcome.resumed_at})" if outcome.resumed_at else "")
    )
    results = {
      "methods": {m: outcome.final[m] for m in methods},
      "chance": {"own": chance, "global": chance_global},
      "modality": np.asarray(setup["modality"]).tolist(),
      # A paired client's up / down; "up_single": a single-modality client's up.
      "bytes_per_client_round": {
        m: {"up": by[2][0], "down": by[2][1], "up_single": by[1][0]} for m, by in sent.items()
      },
    }
    # Chance by the table's keys: K / global_test on the shared test, K / test_per_client own.
    by_key = {f"{d}R@{k}": chance_global[f"R@{k}"] for k in KS for d in ("i2t_", "t2i_", "")}
    baselines = {"chance": {"global": by_key, "fairness": {"mean_R@1": chance["R@1"]}}}
    return loop.Report(
      title="RCSR",
      sections=[],
      plots={},
      results=results,
      text=text,
      final=results["methods"],
      baselines=baselines,
    )

  def init():
    states = {m: state0.replace(method=meths[m]) for m in methods}
    if devices > 1:  # the switches too: the round returns every leaf replicated, so a state
      states = core.replicate(states, mesh)  # placed otherwise would compile it again
    return jax.tree.map(jnp.copy, states)

  return loop.Experiment(
    init=init,
    methods={m: step(m) for m in methods},
    evaluate=evaluate,
    nonfinite=lambda out: [] if bool(out["finite"]) else ["the global model"],
    scalars=scalars,
    runs=methods,
    report=report,
    traffic=traffic,
    eval_every=int(config.eval_every),
  )


#: The report's table: global Recall@K (chance K / global_test), the clients' own
#: Rbar@1 and its spread (chance K / test_per_client), the personal adapters' shift; over
#: seeds RCSR minus every other method, paired by seed.
TABLE = report_lib.Table(
  "Results",
  [
    *(report_lib.Column(f"I2T R@{k}", f"global.i2t_R@{k}") for k in KS),
    *(report_lib.Column(f"T2I R@{k}", f"global.t2i_R@{k}") for k in KS),
    *(report_lib.Column(f"Rbar@{k}", f"global.R@{k}") for k in KS),
    report_lib.Column("own Rbar@1 mean", "fairness.mean_R@1"),
    report_lib.Column("std", "fairness.std_R@1", higher=False),
    report_lib.Column("worst", "fairness.worst_R@1"),
    report_lib.Column("gap", "fairness.gap_R@1", higher=False),
    report_lib.Column("personal shift", "personal_shift", digits=4),
  ],
  headline="global.R@1",
  reference="rcsr",
)


#: RCSR as the loop runs it (:class:`fedjax_mm.runner.loop.System`).
SYSTEM = loop.System(
  name="rcsr",
  methods=alg.METHODS,
  validate=validate,
  experiment=experiment,
  tables=lambda config: [TABLE],
)
run = SYSTEM.run

__all__ = ["SYSTEM", "TABLE", "build", "experiment", "run", "validate"]
