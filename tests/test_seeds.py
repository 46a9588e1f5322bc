"""Intervals over seeds: equal to scipy's paired t-test interval; the verdicts' three cases."""

import math

import numpy as np
import pytest
from scipy import stats

from fedjax_mm.metrics import seeds


@pytest.mark.parametrize("n", [2, 3, 5, 10])
def test_paired_difference_is_scipys_paired_t_interval(n):
  rng = np.random.default_rng(n)
  a, b = rng.normal(70, 3, n), rng.normal(69, 3, n)
  ours = seeds.paired_difference(a, b)
  ref = stats.ttest_rel(a, b).confidence_interval(0.95)
  np.testing.assert_allclose([ours.low, ours.high], [ref.low, ref.high], rtol=1e-12)
  np.testing.assert_allclose(ours.mean, np.mean(a - b), rtol=1e-12)
  assert ours.n == n


def test_interval_is_scipys_one_sample_interval():
  x = np.array([0.1, 0.4, 0.35, 0.8, 0.2])
  ref = stats.ttest_1samp(x, 0.0).confidence_interval(0.9)
  ours = seeds.interval(x, confidence=0.9)
  np.testing.assert_allclose([ours.low, ours.high], [ref.low, ref.high], rtol=1e-12)
  assert seeds.t_quantile(5) == pytest.approx(2.7764451, abs=1e-6)


def test_verdicts():
  up = seeds.paired_difference([3.0, 4.0, 5.0], [1.0, 1.5, 2.0])
  assert up.low > 0 and seeds.verdict(up, +1) == "reproduced"
  assert seeds.verdict(up, -1) == "reversed"
  flat = seeds.paired_difference([1.0, 2.0, 3.0], [2.0, 1.0, 3.0])
  assert flat.low < 0 < flat.high and seeds.verdict(flat, +1) == "undecided"
  one = seeds.paired_difference([1.0], [0.0])
  assert math.isnan(one.low) and seeds.verdict(one) == "one seed"
  assert str(one) == "+1.00 (n=1)"
  assert seeds.Interval(-1e-9, -0.5, 0.5, 3).format(2) == "+0.00 [-0.50, +0.50] (n=3)"


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="one of each per seed"):
    seeds.paired_difference([1.0, 2.0], [1.0])
  with pytest.raises(ValueError, match="non-finite"):
    seeds.interval([1.0, float("nan")])
  with pytest.raises(ValueError, match="at least one"):
    seeds.interval([])
  with pytest.raises(ValueError, match="direction"):
    seeds.verdict(seeds.interval([1.0, 2.0]), 0)
