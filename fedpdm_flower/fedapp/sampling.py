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


def rng_for(seed: int, *path: int) -> np.random.Generator:
    """A generator determined by (seed, *path), e.g. rng_for(seed, STREAM_CLIENT, pid, round)."""
    return np.random.default_rng([seed, *path])


def select_clients(server_round: int, num_clients: int, per_round: int, seed: int, *, first_round_all: bool) -> list[int]:
    """S_t: all N clients in round 1 if `first_round_all` (Alg. 1, S_0 = [N]), else K drawn uniformly without replacement."""
    if first_round_all and server_round == 1:
        return list(range(num_clients))
    rng = rng_for(seed, STREAM_SAMPLER, server_round)
    return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))
