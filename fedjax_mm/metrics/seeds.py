"""Comparisons over seeds: a mean with its 95% Student-t interval, and paired differences.

How every summary over seeds states a result (``python -m experiments.summarize``): each
method's metric as the mean over ``n`` seeds with the half-width of its 95% confidence
interval, and a comparison of two methods as the **paired** difference (seed by seed:
method ``a`` on seed ``s`` minus method ``b`` on seed ``s``, so that what the seed draws, the
data, the partition and the initial models, cancels), its mean and 95% interval
``mean ± t_{0.975, n-1} * sd / sqrt(n)``. A claim "``a`` beats ``b``" is **reproduced**
when the interval excludes zero in the claimed direction (:func:`verdict`); an interval
that holds zero is **undecided** at these seeds, and one that excludes it the other way
is **reversed**.

Host-side numpy and scipy (the t quantile), nothing traced.

Example:
  >>> d = paired_difference([71.0, 74.0, 70.5, 73.0, 72.0], [69.0, 71.5, 70.0, 70.0, 70.5])
  >>> print(d)
  +1.90 [+0.71, +3.09] (n=5)
  >>> verdict(d, direction=+1)
  'reproduced'
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
from scipy import stats

#: Confidence of every interval the summaries print.
CONFIDENCE = 0.95


class Interval(NamedTuple):
  """A mean over ``n`` seeds and its two-sided confidence interval ``[low, high]``.

  With one seed there is no spread: ``low = high = nan`` (not a zero-width interval).
  """

  mean: float
  low: float
  high: float
  n: int

  @property
  def half_width(self) -> float:
    return (self.high - self.low) / 2

  def format(self, digits: int = 2, *, signed: bool = True, count: bool = True) -> str:
    """``"+1.90 [+0.71, +3.09] (n=5)"``; ``"+1.90 (n=1)"`` without spread; ``count=False``
    leaves ``(n=...)`` out (a table's cell, its seeds said once above)."""

    def f(x: float) -> str:
      x = 0.0 if round(x, digits) == 0 else x  # never "-0.00"
      return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"

    n = f" (n={self.n})" if count else ""
    if math.isnan(self.low):
      return f"{f(self.mean)}{n}"
    return f"{f(self.mean)} [{f(self.low)}, {f(self.high)}]{n}"

  def __str__(self) -> str:
    return self.format()


def t_quantile(n: int, confidence: float = CONFIDENCE) -> float:
  """``t_{(1+c)/2, n-1}``: the half-width of a ``c`` interval in standard errors (2.776 at n=5)."""
  if n < 2:
    raise ValueError(f"a t interval needs at least 2 values, got {n}")
  return float(stats.t.ppf((1 + confidence) / 2, n - 1))


def interval(values: Iterable[float], confidence: float = CONFIDENCE) -> Interval:
  """The mean of ``values`` and its Student-t interval (sample std, ``n - 1`` degrees).

  Raises:
    ValueError: no values, or a NaN / Inf among them.
  """
  x = np.asarray([float(v) for v in values], np.float64)
  if x.size == 0:
    raise ValueError("an interval needs at least one value")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"non-finite values in {x.tolist()}")
  mean = float(x.mean())
  if x.size == 1:
    return Interval(mean, math.nan, math.nan, 1)
  half = t_quantile(x.size, confidence) * float(x.std(ddof=1)) / math.sqrt(x.size)
  return Interval(mean, mean - half, mean + half, int(x.size))


def paired_difference(
  a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
  """``a[s] - b[s]`` over the seeds ``s``, and its interval; ``a`` and ``b`` in seed order.

  Raises:
    ValueError: ``a`` and ``b`` differ in length (every seed must have both methods).
  """
  if len(a) != len(b):
    raise ValueError(f"paired values need one of each per seed: {len(a)} vs {len(b)}")
  return interval(np.asarray(a, np.float64) - np.asarray(b, np.float64), confidence)


def verdict(diff: Interval, direction: int = +1) -> str:
  """Whether ``diff`` (``a - b``) shows the claim "``a`` is better" in ``direction``.

  Args:
    diff: a :func:`paired_difference`.
    direction: ``+1`` when higher is better (accuracy, recall), ``-1`` when lower is.

  Returns:
    ``"reproduced"`` (the interval excludes 0 in the claimed direction), ``"reversed"``
    (it excludes 0 the other way), ``"undecided"`` (it holds 0), or ``"one seed"``
    (no interval).
  """
  if direction not in (-1, 1):
    raise ValueError(f"direction is +1 or -1, got {direction}")
  if math.isnan(diff.low):
    return "one seed"
  low, high = (diff.low, diff.high) if direction > 0 else (-diff.high, -diff.low)
  if low > 0:
    return "reproduced"
  if high < 0:
    return "reversed"
  return "undecided"
