"""Client engine throughput: one vmapped round vs a Python loop over clients.

  python -m experiments.benchmarks.engine_throughput [--clients=8,64,512] [--steps=10]
      [--compute_dtype=bfloat16] [--devices=2]

N clients of a small CNN (``cnn_s``, d=64, linear 10-class head) on the embedded
world, each with ``steps * batch`` samples, so one local epoch is ``steps``
minibatch steps. Every contender runs the same single-client function
(:func:`fedjax_mm.core.local_update`), jitted, after a warm-up call:

* engine: ``core.train_group``, one call for all N clients, once per client
  map (``--client_maps``: ``vmap``, ``scan``, ``map:<k>``) and for ``auto``,
  the form :func:`fedjax_mm.core.resolve_client_map` picks on this backend;
* loop:   the jitted single-client update called once per client from Python.

The engine's rounds run on a ``clients`` mesh over ``--devices`` devices
(:func:`fedjax_mm.core.jit_round`), the loop on the first. On the CPU,
``--devices=D`` makes D XLA host devices, and a compiled loop over clients
(``scan``, ``map:<k>``, ``auto``) then runs as one loop per device over its own
clients, the devices at the same time (``vmap`` is split over them by the
compiler).

Both are timed with the zoo's convolution (``models.conv``: im2col, the
default) and, for N <= ``--xla_limit``, with XLA's native convolution, which
``vmap`` turns into a grouped convolution (one timed run each; loops are timed
on at most ``--loop_limit`` clients and scaled). It prints client-steps per
second, the compute rate each contender reaches (XLA's FLOP count of the
round over its time) next to a dense float32 matmul measured in the same run,
and the ratios. The im2col contenders of one N are timed interleaved: after
one untimed round each, they run one round each in turn, ``--repeats`` times,
so all of them share the same stretch of this machine's drifting speed; each
speed-up over the loop is the median of the per-repetition (paired) ratios,
and the rates are from the median round.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from experiments import benchmarks
from fedjax_mm import core, data, models
from fedjax_mm.core import cost
from fedjax_mm.models.conv import Conv

_CLIENTS = benchmarks.define_counts("clients", ["8", "64", "512"], "Client counts N.")
_STEPS = flags.DEFINE_integer("steps", 10, "Local steps per client.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "Local minibatch size.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per cell (median).", lower_bound=1)
_LOOP_LIMIT = flags.DEFINE_integer(
  "loop_limit", 64, "Time the loop on at most this many clients and scale.", lower_bound=1
)
_XLA_LIMIT = flags.DEFINE_integer(
  "xla_limit",
  8,
  "Time the native-convolution contenders (one timed run each: they are slow) up to this N "
  "(0: never).",
  lower_bound=0,
)
_DEVICES = flags.DEFINE_integer(
  "devices",
  1,
  "Devices the engine's rounds run on (a `clients` mesh; the loop runs on the first). On the "
  "CPU, this many XLA host devices are made (jax_num_cpu_devices): one compiled loop over "
  "its clients per device, at the same time. Every N must be a multiple.",
  lower_bound=1,
)

_COMPUTE_DTYPE = flags.DEFINE_enum(
  "compute_dtype",
  "float32",
  core.client.COMPUTE_DTYPES,
  "Mixed precision: the dtype every contender's forward and backward pass runs in "
  "(GroupDef.compute_dtype); parameters and optimiser state stay float32.",
)

TASK = core.Task("classification", "image", "label10", 10)


def _median_time(fn, repeats):
  """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
  jax.block_until_ready(fn())  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _matmul_gflops(repeats):
  a = jax.random.normal(jax.random.key(0), (1024, 1024))
  mm = jax.jit(lambda a: a @ a)
  seconds = _median_time(lambda: [mm(a) for _ in range(10)][-1], repeats) / 10
  return 2 * 1024**3 / seconds / 1e9


def _model(conv_impl):
  def make(rngs):
    model = models.build(
      {"encoder": "cnn_s", "head": "linear", "num_outputs": 10, "rep_dim": 64}, rngs=rngs
    )
    for _, module in nnx.iter_modules(model):
      if isinstance(module, Conv):
        module.impl = conv_impl
    return model

  return make


def _mesh():
  """The engine's ``clients`` mesh: the first ``--devices`` devices."""
  return core.client_mesh(_DEVICES.value)


def _vmapped(impl, num_clients, client_data, batch, client_map="vmap"):
  """(round, None, 1): a callable running one engine round with the given client map.

  The round runs on the engine's mesh (:func:`_mesh`), its clients split over
  the mesh's devices, through :func:`fedjax_mm.core.jit_round`. No FLOP count:
  every column's rate uses the loop's (XLA counts a compiled loop's body once).
  """
  group, state = _group(impl, num_clients, batch, client_map)
  mesh = _mesh()
  state, client_data = state.place(mesh), client_data.place(mesh)
  vmapped = core.jit_round(lambda s, d: core.train_group(group, s, d), state, donate=False)
  return (lambda: vmapped(state, client_data)[0].params), None, 1.0


def _loop(impl, num_clients, client_data, batch):
  """(round, FLOPs, scale): the Python loop over the jitted single-client update.

  The loop runs ``min(num_clients, --loop_limit)`` clients; ``scale`` turns
  its time into a round of ``num_clients``.
  """
  group, state = _group(impl, num_clients, batch)
  objective = core.supervised_objective(group, state.shared)
  single = jax.jit(
    lambda p, o, r, a, m: core.local_update(
      objective, group.tx, p, o, r, a, m, num_epochs=1, batch_size=batch
    )[0]
  )
  looped = min(num_clients, _LOOP_LIMIT.value)
  per = (state.params, state.opt_state, state.rng, client_data.arrays, client_data.sample_mask)
  clients = [jax.tree.map(lambda x, k=k: x[k], per) for k in range(looped)]
  # XLA's cost analysis counts the body of the local update's scan over steps once,
  # so the compiled update's count is one step's: a round is steps x clients of it.
  steps = -(-client_data.sample_mask.shape[1] // batch)
  return (
    lambda: [single(*c) for c in clients],
    cost.flops(single, *clients[0]) * steps * num_clients,
    num_clients / looped,
  )


def _interleaved(rounds, repeats):
  """Times every contender's round ``repeats`` times, one round of each in turn.

  This machine's speed drifts by 20-30% over a minute (other tenants, clock
  changes), so contenders timed one after another can differ by that much
  for no reason of their own. Interleaving puts every contender in the same
  stretch of time; the ratios are then taken per repetition (paired) and
  their median reported.

  Args:
    rounds: ``{name: (round_fn, flops, scale)}``; each ``round_fn`` is called
      once untimed first (compilation, warm-up).
    repeats: timed rounds per contender.

  Returns:
    ``{name: [seconds of each repetition, already scaled]}``.
  """
  for fn, _, _ in rounds.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in rounds}
  for _ in range(repeats):
    for name, (fn, _, scale) in rounds.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append((time.perf_counter() - start) * scale)
  return times


def _group(impl, num_clients, batch, client_map="vmap"):
  return core.init_group(
    _model(impl),
    name=f"cnn_s/{impl}",
    tx=optax.adam(1e-3),
    task=TASK,
    key=jax.random.key(0),
    num_clients=num_clients,
    batch_size=batch,
    client_map=client_map,
    compute_dtype=None if _COMPUTE_DTYPE.value == "float32" else _COMPUTE_DTYPE.value,
  )


_MAPS = flags.DEFINE_list(
  "client_maps", ["vmap", "scan", "map:2", "map:8"], "Client maps to time besides auto."
)


def _cell(num_clients, steps, batch):
  """``({contender: (seconds per round, FLOPs, ratio)}, clients looped over)``.

  ``seconds`` is the median round; ``ratio`` the median of the paired
  (same-repetition) speed-ups over the loop. The im2col contenders are timed
  interleaved (:func:`_interleaved`), ``--repeats`` rounds each; the slow
  native-convolution pair once each, one after the other.
  """
  per_client = steps * batch
  world = data.generate(0, num_clients * per_client)
  parts = np.split(np.arange(num_clients * per_client), num_clients)
  stacked, mask = data.stack_clients(data.split_clients(world, parts))
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(num_clients))
  looped = min(num_clients, _LOOP_LIMIT.value)
  auto = benchmarks.auto_client_map(_mesh())
  rounds = {"loop": _loop("im2col", num_clients, client_data, batch)}
  for client_map in dict.fromkeys([*_MAPS.value, auto]):
    rounds[client_map] = _vmapped("im2col", num_clients, client_data, batch, client_map)
  times = _interleaved(rounds, _REPEATS.value)
  loop = np.asarray(times["loop"])
  ratios = {name: float(np.median(loop / np.asarray(t))) for name, t in times.items()}
  if num_clients <= _XLA_LIMIT.value:  # slow: once each, and not paired with the loop
    native = {
      "loop/xla": _loop("xla", num_clients, client_data, batch),
      "vmap/xla": _vmapped("xla", num_clients, client_data, batch),
    }
    rounds |= native
    times |= _interleaved(native, 1)
  out = {
    name: (statistics.median(seconds), rounds[name][1], ratios.get(name))
    for name, seconds in times.items()
  }
  out["auto"] = out[auto]
  return out, looped


def main(argv):
  del argv
  steps, batch = _STEPS.value, _BATCH.value
  benchmarks.engine_mesh(_DEVICES.value, list(map(int, _CLIENTS.value)))
  device = jax.devices()[0]
  peak = _matmul_gflops(_REPEATS.value)
  auto = benchmarks.auto_client_map(_mesh())
  print(
    f"cnn_s clients, {steps} local steps of batch {batch}, "
    f"device={device.device_kind}; the engine on {_DEVICES.value} of {jax.device_count()} "
    f"devices, the loop on one; compute in {_COMPUTE_DTYPE.value}; "
    f"dense f32 matmul 1024^2: {peak:.0f} GFLOP/s; client_map='auto' is {auto!r} here"
  )
  print(
    "client-steps/s of the median round (GFLOP/s in brackets), im2col convolution; "
    "each engine column's speed-up over the loop is the median of its paired ratios "
    "(contenders timed in turn, one round each, --repeats times)"
  )
  cols = ["loop", *_MAPS.value, "auto"]
  header = f"{'N':>5} | " + " | ".join(f"{c:>19}" for c in cols)
  print(header)
  print("-" * len(header))
  cells = {}
  for num_clients in map(int, _CLIENTS.value):
    cell, looped = _cell(num_clients, steps, batch)
    cells[num_clients] = cell

    def show(name, cell=cell, n=num_clients):
      # The loop's FLOPs for every column: the same work, and XLA's cost analysis
      # counts a compiled loop's body (the engine's scan or map over clients) once.
      seconds, flops = cell[name][0], cell["loop"][1]
      rate = f"{n * steps / seconds:.1f} ({flops / seconds / 1e9:.1f})"
      if name == "loop":
        return f"{rate:>19}"
      return f"{rate} {cell[name][2]:.2f}x".rjust(19)

    scaled = "" if looped == num_clients else f"  (loop timed on {looped}, scaled)"
    print(f"{num_clients:>5} | " + " | ".join(show(c) for c in cols) + scaled)
  small = [n for n in cells if "vmap/xla" in cells[n]]
  if small:
    print("XLA's native convolution (vmap turns it into a grouped convolution):")
    for n in small:
      lv, vv = cells[n]["loop/xla"][0], cells[n]["vmap/xla"][0]
      print(f"{n:>5} | loop {n * steps / lv:.1f} | vmap {n * steps / vv:.1f} ({lv / vv:.2f}x)")
  worst = min(cells[n]["auto"][2] for n in cells)
  print(f"auto ({auto}) / loop, worst over N: {worst:.2f}x")
  if 64 in cells:
    loop_gflops = cells[64]["loop"][1] / cells[64]["loop"][0] / 1e9
    print(
      f"N=64: the loop runs at {loop_gflops:.1f} GFLOP/s, "
      f"{100 * loop_gflops / peak:.0f}% of the matmul rate."
    )


if __name__ == "__main__":
  app.run(main)
