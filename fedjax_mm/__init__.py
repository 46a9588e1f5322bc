"""fedjax_mm: federated multi-task and multimodal learning in JAX/Flax.

Subpackages (each imports only the ones listed before it):
  losses   pure contrastive losses (InfoNCE, pairwise, Muscle, Gramian)
  metrics  pure evaluation metrics
  models   Flax NNX encoders, heads, LoRA
  data     the embedded multimodal world, real datasets, partitioning
  core     stacked client groups, vmapped local training, sharding, ledger, checkpoints
  server   pure transforms of stacked client updates
  algorithms  one module per published system

Import what you need, e.g. ``from fedjax_mm import losses``; importing the
package itself does not import the heavy subpackages.
"""

__version__ = "0.1.0"
