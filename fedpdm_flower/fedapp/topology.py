"""Communication graphs, relay (random-walk) schedules and gossip mixing weights for the decentralized algorithms.

Shared by DP-RECAL (Wang, Guo, Yang, Shi, "Differentially Private Decentralized Optimization with Relay
Communication", seed 001; spec ``dp_recal.md``) and DPQ-DSGD (spec ``dp_quantized.md``), and by the synchronous
baselines DP-NIDS / DP-PG-EXTRA / DP-IC-ADMM (dp_recal.md 5.6). Pure numpy: no networkx.

Contents
* :class:`Graph`: an undirected simple graph on agents ``0..n-1`` (dp_recal.md 1.2) and its generators
  :func:`ring`, :func:`complete`, :func:`star`, :func:`path_graph`, :func:`erdos_renyi`, :func:`random_geometric`,
  :func:`from_edges`, plus :func:`parse_graph` for run-config strings (dp_recal.md 5.3, 7.2).
* The relay walk (dp_recal.md 3.2-3.3): :func:`transition_matrix` ``P = D^-1 A``, the stationary distribution by
  ``d / sum d`` (:func:`stationary_distribution`) and by the paper's least-squares formula (34)
  (:func:`stationary_lemma1`), :func:`start_agent`, :func:`next_agent`, :func:`walk_path`, :func:`cyclic_route`.
* Local communication involvement (dp_recal.md 1.5, 4.5): :func:`activation_counts`, :func:`lci`, :func:`plan_xi`.
* Mixing weights for synchronous gossip (dp_quantized.md 1.2, 6.3; dp_recal.md 5.6): :func:`metropolis_weights`,
  :func:`laplacian`, :func:`validate_mixing`, :func:`support_graph`, :func:`slem`, :func:`spectral_gap`,
  :func:`rho_laplacian`.
* :class:`CommCounters`: the communication counters of dp_recal.md 7.6.

Randomness follows ``fedpdm_flower.fedapp.sampling``: every stream is ``np.random.default_rng([seed, STREAM_*, ...])``, so the
server, the in-process reference simulator and any re-run draw the same graph, start agent and walk.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "START_MODES",
    "STREAM_GRAPH",
    "STREAM_START",
    "STREAM_WALK",
    "WALKS",
    "CommCounters",
    "Graph",
    "activation_counts",
    "complete",
    "cyclic_route",
    "erdos_renyi",
    "from_edges",
    "laplacian",
    "lci",
    "metropolis_weights",
    "next_agent",
    "parse_graph",
    "path_graph",
    "plan_xi",
    "random_geometric",
    "rho_laplacian",
    "ring",
    "slem",
    "spectral_gap",
    "star",
    "start_agent",
    "stationary_distribution",
    "stationary_lemma1",
    "support_graph",
    "transition_matrix",
    "validate_mixing",
    "walk_path",
    "walk_uniforms",
]

# Stream tags (see fedpdm_flower/fedapp/sampling.py; 1-4, 10-13, 20-22 and 101 are taken elsewhere).
STREAM_GRAPH = 30  # random graph generators (erdos_renyi, random_geometric)
STREAM_START = 31  # the start agent i_1
STREAM_WALK = 32  # the walk's per-step uniforms u_1, u_2, ...

WALKS = ("markov", "cyclic", "iid")
START_MODES = ("stationary", "uniform", "fixed:<id>")


def _as_int(value: Any, what: str) -> int:
    """``value`` as a Python int; bools, floats and strings are rejected."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _canonical_edges(n: int, edges: Iterable[Sequence[Any]]) -> tuple[tuple[int, int], ...]:
    """Edges as sorted, deduplicated ``(i, j)`` pairs with ``i < j``; self-loops and out-of-range ends raise."""
    out: set[tuple[int, int]] = set()
    for e in edges:
        if len(e) != 2:
            raise ValueError(f"edge {tuple(e)!r} must have exactly two endpoints")
        i, j = _as_int(e[0], "edge endpoint"), _as_int(e[1], "edge endpoint")
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"edge ({i}, {j}) has an endpoint out of range 0..{n - 1} (n = {n})")
        if i == j:
            raise ValueError(f"edge ({i}, {j}) is a self-loop; the graph must be simple")
        out.add((min(i, j), max(i, j)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Graph:
    """Undirected simple graph ``G = (V, E)`` on agents ``0..n-1`` (dp_recal.md 1.2).

    Construct with ``Graph(n, edges)``: edges are canonicalised (``i < j``, sorted, duplicates and reversed copies
    merged); self-loops and out-of-range endpoints raise ``ValueError``. A ``Graph`` may be disconnected; every
    generator and :func:`from_edges` return connected graphs only. Equality and hashing use ``(n, edges)``;
    ``label`` is a free-form description (e.g. ``"ring(8)"``) for logs and results.

    Derived fields: ``adjacency`` (read-only bool n x n, the paper's A), ``neighbours`` (sorted tuple per agent,
    N_i), ``degrees`` (read-only int64, d_i = |N_i|).
    """

    n: int
    edges: tuple[tuple[int, int], ...]
    label: str = field(default="", compare=False)
    adjacency: NDArray[np.bool_] = field(init=False, repr=False, compare=False)
    neighbours: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    degrees: NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = _as_int(self.n, "n")
        if n < 1:
            raise ValueError(f"a graph needs at least one agent, got n = {n}")
        edges = _canonical_edges(n, self.edges)
        adj = np.zeros((n, n), dtype=np.bool_)
        for i, j in edges:
            adj[i, j] = adj[j, i] = True
        adj.flags.writeable = False
        deg = adj.sum(axis=1).astype(np.int64)
        deg.flags.writeable = False
        nbrs = tuple(tuple(int(j) for j in np.flatnonzero(adj[i])) for i in range(n))
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "adjacency", adj)
        object.__setattr__(self, "neighbours", nbrs)
        object.__setattr__(self, "degrees", deg)

    @property
    def num_edges(self) -> int:
        """m = |E|, the number of undirected edges."""
        return len(self.edges)

    def has_edge(self, i: int, j: int) -> bool:
        """True iff ``{i, j}`` is an edge (False for ``i == j`` and for out-of-range agents)."""
        if not (0 <= i < self.n and 0 <= j < self.n):
            return False
        return bool(self.adjacency[i, j])

    def is_connected(self) -> bool:
        """True iff every agent is reachable from agent 0 (breadth-first search)."""
        seen = np.zeros(self.n, dtype=np.bool_)
        seen[0] = True
        frontier = [0]
        while frontier:
            nxt: list[int] = []
            for i in frontier:
                for j in self.neighbours[i]:
                    if not seen[j]:
                        seen[j] = True
                        nxt.append(j)
            frontier = nxt
        return bool(seen.all())

    def components(self) -> list[list[int]]:
        """Connected components, each a sorted list of agents, ordered by their smallest agent."""
        comp = -np.ones(self.n, dtype=np.int64)
        out: list[list[int]] = []
        for s in range(self.n):
            if comp[s] >= 0:
                continue
            comp[s] = len(out)
            members, stack = [s], [s]
            while stack:
                i = stack.pop()
                for j in self.neighbours[i]:
                    if comp[j] < 0:
                        comp[j] = len(out)
                        members.append(j)
                        stack.append(j)
            out.append(sorted(members))
        return out


def _graph(n: int, edges: Iterable[Sequence[Any]], label: str) -> Graph:
    """``Graph(n, edges)`` from any iterable of pairs (canonicalised and validated)."""
    return Graph(n, _canonical_edges(n, edges), label=label)


def _require_connected(g: Graph, what: str) -> Graph:
    if not g.is_connected():
        comps = g.components()
        shown = ", ".join(str(c) for c in comps[:4]) + (", ..." if len(comps) > 4 else "")
        raise ValueError(f"{what}: the graph is disconnected ({len(comps)} components: {shown}); "
                         "decentralized algorithms need a connected graph")
    return g


# ----------------------------------------------------------------------------------------------------------------
# Generators (dp_recal.md 5.3)


def ring(n: int) -> Graph:
    """Cycle ``0-1-...-(n-1)-0`` (the paper's "circular graph"; every d_i = 2, m = n). Needs n >= 3."""
    n = _as_int(n, "n")
    if n < 3:
        raise ValueError(f"ring(n) needs n >= 3 (n = {n} would repeat an edge or be a single node)")
    return _graph(n, [(i, (i + 1) % n) for i in range(n)], f"ring({n})")


def complete(n: int) -> Graph:
    """Complete graph K_n (every d_i = n - 1, m = n(n-1)/2; dp_recal.md 8 A10). Needs n >= 2."""
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"complete(n) needs n >= 2, got {n}")
    return _graph(n, [(i, j) for i in range(n) for j in range(i + 1, n)], f"complete({n})")


def star(n: int) -> Graph:
    """Star with centre 0 and leaves ``1..n-1`` (a non-regular test graph, dp_recal.md 9 item 1). Needs n >= 2."""
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"star(n) needs n >= 2, got {n}")
    return _graph(n, [(0, j) for j in range(1, n)], f"star({n})")


def path_graph(n: int) -> Graph:
    """Path ``0-1-...-(n-1)`` (dp_recal.md 9 item 1: the path 0-1-2 has g = [1/4, 1/2, 1/4]). Needs n >= 2."""
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"path_graph(n) needs n >= 2, got {n}")
    return _graph(n, [(i, i + 1) for i in range(n - 1)], f"path({n})")


def from_edges(n: int, edges: Iterable[Sequence[Any]], label: str = "") -> Graph:
    """A connected graph from an edge list (dp_recal.md 5.3 ``from_edge_list``).

    Duplicates and reversed copies are merged. ``ValueError`` names the problem: a self-loop, an endpoint out of
    range, or a disconnected graph (with its components).
    """
    n = _as_int(n, "n")
    g = _graph(n, edges, label or f"edges(n={n})")
    return _require_connected(g, f"from_edges(n={n})")


def erdos_renyi(n: int, p: float, seed: int, max_tries: int = 1000) -> Graph:
    """G(n, p): each of the n(n-1)/2 edges independently with probability p, resampled until connected.

    The draws come from one generator ``default_rng([seed, STREAM_GRAPH])``, so the result depends only on
    ``(n, p, seed)``. Raises ``ValueError`` after ``max_tries`` disconnected samples (connectivity needs roughly
    p > ln(n)/n).
    """
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"erdos_renyi needs n >= 2, got {n}")
    if not (0.0 < p <= 1.0):
        raise ValueError(f"erdos_renyi needs 0 < p <= 1, got p = {p}")
    rng = np.random.default_rng([seed, STREAM_GRAPH])
    iu, ju = np.triu_indices(n, k=1)
    for _ in range(max_tries):
        keep = rng.random(iu.size) < p
        g = _graph(n, zip(iu[keep].tolist(), ju[keep].tolist(), strict=True), f"er({n},{p},seed={seed})")
        if g.is_connected():
            return g
    raise ValueError(f"erdos_renyi(n={n}, p={p}, seed={seed}): no connected sample in {max_tries} tries; "
                     f"use p above ln(n)/n = {math.log(n) / n:.3g}")


def random_geometric(n: int, radius: float, seed: int, max_tries: int = 1000) -> Graph:
    """Random geometric graph: n points uniform in the unit square, an edge iff Euclidean distance <= radius.

    Resampled until connected, from one generator ``default_rng([seed, STREAM_GRAPH])``; ``ValueError`` after
    ``max_tries`` disconnected samples.
    """
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"random_geometric needs n >= 2, got {n}")
    if not radius > 0.0:
        raise ValueError(f"random_geometric needs radius > 0, got {radius}")
    rng = np.random.default_rng([seed, STREAM_GRAPH])
    iu, ju = np.triu_indices(n, k=1)
    for _ in range(max_tries):
        pts = rng.random((n, 2))
        dist = np.linalg.norm(pts[iu] - pts[ju], axis=1)
        keep = dist <= radius
        g = _graph(n, zip(iu[keep].tolist(), ju[keep].tolist(), strict=True), f"geometric({n},{radius},seed={seed})")
        if g.is_connected():
            return g
    raise ValueError(f"random_geometric(n={n}, radius={radius}, seed={seed}): no connected sample in {max_tries} "
                     f"tries; use a larger radius (connectivity needs roughly radius > sqrt(ln(n)/(pi n)) = "
                     f"{math.sqrt(math.log(n) / (math.pi * n)):.3g})")


#: largest edge file read (a graph of ~10^5 edges); a larger file is refused unread
MAX_EDGE_FILE_BYTES = 4 * 2**20


def _read_edge_file(path: str, n: int) -> list[tuple[int, int]]:
    """Edges from a text file of ``i j`` lines (whitespace or comma separated; ``#`` comments, blank lines ok).

    An error names the path and the line number, never the line's content: a config that points at another file
    (``edges:/etc/passwd``) must not echo it into logs and error replies.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"graph spec 'edges:{path}': no such file")
    size = p.stat().st_size
    if size > MAX_EDGE_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than an edge file may hold ({MAX_EDGE_FILE_BYTES})")
    try:
        text = p.read_bytes()[:MAX_EDGE_FILE_BYTES + 1].decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not an ASCII text file of 'i j' lines") from None
    edges: list[tuple[int, int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].replace(",", " ").strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"{path}:{lineno}: expected two non-negative integers 'i j' "
                             f"({len(parts)} field(s) there)")
        i, j = int(parts[0]), int(parts[1])
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"{path}:{lineno}: edge ({i}, {j}) out of range 0..{n - 1} (n = {n})")
        edges.append((i, j))
    return edges


def parse_graph(spec: str, n: int, seed: int = 0) -> Graph:
    """A connected graph from a run-config string (dp_recal.md 7.2; dp_quantized.md 6.3).

    ``"ring"``, ``"complete"``, ``"star"``, ``"path"``, ``"er:<p>"`` (Erdos-Renyi, resampled until connected),
    ``"geometric:<radius>"`` (random geometric in the unit square) or ``"edges:<file>"`` (a text file of ``i j``
    lines, relative paths against the working directory). ``seed`` only matters for the random kinds. Errors are
    ``ValueError`` naming the bad spec.
    """
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    kind = kind.strip().lower()
    arg = arg.strip()
    try:
        if kind in ("ring", "complete", "star", "path") and not sep:
            return {"ring": ring, "complete": complete, "star": star, "path": path_graph}[kind](n)
        if kind in ("er", "geometric") and sep:
            try:
                value = float(arg)
            except ValueError:
                raise ValueError(f"{arg!r} is not a number") from None
            return erdos_renyi(n, value, seed) if kind == "er" else random_geometric(n, value, seed)
        if kind == "edges" and arg:
            return from_edges(n, _read_edge_file(arg, n), label=f"edges:{arg}")
    except ValueError as err:
        raise ValueError(f"bad graph spec {spec!r}: {err}") from None
    raise ValueError(f"bad graph spec {spec!r}: expected 'ring', 'complete', 'star', 'path', 'er:<p>', "
                     "'geometric:<radius>' or 'edges:<file>'")


# ----------------------------------------------------------------------------------------------------------------
# Random walk and activation probabilities (dp_recal.md 1.2, 3.2, 3.3)


def laplacian(graph: Graph) -> NDArray[np.float64]:
    """Combinatorial Laplacian ``L = D - A`` (dp_recal.md 1.2). (DPQ-DSGD's weighted ``I - A`` is ``rho_laplacian``.)"""
    adj = graph.adjacency.astype(np.float64)
    return np.diag(graph.degrees.astype(np.float64)) - adj


def _require_walkable(graph: Graph) -> None:
    if graph.n < 2 or not graph.is_connected():
        raise ValueError(f"the relay walk needs a connected graph with n >= 2 ({graph.label or graph})")


def transition_matrix(graph: Graph) -> NDArray[np.float64]:
    """Simple random walk ``P = D^-1 A = I - D^-1 L``: ``P_ij = 1/d_i`` on edges, 0 elsewhere (Assumption 3)."""
    _require_walkable(graph)
    return graph.adjacency.astype(np.float64) / graph.degrees.astype(np.float64)[:, None]


def stationary_distribution(graph: Graph) -> NDArray[np.float64]:
    """Activation probabilities ``g_i = d_i / sum_j d_j = d_i / (2m)`` (dp_recal.md 3.3), the solution of g = P^T g."""
    _require_walkable(graph)
    d = graph.degrees.astype(np.float64)
    out: NDArray[np.float64] = d / float(d.sum())
    return out


def stationary_lemma1(graph: Graph) -> NDArray[np.float64]:
    """The paper's Lemma 1 formula (34): ``g = (D^-1 L^2 D^-1 + 1 1^T)^-1 1``.

    The least-squares form of ``L D^-1 g = 0`` with ``1^T g = 1``; equals :func:`stationary_distribution`
    (dp_recal.md 3.3, 9 item 1). Not the Appendix-A prose form ``g = P g``, which every constant vector solves.
    """
    _require_walkable(graph)
    lap = laplacian(graph)
    dinv = np.diag(1.0 / graph.degrees.astype(np.float64))
    m = dinv @ lap @ lap @ dinv + np.ones((graph.n, graph.n))
    return np.asarray(np.linalg.solve(m, np.ones(graph.n)), dtype=np.float64)


def _dfs_closed_walk(graph: Graph) -> tuple[int, ...]:
    """A closed walk through every agent along edges: DFS preorder from agent 0 (neighbours in increasing order).

    Consecutive preorder agents u -> v are joined directly when ``{u, v}`` is an edge; otherwise the walk climbs
    the DFS tree from u until it reaches an ancestor adjacent to v (v's parent always is), and finally climbs from
    the last agent until it is adjacent to agent 0. Every move is a graph edge, each tree edge is used at most
    twice, so the closed walk has length <= 2(n-1). On the ring this is 0 -> 1 -> ... -> n-1 (-> 0) and on the
    complete graph 0 -> 1 -> ... -> n-1, i.e. Hamiltonian cycles; on a star it is 0,1,0,2,...,0,n-1.
    """
    n = graph.n
    parent = [-1] * n
    seen = [False] * n
    order: list[int] = []
    stack = [0]
    while stack:
        i = stack.pop()
        if seen[i]:
            continue
        seen[i] = True
        order.append(i)
        for j in reversed(graph.neighbours[i]):
            if not seen[j]:
                parent[j] = i
                stack.append(j)
    route = [order[0]]
    for v in [*order[1:], order[0]]:
        u = route[-1]
        while not graph.adjacency[u, v]:  # v's parent (or, when closing, a child of the root) ends the climb
            u = parent[u]
            route.append(u)
        if v != order[0]:
            route.append(v)
    return tuple(route)


@lru_cache(maxsize=64)
def cyclic_route(graph: Graph) -> tuple[int, ...]:
    """The closed walk of the ``cyclic`` relay (dp_recal.md 3.2 [interp]); ``route[-1]`` is adjacent to ``route[0]``.

    A Hamiltonian cycle when one is obvious: ring ``i -> i+1 mod n``, complete graph ``i -> i+1 mod n`` (then
    ``len(route) == n``, every agent appears once and LCI = ceil(K/n)). Any other connected graph gets the
    DFS-based closed walk of :func:`_dfs_closed_walk` (agents may repeat; it is Hamiltonian whenever consecutive
    DFS-preorder agents happen to be adjacent).
    """
    _require_walkable(graph)
    n = graph.n
    if all(graph.has_edge(i, (i + 1) % n) for i in range(n)) and n >= 3:
        return tuple(range(n))  # ring-like or complete: the identity order is a Hamiltonian cycle
    if n == 2:
        return (0, 1)
    return _dfs_closed_walk(graph)


def _is_hamiltonian(route: tuple[int, ...], n: int) -> bool:
    return len(route) == n


def start_agent(graph: Graph, mode: str = "stationary", seed: int = 0) -> int:
    """The first holder ``i_1`` (dp_recal.md 3.2 [interp]).

    ``"stationary"`` (default): drawn from g; ``"uniform"``: uniform over agents; ``"fixed:<id>"``: that agent.
    Random modes use ``default_rng([seed, STREAM_START])``.
    """
    _require_walkable(graph)
    mode = mode.strip()
    if mode.startswith("fixed:"):
        try:
            agent = int(mode.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad start mode {mode!r}: 'fixed:<id>' needs an integer id") from None
        if not 0 <= agent < graph.n:
            raise ValueError(f"bad start mode {mode!r}: agent {agent} out of range 0..{graph.n - 1}")
        return agent
    rng = np.random.default_rng([seed, STREAM_START])
    if mode == "stationary":
        return int(rng.choice(graph.n, p=stationary_distribution(graph)))
    if mode == "uniform":
        return int(rng.integers(graph.n))
    raise ValueError(f"bad start mode {mode!r}: expected 'stationary', 'uniform' or 'fixed:<id>'")


def walk_uniforms(seed: int, first_step: int, count: int) -> NDArray[np.float64]:
    """The walk's uniforms ``u_k`` for ``k = first_step .. first_step + count - 1`` (k >= 1).

    ``u_k`` is the k-th double of ``default_rng([seed, STREAM_WALK])``. Any single ``u_k`` is computed without
    drawing the earlier ones (PCG64 ``advance``), so :func:`next_agent` is stateless while :func:`walk_path` draws
    all of them in one call; both see the same numbers.
    """
    if first_step < 1 or count < 0:
        raise ValueError(f"walk steps start at 1 and count >= 0, got first_step={first_step}, count={count}")
    bitgen = np.random.PCG64(np.random.SeedSequence([seed, STREAM_WALK]))
    if first_step > 1:
        bitgen.advance(first_step - 1)
    return np.random.Generator(bitgen).random(count)


def _cyclic_next(graph: Graph, cur: int, step: int, start: int | None) -> int:
    route = cyclic_route(graph)
    if _is_hamiltonian(route, graph.n):
        return route[(route.index(cur) + 1) % graph.n]
    if start is None:
        raise ValueError(f"the cyclic walk on {graph.label or 'this graph'} is not a Hamiltonian cycle "
                         "(agents repeat along the route), so next_agent needs the start agent")
    pos = (route.index(start) + step) % len(route)
    if route[pos - 1] != cur:
        raise ValueError(f"cyclic walk from start {start}: the holder at step {step} is {route[pos - 1]}, not {cur}")
    return route[pos]


def _pick(graph: Graph, cur: int, walk: str, u: float, cdf: NDArray[np.float64] | None) -> int:
    if walk == "markov":
        nb = graph.neighbours[cur]
        return nb[min(int(u * len(nb)), len(nb) - 1)]
    assert cdf is not None
    return min(int(np.searchsorted(cdf, u, side="right")), graph.n - 1)


def next_agent(graph: Graph, cur: int, step: int, seed: int, walk: str = "markov", start: int | None = None) -> int:
    """The next holder ``i_{step+1}`` given the current one ``cur = i_step`` (dp_recal.md 3.2), statelessly.

    * ``"markov"`` (default, Assumption 3): a uniform neighbour of ``cur``, ``N_cur[floor(u_step d_cur)]``.
    * ``"cyclic"``: the next agent along :func:`cyclic_route`. For a Hamiltonian route that is ``cur``'s successor;
      otherwise the position is ``(index of start + step) mod len(route)``, so ``start = i_1`` must be given.
    * ``"iid"``: a draw from g independent of ``cur`` (inverse CDF at ``u_step``). **Not graph-local**: an ablation
      matching the analysis (dp_recal.md 8 A5), never a hop a relay server should accept as an edge.

    The result depends only on ``(graph, cur, step, seed, walk[, start])``, so a server can recompute it.
    """
    cur, step = _as_int(cur, "cur"), _as_int(step, "step")
    _require_walkable(graph)
    if not 0 <= cur < graph.n:
        raise ValueError(f"current agent {cur} out of range 0..{graph.n - 1}")
    if walk == "cyclic":
        return _cyclic_next(graph, cur, step, start)
    if walk not in ("markov", "iid"):
        raise ValueError(f"unknown walk {walk!r}: expected one of {WALKS}")
    u = float(walk_uniforms(seed, step, 1)[0])
    cdf = np.cumsum(stationary_distribution(graph)) if walk == "iid" else None
    return _pick(graph, cur, walk, u, cdf)


def walk_path(graph: Graph, K: int, walk: str = "markov", start: str | int = "stationary",
              seed: int = 0) -> NDArray[np.int64]:
    """The holders ``i_1..i_K`` of a K-iteration relay run; entry k-1 is the agent active at iteration k.

    ``start`` is a :func:`start_agent` mode or an agent id. Equals repeated :func:`next_agent` calls with the same
    ``seed`` (tested), but draws the uniforms in one call.
    """
    K = _as_int(K, "K")
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    first = start_agent(graph, start, seed) if isinstance(start, str) else _as_int(start, "start")
    if not 0 <= first < graph.n:
        raise ValueError(f"start agent {first} out of range 0..{graph.n - 1}")
    _require_walkable(graph)
    out = np.empty(K, dtype=np.int64)
    if K == 0:
        return out
    if walk == "cyclic":
        route = np.asarray(cyclic_route(graph), dtype=np.int64)
        p0 = int(np.flatnonzero(route == first)[0])
        return route[(p0 + np.arange(K)) % route.size]
    if walk == "iid":
        cdf = np.cumsum(stationary_distribution(graph))
        draws = np.minimum(np.searchsorted(cdf, walk_uniforms(seed, 1, K - 1), side="right"), graph.n - 1)
        out[0] = first
        out[1:] = draws
        return out
    if walk != "markov":
        raise ValueError(f"unknown walk {walk!r}: expected one of {WALKS}")
    nbrs = graph.neighbours
    cur = first
    path = [cur]
    for u in walk_uniforms(seed, 1, K - 1).tolist():
        nb = nbrs[cur]
        d = len(nb)
        cur = nb[min(int(u * d), d - 1)]
        path.append(cur)
    out[:] = path
    return out


# ----------------------------------------------------------------------------------------------------------------
# Local communication involvement (dp_recal.md 1.5, 4.5)


def activation_counts(path: Sequence[int] | NDArray[np.integer[Any]], n: int) -> NDArray[np.int64]:
    """``tau_i(K)``: how many iterations agent i was active/published in (once per iteration; dp_recal.md 1.5)."""
    arr = np.asarray(path, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"activation path has agents outside 0..{n - 1}")
    return np.bincount(arr, minlength=n).astype(np.int64)


def lci(counts: Sequence[int] | NDArray[np.integer[Any]]) -> int:
    """Local communication involvement ``xi = max_i tau_i(K)`` (dp_recal.md 1.5; 0 for a run with no activations)."""
    arr = np.asarray(counts, dtype=np.int64).reshape(-1)
    return int(arr.max()) if arr.size else 0


def plan_xi(K: int, graph: Graph, walk: str = "markov", rule: str = "walk") -> int:
    """Planned LCI ``xi_plan`` for calibrating sigma_1 before the run (dp_recal.md 4.5 accounting notes [interp]).

    ``rule="walk"``:
    * ``cyclic``: ``ceil(K / len(route)) * (max visits of an agent per route)``; for a Hamiltonian route
      (ring, complete) this is ``ceil(K/n)``, the exact LCI.
    * ``markov`` and ``iid``: ``ceil(1.15 K max_i g_i)`` (ring-8, K = 4800: 690, above the 95th percentile 679 of
      dp_recal.md 3.4). Not a guarantee; pair it with ``stop_on_budget``.

    ``rule="K"``: the most conservative ``xi_plan = K``. Every plan is capped at K.
    """
    K = _as_int(K, "K")
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    if rule == "K":
        return K
    if rule != "walk":
        raise ValueError(f"unknown plan rule {rule!r}: expected 'walk' or 'K'")
    if walk == "cyclic":
        route = cyclic_route(graph)
        visits = int(np.bincount(np.asarray(route), minlength=graph.n).max())
        plan = math.ceil(K / len(route)) * visits
    elif walk in ("markov", "iid"):
        plan = math.ceil(round(1.15 * K * float(stationary_distribution(graph).max()), 9))
    else:
        raise ValueError(f"unknown walk {walk!r}: expected one of {WALKS}")
    return min(K, plan)


# ----------------------------------------------------------------------------------------------------------------
# Mixing weights for synchronous gossip (dp_quantized.md 1.2, 6.3; dp_recal.md 5.6)


def metropolis_weights(graph: Graph) -> NDArray[np.float64]:
    """Metropolis-Hastings weights: ``W_ij = 1/(1 + max(d_i, d_j))`` on edges, ``W_ii = 1 - sum_{j != i} W_ij``.

    Symmetric and doubly stochastic with nonnegative entries (dp_recal.md 5.6; dp_quantized.md 6.3, where it is
    called A: 1/3 everywhere on a ring, rho_L = 0.4607 for the 5-ring).
    """
    w = np.zeros((graph.n, graph.n), dtype=np.float64)
    d = graph.degrees
    for i, j in graph.edges:
        w[i, j] = w[j, i] = 1.0 / (1.0 + max(int(d[i]), int(d[j])))
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def _sym_eigvals(w: NDArray[np.floating[Any]]) -> NDArray[np.float64]:
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {arr.shape}")
    if not np.allclose(arr, arr.T, rtol=0.0, atol=1e-12):
        raise ValueError("mixing matrix must be symmetric for its spectrum to be real")
    return np.asarray(np.linalg.eigvalsh((arr + arr.T) / 2.0), dtype=np.float64)


def slem(w: NDArray[np.floating[Any]]) -> float:
    """Second-largest eigenvalue modulus ``max(|lambda_2|, |lambda_n|)`` of a symmetric doubly stochastic W."""
    ev = _sym_eigvals(w)  # ascending; ev[-1] = 1 for a stochastic W
    if ev.size < 2:
        return 0.0
    return float(max(abs(ev[-2]), abs(ev[0])))


def spectral_gap(w: NDArray[np.floating[Any]]) -> float:
    """``1 - slem(W)``: > 0 iff gossip with W converges to the average (connected graph, W not periodic)."""
    return 1.0 - slem(w)


def rho_laplacian(w: NDArray[np.floating[Any]]) -> float:
    """DPQ-DSGD's ``rho_L``: the second-smallest eigenvalue of ``I - W`` (dp_quantized.md 1.1; 0 iff disconnected)."""
    ev = _sym_eigvals(w)
    return float(1.0 - ev[-2]) if ev.size >= 2 else 0.0


def support_graph(w: NDArray[np.floating[Any]], tol: float = 0.0) -> Graph:
    """The graph with an edge ``{i, j}`` (i != j) wherever ``|W_ij| > tol`` (for an explicit mixing matrix)."""
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {arr.shape}")
    iu, ju = np.triu_indices(arr.shape[0], k=1)
    keep = (np.abs(arr[iu, ju]) > tol) | (np.abs(arr[ju, iu]) > tol)
    return _graph(arr.shape[0], zip(iu[keep].tolist(), ju[keep].tolist(), strict=True), "support(W)")


def validate_mixing(w: NDArray[np.floating[Any]], graph: Graph | None = None, tol: float = 1e-12) -> None:
    """Check Assumption 1 of dp_quantized.md (1.2, 6.3): raise ``ValueError`` naming the first violation.

    W must be square, finite, symmetric, entrywise >= 0, with rows (hence columns) summing to 1 within ``tol``,
    and connected (``rho_laplacian(W) > 1e-9``). With ``graph``, off-diagonal ``W_ij > 0`` exactly on its edges.
    """
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(f"mixing matrix must be square, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("mixing matrix has non-finite entries")
    if graph is not None and arr.shape[0] != graph.n:
        raise ValueError(f"mixing matrix is {arr.shape[0]} x {arr.shape[0]} but the graph has n = {graph.n}")
    asym = float(np.abs(arr - arr.T).max())
    if asym > tol:
        raise ValueError(f"mixing matrix is not symmetric (max |W - W^T| = {asym:.3g})")
    if arr.min() < -tol:
        raise ValueError(f"mixing matrix has a negative entry ({arr.min():.3g})")
    row_err = float(np.abs(arr.sum(axis=1) - 1.0).max())
    if row_err > tol:
        raise ValueError(f"mixing matrix rows do not sum to 1 (max error {row_err:.3g})")
    if graph is not None:
        off = ~np.eye(graph.n, dtype=np.bool_)
        bad = off & ((arr > tol) != graph.adjacency)
        if bad.any():
            i, j = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"mixing matrix support does not match the graph at ({i}, {j}): "
                             f"W = {arr[i, j]:.3g}, edge = {graph.has_edge(i, j)}")
    rho = rho_laplacian(arr)
    if rho <= 1e-9:
        raise ValueError(f"mixing matrix describes a disconnected graph (rho_L = {rho:.3g} <= 1e-9)")


# ----------------------------------------------------------------------------------------------------------------
# Communication counting (dp_recal.md 7.6)


@dataclass
class CommCounters:
    """Communication counters of dp_recal.md 7.6.

    ``graph_msgs``: the paper's communication metric (relay: one per baton hop, K in total; synchronous methods:
    the per-algorithm constant of dp_recal.md 5.6 per iteration). ``flower_transfers``: Flower messages, one per
    direction (relay: 2K + 2n including registration). ``bytes_up`` / ``bytes_down``: array payload bytes
    client -> server and server -> client.
    """

    graph_msgs: int = 0
    flower_transfers: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    def add_registration(self, n: int, bytes_up: int = 0, bytes_down: int = 0) -> None:
        """A round in which all n clients get one message and reply once; not a graph message."""
        self.flower_transfers += 2 * n
        self.bytes_up += bytes_up
        self.bytes_down += bytes_down

    def add_hop(self, bytes_up: int, bytes_down: int) -> None:
        """One relay iteration: holder i -> server (upload) and server -> holder (download) = one graph hop."""
        self.graph_msgs += 1
        self.flower_transfers += 2
        self.bytes_up += bytes_up
        self.bytes_down += bytes_down

    def add_round(self, graph_msgs: int, flower_transfers: int, bytes_up: int, bytes_down: int) -> None:
        """One synchronous round with explicit counts (e.g. 16 graph messages and 2n transfers on ring-8 NIDS)."""
        self.graph_msgs += graph_msgs
        self.flower_transfers += flower_transfers
        self.bytes_up += bytes_up
        self.bytes_down += bytes_down

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics/results)."""
        return asdict(self)
