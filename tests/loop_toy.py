"""A toy experiment for the loop's tests: no model, no data, a scalar per user whose round adds 1.

:func:`experiment` is a :class:`fedjax_mm.runner.loop.Experiment` with two
methods over two users: ``one`` adds 1 to each user's scalar per round,
``two`` adds 2. Each round also draws a uniform number from the method's own
typed PRNG key, so a resume has to restore keys bit for bit; ``one``'s users
send 4 bytes up and receive 8 per round (``two`` sends nothing); evaluation
(every 2 rounds and after the last) reads the scalars back. ``nan_at=R`` makes
``two`` give user b a NaN in round R.

Run as a script, it is the process the tests kill::

  python tests/loop_toy.py WORKDIR [PAUSE]

PAUSE stops the run at one moment, writes ``WORKDIR.paused`` and sleeps there
until killed: ``round:R`` inside round R (``one`` has run it, ``two`` has
not), ``checkpoint:R`` once round R's checkpoint is written but before Orbax
renames it into place, ``report`` once ``report.md`` is written and before
the plot and ``results.json``.
"""

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_mm.runner import loop
from fedjax_mm.runner.writers import metric_series

USERS = ("user a", "user b")
STEPS = {"one": 1.0, "two": 2.0}


def get_config():
  return ml_collections.ConfigDict({"rounds": 5, "checkpoint_every": 2, "nan_at": 0})


def experiment(config) -> loop.Experiment:
  def step(m):
    @jax.jit
    def fn(state):
      rng, key = jax.random.split(state["rng"])
      done = state["round"] + 1
      poison = (m == "two") & (done == config.nan_at) & (jnp.arange(len(USERS)) == 1)
      x = state["x"] + jnp.where(poison, jnp.nan, STEPS[m])
      out = {"finite": jnp.isfinite(x), "draw": jax.random.uniform(key)}
      return {"round": done, "x": x, "rng": rng}, out

    return fn

  def init():
    return {
      m: {
        "round": jnp.zeros((), jnp.int32),
        "x": jnp.zeros(len(USERS), jnp.float32),
        "rng": jax.random.key(i),
      }
      for i, m in enumerate(STEPS)
    }

  def scalars(r, outs, evals):
    rows = []
    for m in STEPS:
      values = {"draw": float(outs[m]["draw"])}
      values |= {f"{user}/x": v for user, v in evals.get(m, {}).items()}
      rows.append((m, values))
    if evals:  # A second line of one run in the same round, as FedMuscle's Delta.
      rows.append(("one", {"gap": evals["two"]["user a"] - evals["one"]["user a"]}))
    return rows

  def report(outcome):
    history = outcome.history
    ledger = outcome.ledgers["one"]
    results = {
      "final": outcome.final,
      "draws": {m: metric_series(history, "draw", run=m) for m in STEPS},
      "gap": metric_series(history, "gap", run="one"),
      "traffic": {m: [l.total_up, l.total_down] for m, l in outcome.ledgers.items()},
      "ledger_rounds": [record["round"] for record in ledger.rounds],
      "wall_time_s": outcome.wall_time_s,
    }
    resumed = f" (resumed at round {outcome.resumed_at})" if outcome.resumed_at else ""
    text = f"x after {config.rounds} rounds: {outcome.final}{resumed}"
    curves = {"user a": {m: metric_series(history, "user a/x", run=m) for m in STEPS}}
    return loop.Report(
      title="Toy",
      sections=[("Result", text)],
      plots={"x.png": loop.Curves(curves, "x per round", "x")},
      results=results,
      text=text,
    )

  return loop.Experiment(
    init=init,
    methods={m: step(m) for m in STEPS},
    evaluate=lambda s: {user: float(v) for user, v in zip(USERS, np.asarray(s["x"]), strict=True)},
    nonfinite=lambda out: [USERS[i] for i in np.flatnonzero(~np.asarray(out["finite"]))],
    scalars=scalars,
    runs=tuple(STEPS),
    report=report,
    traffic=lambda m, out: ([4, 4], [8, 8]) if m == "one" else None,
    eval_every=2,
    postfix=lambda evals: {"x": str(evals["one"])} if evals else {},
  )


def _pause(marker: pathlib.Path) -> None:
  marker.write_text("")
  time.sleep(600)


def _pausing(pause: str, marker: pathlib.Path):
  """``experiment`` with the pause of the module docstring wired in."""
  kind, _, at = pause.partition(":")
  if kind == "checkpoint":
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self):  # Runs in Orbax's writer: the step stays a tmp folder.
      if self.get_final().name == at:
        _pause(marker)
      await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = held
  elif kind == "report":
    from fedjax_mm.runner import report as report_lib

    report_lib.plot_curves = lambda *args, **kwargs: _pause(marker)

  def build(config):
    exp = experiment(config)
    if kind != "round":
      return exp
    two = exp.methods["two"]

    def paused(state):
      if int(state["round"]) + 1 == int(at):
        _pause(marker)
      return two(state)

    return exp._replace(methods={"one": exp.methods["one"], "two": paused})

  return build


if __name__ == "__main__":
  workdir = pathlib.Path(sys.argv[1])
  build = experiment
  if len(sys.argv) > 2:
    build = _pausing(sys.argv[2], pathlib.Path(f"{workdir}.paused"))
  loop.run(build, get_config(), workdir, progress=False)
