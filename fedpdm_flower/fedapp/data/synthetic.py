"""Small deterministic datasets for unit tests and fast CI runs.

Everything here is generated from a seed with numpy only, so it needs no files and no network. The
classification sets mimic the real loaders' layout (features roughly in [0, 1] followed by a constant
1.0 bias column) so that code written for MNIST runs unchanged on them.

Registered names (usable wherever a dataset name is accepted, e.g. ``load_dataset`` and
``load_partition``):

========================  =======  ======  ==============  =======  =================================
name                      train    test    features        classes  use
========================  =======  ======  ==============  =======  =================================
``synthetic``             2000     500     20 + bias = 21  4        default fast dataset
``synthetic-10class``     6000     1000    20 + bias = 21  10       MNIST-like label structure
``synthetic-binary``      3256     1628    20 + bias = 21  2        Adult-like, 76 % / 24 % classes
========================  =======  ======  ==============  =======  =================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.data.partition import largest_remainder
from fedpdm_flower.fedapp.data.sources import ArrayDataset, DatasetInfo

# Per-feature noise: a linear (ridge) classifier reaches about 97 % / 90 % / 98 % test accuracy on
# the three presets, so the tasks are learnable (> 80 %) but not saturated, leaving room to see
# the cost of DP noise or compression.
_NOISE_STD = 0.2


@dataclass(frozen=True)
class _Preset:
    num_train: int
    num_test: int
    num_features: int
    num_classes: int
    class_weights: tuple[float, ...] | None
    seed: int


SYNTHETIC_PRESETS: dict[str, _Preset] = {
    "synthetic": _Preset(2000, 500, 20, 4, None, 20240),
    "synthetic-10class": _Preset(6000, 1000, 20, 10, None, 20241),
    # Adult's train class balance (24720 / 7841) at one tenth of the size.
    "synthetic-binary": _Preset(3256, 1628, 20, 2, (0.7592, 0.2408), 20242),
}


def make_classification(
    n_samples: int,
    num_features: int,
    num_classes: int,
    seed: int,
    *,
    class_weights: Sequence[float] | None = None,
) -> ArrayDataset:
    """Gaussian class blobs in the unit cube, with a bias column appended.

    Parameters
    ----------
    n_samples : int
        Number of samples, at least ``num_classes``.
    num_features : int
        Number of informative features, before the bias column (the result has ``num_features + 1``).
    num_classes : int
        Number of classes, at least 2. Labels are ``0 .. num_classes - 1``.
    seed : int
        Seed of the generator; equal arguments give identical arrays.
    class_weights : sequence of float, optional
        Relative class frequencies. By default classes are balanced (sizes differ by at most one).

    Returns
    -------
    ArrayDataset
        ``x`` of shape ``(n_samples, num_features + 1)`` with values clipped to [0, 1] and the last
        column equal to 1.0; ``y`` of shape ``(n_samples,)``.

    Raises
    ------
    ValueError
        If a size is out of range or ``class_weights`` is malformed.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if n_samples < num_classes:
        raise ValueError(f"n_samples ({n_samples}) must be >= num_classes ({num_classes})")
    rng = np.random.default_rng(seed)
    if class_weights is None:
        y = np.arange(n_samples, dtype=np.int64) % num_classes
    else:
        w = np.asarray(class_weights, dtype=np.float64)
        if w.shape != (num_classes,) or np.any(w <= 0) or not np.all(np.isfinite(w)):
            raise ValueError(f"class_weights must be {num_classes} positive finite numbers, got {class_weights!r}")
        sizes = largest_remainder(n_samples, w / w.sum())
        y = np.repeat(np.arange(num_classes, dtype=np.int64), sizes)
    y = rng.permutation(y)
    # Means in the middle of the cube so that clipping to [0, 1] rarely bites.
    means = rng.uniform(0.2, 0.8, size=(num_classes, num_features))
    feats = np.clip(means[y] + rng.normal(0.0, _NOISE_STD, size=(n_samples, num_features)), 0.0, 1.0)
    x = np.empty((n_samples, num_features + 1), dtype=np.float64)
    x[:, :num_features] = feats
    x[:, num_features] = 1.0
    return ArrayDataset(x=x, y=y)


def load_synthetic(name: str) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Build a registered synthetic dataset (see the module docstring for the presets).

    Parameters
    ----------
    name : str
        One of ``SYNTHETIC_PRESETS``.

    Returns
    -------
    tuple of (ArrayDataset, ArrayDataset, DatasetInfo)
        Train set, test set (drawn from the same class means) and metadata.

    Raises
    ------
    ValueError
        If ``name`` is not a registered preset.
    """
    if name not in SYNTHETIC_PRESETS:
        raise ValueError(f"unknown synthetic dataset {name!r}; valid names: {', '.join(SYNTHETIC_PRESETS)}")
    p = SYNTHETIC_PRESETS[name]
    # One draw, then split, so train and test share the class means.
    full = make_classification(
        p.num_train + p.num_test, p.num_features, p.num_classes, p.seed, class_weights=p.class_weights
    )
    train = full.subset(np.arange(p.num_train, dtype=np.int64))
    test = full.subset(np.arange(p.num_train, len(full), dtype=np.int64))
    info = DatasetInfo(
        name=name,
        num_classes=p.num_classes,
        num_features=p.num_features + 1,
        source=f"generated by fedpdm_flower.fedapp.data.synthetic.make_classification (seed {p.seed})",
        feature_names=(*tuple(f"f{j}" for j in range(p.num_features)), "bias"),
    )
    return train, test, info


def make_lasso_problem(
    num_clients: int, samples_per_client: int, dim: int, seed: int
) -> list[tuple[NDArray[np.float64], NDArray[np.float64]]]:
    """Heterogeneous least-squares data for federated lasso tests.

    Client ``i`` holds ``(A_i, c_i)`` with local objective ``f_i(x) = ||A_i x - c_i||^2 / (2 m)``. The
    clients differ in both the design and the target, so their local minimisers differ and a method
    that ignores the heterogeneity does not reach the global solution:

    * ``A_i = G_i * s_i + mu_i``: Gaussian ``G_i`` with a client-specific column scale ``s_i`` in
      [0.5, 1.5] and a client-specific mean shift ``mu_i``;
    * ``c_i = A_i (x_true + d_i) + noise``: a shared sparse ``x_true`` (a quarter of the entries
      nonzero) plus a small client-specific dense drift ``d_i``.

    Parameters
    ----------
    num_clients : int
        Number of clients, at least 1.
    samples_per_client : int
        Rows ``m`` of each ``A_i``, at least 1.
    dim : int
        Number of unknowns, at least 1.
    seed : int
        Seed of the generator; equal arguments give identical arrays.

    Returns
    -------
    list of (ndarray, ndarray)
        One ``(A_i, c_i)`` per client, shapes ``(m, dim)`` and ``(m,)``, float64.

    Raises
    ------
    ValueError
        If a size is below 1.
    """
    for key, val in (("num_clients", num_clients), ("samples_per_client", samples_per_client), ("dim", dim)):
        if val < 1:
            raise ValueError(f"{key} must be >= 1, got {val}")
    rng = np.random.default_rng(seed)
    x_true = np.zeros(dim, dtype=np.float64)
    support = rng.choice(dim, size=max(1, dim // 4), replace=False)
    x_true[support] = rng.choice([-1.0, 1.0], size=support.size) * rng.uniform(0.5, 2.0, size=support.size)
    problems: list[tuple[NDArray[np.float64], NDArray[np.float64]]] = []
    for _ in range(num_clients):
        scale = rng.uniform(0.5, 1.5, size=dim)
        shift = rng.normal(0.0, 0.3, size=dim)
        a = rng.normal(size=(samples_per_client, dim)) * scale + shift
        drift = rng.normal(0.0, 0.1, size=dim)
        c = a @ (x_true + drift) + rng.normal(0.0, 0.1, size=samples_per_client)
        problems.append((a, c))
    return problems

