"""Muscle loss: the exp-domain contraction, the log-domain tensor and the paper's protocol.

  python -m experiments.benchmarks.muscle_loss [--dim=256] [--repeats=5]

For each (B, M) it times, jitted and after warm-up (median of ``--repeats``,
more for fast cells), one user's loss and gradient with respect to its anchor
and its partners' representations, server part included, at the paper's
temperatures (tau = 0.2, gamma = 1/0.15 - 1/0.2):

* contract:  ``muscle_loss(..., method="contract")``: one einsum of ``M``
  anchor-sample and ``M(M-1)/2`` sample-sample exp-domain matrices (what
  ``method="auto"`` picks here: the logit range R is printed);
* logsumexp: ``muscle_loss(..., method="logsumexp")``: a log-sum-exp over the
  broadcast ``[B]^(M+1)`` tensor (the library's path before the contraction,
  and its fallback);
* paper:     ``muscle_paper_targets`` (S ``[B^M, d]``, log alpha ``[B^M]``) then
  ``muscle_loss_from_paper_targets``: eq. (5) as the paper's server sends it.

It prints XLA's temporary memory for each compiled function
(``compile().memory_analysis()``) and the two speed ratios against the
contraction, measured in the same run. Cells whose work (``B^(M+1)`` terms) or
memory would take minutes are not run and say so. The last lines check the
targets: >= 10x the log-domain path at M = 3 and M = 4 (B = 32), M = 5 at
B = 32 under 1 s, and >= 300x the paper's protocol at M = 3, B = 32.
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
_BATCHES = flags.DEFINE_list("batches", ["32", "64", "128"], "Batch sizes B.")
_MAX_M = flags.DEFINE_integer("max_partners", 5, "Largest M.")
#: Largest number of tuple terms B^(M+1) each path is run at (beyond: seconds per call).
_MAX_TERMS = {"contract": 2**31, "logsumexp": 2**28, "paper": 2**28}
TAU, GAMMA = 0.2, float(losses.muscle_gamma(0.2, 0.15))


def _loss(method):
  def fn(anchor, others):
    return losses.muscle_loss(anchor, others, tau=TAU, gamma=GAMMA, method=method).mean()

  return fn


def _paper(anchor, others):
  s, log_alpha = losses.muscle_paper_targets(others, tau=TAU, gamma=GAMMA)
  return losses.muscle_loss_from_paper_targets(anchor, s, log_alpha).mean()


PATHS = {"contract": _loss("contract"), "logsumexp": _loss("logsumexp"), "paper": _paper}


def _compile(loss_fn, anchor, others):
  grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
  compiled = jax.jit(grad).lower(anchor, others).compile()
  stats = compiled.memory_analysis()
  temp = None if stats is None else stats.temp_size_in_bytes
  return compiled, temp


def _time(compiled, anchor, others, repeats):
  """Median time after warm-up: at least ``repeats`` runs, more for fast cells.

  Millisecond cells are noisy on a shared CPU, so fast cells keep sampling
  until 1 s has been spent or 50 runs.
  """
  jax.block_until_ready(compiled(anchor, others))  # warm-up
  times = []
  while len(times) < repeats or (sum(times) < 1.0 and len(times) < 50):
    start = time.perf_counter()
    jax.block_until_ready(compiled(anchor, others))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _run(path, batch, num_others, anchor, others, repeats):
  """``(seconds, temp bytes, note)``; seconds is None when the cell is skipped."""
  terms = batch ** (num_others + 1)
  if terms > _MAX_TERMS[path]:
    return None, None, f"{path}: not run ({terms:.1e} terms)"
  if path == "paper":
    s_bytes = batch**num_others * (anchor.shape[1] + 1) * 4
    if s_bytes > _MAX_GIB.value * 2**30:
      return None, None, f"paper: not run, S alone is {s_bytes / 2**30:.0f} GiB"
  compiled, temp = _compile(PATHS[path], anchor, others)
  if temp is not None and temp > _MAX_GIB.value * 2**30:
    return None, temp, f"{path}: not run, needs {temp / 2**30:.1f} GiB"
  slow = terms > 2**24
  return _time(compiled, anchor, others, 2 if slow else repeats), temp, ""


def _ms(seconds):
  return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _gib(num_bytes):
  return "-" if num_bytes is None else f"{num_bytes / 2**30:.3f}"


def _ratio(slow, fast):
  return "-" if slow is None or fast is None else f"{slow / fast:.1f}x"


def main(argv):
  del argv
  dim, repeats = _DIM.value, _REPEATS.value
  print(
    f"Muscle loss + gradient (anchor and partners) for one user, d={dim}, tau={TAU}, "
    f"gamma={GAMMA:.4f}, device={jax.devices()[0].device_kind}"
  )
  header = (
    f"{'B':>3} {'M':>2} {'R':>5} | {'contract ms':>11} {'GiB':>6} | {'logsumexp ms':>12} {'GiB':>6} | "
    f"{'paper ms':>10} {'GiB':>6} | {'lse/contr':>9} {'paper/contr':>11}"
  )
  print(header)
  print("-" * len(header))
  results = {}
  for batch in (int(b) for b in _BATCHES.value):
    for num_others in range(1, _MAX_M.value + 1):
      keys = jax.random.split(jax.random.key(batch * 10 + num_others), 2)
      anchor = jax.random.normal(keys[0], (batch, dim))
      anchor = anchor / jnp.linalg.norm(anchor, axis=-1, keepdims=True)
      others = jax.random.normal(keys[1], (num_others, batch, dim))
      others = others / jnp.linalg.norm(others, axis=-1, keepdims=True)
      cell, notes = {}, []
      for path in PATHS:
        seconds, temp, note = _run(path, batch, num_others, anchor, others, repeats)
        cell[path] = (seconds, temp)
        if note:
          notes.append(note)
      results[batch, num_others] = cell
      logit_range = losses.muscle_logit_range(TAU, GAMMA, num_others)
      (c, c_mem), (l, l_mem), (p, p_mem) = cell["contract"], cell["logsumexp"], cell["paper"]
      print(
        f"{batch:>3} {num_others:>2} {logit_range:>5.1f} | {_ms(c):>11} {_gib(c_mem):>6} | "
        f"{_ms(l):>12} {_gib(l_mem):>6} | {_ms(p):>10} {_gib(p_mem):>6} | "
        f"{_ratio(l, c):>9} {_ratio(p, c):>11}  {'; '.join(notes)}",
        flush=True,
      )

  def get(batch, num_others, path):
    return results.get((batch, num_others), {}).get(path, (None, None))[0]

  print("targets (B = 32):")
  for num_others in (3, 4):
    print(
      f"  M={num_others}: contraction vs log-domain "
      f"{_ratio(get(32, num_others, 'logsumexp'), get(32, num_others, 'contract'))} (target >= 10x)"
    )
  print(f"  M=5: contraction {_ms(get(32, 5, 'contract'))} ms (target < 1000 ms)")
  print(
    f"  M=3: contraction vs the paper's protocol "
    f"{_ratio(get(32, 3, 'paper'), get(32, 3, 'contract'))} (target >= 300x)"
  )


if __name__ == "__main__":
  app.run(main)
