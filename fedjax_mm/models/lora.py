"""Low-rank adapters (LoRA, Hu et al., ICLR 2022) and the filters that select what trains.

FedMuscle fine-tunes every user's encoder with LoRA of rank 16: each adapted
dense layer computes

    y = x W + b + (x A) B          A: [in, r] (he-uniform),  B: [r, out] (zeros)

so a freshly initialised adapter leaves the layer's output unchanged, and
training only (A, B) costs ``r * (in + out)`` parameters per layer instead of
``in * out``.

Which layers carry adapters is decided by the encoders: every dense layer of
attention (q, k, v, out), of the transformer MLPs and of the GRU is built with
:func:`dense`; patch/token embeddings, convolutions and norms are not adapted.
The adapters are ``nnx.LoRAParam`` variables (a subclass of ``nnx.Param``), so
they are selected by type, while the projector and head are selected by path.

Typical use in a training step::

  wrt = trainable_filter(lora=config.lora_rank > 0)
  graphdef, trainable, frozen = nnx.split(model, wrt, ...)
  grads = jax.grad(loss_fn)(trainable, frozen, batch)   # only `trainable`
  # or: nnx.Optimizer(model, optax.adamw(1e-3), wrt=wrt)
"""

from __future__ import annotations

from flax import nnx

__all__ = [
  "adapter_filter",
  "dense",
  "frozen_filter",
  "trainable_filter",
]

#: Selects only the LoRA adapter matrices (``lora_a``, ``lora_b``).
adapter_filter = nnx.LoRAParam


def dense(
  in_features: int,
  out_features: int,
  *,
  lora_rank: int = 0,
  rngs: nnx.Rngs,
  **kwargs,
) -> nnx.Linear:
  """A dense layer, LoRA-adapted when ``lora_rank > 0``.

  The layer draws exactly one key from ``rngs.params`` whatever the rank, and
  the base kernel is initialised from that key alone. Hence a model built with
  ``lora_rank=r`` from a given seed has *the same* base weights as the model
  built with ``lora_rank=0`` from that seed, and (since ``B = 0``) the same
  outputs; the base parameter paths (``kernel``, ``bias``) are identical too,
  so a base checkpoint loads into the adapted model with ``nnx.update``.

  Args:
    in_features: input width.
    out_features: output width.
    lora_rank: adapter rank r; 0 gives a plain ``nnx.Linear``.
    rngs: random streams; one ``params`` key is consumed.
    **kwargs: forwarded to ``nnx.Linear`` (e.g. ``use_bias``, ``kernel_init``).

  Returns:
    ``nnx.Linear`` (rank 0) or ``nnx.LoRALinear`` whose adapters live under
    ``.lora.lora_a`` ``[in, r]`` and ``.lora.lora_b`` ``[r, out]``.
  """
  if lora_rank < 0:
    raise ValueError(f"lora_rank must be >= 0, got {lora_rank}.")
  sub = nnx.Rngs(params=rngs.params())
  if lora_rank == 0:
    return nnx.Linear(in_features, out_features, rngs=sub, **kwargs)
  return nnx.LoRALinear(in_features, out_features, lora_rank=lora_rank, rngs=sub, **kwargs)


def _projector_or_head():
  return nnx.Any(nnx.PathContains("projector"), nnx.PathContains("head"))


def trainable_filter(lora: bool) -> nnx.filterlib.Filter:
  """The nnx filter of the parameters a user trains.

  Args:
    lora: whether the model is fine-tuned with adapters.

  Returns:
    ``nnx.Param`` (everything) when ``lora`` is False; otherwise the adapters
    (``nnx.LoRAParam``) plus every parameter of the ``projector`` and ``head``,
    so the encoder's base weights, embeddings and norms stay frozen. Usable as
    ``nnx.Optimizer(model, tx, wrt=...)`` and as the first filter of
    ``nnx.split(model, filter, ...)``. Intersect with
    :data:`fedjax_mm.models.representation_filter` (``nnx.All``) for the
    contrastive epochs that update only encoder + projector.
  """
  if not lora:
    return nnx.Param
  return nnx.Any(adapter_filter, nnx.All(nnx.Param, _projector_or_head()))


def frozen_filter(lora: bool) -> nnx.filterlib.Filter:
  """The complement of :func:`trainable_filter` among parameters."""
  return nnx.All(nnx.Param, nnx.Not(trainable_filter(lora)))
