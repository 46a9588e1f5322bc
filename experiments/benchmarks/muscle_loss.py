"""Muscle loss: the exp-domain contraction, the log-domain tensor and the paper's protocol.

  python -m experiments.benchmarks.muscle_loss [--dim=256] [--repeats=5] [--grad=all|user]

For each (B, M) it times, jitted and after warm-up (median of ``--repeats``,
more for fast cells; the paths of a cell called in turn, so that all of them
meet the same drift in this machine's speed), one user's loss and gradient,
server part included, at the paper's temperatures (tau = 0.2, gamma = 1/0.15 -
1/0.2). ``--grad=all`` (the default) differentiates with respect to the anchor
and the partners' representations, as a caller of the pure loss might;
``--grad=user`` does what FedMuscle's round does
(``algorithms.fedmuscle.user_gradients``): the server's half runs forward on
the partners' matrices as constants, and the user differentiates only with
respect to its own representation.

* contract:  ``muscle_loss(..., method="contract")``: one einsum of ``M``
  anchor-sample and ``M(M-1)/2`` sample-sample exp-domain matrices (what
  ``method="auto"`` picks here: the logit range R is printed);
* logsumexp: ``muscle_loss(..., method="logsumexp")``: a log-sum-exp over the
  broadcast ``[B]^(M+1)`` tensor (the library's path before the contraction,
  and its fallback);
* paper:     ``muscle_paper_targets`` (S ``[B^M, d]``, log alpha ``[B^M]``) then
  ``muscle_loss_from_paper_targets``: eq. (5) as the paper's server sends it;
* plain:     the same exp-domain denominator written outside the library (each
  factor shifted by its maximum, exponentiated, one greedy ``einsum``, the log
  and the shifts added back): what the library's contraction must not lose to.

It prints XLA's temporary memory for each compiled function
(``compile().memory_analysis()``), XLA's count of its FLOPs and
transcendentals (``cost_analysis()``; a lower bound, marked ``>=``, where the
program loops over anchor chunks), and the two speed ratios against the
contraction, measured in the same run, each beside its FLOP ratio: the speed
ratio the two would have if they ran at the same FLOP rate. A speed ratio far
above its FLOP ratio comes from the transcendentals avoided (the log-domain
path takes one ``exp`` per tuple term) or from the contraction's smaller
working set; one that tracks it says the contraction has no work left to
remove, only speed per FLOP to gain. Cells whose work (``B^(M+1)`` terms) or
memory would take minutes are not run and say so. The last lines check the
targets: >= 10x the log-domain path at M = 3 and M = 4 (B = 32), M = 5 at
B = 32 under 1 s, >= 1.00x the plain einsum (its time over the library's) at
M = 3, 4 and B = 32, 64 (the worst of the four printed), and >= 300x the
paper's protocol at M = 3, B = 32.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import benchmarks
from fedjax_mm import losses

_DIM = flags.DEFINE_integer("dim", 256, "Representation dimension d.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
  "repeats", 5, "Minimum timed runs per cell (median reported).", lower_bound=1
)
_MAX_GIB = flags.DEFINE_float(
  "max_gib", 8.0, "Skip cells whose compiled temporaries exceed this.", lower_bound=0.0
)
_BATCHES = benchmarks.define_counts("batches", ["32", "64", "128"], "Batch sizes B.")
_MAX_M = flags.DEFINE_integer("max_partners", 5, "Largest M.", lower_bound=1)
_GRAD = flags.DEFINE_enum(
  "grad",
  "all",
  ["all", "user"],
  "all: gradient w.r.t. the anchor and the partners; user: w.r.t. the anchor only, the "
  "partners' matrices constants (what FedMuscle's round computes).",
)
#: Largest number of tuple terms B^(M+1) each path is run at (beyond: seconds per call).
_MAX_TERMS = {"contract": 2**31, "logsumexp": 2**28, "paper": 2**28, "plain": 2**31}
TAU, GAMMA = 0.2, float(losses.muscle_gamma(0.2, 0.15))


def _loss(method):
  def fn(anchor, others):
    return losses.muscle_loss(anchor, others, tau=TAU, gamma=GAMMA, method=method).mean()

  return fn


def _paper(anchor, others):
  s, log_alpha = losses.muscle_paper_targets(others, tau=TAU, gamma=GAMMA)
  return losses.muscle_loss_from_paper_targets(anchor, s, log_alpha).mean()


def _plain(anchor, others):
  """The denominator as one exp-domain ``einsum``, written without the library.

  What a user would write from the module docstring's formula: each factor
  shifted by its largest entry and exponentiated, one ``einsum`` (opt_einsum's
  greedy order) of the ``M`` anchor-sample and ``M(M-1)/2`` sample-sample
  matrices, then the log and the shifts added back.
  """
  num_others = others.shape[0]
  letters = "abcdefghjklmnopqrstuvwxyz"[:num_others]
  pairs = [(m, n) for m in range(num_others) for n in range(m + 1, num_others)]
  logits = jnp.einsum("id,mkd->mik", anchor, others) / TAU  # [M, B, B]
  pair_logits = [-GAMMA * others[m] @ others[n].T for m, n in pairs]
  factors, shift = [], 0.0
  for x in [*logits, *pair_logits]:
    top = jax.lax.stop_gradient(jnp.max(x))
    factors.append(jnp.exp(x - top))
    shift = shift + top
  subscripts = ",".join([f"i{c}" for c in letters] + [letters[m] + letters[n] for m, n in pairs])
  total = jnp.einsum(f"{subscripts}->i", *factors, optimize="greedy")
  positive = jnp.einsum("mii->i", logits) + sum(jnp.diagonal(p) for p in pair_logits)
  return (jnp.log(total) + shift - positive).mean()


PATHS = {
  "contract": _loss("contract"),
  "logsumexp": _loss("logsumexp"),
  "paper": _paper,
  "plain": _plain,
}


def _loss_and_grad(loss_fn, grad):
  """The loss and its gradient in one of the ``--grad`` forms."""
  if grad == "all":
    return jax.value_and_grad(loss_fn, argnums=(0, 1))
  # The partners' matrices are what the server received: constants to the user.
  return jax.value_and_grad(lambda anchor, others: loss_fn(anchor, jax.lax.stop_gradient(others)))


def _compile(loss_fn, anchor, others, grad="all"):
  """``(compiled, temporary bytes, work)`` of the loss and its gradient.

  ``work`` is ``(FLOPs, transcendentals, exact)`` from XLA's cost analysis.
  The analysis counts a loop's body once, so where the compiled program
  loops (anchors streamed in chunks) the counts are lower bounds and
  ``exact`` is False.
  """
  compiled = jax.jit(_loss_and_grad(loss_fn, grad)).lower(anchor, others).compile()
  stats = compiled.memory_analysis()
  temp = None if stats is None else stats.temp_size_in_bytes
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  analysis = analysis or {}
  exact = " while(" not in compiled.as_text()
  work = (float(analysis.get("flops", 0.0)), float(analysis.get("transcendentals", 0.0)), exact)
  return compiled, temp, work


def _time(compiled, anchor, others, quotas):
  """Median time of each compiled path, the paths timed in turn after warm-up.

  Args:
    compiled: ``{path: compiled loss-and-gradient}``.
    anchor, others: their inputs.
    quotas: ``{path: minimum timed runs}``.

  Returns:
    ``{path: median seconds}``.

  The paths of a cell take turns, so they share the same stretch of this
  machine's drifting speed (it moves by 20-30% within a minute). In each turn
  a path is called once untimed and then timed: the paper's protocol streams
  tens of MiB through the caches, and a contraction timed right after it ran
  25-40% slower than in a run of its own. Millisecond calls are noisy, so a
  path keeps sampling past its quota until it has spent 1 s or made 50 runs.
  """
  times = {path: [] for path in compiled}

  def wants(path):
    t = times[path]
    return len(t) < quotas[path] or (sum(t) < 1.0 and len(t) < 50)

  while any(wants(path) for path in compiled):
    for path, fn in compiled.items():
      if wants(path):
        jax.block_until_ready(fn(anchor, others))  # its own data back in cache
        start = time.perf_counter()
        jax.block_until_ready(fn(anchor, others))
        times[path].append(time.perf_counter() - start)
  return {path: statistics.median(t) for path, t in times.items()}


def _prepare(path, batch, num_others, anchor, others, repeats):
  """``(compiled, quota, temp bytes, work, note)``; compiled is None when the cell is skipped."""
  terms = batch ** (num_others + 1)
  if terms > _MAX_TERMS[path]:
    return None, 0, None, None, f"{path}: not run ({terms:.1e} terms)"
  if path == "paper":
    s_bytes = batch**num_others * (anchor.shape[1] + 1) * 4
    if s_bytes > _MAX_GIB.value * 2**30:
      return None, 0, None, None, f"paper: not run, S alone is {s_bytes / 2**30:.0f} GiB"
  compiled, temp, work = _compile(PATHS[path], anchor, others, _GRAD.value)
  if temp is not None and temp > _MAX_GIB.value * 2**30:
    return None, 0, temp, work, f"{path}: not run, needs {temp / 2**30:.1f} GiB"
  slow = terms > 2**24
  return compiled, 2 if slow else repeats, temp, work, ""


def _ms(seconds):
  return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _gib(num_bytes):
  return "-" if num_bytes is None else f"{num_bytes / 2**30:.3f}"


def _ratio(slow, fast, digits=1):
  return "-" if slow is None or fast is None else f"{slow / fast:.{digits}f}x"


def _mflop(work):
  """``"16.5"``: XLA's FLOP count in millions (``">=16.5"`` where it is a lower bound)."""
  if work is None:
    return "-"
  flop, _, exact = work
  return f"{'' if exact else '>='}{flop / 1e6:.1f}"


def _work_ratio(slow, fast):
  """Ratio of FLOP counts: the speed ratio two paths would have at equal FLOP rates."""
  if slow is None or fast is None or not (slow[2] and fast[2]) or not fast[0]:
    return "-"
  return f"{slow[0] / fast[0]:.1f}x"


def main(argv):
  del argv
  dim, repeats = _DIM.value, _REPEATS.value
  wrt = "anchor and partners" if _GRAD.value == "all" else "anchor only, as FedMuscle's round"
  print(
    f"Muscle loss + gradient ({wrt}) for one user, d={dim}, tau={TAU}, "
    f"gamma={GAMMA:.4f}, device={jax.devices()[0].device_kind}"
  )
  print(
    "ms: median time; GiB: XLA's temporaries; MFLOP and Mexp: XLA's count of FLOPs and of "
    "transcendentals (exp, log); time and (FLOP) ratios against the contraction"
  )
  header = (
    f"{'B':>3} {'M':>2} {'R':>5} | {'contract ms':>11} {'GiB':>6} {'MFLOP':>8} | "
    f"{'logsumexp ms':>12} {'GiB':>6} {'MFLOP':>8} {'Mexp':>6} | "
    f"{'paper ms':>10} {'GiB':>6} {'MFLOP':>9} | {'lse/contr':>16} {'paper/contr':>17} | "
    f"{'plain ms':>9} {'plain/contr':>11}"
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
      prepared = {
        path: _prepare(path, batch, num_others, anchor, others, repeats) for path in PATHS
      }
      runnable = {path: p[0] for path, p in prepared.items() if p[0] is not None}
      seconds = _time(runnable, anchor, others, {path: prepared[path][1] for path in runnable})
      cell = {path: (seconds.get(path), p[2], p[3]) for path, p in prepared.items()}
      notes = [p[4] for p in prepared.values() if p[4]]
      results[batch, num_others] = cell
      logit_range = losses.muscle_logit_range(TAU, GAMMA, num_others)
      (c, c_mem, c_w), (l, l_mem, l_w), (p, p_mem, p_w), (e, _, _) = (
        cell["contract"],
        cell["logsumexp"],
        cell["paper"],
        cell["plain"],
      )
      exps = "-" if l_w is None else f"{l_w[1] / 1e6:.2f}"
      lse_ratio = f"{_ratio(l, c)} ({_work_ratio(l_w, c_w)})"
      paper_ratio = f"{_ratio(p, c)} ({_work_ratio(p_w, c_w)})"
      print(
        f"{batch:>3} {num_others:>2} {logit_range:>5.1f} | "
        f"{_ms(c):>11} {_gib(c_mem):>6} {_mflop(c_w):>8} | "
        f"{_ms(l):>12} {_gib(l_mem):>6} {_mflop(l_w):>8} {exps:>6} | "
        f"{_ms(p):>10} {_gib(p_mem):>6} {_mflop(p_w):>9} | "
        f"{lse_ratio:>16} {paper_ratio:>17} | {_ms(e):>9} {_ratio(e, c, 2):>11}  "
        f"{'; '.join(notes)}",
        flush=True,
      )

  def get(batch, num_others, path):
    return results.get((batch, num_others), {}).get(path, (None, None, None))[0]

  def work(batch, num_others, path):
    return results.get((batch, num_others), {}).get(path, (None, None, None))[2]

  print("targets (B = 32):")
  for num_others in (3, 4):
    print(
      f"  M={num_others}: contraction vs log-domain "
      f"{_ratio(get(32, num_others, 'logsumexp'), get(32, num_others, 'contract'))} (target >= 10x; "
      f"FLOP ratio {_work_ratio(work(32, num_others, 'logsumexp'), work(32, num_others, 'contract'))})"
    )
  print(f"  M=5: contraction {_ms(get(32, 5, 'contract'))} ms (target < 1000 ms)")
  plain = {
    (batch, num_others): (get(batch, num_others, "plain"), get(batch, num_others, "contract"))
    for batch in (32, 64)
    for num_others in (3, 4)
    if None not in (get(batch, num_others, "plain"), get(batch, num_others, "contract"))
  }
  cells = ", ".join(f"B={b} M={m} {_ratio(*plain[b, m], 2)}" for b, m in plain) or "not run"
  worst = min((e / c for e, c in plain.values()), default=None)
  print(
    f"  contraction vs a plain einsum (time plain / library): {cells}; worst "
    f"{'-' if worst is None else f'{worst:.2f}x'} (target >= 1.00x)"
  )
  print(
    f"  M=3: contraction vs the paper's protocol "
    f"{_ratio(get(32, 3, 'paper'), get(32, 3, 'contract'))} (target >= 300x; "
    f"FLOP ratio {_work_ratio(work(32, 3, 'paper'), work(32, 3, 'contract'))})"
  )


if __name__ == "__main__":
  app.run(main)
