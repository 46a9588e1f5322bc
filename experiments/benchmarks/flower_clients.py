"""The workload of :mod:`experiments.benchmarks.vs_flower`, importable by Ray's workers.

Flower's simulation pickles its ClientApp to Ray worker processes, which import
what it refers to by module name; the benchmark script itself runs as
``__main__`` and defines absl flags, so the clients, the model in both
frameworks and the data live here. torch and flwr are imported only inside the
functions that need them (the ``peers`` extra).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from fedjax_mm import core, data, models

TASK = core.Task("classification", "image", "label10", 10)
LEARNING_RATE = 1e-3
_MODEL = {"encoder": "cnn_s", "head": "linear", "num_outputs": 10, "rep_dim": 64}


def client_arrays(k: int, n: int) -> dict[str, np.ndarray]:
  """Client ``k``'s samples: images ``[n, 32, 32, 3]`` and ``label10 [n]``."""
  world = data.generate(k, n)
  return {"image": np.asarray(world["image"]), "label10": np.asarray(world["label10"])}


# --- JAX (the engine and the Flower client share the same update) ---------------


def make_group(num_clients: int, batch: int):
  """The engine's group of ``num_clients`` clients of ``cnn_s`` (Adam, same initial model)."""
  return core.init_group(
    lambda rngs: models.build(_MODEL, rngs=rngs),
    name="cnn_s",
    tx=optax.adam(LEARNING_RATE),
    task=TASK,
    key=jax.random.key(0),
    num_clients=num_clients,
    batch_size=batch,
    same_init=True,
  )


@functools.cache
def _jax_client(steps: int, batch: int):
  """(treedef, initial params, jitted update) of one client, built once per process."""
  group, state = make_group(1, batch)
  params = jax.tree.map(lambda x: x[0], state.params)
  objective = core.supervised_objective(group, state.shared)

  @jax.jit
  def update(params, rng, arrays):
    mask = jax.numpy.ones(steps * batch, bool)
    opt_state = group.tx.init(params)
    return core.local_update(
      objective, group.tx, params, opt_state, rng, arrays, mask, num_epochs=1, batch_size=batch
    )[0]

  return jax.tree.structure(params), params, update


def jax_initial_parameters(batch: int) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(_jax_client(1, batch)[1])]


# --- PyTorch ---------------------------------------------------------------------


def torch_model():
  """``cnn_s`` in PyTorch (NCHW), parameter for parameter."""
  import torch  # noqa: PLC0415 (optional extra)

  layers, cin = [], 3
  for width, stride in [(32, 1), (64, 2), (64, 2)]:
    layers += [
      torch.nn.Conv2d(cin, width, 3, stride=stride, padding=1, bias=False),
      torch.nn.GroupNorm(8, width),
      torch.nn.ReLU(),
    ]
    cin = width
  return torch.nn.Sequential(
    *layers,
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(64, 64),
    torch.nn.Linear(64, 10),
  )


def torch_local_update(model, arrays, steps: int, batch: int, seed: int) -> None:
  """One epoch of ``steps`` Adam steps on one client's samples, in place, on the model's device."""
  import torch  # noqa: PLC0415

  device = next(model.parameters()).device
  x = torch.from_numpy(arrays["image"]).permute(0, 3, 1, 2).contiguous().to(device)
  y = torch.from_numpy(arrays["label10"]).long().to(device)
  order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)).to(device)
  optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
  for step in range(steps):
    idx = order[step * batch : (step + 1) * batch]
    loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


# --- Flower ----------------------------------------------------------------------


def client_apps():
  """(jax ClientApp, torch ClientApp); built lazily so flwr stays optional."""
  from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: PLC0415
  from flwr.clientapp import ClientApp  # noqa: PLC0415

  jax_app, torch_app = ClientApp(), ClientApp()

  def reply(msg: Message, ndarrays: list[np.ndarray], n: int) -> Message:
    content = RecordDict(
      {"arrays": ArrayRecord(ndarrays), "metrics": MetricRecord({"num-examples": n})}
    )
    return Message(content=content, reply_to=msg)

  def settings(msg: Message, context: Context):
    config = msg.content["config"]
    steps, batch = int(config["steps"]), int(config["batch"])
    k = int(context.node_config["partition-id"])
    return k, steps, batch, int(config["server-round"])

  @jax_app.train()
  def jax_train(msg: Message, context: Context) -> Message:
    k, steps, batch, server_round = settings(msg, context)
    treedef, _, update = _jax_client(steps, batch)
    arrays = _cached_arrays(k, steps * batch)
    params = jax.tree.unflatten(treedef, msg.content["arrays"].to_numpy_ndarrays())
    rng = jax.random.fold_in(jax.random.key(k), server_round)
    params = update(params, rng, arrays)
    return reply(msg, [np.asarray(x) for x in jax.tree.leaves(params)], steps * batch)

  @torch_app.train()
  def torch_train(msg: Message, context: Context) -> Message:
    import torch  # noqa: PLC0415

    k, steps, batch, server_round = settings(msg, context)
    model = _cached_torch_model()
    names = list(model.state_dict())
    ndarrays = msg.content["arrays"].to_numpy_ndarrays()
    model.load_state_dict(
      {n: torch.from_numpy(a.copy()) for n, a in zip(names, ndarrays, strict=True)}
    )
    torch_local_update(model, _cached_arrays(k, steps * batch), steps, batch, seed=server_round)
    out = [v.detach().numpy() for v in model.state_dict().values()]
    return reply(msg, out, steps * batch)

  return jax_app, torch_app


@functools.cache
def _cached_arrays(k: int, n: int):
  return client_arrays(k, n)


@functools.cache
def _cached_torch_model():
  return torch_model()
