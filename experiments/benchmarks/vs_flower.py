"""The engine against the frameworks a user would pick instead: Flower and PyTorch.

  pip install -e ".[peers]"     # flwr[simulation] and torch (large wheels; optional)
  python -m experiments.benchmarks.vs_flower [--clients=8,64] [--rounds=4]

One FedAvg workload, four ways. N clients of ``cnn_s`` (3 conv3x3 32-64-64 with
GroupNorm and ReLU, mean pool, a 64 -> 64 projector, a 10-class linear head;
61,290 parameters), each holding ``steps * batch`` samples of the embedded world
(client k's are ``data.generate(k, steps * batch)``), every client in every
round, one local epoch of ``steps`` Adam steps (learning rate 1e-3, optimiser
state reset each round), the server averaging by sample count:

* **engine**: :func:`fedjax_mm.algorithms.fedavg`'s round, jitted once by
  :func:`fedjax_mm.core.jit_round`, the clients run by the engine's default
  client map (``auto``), on a ``clients`` mesh of ``--devices`` devices (on
  the CPU, ``--devices=2`` makes two XLA host devices, one loop over its own
  clients on each: the engine's counterpart of Flower's one client per core);
* **flower+jax**: Flower's simulation engine (``flwr.simulation.run_simulation``,
  Ray backend, the Message API's ``FedAvg`` strategy) whose ClientApp calls the
  same jitted single-client update (:func:`fedjax_mm.core.local_update`) on
  NumPy arrays;
* **flower+torch**: the same Flower run with a PyTorch client of the same CNN;
* **torch loop**: a plain PyTorch loop over the clients and a mean of their
  ``state_dict``s, no framework: the floor a CPU user compares with. It runs
  once per ``--torch_threads`` value (``torch.set_num_threads``): on a busy
  2-core machine one thread is 3x faster than two, so both are shown. With
  ``--torch_device=cuda`` it runs on the GPU (synchronised before each round's
  time stamp), the floor a GPU user compares with.

Each contender runs ``--rounds`` rounds and is timed per round; the first round
(compilation, Ray's start, actor start-up) is excluded and the median of the
others is reported, as client-steps per second and as the engine's speed-up. With
``--trials=k`` the whole sequence of contenders runs k times in turn, and the
engine's speed-up over each is the median of the k per-trial ratios: this
machine's speed drifts by 20-30% over minutes, which a single pass attributes
to whichever contender ran in the slow stretch.

Flower's rounds are timed on the server, between the strategy's end-of-round
callbacks (``evaluate_fn``), so they include sending the model, the clients'
work and aggregation, as they would in a user's run. ``--flower_cpus`` is the
``num_cpus`` each simulated client reserves (Flower's default is 2); Ray runs
``floor(cores / flower_cpus)`` clients at once.

Both frameworks' inputs are the same samples and the same architecture (the
parameter counts are printed and must agree); the PyTorch model pads its
stride-2 convolutions symmetrically where XLA's ``SAME`` pads ``(0, 1)``, which
changes no FLOP count.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from experiments import benchmarks
from experiments.benchmarks import flower_clients as workload
from fedjax_mm import algorithms, core

_CLIENTS = benchmarks.define_counts("clients", ["8", "64"], "Client counts N.")
_STEPS = flags.DEFINE_integer("steps", 10, "Local steps per client and round.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "Local minibatch size.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer(
  "rounds", 4, "Rounds per contender (the first is not timed).", lower_bound=2
)
_TRIALS = flags.DEFINE_integer(
  "trials",
  1,
  "Times every contender runs, in turn, per N; the engine's speed-up is the median of the "
  "per-trial ratios (this machine's speed drifts between contenders' runs).",
  lower_bound=1,
)
_DEVICES = flags.DEFINE_integer(
  "devices",
  1,
  "Devices the engine runs on (a `clients` mesh). On the CPU, this many XLA host devices "
  "are made (jax_num_cpu_devices), each running a compiled loop over its own clients, as "
  "Flower runs one client per core. Every N must be a multiple.",
  lower_bound=1,
)
_FLOWER_CPUS = flags.DEFINE_float(
  "flower_cpus", 1.0, "num_cpus per simulated Flower client.", lower_bound=0.0
)
_TORCH_THREADS = benchmarks.define_counts(
  "torch_threads", ["1", str(os.cpu_count())], "torch.set_num_threads values for the torch loop."
)
_TORCH_DEVICE = flags.DEFINE_string(
  "torch_device", "cpu", "Where the torch loop runs (a torch device: cpu, cuda, cuda:1)."
)
#: Every contender, and the default: all of them.
CONTENDERS = ("engine", "flower+jax", "flower+torch", "torch loop")
_CONTENDERS = benchmarks.define_names(
  "contenders", CONTENDERS, CONTENDERS, "Which contenders to run."
)


def _median_round(stamps: list[float]) -> float:
  """Median seconds per round from end-of-round timestamps (round 0 = start)."""
  durations = np.diff(stamps)
  if len(durations) < 2:
    raise ValueError("need at least 2 rounds: the first one is not timed.")
  return statistics.median(durations[1:].tolist())


# --- Runners ----------------------------------------------------------------------


def run_engine(num_clients: int, steps: int, batch: int, rounds: int) -> float:
  """Seconds per round of the engine's jitted FedAvg round, on ``--devices`` devices."""
  group, state = workload.make_group(num_clients, batch)
  clients = [workload.client_arrays(k, steps * batch) for k in range(num_clients)]
  stacked = {key: np.stack([c[key] for c in clients]) for key in clients[0]}
  mask = np.ones((num_clients, steps * batch), bool)
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(num_clients))
  algorithm = algorithms.fedavg([group])
  mesh = core.client_mesh(_DEVICES.value)
  fed_state = algorithm.init([state], jax.random.key(1)).place(mesh)
  client_data = client_data.place(mesh)
  round_fn = core.jit_round(algorithm.round, fed_state)
  stamps = [time.perf_counter()]
  for _ in range(rounds):
    fed_state = jax.block_until_ready(round_fn(fed_state, [client_data])[0])
    stamps.append(time.perf_counter())
  return _median_round(stamps)


def run_torch_loop(num_clients: int, steps: int, batch: int, rounds: int, threads: int) -> float:
  """Seconds per round of a plain PyTorch loop over clients plus a mean."""
  import torch  # noqa: PLC0415

  torch.set_num_threads(threads)
  torch.manual_seed(0)
  device = torch.device(_TORCH_DEVICE.value)
  model = workload.torch_model().to(device)
  clients = [workload.client_arrays(k, steps * batch) for k in range(num_clients)]
  global_state = {k: v.clone() for k, v in model.state_dict().items()}
  stamps = [time.perf_counter()]
  for r in range(rounds):
    states = []
    for k, arrays in enumerate(clients):
      model.load_state_dict(global_state)
      workload.torch_local_update(model, arrays, steps, batch, seed=r * num_clients + k)
      states.append({name: v.detach().clone() for name, v in model.state_dict().items()})
    global_state = {name: torch.stack([s[name] for s in states]).mean(0) for name in states[0]}
    if device.type == "cuda":
      torch.cuda.synchronize(device)  # kernels are queued, not done, until here
    stamps.append(time.perf_counter())
  return _median_round(stamps)


def run_flower(kind: str, num_clients: int, steps: int, batch: int, rounds: int) -> float:
  """Seconds per round of a Flower simulation whose clients are ``kind`` (jax | torch)."""
  from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: PLC0415
  from flwr.serverapp import Grid, ServerApp  # noqa: PLC0415
  from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415
  from flwr.simulation import run_simulation  # noqa: PLC0415

  if kind == "jax":
    initial = workload.jax_initial_parameters(batch)
  else:
    initial = [v.detach().numpy() for v in workload.torch_model().state_dict().values()]
  stamps: list[float] = []
  trained: list[int] = []  # clients whose update arrived, per round
  server_app = ServerApp()

  class CountingFedAvg(FedAvg):
    """Flower's FedAvg; counts the replies that carry no error (Flower logs and skips those)."""

    def aggregate_train(self, server_round, replies):
      replies = list(replies)
      trained.append(sum(not reply.has_error() for reply in replies))
      return super().aggregate_train(server_round, replies)

  @server_app.main()
  def main(grid: Grid, context: Context) -> None:
    del context
    strategy = CountingFedAvg(
      fraction_train=1.0,
      fraction_evaluate=0.0,
      min_train_nodes=num_clients,
      min_available_nodes=num_clients,
    )

    def stamp(server_round, arrays):
      del server_round, arrays
      stamps.append(time.perf_counter())

    strategy.start(
      grid=grid,
      initial_arrays=ArrayRecord(initial),
      num_rounds=rounds,
      train_config=ConfigRecord({"steps": steps, "batch": batch}),
      evaluate_fn=stamp,
    )

  logging.getLogger("flwr").setLevel(logging.WARNING)  # one INFO block per round otherwise
  jax_app, torch_app = workload.client_apps()
  run_simulation(
    server_app=server_app,
    client_app=jax_app if kind == "jax" else torch_app,
    num_supernodes=num_clients,
    backend_config={
      "client_resources": {"num_cpus": _FLOWER_CPUS.value, "num_gpus": 0.0},
      "init_args": {"num_cpus": os.cpu_count(), "include_dashboard": False},
    },
  )
  if len(stamps) != rounds + 1 or trained != [num_clients] * rounds:
    raise RuntimeError(
      f"Flower ran {len(stamps) - 1} of {rounds} rounds with {trained} of {num_clients} "
      "clients' updates; see its log above."
    )
  return _median_round(stamps)


def _parameter_counts(batch: int) -> tuple[int, int | None]:
  ours = sum(x.size for x in workload.jax_initial_parameters(batch))
  try:
    theirs = sum(p.numel() for p in workload.torch_model().parameters())
  except ImportError:
    theirs = None
  return ours, theirs


def main(argv):
  del argv
  steps, batch, rounds = _STEPS.value, _BATCH.value, _ROUNDS.value
  mesh = benchmarks.engine_mesh(_DEVICES.value, list(map(int, _CLIENTS.value)))
  auto = benchmarks.auto_client_map(mesh)
  os.environ.setdefault("RAY_DEDUP_LOGS", "0")
  ours, theirs = _parameter_counts(batch)
  if theirs is not None and ours != theirs:
    raise RuntimeError(f"cnn_s has {ours} parameters here and {theirs} in PyTorch.")
  print(
    f"FedAvg, cnn_s ({ours} parameters), {steps} local Adam steps of batch {batch}, "
    f"all clients every round; {rounds} rounds each, the first not timed; "
    f"engine on {_DEVICES.value} device(s), client_map auto = {auto!r}; "
    f"{os.cpu_count()} CPUs, Flower clients reserve {_FLOWER_CPUS.value:g} each; "
    f"JAX on {jax.devices()[0].device_kind}, the torch loop on {_TORCH_DEVICE.value}"
  )
  runners = {
    "engine": run_engine,
    "flower+jax": functools.partial(run_flower, "jax"),
    "flower+torch": functools.partial(run_flower, "torch"),
  }
  for threads in map(int, _TORCH_THREADS.value):
    runners[f"torch loop/{threads}t"] = functools.partial(run_torch_loop, threads=threads)
  names = [
    name
    for contender in _CONTENDERS.value
    for name in runners
    if name == contender or name.startswith(contender + "/")
  ]
  rows = {}
  for num_clients in map(int, _CLIENTS.value):
    for trial in range(_TRIALS.value):
      for name in names:
        seconds = runners[name](num_clients, steps, batch, rounds)
        rows.setdefault((num_clients, name), []).append(seconds)
        print(
          f"  N={num_clients:<4} trial {trial}  {name:<13} {seconds:8.2f} s/round  "
          f"{num_clients * steps / seconds:8.1f} client-steps/s",
          flush=True,
        )
  print(
    f"\nclient-steps per second (median of {_TRIALS.value} trial(s)), and the engine's "
    "speed-up over each contender (median of the per-trial ratios)"
  )
  print(f"{'N':>5} | " + " | ".join(f"{n:>22}" for n in names))
  for num_clients in map(int, _CLIENTS.value):
    cells = []
    for name in names:
      seconds = np.asarray(rows[num_clients, name])
      rate = num_clients * steps / np.median(seconds)
      if name == "engine" or "engine" not in names:
        cells.append(f"{rate:>22.1f}")
      else:
        speedup = np.median(seconds / np.asarray(rows[num_clients, "engine"]))
        cells.append(f"{rate:.1f} (engine {speedup:.2f}x)".rjust(22))
    print(f"{num_clients:>5} | " + " | ".join(cells))


if __name__ == "__main__":
  app.run(main)
