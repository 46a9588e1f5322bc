"""Muscle loss: factored protocol vs the paper's protocol, speed, memory, downlink.

  python -m experiments.benchmarks.muscle_loss [--dim=256] [--repeats=5]

For each (B, M) it times, jitted and after warm-up (median of ``--repeats``),
one user's loss and gradient with respect to its anchor, server part included:

* factored: ``muscle_server_targets`` then ``muscle_client_loss`` (what
  ``muscle_loss`` runs): a log-sum-exp over a broadcast [B]^(M+1) tensor;
* paper:    ``muscle_paper_targets`` (S [B^M, d], log alpha [B^M]) then
  ``muscle_loss_from_paper_targets``, eq. (5) as the paper's server sends it.

It also prints XLA's temporary memory for each compiled function
(``compile().memory_analysis()``) and the downlink floats per user per batch.
A cell whose compiled temporaries exceed ``--max_gib`` is not run. The last
line is the speed ratio at B=32, M=3 (the paper's defaults).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from fedjax_mm import losses

_DIM = flags.DEFINE_integer("dim", 256, "Representation dimension d.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Minimum timed runs per cell (median reported).")
_MAX_GIB = flags.DEFINE_float("max_gib", 8.0, "Skip cells whose compiled temporaries exceed this.")
_CELLS = ((32, 1), (32, 2), (32, 3), (32, 4), (32, 5), (64, 3))
TAU, GAMMA = 0.2, float(losses.muscle_gamma(0.2, 0.15))


def _factored(anchor, others):
  return losses.muscle_loss(anchor, others, tau=TAU, gamma=GAMMA).mean()


def _paper(anchor, others):
  s, log_alpha = losses.muscle_paper_targets(others, tau=TAU, gamma=GAMMA)
  return losses.muscle_loss_from_paper_targets(anchor, s, log_alpha).mean()


def _compile(loss_fn, anchor, others):
  compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(anchor, others).compile()
  stats = compiled.memory_analysis()
  temp = None if stats is None else stats.temp_size_in_bytes
  return compiled, temp


def _time(compiled, anchor, others, repeats):
  """Median time after warm-up: at least ``repeats`` runs, more for fast cells.

  Millisecond cells are noisy on a shared CPU (a median of 3 varied 2-3x between
  runs), so fast cells keep sampling until 1 s has been spent or 50 runs.
  """
  jax.block_until_ready(compiled(anchor, others))  # warm-up
  times = []
  while len(times) < repeats or (sum(times) < 1.0 and len(times) < 50):
    start = time.perf_counter()
    jax.block_until_ready(compiled(anchor, others))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _gib(num_bytes):
  return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.3f}"


def main(argv):
  del argv
  dim, repeats = _DIM.value, _REPEATS.value
  print(
    f"Muscle loss + gradient for one user, d={dim}, median of >= {repeats} runs (more for fast cells), device={jax.devices()[0].device_kind}"
  )
  header = (
    f"{'B':>3} {'M':>2} | {'factored ms':>11} {'temp GiB':>8} | {'paper ms':>10} {'temp GiB':>8} | "
    f"{'speedup':>8} | {'down floats fact.':>17} {'down floats paper':>17} {'ratio':>10}"
  )
  print(header)
  print("-" * len(header))
  ratio_at_default = None
  for batch, num_others in _CELLS:
    keys = jax.random.split(jax.random.key(batch * 10 + num_others), 2)
    anchor = jax.random.normal(keys[0], (batch, dim))
    anchor = anchor / jnp.linalg.norm(anchor, axis=-1, keepdims=True)
    others = jax.random.normal(keys[1], (num_others, batch, dim))
    others = others / jnp.linalg.norm(others, axis=-1, keepdims=True)

    factored, factored_temp = _compile(_factored, anchor, others)
    factored_s = _time(factored, anchor, others, repeats)

    paper_s, paper_temp, note = None, None, ""
    paper_bytes = batch**num_others * (dim + 1) * 4
    if paper_bytes > _MAX_GIB.value * 2**30:
      note = f"paper: not run, S alone is {paper_bytes / 2**30:.0f} GiB"
    else:
      paper, paper_temp = _compile(_paper, anchor, others)
      if paper_temp is not None and paper_temp > _MAX_GIB.value * 2**30:
        note = f"paper: not run, needs {paper_temp / 2**30:.1f} GiB"
      else:
        paper_s = _time(paper, anchor, others, max(1, repeats if batch**num_others <= 2**16 else 2))

    down_factored = num_others * batch * dim + num_others * (num_others - 1) // 2 * batch * batch
    down_paper = batch**num_others * (dim + 1)
    speedup = paper_s / factored_s if paper_s else None
    if (batch, num_others) == (32, 3):
      ratio_at_default = speedup
    print(
      f"{batch:>3} {num_others:>2} | {factored_s * 1e3:>11.2f} {_gib(factored_temp):>8} | "
      f"{'-' if paper_s is None else f'{paper_s * 1e3:.2f}':>10} {_gib(paper_temp) if paper_s else '-':>8} | "
      f"{'-' if speedup is None else f'{speedup:.1f}x':>8} | {down_factored:>17,} {down_paper:>17,} "
      f"{down_paper / down_factored:>9,.0f}x {note}"
    )
  print(f"speed ratio paper/factored at B=32, M=3: {ratio_at_default:.1f}x")


if __name__ == "__main__":
  app.run(main)
