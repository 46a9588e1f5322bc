"""Client engine throughput: one vmapped round vs a Python loop over clients.

  python -m experiments.benchmarks.engine_throughput [--clients=8,64,512] [--steps=10]

N clients of a small CNN (``cnn_s``, d=64, linear 10-class head) on the embedded
world, each with ``steps * batch`` samples, so one local epoch is ``steps``
minibatch steps. Both contenders run the same single-client function
(:func:`fedjax_mm.core.local_update`), jitted, after a warm-up call:

* vmapped: ``core.train_group`` — one call for all N clients;
* loop:    the jitted single-client update called once per client from Python.

It prints client-steps per second for both and their ratio. Timing is the
median of ``--repeats`` runs (each run is a full round of N clients).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
import optax
from absl import app, flags

from fedjax_mm import core, data, models

_CLIENTS = flags.DEFINE_list("clients", ["8", "64", "512"], "Client counts N.")
_STEPS = flags.DEFINE_integer("steps", 10, "Local steps per client.")
_BATCH = flags.DEFINE_integer("batch", 8, "Local minibatch size.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds per cell (median).")
_LOOP_LIMIT = flags.DEFINE_integer(
  "loop_limit", 64, "Time the loop on at most this many clients and scale."
)

TASK = core.Task("classification", "image", "label10", 10)


def _median_time(fn, repeats):
  jax.block_until_ready(fn())  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _cell(num_clients, steps, batch):
  """Client-steps per second of the vmapped round and of the loop."""
  per_client = steps * batch
  world = data.generate(0, num_clients * per_client)
  parts = np.split(np.arange(num_clients * per_client), num_clients)
  stacked, mask = data.stack_clients(data.split_clients(world, parts))
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(num_clients))
  group, state = core.init_group(
    lambda rngs: models.build(
      {"encoder": "cnn_s", "head": "linear", "num_outputs": 10, "rep_dim": 64}, rngs=rngs
    ),
    name="cnn_s",
    tx=optax.adam(1e-3),
    task=TASK,
    key=jax.random.key(0),
    num_clients=num_clients,
    batch_size=batch,
  )
  vmapped = jax.jit(lambda s, d: core.train_group(group, s, d)[0].params)
  vmapped_s = _median_time(lambda: vmapped(state, client_data), _REPEATS.value)

  objective = core.supervised_objective(group, state.shared)
  single = jax.jit(
    lambda p, o, r, a, m: core.local_update(
      objective, group.tx, p, o, r, a, m, num_epochs=1, batch_size=batch
    )[0]
  )
  looped = min(num_clients, _LOOP_LIMIT.value)
  per = (state.params, state.opt_state, state.rng, client_data.arrays, client_data.sample_mask)
  clients = [jax.tree.map(lambda x, k=k: x[k], per) for k in range(looped)]
  loop_s = (
    _median_time(lambda: [single(*c) for c in clients], _REPEATS.value) * num_clients / looped
  )
  return num_clients * steps / vmapped_s, num_clients * steps / loop_s, looped


def main(argv):
  del argv
  steps, batch = _STEPS.value, _BATCH.value
  print(
    f"cnn_s clients, {steps} local steps of batch {batch}, device={jax.devices()[0].device_kind} x{jax.device_count()}"
  )
  header = f"{'N':>6} | {'vmapped steps/s':>15} | {'loop steps/s':>13} | {'ratio':>6}"
  print(header)
  print("-" * len(header))
  ratios = {}
  for num_clients in map(int, _CLIENTS.value):
    vmapped_rate, loop_rate, looped = _cell(num_clients, steps, batch)
    ratios[num_clients] = vmapped_rate / loop_rate
    scaled = "" if looped == num_clients else f"  (loop timed on {looped} clients, scaled)"
    print(
      f"{num_clients:>6} | {vmapped_rate:>15.1f} | {loop_rate:>13.1f} | {ratios[num_clients]:>5.1f}x{scaled}"
    )
  if 64 in ratios:
    print(f"vmapped / loop at N=64: {ratios[64]:.1f}x")


if __name__ == "__main__":
  app.run(main)
