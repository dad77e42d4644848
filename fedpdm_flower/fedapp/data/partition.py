"""Split a dataset among clients: IID, Dirichlet, label-k (flwr-datasets' algorithms), the paper's split, one writer each.

Every scheme is a pure function of ``(y, scheme, num_partitions, seed, options)``, so a client rebuilds its share on
demand instead of storing it in its state. The work is done once per dataset and configuration, not once per node:
:func:`split_dataset` returns a :class:`Split`, one seeded arrangement of the row numbers (a permutation, the rows
grouped by class or by writer) and, per node, the ``(start, count)`` of each of its slices of that arrangement. Its
cost is O(n) for the labels (one pass per class, one sort) plus small vectorised arrays of N x C entries (N nodes,
C classes); a node's rows are then its few slices, sorted (:meth:`Split.indices`). 10,000 nodes of MNIST cost about
0.1-0.3 s and a few MB whatever node asks (``tests/test_data.py::test_node_of_a_10000_node_split_is_cheap``).
:func:`load_partition` caches the Split per process, keyed by the arguments *and* a digest of the labels (and
groups) it split, so a split computed on one copy of a dataset (e.g. a test's fake download) is never served for
another.

``iid``, ``dirichlet`` and ``label-k`` are flwr-datasets' ``IidPartitioner`` (after ``FederatedDataset``'s seeded
shuffle), ``DirichletPartitioner`` and ``PathologicalPartitioner``, re-implemented in numpy so that one node does not
materialise all N partitions through an HF ``datasets.Dataset``: they draw the same random numbers in the same order
and give the same partitions (compared with flwr-datasets itself in ``tests/test_data.py``). ``paper`` is ours
(:func:`paper_partition`); ``writer`` (:func:`writer_partition`) needs natural groups (FEMNIST's writers).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp.data.sources import ArrayDataset, train_labels, train_rows

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "label-k", "paper", "writer")

# Dirichlet retries until every client has at least this many samples (flwr-datasets' default).
DIRICHLET_MIN_PARTITION_SIZE = 10
#: flwr-datasets' DirichletPartitioner gives up after this many draws (its attempts 0..10)
DIRICHLET_MAX_DRAWS = 11

_PartitionKey = tuple[str, str, int, int, str, str | None, tuple[tuple[str, Any], ...], str]


@dataclass(frozen=True)
class Split:
    """Every node's rows of one dataset, stored once: node ``i`` holds the slices
    ``pool[starts[i, j] : starts[i, j] + counts[i, j]]`` over ``j`` (sorted, they are its row numbers).

    Attributes
    ----------
    pool : ndarray of int64, shape (m,)
        Row numbers in the scheme's arrangement (a permutation; the rows grouped by class, each class's rows in the
        scheme's order; the rows grouped by writer).
    starts, counts : ndarray of int64, shape (N, B)
        Per node, where its ``B`` slices start in ``pool`` and how long they are (``B`` = 1 for ``iid`` and
        ``writer``, the number of classes otherwise; a count of 0 is an unused slice).
    """

    pool: NDArray[np.int64]
    starts: NDArray[np.int64]
    counts: NDArray[np.int64]

    @property
    def num_partitions(self) -> int:
        """N."""
        return int(self.starts.shape[0])

    def sizes(self) -> NDArray[np.int64]:
        """Samples per node, shape (N,)."""
        return np.asarray(self.counts.sum(axis=1), dtype=np.int64)

    def indices(self, partition_id: int) -> NDArray[np.int64]:
        """Node ``partition_id``'s row numbers, sorted (a new array)."""
        i = int(partition_id)
        pieces = [self.pool[s : s + c] for s, c in zip(self.starts[i].tolist(), self.counts[i].tolist(), strict=True)
                  if c > 0]
        out = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        out.sort()
        return out

    def all(self) -> list[NDArray[np.int64]]:
        """Every node's row numbers, in node order."""
        return [self.indices(i) for i in range(self.num_partitions)]


_PARTITION_CACHE: dict[_PartitionKey, Split] = {}


def partition_indices(
    y: ArrayLike,
    scheme: str,
    num_partitions: int,
    seed: int,
    *,
    labels_per_client: int = 4,
    samples_per_client: int | None = None,
    dirichlet_alpha: float = 0.5,
    groups: ArrayLike | None = None,
) -> list[NDArray[np.int64]]:
    """Assign sample indices to ``num_partitions`` clients (every node's share of :func:`split_dataset`).

    Parameters
    ----------
    y : array_like of int, shape (n,)
        Labels of the dataset to split.
    scheme : str
        * ``"iid"``: shuffle with ``seed``, then cut into equal contiguous shards (what
          ``FederatedDataset(shuffle=True)`` + ``IidPartitioner`` do); sizes differ by at most one.
        * ``"dirichlet"``: ``DirichletPartitioner(alpha=dirichlet_alpha, self_balancing=False)``
          with ``min_partition_size = min(10, n // (2 * num_partitions))`` (the cap keeps small
          synthetic sets partitionable): per class (ascending), proportions over the clients from
          ``default_rng(seed).dirichlet``, the class's rows (ascending) cut at the floored cumulative proportions;
          drawn again, up to 11 times in all, until every client has the minimum.
        * ``"label-k"``: ``PathologicalPartitioner(num_classes_per_partition=labels_per_client,
          class_assignment_mode="first-deterministic")``: client ``i`` gets class ``i mod C`` and then
          ``labels_per_client - 1`` other classes drawn uniformly (``default_rng(seed)``, redrawn on a repeat); each
          class's rows (ascending) are cut by ``np.array_split`` among its clients in client order.
        * ``"paper"``: the split of seed 000 Section V-B1, see :func:`paper_partition`.
        * ``"writer"``: client ``i`` gets every sample of one natural group (FEMNIST writer), see
          :func:`writer_partition`; needs ``groups``.
    num_partitions : int
        Number of clients ``N``, at least 1.
    seed : int
        Seed; equal arguments give identical partitions.
    labels_per_client : int, default 4
        Labels per client for ``"label-k"`` and ``"paper"``.
    samples_per_client : int, optional
        Samples per client for ``"paper"`` (default ``n // N``); ignored by the other schemes.
    dirichlet_alpha : float, default 0.5
        Concentration of the Dirichlet prior for ``"dirichlet"``; smaller is more skewed.
    groups : array_like of int, shape (n,), optional
        Natural group of every sample (``ArrayDataset.groups``), required by ``"writer"`` and ignored otherwise.

    Returns
    -------
    list of ndarray of int64
        ``num_partitions`` sorted, pairwise disjoint index arrays into ``y``.

    Raises
    ------
    ValueError
        For an unknown scheme, an out-of-range argument, or a split that cannot be satisfied.
    """
    return split_dataset(y, scheme, num_partitions, seed, labels_per_client=labels_per_client,
                         samples_per_client=samples_per_client, dirichlet_alpha=dirichlet_alpha, groups=groups).all()


def split_dataset(
    y: ArrayLike,
    scheme: str,
    num_partitions: int,
    seed: int,
    *,
    labels_per_client: int = 4,
    samples_per_client: int | None = None,
    dirichlet_alpha: float = 0.5,
    groups: ArrayLike | None = None,
) -> Split:
    """The :class:`Split` of ``y`` among ``num_partitions`` clients under ``scheme`` (arguments of
    :func:`partition_indices`); ``split.indices(i)`` is client ``i``'s share. Costs O(n) plus O(N x C), not N times
    that: no node's rows are gathered until asked for."""
    labels = _check_labels(y)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}")
    _check_int("num_partitions", num_partitions, 1)
    if num_partitions > labels.size:
        raise ValueError(f"num_partitions ({num_partitions}) exceeds the number of samples ({labels.size})")
    _check_int("labels_per_client", labels_per_client, 1)
    if samples_per_client is not None:
        _check_int("samples_per_client", samples_per_client, 1)
    if not (np.isfinite(dirichlet_alpha) and dirichlet_alpha > 0):
        raise ValueError(f"dirichlet_alpha must be a positive finite number, got {dirichlet_alpha}")
    n_parts = int(num_partitions)
    if scheme == "paper":
        return _paper_split(labels, n_parts, seed, labels_per_client, samples_per_client)
    if scheme == "writer":
        if groups is None:
            raise ValueError("partition scheme 'writer' needs the samples' writer ids (groups); only 'femnist' has them")
        g = np.asarray(groups)
        if g.shape != labels.shape or not np.issubdtype(g.dtype, np.integer):
            raise ValueError(f"groups must hold one integer per sample, got shape {g.shape} dtype {g.dtype}")
        return _writer_split(g, n_parts, seed)
    if scheme == "iid":
        return _iid_split(labels.size, n_parts, seed)
    if scheme == "dirichlet":
        return _dirichlet_split(labels, n_parts, seed, dirichlet_alpha)
    return _label_k_split(labels, n_parts, seed, labels_per_client)


def load_partition(
    name: str,
    scheme: str,
    partition_id: int,
    num_partitions: int,
    seed: int,
    source: str = "offline",
    *,
    root: str | None = None,
    **kw: Any,
) -> ArrayDataset:
    """Return client ``partition_id``'s share of the training set of dataset ``name``.

    The dataset is loaded through :func:`fedpdm_flower.fedapp.data.load_dataset` (memoised) and its :class:`Split` is
    cached per process, keyed by every argument that shapes it: the first call of a process pays O(n + N x C) for
    the whole split, every call (first or later) gathers only its own node's rows. The cache is only a speed-up:
    the partitions are a deterministic function of the arguments, so a fresh process rebuilds the same.

    Parameters
    ----------
    name : str
        Any name :func:`fedpdm_flower.fedapp.data.load_dataset` accepts, including the ``"synthetic*"`` presets.
    scheme : str
        Partition scheme, see :func:`partition_indices`.
    partition_id : int
        Client index in ``0 .. num_partitions - 1``.
    num_partitions : int
        Number of clients.
    seed : int
        Partition seed.
    source : str, default "offline"
        Data source, see :func:`fedpdm_flower.fedapp.data.load_dataset`.
    root : str, optional
        Download directory for ``source="online"``.
    **kw
        Passed to :func:`partition_indices` (``labels_per_client``, ``samples_per_client``,
        ``dirichlet_alpha``).

    Returns
    -------
    ArrayDataset
        A writable copy of the client's training samples, in ascending index order.

    Raises
    ------
    ValueError
        For a bad dataset name, scheme, partition id or partition option.
    """
    _check_int("num_partitions", num_partitions, 1)
    if not (isinstance(partition_id, int | np.integer) and 0 <= partition_id < num_partitions):
        raise ValueError(f"partition_id must be in [0, {num_partitions - 1}], got {partition_id!r}")
    rows = cached_split(name, scheme, num_partitions, seed, source, root=root, **kw).indices(partition_id)
    return train_rows(name, rows, source, root)  # only these rows become features (image datasets)


def cached_split(name: str, scheme: str, num_partitions: int, seed: int, source: str = "offline", *,
                 root: str | None = None, **kw: Any) -> Split:
    """The :class:`Split` of dataset ``name``'s training set (arguments of :func:`load_partition`), computed once
    per process and configuration from the labels alone (:func:`fedpdm_flower.fedapp.data.sources.train_labels`)."""
    y, groups = train_labels(name, source, root)
    key: _PartitionKey = (name, scheme, num_partitions, seed, source, root, tuple(sorted(kw.items())),
                          _digest(y, groups))
    split = _PARTITION_CACHE.get(key)
    if split is None:
        split = split_dataset(y, scheme, num_partitions, seed, groups=groups, **kw)
        for arr in (split.pool, split.starts, split.counts):
            arr.setflags(write=False)  # shared by later calls
        if len(_PARTITION_CACHE) >= 16:  # a long-lived process (tests) sees many configurations
            _PARTITION_CACHE.clear()
        _PARTITION_CACHE[key] = split
    return split


def clear_partition_cache() -> None:
    """Forget every cached partition (for tests and long-lived processes)."""
    _PARTITION_CACHE.clear()
    _DIGESTS.clear()


#: digests of the (read-only, memoised) label arrays seen, by id, with the arrays kept alive so ids are not reused
_DIGESTS: dict[tuple[int, int], tuple[NDArray[np.int64], NDArray[np.int64] | None, str]] = {}


def _digest(y: NDArray[np.int64], groups: NDArray[np.int64] | None) -> str:
    """What a partition depends on besides the arguments: the labels and groups (BLAKE2b, ~1 ms for MNIST; once per
    array: a process asks for every node's share of the same memoised labels)."""
    key = (id(y), id(groups))
    hit = _DIGESTS.get(key)
    if hit is not None and hit[0] is y and hit[1] is groups:
        return hit[2]
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(y).tobytes())
    if groups is not None:
        h.update(b"groups")
        h.update(np.ascontiguousarray(groups).tobytes())
    if len(_DIGESTS) >= 16:
        _DIGESTS.clear()
    _DIGESTS[key] = (y, groups, h.hexdigest())
    return h.hexdigest()


def writer_partition(groups: ArrayLike, num_partitions: int, seed: int) -> list[NDArray[np.int64]]:
    """One natural group (FEMNIST writer) per client: the first ``num_partitions`` groups of a seeded shuffle.

    The distinct group ids are sorted, permuted with ``np.random.default_rng(seed)``, and client ``i`` gets every
    sample of the ``i``-th group of that order. With ``num_partitions`` equal to the number of groups every writer
    is a client (the paper's FEMNIST setting, P = number of sampled writers); fewer clients use a seeded subset of
    the writers (their samples only; the rest are unused).

    Raises
    ------
    ValueError
        If ``num_partitions`` exceeds the number of groups.
    """
    _check_int("num_partitions", num_partitions, 1)
    return _writer_split(np.asarray(groups), int(num_partitions), seed).all()


def _writer_split(groups: NDArray[Any], num_partitions: int, seed: int) -> Split:
    g = np.asarray(groups, dtype=np.int64)
    ids, inverse = np.unique(g, return_inverse=True)
    if num_partitions > ids.size:
        raise ValueError(
            f"partition scheme 'writer': num_partitions ({num_partitions}) exceeds the number of writers in the "
            f"dataset ({ids.size}); use at most {ids.size} clients"
        )
    order = np.argsort(inverse, kind="stable").astype(np.int64)  # rows grouped by writer, ascending in each
    sizes = np.bincount(inverse, minlength=ids.size).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    chosen = np.random.default_rng(seed).permutation(ids.size)[:num_partitions]
    return Split(order, first[chosen][:, None], sizes[chosen][:, None])


# ------------------------------------------------------------------------------- flwr-datasets' schemes


def _iid_split(n: int, num_partitions: int, seed: int) -> Split:
    """``FederatedDataset(shuffle=True, seed)`` + ``IidPartitioner``: datasets' ``Dataset.shuffle(seed)`` is
    ``default_rng(seed).permutation(n)``, and ``Dataset.shard(contiguous=True)`` cuts as ``np.array_split``."""
    perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
    sizes = _array_split_sizes(n, num_partitions)
    return Split(perm, _exclusive_cumsum(sizes)[:, None], sizes[:, None])


def _class_pools(labels: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(sorted distinct classes, the rows grouped by class with each class's rows ascending, each class's first
    position in that order)."""
    classes, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable").astype(np.int64)
    return classes, order, _exclusive_cumsum(sizes.astype(np.int64))


def _dirichlet_split(labels: NDArray[np.int64], num_partitions: int, seed: int, alpha: float) -> Split:
    """flwr-datasets' ``DirichletPartitioner(self_balancing=False)``, its draws and cuts (see :func:`partition_indices`)."""
    n = labels.size
    min_size = min(DIRICHLET_MIN_PARTITION_SIZE, n // (2 * num_partitions))
    classes, order, first = _class_pools(labels)
    class_sizes = np.diff(np.append(first, n))
    rng = np.random.default_rng(seed)
    prior = np.full(num_partitions, float(alpha))
    starts = np.zeros((num_partitions, classes.size), dtype=np.int64)
    counts = np.zeros_like(starts)
    for _ in range(DIRICHLET_MAX_DRAWS):
        for c, size in enumerate(class_sizes.tolist()):
            # np.split(rows of class c, (cumsum(p) * size).astype(int)[:-1]): piece i is rows[cut[i-1]:cut[i]]
            cuts = (np.cumsum(rng.dirichlet(prior)) * size).astype(np.int64)[:-1]
            lo = np.minimum(np.concatenate([[0], cuts]), size)
            hi = np.minimum(np.concatenate([cuts, [size]]), size)
            starts[:, c] = first[c] + lo
            counts[:, c] = np.maximum(hi - lo, 0)
        if int(counts.sum(axis=1).min()) >= min_size:
            return Split(order, starts, counts)
    raise ValueError(
        f"dirichlet split: after {DIRICHLET_MAX_DRAWS} draws some of the {num_partitions} clients still had fewer "
        f"than {min_size} samples (dirichlet_alpha={alpha:g}, {n} samples); raise dirichlet_alpha (run config key "
        "'dirichlet-alpha') or lower num_partitions"
    )


def _label_k_split(labels: NDArray[np.int64], num_partitions: int, seed: int, k: int) -> Split:
    """flwr-datasets' ``PathologicalPartitioner(class_assignment_mode="first-deterministic")`` (see
    :func:`partition_indices`).

    Its per-client ``rng.choice(classes, size=1)`` draws are taken in blocks of ``rng.integers(0, C, size)``: numpy's
    ``Generator.choice`` with replacement draws ``integers(0, C)``, and ``integers`` keeps the unused half of a
    64-bit draw in the bit generator, so blocks give the same sequence as single draws (checked against
    flwr-datasets in ``tests/test_data.py``)."""
    classes, order, first = _class_pools(labels)
    n_classes = classes.size
    if k > n_classes:
        raise ValueError(f"labels_per_client ({k}) exceeds the number of classes ({n_classes})")
    rng = np.random.default_rng(seed)
    draws: list[int] = []
    pos = 0
    picked: list[int] = []  # client-major: client i's k classes at [i k, (i + 1) k)
    for i in range(num_partitions):
        chosen = [i % n_classes]
        while len(chosen) < k:
            if pos == len(draws):
                draws = rng.integers(0, n_classes, size=16 * k + 4096).tolist()
                pos = 0
            c = draws[pos]
            pos += 1
            if c not in chosen:
                chosen.append(c)
        picked.extend(chosen)
    member = np.zeros((num_partitions, n_classes), dtype=bool)
    member[np.repeat(np.arange(num_partitions), k), picked] = True
    uses = member.sum(axis=0)
    class_sizes = np.diff(np.append(first, labels.size))
    over = np.flatnonzero(uses > class_sizes)
    if over.size:
        c = int(over[0])
        raise ValueError(
            f"label-k split: label {classes[c]} is assigned to {uses[c]} clients but has only {class_sizes[c]} "
            "samples; lower num_partitions or labels_per_client"
        )
    # np.array_split(rows of class c, uses[c]): the r-th client holding c (in client order) gets piece r
    rank = np.cumsum(member, axis=0) - 1
    div, mod = class_sizes // np.maximum(uses, 1), class_sizes % np.maximum(uses, 1)
    counts = np.where(member, div[None, :] + (rank < mod[None, :]), 0).astype(np.int64)
    starts = (first[None, :] + rank * div[None, :] + np.minimum(rank, mod[None, :])).astype(np.int64)
    return Split(order, np.where(member, starts, 0), counts)


def _array_split_sizes(n: int, parts: int) -> NDArray[np.int64]:
    div, mod = divmod(n, parts)
    return (div + (np.arange(parts) < mod)).astype(np.int64)


def _exclusive_cumsum(a: NDArray[np.int64], axis: int = 0) -> NDArray[np.int64]:
    out = np.cumsum(a, axis=axis)
    return np.asarray(out - a, dtype=np.int64)


# ------------------------------------------------------------------------------------------ the paper


def paper_partition(
    y: ArrayLike,
    num_partitions: int,
    seed: int,
    labels_per_client: int = 4,
    samples_per_client: int | None = None,
) -> list[NDArray[np.int64]]:
    """The non-IID split of seed 000 (DP-FedPDM, Section V-B1), made exact and deterministic.

    The paper gives each MNIST client exactly 4 distinct labels and 600 samples ("following" Li et
    al., ICLR 2020), and each Adult client 325 samples of a single class. It does not say how, so the
    algorithm is ours:

    **More classes than labels_per_client (MNIST).** With ``C`` classes, ``N`` clients, ``L`` labels
    and ``S`` samples per client:

    1. Label sets: each label is given to ``N*L // C`` or one more clients (the extra uses go to the
       largest classes). Clients pick, in turn, the ``L`` labels with the most uses left, ties broken
       by a seeded random key. This greedy never gets stuck (each label's remaining uses never exceed
       the remaining clients) and yields varied label sets.
    2. Counts: label ``c`` contributes ``T_c`` samples: one per client using it plus a share of the
       rest proportional to its remaining pool (so all of it when ``N*S == n``, as for MNIST with
       N = 100). The per-(client, label) counts form the integer matrix with row sums ``S``, column
       sums ``T_c``, zeros off the label sets and at least 1 on them, nearest to proportional:
       Sinkhorn scaling of the label-set mask, floored; the leftover units go greedily to the
       largest fractional parts, and a max-flow (allowed to reroute those) places what remains,
       dipping into a label's unused samples only if the totals ``T_c`` cannot be met exactly.
    3. Samples: each label's pool is shuffled with the seed and cut into consecutive chunks of the
       chosen counts, so clients are disjoint.

    *Deviation from a shard split:* MNIST labels have 5421 to 6742 samples, so 40 clients per label
    cannot all get 150 of each; counts per (client, label) vary (about 130 to 170 for MNIST), while
    every client still has exactly ``S`` samples and exactly ``L`` labels.

    **No more classes than labels_per_client, or labels_per_client == 1 (Adult).** Each client holds
    ``S`` samples of one class.
    Clients are given to classes in proportion to class frequency (largest remainder, capped at
    ``pool // S``), which for Adult with N = 100 is 76 clients of class 0 and 24 of class 1; leftover
    samples (61 for Adult) are unused. Which client gets which class is a seeded permutation.

    Parameters
    ----------
    y : array_like of int, shape (n,)
        Labels.
    num_partitions : int
        Number of clients ``N``.
    seed : int
        Seed; equal arguments give identical partitions.
    labels_per_client : int, default 4
        Distinct labels per client ``L``.
    samples_per_client : int, optional
        Samples per client ``S`` (default ``n // N``: 600 for MNIST, 325 for Adult with N = 100).

    Returns
    -------
    list of ndarray of int64
        ``N`` sorted, pairwise disjoint index arrays, each of length ``S``.

    Raises
    ------
    ValueError
        If the request cannot be met, e.g. ``N*S > n``, ``S < L``, or a label pool too small for the
        clients it is assigned to. Very tight requests (nearly every sample needed with few clients)
        can also fail for the chosen label sets even where another assignment would work.
    """
    labels = _check_labels(y)
    _check_int("num_partitions", num_partitions, 1)
    _check_int("labels_per_client", labels_per_client, 1)
    return _paper_split(labels, int(num_partitions), seed, labels_per_client, samples_per_client).all()


def _paper_split(labels: NDArray[np.int64], num_partitions: int, seed: int, labels_per_client: int,
                 samples_per_client: int | None) -> Split:
    n = labels.size
    spc = n // num_partitions if samples_per_client is None else samples_per_client
    _check_int("samples_per_client", spc, 1)
    if num_partitions * spc > n:
        raise ValueError(
            f"paper split needs num_partitions * samples_per_client = {num_partitions} * {spc} = "
            f"{num_partitions * spc} samples but the dataset has {n}"
        )
    classes, order, first = _class_pools(labels)
    sizes = np.diff(np.append(first, n)).astype(np.int64)
    rng = np.random.default_rng(seed)
    # One label per client is the one-class rule whatever the number of classes.
    if classes.size <= labels_per_client or labels_per_client == 1:
        counts = _one_class_counts(sizes, num_partitions, spc, classes, rng)
    else:
        counts = _multi_label_counts(sizes, num_partitions, spc, labels_per_client, classes, rng)
    # Draw without replacement: shuffle each label's pool once, then hand out consecutive chunks (client order).
    pool = np.concatenate([rng.permutation(order[f : f + s]) for f, s in zip(first.tolist(), sizes.tolist(),
                                                                              strict=True)]).astype(np.int64)
    starts = first[None, :] + _exclusive_cumsum(counts, axis=0)
    return Split(pool, np.where(counts > 0, starts, 0), counts)


def _one_class_counts(
    sizes: NDArray[np.int64], num_partitions: int, spc: int, classes: NDArray[np.int64], rng: np.random.Generator
) -> NDArray[np.int64]:
    """Counts matrix (clients x classes) for the one-class-per-client rule."""
    caps = sizes // spc
    if int(caps.sum()) < num_partitions:
        raise ValueError(
            f"paper split (one class per client): with {spc} samples per client the classes "
            f"{classes.tolist()} (sizes {sizes.tolist()}) hold only {int(caps.sum())} clients, "
            f"fewer than num_partitions={num_partitions}"
        )
    quota = num_partitions * sizes / sizes.sum()
    k = np.minimum(np.floor(quota).astype(np.int64), caps)
    while int(k.sum()) < num_partitions:
        # Largest remainder among classes with room left; argmax breaks ties to the lower class.
        rem = np.where(k < caps, quota - k, -np.inf)
        k[int(np.argmax(rem))] += 1
    client_class = rng.permutation(np.repeat(np.arange(sizes.size), k))
    counts = np.zeros((num_partitions, sizes.size), dtype=np.int64)
    counts[np.arange(num_partitions), client_class] = spc
    return counts


def _multi_label_counts(
    sizes: NDArray[np.int64],
    num_partitions: int,
    spc: int,
    num_labels: int,
    classes: NDArray[np.int64],
    rng: np.random.Generator,
) -> NDArray[np.int64]:
    """Counts matrix (clients x classes) with exactly ``num_labels`` nonzero entries per row, row sums ``spc``."""
    n_clients, n_classes = num_partitions, sizes.size
    if spc < num_labels:
        raise ValueError(
            f"paper split: samples_per_client ({spc}) must be >= labels_per_client ({num_labels}) "
            "so that each client has at least one sample of each of its labels"
        )
    # 1. How many clients use each label: as equal as possible, extras to the largest classes.
    uses = np.full(n_classes, n_clients * num_labels // n_classes, dtype=np.int64)
    extra = n_clients * num_labels % n_classes
    uses[np.argsort(-sizes, kind="stable")[:extra]] += 1
    # Greedy: each client takes the labels with the most uses left (random tie-break). Invariant:
    # max(left) <= clients left and sum(left) = num_labels * clients left, so it always finds num_labels.
    # The tie-break keys are client i's rng.random(n_classes), drawn for all clients at once (the same numbers:
    # a float64 draw takes one 64-bit output). np.lexsort((keys, -left)) is a stable sort by -left of the columns
    # in ascending key order (ties in the key to the lower column, as np.argsort's stable sort leaves them).
    by_key = np.argsort(rng.random((n_clients, n_classes)), axis=1, kind="stable").tolist()
    neg_left = (-uses).tolist()
    picks: list[int] = []
    for i in range(n_clients):
        pick = sorted(by_key[i], key=neg_left.__getitem__)[:num_labels]
        picks.extend(pick)
        for c in pick:
            neg_left[c] += 1
    mask = np.zeros((n_clients, n_classes), dtype=bool)
    mask[np.repeat(np.arange(n_clients), num_labels), picks] = True
    left = [-v for v in neg_left]
    if any(left):  # pragma: no cover - guarded by the invariant above
        raise RuntimeError("label assignment did not use every slot")

    # 2. Column totals: one sample per (client, label), then the rest in proportion to what each
    #    label has left, so a total never exceeds its pool (all of it when N*S == n).
    short = np.flatnonzero(sizes < uses)
    if short.size:
        c = int(short[0])
        raise ValueError(
            f"paper split: label {classes[c]} has {sizes[c]} samples but is assigned to {uses[c]} clients "
            "(each needs at least one); lower num_partitions or labels_per_client"
        )
    used = uses > 0
    avail = int(sizes[used].sum())
    need = n_clients * spc
    if need > avail:
        raise ValueError(
            f"paper split: the {int(used.sum())} labels in use hold {avail} samples but {need} are needed "
            f"({n_clients} clients x {num_labels} labels cover only the largest classes)"
        )
    col = uses.copy()
    spare = (sizes - uses)[used]
    if spare.sum() > 0:
        col[used] += largest_remainder(need - int(uses.sum()), spare / spare.sum())
    # One sample per (client, label) is reserved up front; the rest is distributed below.
    row_rest = np.full(n_clients, spc - num_labels, dtype=np.int64)
    col_rest = col - uses
    frac = _sinkhorn(mask, row_rest.astype(np.float64), col_rest.astype(np.float64))
    base = np.floor(frac + 1e-9).astype(np.int64)
    extra_units = _round_to_margins(
        mask,
        frac - base,
        supply=row_rest - base.sum(axis=1),
        demand=np.maximum(col_rest - base.sum(axis=0), 0),
        capacity=sizes - uses - base.sum(axis=0),
    )
    if extra_units is None:
        raise ValueError(
            f"paper split: cannot give {n_clients} clients {spc} samples from exactly {num_labels} labels "
            f"with label sizes {sizes.tolist()} (label sets balanced to {uses.tolist()} clients per label)"
        )
    counts = mask.astype(np.int64) + base + extra_units
    assert np.all(counts.sum(axis=1) == spc) and np.all(counts.sum(axis=0) <= sizes)
    assert np.all((counts > 0) == mask)
    return counts


def _sinkhorn(
    mask: NDArray[np.bool_], rows: NDArray[np.float64], cols: NDArray[np.float64], iters: int = 5000
) -> NDArray[np.float64]:
    """Scale ``mask`` towards row sums ``rows`` and column sums ``cols`` (iterative proportional fitting).

    The row sums are exact on return (they are the clients' quotas); the column sums are exact only
    if the margins are compatible with the mask, otherwise the rounding step absorbs the difference.
    """
    f = mask.astype(np.float64)

    def fit_rows() -> None:
        rs = f.sum(axis=1)
        f[...] *= np.divide(rows, rs, out=np.zeros_like(rs), where=rs > 0)[:, None]

    for _ in range(iters):
        fit_rows()
        cs = f.sum(axis=0)
        f *= np.divide(cols, cs, out=np.zeros_like(cs), where=cs > 0)[None, :]
        if np.max(np.abs(f.sum(axis=1) - rows), initial=0.0) < 1e-9:
            break
    fit_rows()
    return f


def _round_to_margins(
    mask: NDArray[np.bool_],
    frac: NDArray[np.float64],
    *,
    supply: NDArray[np.int64],
    demand: NDArray[np.int64],
    capacity: NDArray[np.int64],
) -> NDArray[np.int64] | None:
    """Integer matrix on ``mask`` with row sums ``supply``, column sums ``demand`` where possible.

    Column sums may exceed ``demand`` up to ``capacity`` (a label's spare samples) only when the
    demands cannot be met exactly; returns None if even that fails.

    A greedy pass first gives each row one unit in the columns with the largest fractional parts
    (the rounding closest to the Sinkhorn solution); an Edmonds-Karp max-flow on source -> rows ->
    columns -> sink, started from the greedy units so that it may reroute them, places the rest
    (:class:`_BipartiteFlow`).
    """
    if np.any(supply < 0) or np.any(capacity < demand):
        return None
    r, c = mask.shape
    greedy = np.zeros((r, c), dtype=np.int64)
    left = demand.tolist()
    # per row, its mask columns by decreasing fractional part (ties to the lower column: a stable sort), then the rest
    ranked = np.argsort(np.where(mask, -frac, np.inf), axis=1, kind="stable").tolist()
    allowed = mask.sum(axis=1).tolist()
    rows: list[int] = []
    taken: list[int] = []
    for i, s in enumerate(supply.tolist()):
        if s <= 0:
            continue
        for j in ranked[i][: allowed[i]]:  # the columns with demand left, in that order, up to s of them
            if left[j] > 0:
                rows.append(i)
                taken.append(j)
                left[j] -= 1
                s -= 1
                if s == 0:
                    break
    greedy[rows, taken] = 1
    total = int(supply.sum())
    flow = _BipartiteFlow(mask, supply, greedy, total)
    sent = int(greedy.sum()) + flow.augment(demand)
    if sent < total:
        sent += flow.augment(capacity)
    if sent < total:
        return None
    return flow.flow


class _BipartiteFlow:
    """Edmonds-Karp on the network source -> rows (capacity ``supply``) -> columns (capacity ``total`` where
    ``mask``) -> sink (the capacities given to :meth:`augment`), from an initial row-column flow.

    It finds the same augmenting paths as a breadth-first search over the dense (rows + columns + 2)^2 residual
    matrix that visits the nodes in index order (rows, columns, source, sink), one level at a time, and takes as
    a node's parent the first node of the previous level with residual capacity to it: so the flow it returns,
    not just its value, is that search's (``tests/test_data.py`` compares the two). It never builds that matrix:

    * the rows a level reaches from a set Y of columns are the unvisited rows whose flow support
      ``{j : F[i, j] > 0}`` meets Y, so rows with the same (flow support, residual columns) pattern are always
      reached together; a level is computed over the patterns (a few hundred for MNIST), each with its
      smallest row, not over the rows;
    * the rows with supply left (the first level) are kept apart, in index order.

    A search therefore costs O(patterns x columns) instead of O((rows + columns)^2): 10,000 clients of MNIST need
    about 1,400 searches.
    """

    _NONE = np.iinfo(np.int64).max

    def __init__(self, mask: NDArray[np.bool_], supply: NDArray[np.int64], initial: NDArray[np.int64],
                 total: int) -> None:
        self.mask, self.total = mask, total
        self.supply = supply.astype(np.int64)
        self.flow = initial.astype(np.int64)  # row -> column flow
        self.fs = self.flow.sum(axis=1)  # source -> row
        self.ft = self.flow.sum(axis=0)  # column -> sink
        r, self.c = mask.shape
        self.resid = mask & (self.flow < total)  # residual row -> column edges
        self.deficit = np.flatnonzero(self.supply - self.fs > 0)  # rows the source still reaches, ascending
        self.Rd = self.resid[self.deficit]
        self.in_deficit = np.zeros(r, dtype=bool)
        self.in_deficit[self.deficit] = True
        # the other rows by pattern (flow support P, residual columns R): members sorted, and per pattern its
        # P and R rows and smallest member in arrays that grow (G patterns in use)
        self.members: list[list[int]] = []
        self.index: dict[bytes, int] = {}
        self.group = np.full(r, -1, dtype=np.int64)
        self.G = 0
        self._P = np.zeros((16, self.c), dtype=bool)
        self._R = np.zeros((16, self.c), dtype=bool)
        self._first = np.full(16, self._NONE, dtype=np.int64)
        packed = np.packbits(np.concatenate([self.flow > 0, self.resid], axis=1), axis=1)
        for i in np.flatnonzero(~self.in_deficit).tolist():  # ascending, so each member list comes out sorted
            key = packed[i].tobytes()
            g = self.index.get(key)
            if g is None:
                g = self._new_pattern(key)
            self.members[g].append(i)
            self.group[i] = g
        for g in range(self.G):
            self._first[g] = self.members[g][0]

    def _new_pattern(self, key: bytes) -> int:
        g = self.index[key] = self.G
        if g == self._first.size:
            self._P = np.concatenate([self._P, np.zeros_like(self._P)])
            self._R = np.concatenate([self._R, np.zeros_like(self._R)])
            self._first = np.concatenate([self._first, np.full(g, self._NONE, dtype=np.int64)])
        bits = np.unpackbits(np.frombuffer(key, dtype=np.uint8), count=2 * self.c).astype(bool)
        self._P[g], self._R[g] = bits[: self.c], bits[self.c :]
        self.members.append([])
        self.G += 1
        return g

    def _leave(self, i: int) -> None:
        g = int(self.group[i])
        if g < 0:
            return
        members = self.members[g]
        pos = bisect.bisect_left(members, i)
        assert members[pos] == i, "pattern index out of step with the flow"
        del members[pos]
        self._first[g] = members[0] if members else self._NONE
        self.group[i] = -1

    def _join(self, i: int) -> None:
        key = np.packbits(np.concatenate([self.flow[i] > 0, self.resid[i]])).tobytes()
        g = self.index.get(key)
        if g is None:
            g = self._new_pattern(key)
        bisect.insort(self.members[g], i)
        self._first[g] = self.members[g][0]
        self.group[i] = g

    def _search(self, sink_cap: NDArray[np.int64]) -> list[tuple[bool, int, int]] | None:
        """The shortest augmenting path as (forward?, row, column) edges from the source side; None if none."""
        if self.deficit.size == 0:
            return None
        NONE, G = self._NONE, self.G
        P, R, first = self._P[:G], self._R[:G], self._first[:G]
        col_parent = np.full(self.c, -1, dtype=np.int64)
        levels: list[NDArray[np.bool_]] = []
        # level 1 are the deficit rows; the columns they reach form level 2, each from its smallest such row
        Rd = self.Rd
        level: NDArray[np.bool_] = np.asarray(Rd.any(axis=0))
        col_parent[level] = self.deficit[Rd[:, level].argmax(axis=0)]
        visited = level.copy()
        open_cols = sink_cap - self.ft > 0
        while level.any():
            levels.append(level)
            sink = level & open_cols
            if sink.any():
                return self._path(int(sink.argmax()), col_parent, levels)
            # the rows this level reaches: patterns whose support meets it and missed every earlier level
            hit = P[:, level].any(axis=1)
            if len(levels) > 1:
                hit &= ~P[:, visited & ~level].any(axis=1)
            hit &= first != NONE
            if not hit.any():
                return None
            cand = np.where(R[hit] & ~visited, first[hit][:, None], NONE).min(axis=0)
            level = np.asarray(cand != NONE)
            col_parent[level] = cand[level]
            visited |= level
        return None

    def _path(self, last: int, col_parent: NDArray[np.int64], levels: list[NDArray[np.bool_]]
              ) -> list[tuple[bool, int, int]]:
        # walk back: column <- its parent row <- the row's smallest support column of the level before <- ...
        edges: list[tuple[bool, int, int]] = []
        col = last
        for depth in range(len(levels) - 1, -1, -1):
            row = int(col_parent[col])
            edges.append((True, row, col))
            if depth == 0:
                break
            col = int(((self.flow[row] > 0) & levels[depth - 1]).argmax())
            edges.append((False, row, col))
        edges.reverse()
        return edges

    def augment(self, sink_cap: NDArray[np.int64]) -> int:
        """Push flow along shortest augmenting paths until none is left; return the amount added."""
        sent = 0
        flow, total = self.flow, self.total
        while True:
            path = self._search(sink_cap)
            if path is None:
                return sent
            src_row, sink_col = path[0][1], path[-1][2]
            push = min(int(self.supply[src_row] - self.fs[src_row]), int(sink_cap[sink_col] - self.ft[sink_col]))
            for fwd, i, j in path:
                push = min(push, int(total - flow[i, j]) if fwd else int(flow[i, j]))
            touched = sorted({i for _, i, _ in path})
            for i in touched:
                self._leave(i)
            for fwd, i, j in path:
                flow[i, j] += push if fwd else -push
                self.resid[i, j] = self.mask[i, j] and flow[i, j] < total
            self.fs[src_row] += push
            self.ft[sink_col] += push
            sent += push
            keep = self.deficit != src_row
            if self.supply[src_row] - self.fs[src_row] == 0:
                self.in_deficit[src_row] = False
                self.deficit, self.Rd = self.deficit[keep], self.Rd[keep]
            else:
                self.Rd[~keep] = self.resid[src_row]
            for i in touched:
                if not self.in_deficit[i]:
                    self._join(i)


# -------------------------------------------------------------------------------------------- helpers


def _check_labels(y: ArrayLike) -> NDArray[np.int64]:
    arr = np.asarray(y)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"y must be a non-empty 1-D array of labels, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"y must hold integer labels, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_int(key: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")


def largest_remainder(total: int, shares: NDArray[np.float64]) -> NDArray[np.int64]:
    """Split ``total`` into integers proportional to ``shares`` (Hamilton's method).

    Parameters
    ----------
    total : int
        Nonnegative integer to split.
    shares : ndarray of float64
        Nonnegative weights summing to 1.

    Returns
    -------
    ndarray of int64
        Integers summing to ``total``, each the floor or ceiling of ``total * share``; remainders are
        handed out largest first, ties to the lower index (deterministic).
    """
    raw = total * shares
    out = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - out), kind="stable")
    out[order[: total - int(out.sum())]] += 1
    return out
