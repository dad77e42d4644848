"""Split a dataset among clients: IID, Dirichlet, label-k (flwr-datasets), the paper's split, and one writer per client.

Every scheme is a pure function of ``(y, scheme, num_partitions, seed, options)``, so a client
rebuilds its share on demand instead of storing it in its state. ``load_partition`` adds a
best-effort per-process cache on top, keyed by the arguments *and* a digest of the labels (and groups) it split,
so a partition computed on one copy of a dataset (e.g. a test's fake download) is never served for another.

The ``iid``, ``dirichlet`` and ``label-k`` schemes reuse flwr-datasets' partitioners on an in-memory
``datasets.Dataset`` holding only the labels and row numbers (no hub access, see
``shared/notes/flower-1.42.md`` section 9). ``paper`` is ours, written in numpy
(:func:`paper_partition`). ``writer`` (:func:`writer_partition`) needs natural groups (FEMNIST's writers).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp.data.sources import ArrayDataset, load_dataset

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "label-k", "paper", "writer")

# Dirichlet retries until every client has at least this many samples (flwr-datasets' default).
DIRICHLET_MIN_PARTITION_SIZE = 10

_PartitionKey = tuple[str, str, int, int, str, str | None, tuple[tuple[str, Any], ...], str]
_PARTITION_CACHE: dict[_PartitionKey, list[NDArray[np.int64]]] = {}


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
    """Assign sample indices to ``num_partitions`` clients.

    Parameters
    ----------
    y : array_like of int, shape (n,)
        Labels of the dataset to split.
    scheme : str
        * ``"iid"``: shuffle with ``seed``, then cut into equal contiguous shards (what
          ``FederatedDataset(shuffle=True)`` + ``IidPartitioner`` do); sizes differ by at most one.
        * ``"dirichlet"``: ``DirichletPartitioner(alpha=dirichlet_alpha, self_balancing=False)``
          with ``min_partition_size = min(10, n // (2 * num_partitions))`` (the cap keeps small
          synthetic sets partitionable).
        * ``"label-k"``: ``PathologicalPartitioner(num_classes_per_partition=labels_per_client,
          class_assignment_mode="first-deterministic")``: client ``i`` gets classes
          ``i, i+1, ..., i+k-1`` (mod the number of classes), each class split evenly among its clients.
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

    if scheme == "paper":
        return paper_partition(labels, num_partitions, seed, labels_per_client, samples_per_client)
    if scheme == "writer":
        if groups is None:
            raise ValueError("partition scheme 'writer' needs the samples' writer ids (groups); only 'femnist' has them")
        g = np.asarray(groups)
        if g.shape != labels.shape or not np.issubdtype(g.dtype, np.integer):
            raise ValueError(f"groups must hold one integer per sample, got shape {g.shape} dtype {g.dtype}")
        return writer_partition(g, num_partitions, seed)
    return _flwr_partition(labels, scheme, num_partitions, seed, labels_per_client, dirichlet_alpha)


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

    The dataset is loaded through :func:`fedpdm_flower.fedapp.data.load_dataset` (memoised) and the index lists are
    cached per process, keyed by every argument that shapes them. The cache is only a speed-up: the
    partitions are a deterministic function of the arguments, so a fresh process rebuilds the same.

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
    train, _, _ = load_dataset(name, source, root)
    key: _PartitionKey = (name, scheme, num_partitions, seed, source, root, tuple(sorted(kw.items())), _digest(train))
    parts = _PARTITION_CACHE.get(key)
    if parts is None:
        parts = partition_indices(train.y, scheme, num_partitions, seed, groups=train.groups, **kw)
        for p in parts:
            p.setflags(write=False)  # shared by later calls
        _PARTITION_CACHE[key] = parts
    return train.subset(parts[int(partition_id)])


def clear_partition_cache() -> None:
    """Forget every cached partition (for tests and long-lived processes)."""
    _PARTITION_CACHE.clear()


def _digest(data: ArrayDataset) -> str:
    """What a partition depends on besides the arguments: the labels and groups (BLAKE2b; ~1 ms for MNIST)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(data.y).tobytes())
    if data.groups is not None:
        h.update(b"groups")
        h.update(np.ascontiguousarray(data.groups).tobytes())
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
    g = np.asarray(groups, dtype=np.int64)
    _check_int("num_partitions", num_partitions, 1)
    ids, inverse = np.unique(g, return_inverse=True)
    if num_partitions > ids.size:
        raise ValueError(
            f"partition scheme 'writer': num_partitions ({num_partitions}) exceeds the number of writers in the "
            f"dataset ({ids.size}); use at most {ids.size} clients"
        )
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=ids.size))
    members = np.split(order, bounds[:-1])
    chosen = np.random.default_rng(seed).permutation(ids.size)[:num_partitions]
    return [np.sort(members[int(k)]).astype(np.int64) for k in chosen]


# ---------------------------------------------------------------------------------------- flwr-datasets


def _flwr_partition(
    labels: NDArray[np.int64],
    scheme: str,
    num_partitions: int,
    seed: int,
    labels_per_client: int,
    dirichlet_alpha: float,
) -> list[NDArray[np.int64]]:
    # The partitioners live on HF datasets; these keep it from ever reaching for the hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        Partitioner,
        PathologicalPartitioner,
    )

    n = labels.size
    # A row-number column lets us read indices back through the public load_partition API.
    ds = datasets.Dataset.from_dict({"label": labels, "idx": np.arange(n, dtype=np.int64)})
    partitioner: Partitioner
    if scheme == "iid":
        # IidPartitioner shards contiguously; FederatedDataset(shuffle=True) shuffles first, so do too.
        ds = ds.shuffle(seed=seed)
        partitioner = IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=dirichlet_alpha,
            min_partition_size=min(DIRICHLET_MIN_PARTITION_SIZE, n // (2 * num_partitions)),
            self_balancing=False,
            seed=seed,
        )
    else:
        num_classes = np.unique(labels).size
        if labels_per_client > num_classes:
            raise ValueError(
                f"labels_per_client ({labels_per_client}) exceeds the number of classes ({num_classes})"
            )
        partitioner = PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=labels_per_client,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    partitioner.dataset = ds
    out: list[NDArray[np.int64]] = []
    for pid in range(num_partitions):
        part = partitioner.load_partition(pid)
        idx = part.with_format("numpy", columns=["idx"])[:]["idx"]
        out.append(np.sort(np.asarray(idx, dtype=np.int64).reshape(-1)))
    return out


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
    n = labels.size
    spc = n // num_partitions if samples_per_client is None else samples_per_client
    _check_int("samples_per_client", spc, 1)
    if num_partitions * spc > n:
        raise ValueError(
            f"paper split needs num_partitions * samples_per_client = {num_partitions} * {spc} = "
            f"{num_partitions * spc} samples but the dataset has {n}"
        )
    classes, inverse = np.unique(labels, return_inverse=True)
    pools = [np.flatnonzero(inverse == c) for c in range(classes.size)]
    sizes = np.array([p.size for p in pools], dtype=np.int64)
    rng = np.random.default_rng(seed)
    # One label per client is the one-class rule whatever the number of classes.
    if classes.size <= labels_per_client or labels_per_client == 1:
        counts = _one_class_counts(sizes, num_partitions, spc, classes, rng)
    else:
        counts = _multi_label_counts(sizes, num_partitions, spc, labels_per_client, classes, rng)
    # Draw without replacement: shuffle each label's pool once, then hand out consecutive chunks.
    offsets = np.zeros(num_partitions + 1, dtype=np.int64)
    chunks: list[list[NDArray[np.int64]]] = [[] for _ in range(num_partitions)]
    for c, pool in enumerate(pools):
        shuffled = rng.permutation(pool)
        offsets[1:] = np.cumsum(counts[:, c])
        for i in np.flatnonzero(counts[:, c]):
            chunks[i].append(shuffled[offsets[i] : offsets[i + 1]])
    return [np.sort(np.concatenate(ch)).astype(np.int64) for ch in chunks]


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
    mask = np.zeros((n_clients, n_classes), dtype=bool)
    left = uses.copy()
    for i in range(n_clients):
        order = np.lexsort((rng.random(n_classes), -left))
        pick = order[:num_labels]
        mask[i, pick] = True
        left[pick] -= 1
    if np.any(left != 0):  # pragma: no cover - guarded by the invariant above
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
    columns -> sink, started from the greedy units so that it may reroute them, places the rest.
    """
    if np.any(supply < 0) or np.any(capacity < demand):
        return None
    r, c = mask.shape
    greedy = np.zeros((r, c), dtype=np.int64)
    left = demand.copy()
    for i in range(r):
        cand = np.flatnonzero(mask[i] & (left > 0))
        take = cand[np.argsort(-frac[i, cand], kind="stable")[: supply[i]]]
        greedy[i, take] = 1
        left[take] -= 1
    size = r + c + 2
    src, snk = r + c, r + c + 1
    total = int(supply.sum())
    cap = np.zeros((size, size), dtype=np.int64)
    cap[src, :r] = supply
    cap[:r, r : r + c] = np.where(mask, total, 0)
    cap[r : r + c, snk] = demand
    flow = np.zeros_like(cap)
    flow[:r, r : r + c] = greedy
    flow[r : r + c, :r] = -greedy.T
    flow[src, :r] = greedy.sum(axis=1)
    flow[:r, src] = -flow[src, :r]
    flow[r : r + c, snk] = greedy.sum(axis=0)
    flow[snk, r : r + c] = -flow[r : r + c, snk]
    sent = int(greedy.sum()) + _max_flow(cap, flow, src, snk)
    if sent < total:
        cap[r : r + c, snk] = capacity
        sent += _max_flow(cap, flow, src, snk)
    if sent < total:
        return None
    return flow[:r, r : r + c].copy()


def _max_flow(cap: NDArray[np.int64], flow: NDArray[np.int64], src: int, snk: int) -> int:
    """Augment ``flow`` (in place, skew-symmetric) along shortest paths; return the amount added."""
    sent = 0
    n = cap.shape[0]
    while True:
        # Level-synchronous BFS, one numpy step per level rather than one Python step per edge.
        parent = np.full(n, -1, dtype=np.int64)
        parent[src] = src
        frontier = np.array([src], dtype=np.int64)
        while frontier.size and parent[snk] < 0:
            reach = (cap[frontier] - flow[frontier] > 0) & (parent < 0)[None, :]
            new = np.flatnonzero(reach.any(axis=0))
            parent[new] = frontier[np.argmax(reach[:, new], axis=0)]
            frontier = new
        if parent[snk] < 0:
            return sent
        path = [snk]
        while path[-1] != src:
            path.append(int(parent[path[-1]]))
        us, vs = np.array(path[1:]), np.array(path[:-1])
        push = int((cap[us, vs] - flow[us, vs]).min())
        flow[us, vs] += push
        flow[vs, us] -= push
        sent += push


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
