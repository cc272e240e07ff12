"""Differences between two variants measured on the same items, as paired data.

Model: every function takes the reference's and the variant's scores on the same items (documents,
or windows of held-out text), in the same order, and returns a `Paired`: the mean difference
(variant - reference) with its 95% interval, a two-sided p-value, and the smallest difference this
many items could have detected (`mde`: 80% power at alpha 0.05, from the difference's standard
error). Pairing removes the item-to-item variance that two unpaired standard errors keep, so far
smaller differences are told from noise.

- Accuracy (0/1 per document): McNemar's exact test (a binomial test on the discordant documents)
  and a paired bootstrap interval of the accuracy difference.
- A per-window mean (NLL per token): a paired t-test and its interval; windows of held-out text are
  few (8-32) and close to independent.
- Bits per byte over documents of unequal length: the ratio sum(loglikelihood) / sum(bytes) per
  variant; a paired bootstrap interval over documents and a paired permutation (swap within
  documents) p-value.

`adjust` corrects p-values for the number of comparisons (Benjamini-Hochberg: the expected share
of false "differences" among those called is at most alpha); `verdict` names the outcome.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.80
RESAMPLES = 10_000
Z_MDE = float(stats.norm.ppf(1 - ALPHA / 2) + stats.norm.ppf(POWER))
"""A true difference of Z_MDE standard errors is detected with 80% power at alpha 0.05."""
MCNEMAR_MIN_DISCORDANT = 6
"""The fewest discordant documents (all one way) for which McNemar's exact two-sided p < 0.05."""

Verdict = Literal["better", "worse", "no detectable difference"]


@dataclass(frozen=True)
class Paired:
    n: int
    """Items scored by both."""
    delta: float
    """Mean of variant - reference, in the metric's unit."""
    low: float
    high: float
    """The 95% interval of `delta`."""
    p: float
    """Two-sided p-value of "no difference" (1.0 when every pair is equal)."""
    mde: float
    """The smallest |delta| this n detects with 80% power at alpha 0.05."""
    test: str

    def to_json(self) -> dict[str, float | int | str]:
        return asdict(self)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def accuracy_difference(
    reference: Sequence[float], variant: Sequence[float], seed: int = 0
) -> Paired:
    """Accuracy of `variant` minus `reference` on the same documents (each score 0 or 1)."""
    ref, var = _pair(reference, variant)
    b = int(np.sum((ref == 1) & (var == 0)))  # right before, wrong now
    c = int(np.sum((ref == 0) & (var == 1)))
    p = stats.binomtest(c, b + c, 0.5).pvalue if b + c else 1.0
    diffs = var - ref
    low, high, stderr = _bootstrap_mean(diffs, seed)
    mde = max(Z_MDE * stderr, MCNEMAR_MIN_DISCORDANT / len(diffs))
    return Paired(len(diffs), float(diffs.mean()), low, high, float(p), mde, "mcnemar-exact")


def window_difference(reference: Sequence[float], variant: Sequence[float]) -> Paired:
    """Mean of `variant` minus `reference` over the same windows (paired t)."""
    ref, var = _pair(reference, variant)
    diffs = var - ref
    n, delta = len(diffs), float(diffs.mean())
    sd = float(diffs.std(ddof=1)) if n > 1 else 0.0
    if n < 2 or sd == 0.0:
        return Paired(n, delta, delta, delta, 1.0 if delta == 0 else 0.0, 0.0, "paired-t")
    result = stats.ttest_1samp(diffs, 0.0)
    interval = result.confidence_interval(1 - ALPHA)
    stderr = sd / math.sqrt(n)
    t_power = float(stats.t.ppf(1 - ALPHA / 2, n - 1) + stats.t.ppf(POWER, n - 1))
    return Paired(
        n, delta, float(interval.low), float(interval.high), float(result.pvalue),
        t_power * stderr, "paired-t",
    )  # fmt: skip


def bits_per_byte_difference(
    reference_ll: Sequence[float],
    variant_ll: Sequence[float],
    doc_bytes: Sequence[int],
    seed: int = 0,
) -> Paired:
    """Bits per byte of `variant` minus `reference` over the same documents, each given as its
    summed loglikelihood (nats) and its UTF-8 bytes: sum(-ll) / sum(bytes) / ln 2 per variant."""
    ref, var = _pair(reference_ll, variant_ll)
    size = np.asarray(doc_bytes, dtype=np.float64)
    if len(size) != len(ref):
        raise ValueError(f"{len(size)} byte counts for {len(ref)} documents")

    def statistic(r: np.ndarray, v: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        return (r - v).sum(axis=axis) / b.sum(axis=axis) / math.log(2)

    delta = float(statistic(ref, var, size))
    if len(ref) < 2 or np.all(ref == var):
        return Paired(len(ref), delta, delta, delta, 1.0, 0.0, "paired-permutation")
    boot = stats.bootstrap(
        (ref, var, size), statistic, paired=True, vectorized=True, n_resamples=RESAMPLES,
        method="percentile", rng=_rng(seed),
    )  # fmt: skip
    perm = stats.permutation_test(
        (ref, var), lambda r, v, axis=-1: statistic(r, v, size, axis), vectorized=True,
        permutation_type="samples", n_resamples=RESAMPLES, rng=_rng(seed + 1),
    )  # fmt: skip
    low, high = boot.confidence_interval
    return Paired(
        len(ref), delta, float(low), float(high), float(perm.pvalue),
        Z_MDE * float(boot.standard_error), "paired-permutation",
    )  # fmt: skip


def adjust(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, in the given order."""
    if not p_values:
        return []
    return [float(p) for p in stats.false_discovery_control(np.asarray(p_values), method="bh")]


def verdict(
    delta: float, p_adjusted: float, better: Literal["higher", "lower"], alpha: float = ALPHA
) -> Verdict:
    if p_adjusted >= alpha or delta == 0:
        return "no detectable difference"
    return "better" if (delta > 0) == (better == "higher") else "worse"


def _pair(reference: Sequence[float], variant: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    ref, var = np.asarray(reference, dtype=np.float64), np.asarray(variant, dtype=np.float64)
    if ref.shape != var.shape or ref.ndim != 1 or len(ref) == 0:
        raise ValueError(
            f"paired scores need two equal, non-empty lists ({ref.shape}, {var.shape})"
        )
    return ref, var


def _bootstrap_mean(diffs: np.ndarray, seed: int) -> tuple[float, float, float]:
    """(low, high, standard error) of the mean of `diffs`, paired bootstrap, percentile."""
    if len(diffs) < 2 or np.all(diffs == diffs[0]):
        return float(diffs[0]), float(diffs[0]), 0.0
    boot = stats.bootstrap(
        (diffs,), np.mean, vectorized=True, n_resamples=RESAMPLES, method="percentile",
        rng=_rng(seed),
    )  # fmt: skip
    low, high = boot.confidence_interval
    return float(low), float(high), float(boot.standard_error)
