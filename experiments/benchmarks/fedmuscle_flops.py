"""FLOPs per round of every FedMuscle-experiment method, users and server apart.

  python -m experiments.benchmarks.fedmuscle_flops [--variant=smoke]

Builds the users of ``experiments/fedmuscle.py`` (or its ``--variant``) and
prints :func:`fedjax_mm.algorithms.cost.method_costs` for every method, FedMuscle
once per contrastive loss (muscle, pairwise, gramian): GFLOPs per round of
all users, of each user, and of the server. Nothing is trained (each method's
steps are compiled once; see ``fedjax_mm/algorithms/cost.py`` for what is counted).
"""

from __future__ import annotations

from absl import app, flags

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm.algorithms import cost
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner import fedmuscle_report, report

_VARIANT = flags.DEFINE_string("variant", None, "experiments/fedmuscle.py variant (e.g. smoke)")


def main(argv):
  del argv
  config = fedmuscle_config.get_config(_VARIANT.value)
  users, groups, states, train, _, public, _ = runner.build(config)
  archs = tuple(runner._architecture(config, u) for u in users)
  count = lambda methods: cost.method_costs(
    config, methods, groups, states, train, public, architectures=archs
  )
  rows, giga = [], lambda x: f"{x / 1e9:.4g}"
  for loss in ("muscle", "pairwise", "gramian"):
    config.muscle.loss = loss
    c = count(["fedmuscle"])["fedmuscle"]
    rows.append([f"FedMuscle ({loss})", c])
  others = [m for m in runner.METHODS if m != "fedmuscle"]
  rows += [[fedmuscle_report.label(config, m), c] for m, c in count(others).items()]
  per_user = "per user (" + ", ".join(f"{u.index + 1}: {u.encoder}/{u.task}" for u in users) + ")"
  print(
    report.format_table(
      ["method", "users, GFLOPs/round", per_user, "server, GFLOPs/round"],
      [
        [name, giga(sum(c.users)), " / ".join(giga(x) for x in c.users), giga(c.server)]
        for name, c in rows
      ],
    )
  )
  mc = config.muscle
  print(
    f"M={mc.num_partners}, B={mc.batch_size}, T={mc.cl_epochs}, P={config.public.size}, "
    f"E={config.local_epochs}, d={config.rep_dim}"
  )


if __name__ == "__main__":
  app.run(main)
