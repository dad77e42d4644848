"""Client sampling S_t, stateless and seeded so that every driver samples the same clients."""

from __future__ import annotations

import numpy as np

# Distinct stream tags keep the sampler, the model init and each client's RNG independent of each other.
STREAM_SAMPLER = 1
STREAM_INIT = 2
STREAM_CLIENT = 3
STREAM_DOWNLINK = 4
#: the server's draw of the nodes that evaluate the global model in a round (client-side evaluation)
STREAM_EVALUATE = 5


#: SeedSequence's entropy word: a Python int below this is one uint32 word of the array default_rng builds
_WORD = 2**32


def rng_for(seed: int, *path: int) -> np.random.Generator:
    """A generator determined by (seed, *path), e.g. rng_for(seed, STREAM_CLIENT, pid, round): exactly
    ``np.random.default_rng([seed, *path])``, the stream every spec names.

    When every word is an int in [0, 2^32) the entropy goes to ``SeedSequence`` as a uint32 array, which is the
    array ``default_rng`` builds from the list itself (one uint32 word per such int), without numpy's per-item
    coercion of a Python list: 34 us a generator against 44 here, and the DPQ simulator makes one per node, step
    and stream. Other words (negative, >= 2^32, non-int) take ``default_rng``'s own path, which splits or rejects
    them.
    """
    words = (seed, *path)
    if all(type(w) is int and 0 <= w < _WORD for w in words):
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(np.array(words, dtype=np.uint32))))
    return np.random.default_rng(list(words))


def select_clients(server_round: int, num_clients: int, per_round: int, seed: int, *, first_round_all: bool) -> list[int]:
    """S_t: all N clients in round 1 if `first_round_all` (Alg. 1, S_0 = [N]), else K drawn uniformly without replacement."""
    if first_round_all and server_round == 1:
        return list(range(num_clients))
    rng = rng_for(seed, STREAM_SAMPLER, server_round)
    return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))
