"""FLOPs of a function as XLA counts them: ``jax.jit(fn).lower(...).compile().cost_analysis()``.

What the count is (observed on XLA:CPU, JAX 0.10; ``tests/test_cost.py`` checks
the first two):

* **A matrix product** ``[m, k] @ [k, n]`` counts ``2 m n k`` (one multiply and
  one add per term), exactly.
* **A convolution** counts two per multiply-add actually performed: with
  ``SAME`` padding the taps that fall on the zero border are not counted (an
  8x8 image, 3x3 kernel, 3 -> 4 channels: 11,616, not the naive 13,824).
* **Elementwise arithmetic** counts one per element; **transcendentals**
  (``exp``, ``log``, ``tanh``, ...) are *not* in ``flops`` but in a separate
  ``transcendentals`` entry, which :func:`flops` leaves out (a softmax's
  exponentials are cheap beside the matrix products here).
* **Loops are counted once.** The body of a ``lax.scan`` / ``fori_loop`` /
  ``lax.map`` (an HLO ``while``) is counted a single time, whatever its trip
  count (10 chained matmuls in a scan count as one, plus the loop counter).
  Callers must therefore count one step (one local step, one public batch)
  and multiply by the number of steps themselves, and avoid ``lax.map``
  chunking inside what they count.
* **Fusion** does not change the count (the analysis runs on the optimised
  HLO, with fused computations counted op by op); an op that XLA removes
  (a multiplication by a constant one, a transpose) counts nothing, and a
  custom call into a library counts nothing at all (none was met here:
  ``jnp.linalg.det`` of small matrices compiled to counted HLO).
* ``cost_analysis()`` returns a dict in current JAX; older versions returned a
  list with one dict per computation, both are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def flops(fn: Callable[..., Any], *args: Any) -> float:
  """FLOPs of ``fn(*args)`` as XLA's cost analysis of the compiled function counts them.

  Args:
    fn: a traceable function (it is jitted here; nothing is run).
    *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees.

  Returns:
    The ``flops`` entry of the compiled function's cost analysis (0 when the
    backend reports none). Loops count their body once (module docstring).

  Examples:
    >>> import jax.numpy as jnp
    >>> flops(jnp.matmul, jnp.ones((8, 16)), jnp.ones((16, 4)))
    1024.0
  """
  analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  return float((analysis or {}).get("flops", 0.0))


def matrix_products(fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
  """The matrix products (``dot_general``) in the jaxpr of ``fn(*args)``, loop bodies once.

  What a benchmark needs to time each product alone (for instance to bound how
  fast a step could be if nothing but its products cost): each entry holds
  ``lhs`` and ``rhs`` (``jax.ShapeDtypeStruct``), ``dimension_numbers``,
  ``precision`` and ``preferred_element_type``, the parameters of
  ``jax.lax.dot_general``. Like :func:`flops`, the body of a scan or loop is
  read once, and every nested jaxpr (``jit``, ``custom_jvp``, a ``cond``'s
  branches) is entered. The products are those of the traced program, before
  XLA's optimisations: XLA may still fuse, merge or drop some.

  Examples:
    >>> import jax.numpy as jnp
    >>> [(p["lhs"].shape, p["rhs"].shape) for p in matrix_products(jnp.matmul,
    ...   jnp.ones((8, 16)), jnp.ones((16, 4)))]
    [((8, 16), (16, 4))]
  """
  return [
    {
      "lhs": jax.ShapeDtypeStruct(eqn.invars[0].aval.shape, eqn.invars[0].aval.dtype),
      "rhs": jax.ShapeDtypeStruct(eqn.invars[1].aval.shape, eqn.invars[1].aval.dtype),
      "dimension_numbers": eqn.params["dimension_numbers"],
      "precision": eqn.params.get("precision"),
      "preferred_element_type": eqn.params.get("preferred_element_type"),
    }
    for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr, "dot_general")
  ]


def equations(jaxpr: Any, primitive: str) -> list[Any]:
  """Every equation of ``primitive`` in ``jaxpr`` and the jaxprs nested in it, in order.

  ``jaxpr`` is a ``Jaxpr`` or a ``ClosedJaxpr``. Nested jaxprs (a scan's body,
  a ``jit``, a ``custom_jvp``, a ``cond``'s branches, a ``shard_map``) are
  entered, and a loop body is read once.
  """
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if eqn.primitive.name == primitive:
      found.append(eqn)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          found += equations(sub, primitive)
  return found
