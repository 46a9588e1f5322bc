"""Equality of two compiled programs that do the same float32 arithmetic.

Two programs that compute the same thing in a different structure (a round with
faults switched on but nothing drawn and one without; a vmapped group and the
same clients one by one; a method with its extra term weighted 0 and the method
without it) are mathematically equal, but XLA fuses each differently and may
sum in another order, so the float32 results can differ in their last bits (a
few ulp; seen with XLA:CPU's elemental fusion emitters, which the tests select
in ``conftest.py``), and training steps carry such differences into trained
parameters, growing with each step (measured: up to 1.3e-7 on weights of about
0.03 after CreamFL's local SGD steps at learning rate 0.5). These tests
therefore compare at :data:`RTOL` and :data:`ATOL`, an order of magnitude above
that and orders of magnitude below one optimiser step of the toys (AdamW at
1e-3, Adam at 1e-2, SGD at 0.5), so far below any effect a term, a weight or a
missed client would have (:func:`close` is also how the tests say "differs").
"""

import jax
import numpy as np

RTOL = 1e-5
ATOL = 1e-6


def _raw(x):
  x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return np.asarray(x)


def assert_close(a, b):
  """Every leaf of ``a`` equals ``b``'s up to float32 rounding (keys and ints exactly)."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  for x, y in pairs:
    x, y = _raw(x), _raw(y)
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)
    else:
      np.testing.assert_array_equal(x, y)


def close(a, b) -> bool:
  """Whether :func:`assert_close` would pass."""
  try:
    assert_close(a, b)
  except AssertionError:
    return False
  return True
