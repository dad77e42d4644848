"""FedREP's local algorithm and server step, framework-free (no Flower imports).

Yang, Wang, Li, "FedREP: A Byzantine-Robust, Communication-Efficient and Privacy-Preserving Framework for
Federated Learning" (arXiv 2303.05206; spec ``shared/specs/fedrep.md``).

* Local momentum SGD, Eq. (180) (spec 3.2 b): the weights restart from the global model every round, the
  momentum persists across rounds, and the momentum is *dampened* (factor 1 - beta on the gradient, starting
  from m = 0, which is not PyTorch's first step):

      m^{t+1,j+1} = beta m^{t+1,j} + (1 - beta) grad f_i(w^{t+1,j}),     w^{t+1,j+1} = w^{t+1,j} - eta m^{t+1,j+1}

* Error compensation (Alg. 2): g_k^t = u_k^t + (w^t - w_k^{t+1}); ConSpar keeps g on the agreed set I^t and
  u_k^{t+1} = g_k^t - g~_k^t (:mod:`fedapp.compression.conspar`).
* Server step (Alg. 1 last line): w^{t+1} = w^t - G~^t, no server learning rate.
* Data order (spec 11.13, our reading): per-client shuffled passes over the local data, one fresh seeded
  permutation per pass; the position is a single integer cursor kept in the client's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from fedapp.models.base import FloatArray
from fedapp.models.torch_net import TorchNet


def next_batch(n: int, batch_size: int, cursor: int, permutation: Callable[[int], NDArray[np.int64]]) -> tuple[NDArray[np.int64], int]:
    """Sample indices of the next mini-batch and the advanced cursor.

    The cursor counts samples drawn since the start of the run; pass p = cursor // n uses ``permutation(p)``.
    A batch never crosses the end of a pass (the last batch of a pass may be short: drop_last = False).
    """
    epoch, pos = divmod(cursor, n)
    end = min(pos + batch_size, n)
    return permutation(epoch)[pos:end], cursor + (end - pos)


@dataclass
class LocalResult:
    """One client's local round: its model w_k^{t+1}, momentum buffer, data cursor and mean training loss."""

    w: FloatArray
    momentum: NDArray[np.float32]
    cursor: int
    loss: float


def local_momentum_sgd(
    net: TorchNet,
    w0: FloatArray,
    momentum: NDArray[np.float32] | None,
    features: NDArray[Any],
    labels: NDArray[Any],
    *,
    lr: float,
    beta: float,
    steps: int,
    batch_size: int,
    cursor: int,
    permutation: Callable[[int], NDArray[np.int64]],
) -> LocalResult:
    """I = ``steps`` steps of Eq. (180) from w0 with the persistent (dampened) momentum buffer.

    Parameters
    ----------
    net
        The network (its module is overwritten with w0).
    w0
        The global model w^t (flat, :class:`TorchNet` layout).
    momentum
        m_k from the previous round over the trainable parameters; None means m = 0 (first round).
    features, labels
        The client's data.
    lr, beta
        eta and beta of Eq. (180); beta = 0 is plain local SGD (spec 3.2 a).
    steps, batch_size
        I and B.
    cursor, permutation
        Data order (see :func:`next_batch`).
    """
    net.set_flat(w0)
    m = torch.zeros(net.num_trainable) if momentum is None else torch.from_numpy(np.array(momentum, dtype=np.float32))
    losses = []
    for _ in range(steps):
        idx, cursor = next_batch(len(labels), batch_size, cursor, permutation)
        grad, loss = net.batch_gradient(features[idx], labels[idx])
        m.mul_(beta).add_(grad, alpha=1.0 - beta)  # m = beta m + (1 - beta) grad
        net.add_to_trainable(-lr * m)  # w = w - eta m
        losses.append(loss)
    return LocalResult(w=net.get_flat(), momentum=m.numpy().astype(np.float32), cursor=cursor, loss=float(np.mean(losses)))


def learning_rate(lr: float, server_round: int, decay_round: int, factor: float = 0.1) -> float:
    """eta_t: the initial lr, times ``factor`` from ``decay_round`` on (spec 3.3: x0.1 at epoch 80; 0 = never)."""
    return lr * factor if decay_round and server_round >= decay_round else lr


def server_step(w: NDArray[np.float32], indices: NDArray[np.int64], update: FloatArray) -> NDArray[np.float32]:
    """w^{t+1} = w^t - G~^t, G~^t = ``update`` on ``indices`` and zero elsewhere (Alg. 1, last line).

    The model is kept as float32, the values every client receives, so that server and clients hold the same w.
    """
    out = np.array(w, dtype=np.float32)
    out[indices] = (out[indices].astype(np.float64) - update).astype(np.float32)
    return out


def _check_torch_setup(cfg: Any) -> None:
    """Rules every FedREP-setup algorithm shares: a torch network, fewer Byzantine clients than clients."""
    from fedapp.config import ConfigError
    from fedapp.models.torch_net import TORCH_MODELS

    if cfg.model not in TORCH_MODELS:
        raise ConfigError(f"run config key 'model' is {cfg.model!r}; {cfg.algorithm} trains a torch network: "
                          f"one of {', '.join(TORCH_MODELS)}")
    if cfg.byzantine_clients >= cfg.num_clients:
        raise ConfigError(f"run config key 'byzantine-clients' ({cfg.byzantine_clients}) must be below "
                          f"'num-clients' ({cfg.num_clients})")


def validate_config(cfg: Any) -> None:
    """FedREP's own run-config rules (raise ConfigError naming the key), checked before any round."""
    from fedapp.config import ConfigError

    _check_torch_setup(cfg)
    if cfg.conspar_fraction > cfg.num_clients:
        raise ConfigError(f"run config key 'conspar-fraction' ({cfg.conspar_fraction}) exceeds 'num-clients' "
                          f"({cfg.num_clients}): K = m d (every client proposes all d coordinates) is the largest")
    if cfg.algorithm in ("fedrep-fedavg", "sparse-secagg"):  # buffers / masking are fixed for these baselines
        if cfg.algorithm == "sparse-secagg" and cfg.attack in ("alie", "foe"):
            raise ConfigError(f"run config key 'attack' is {cfg.attack!r}: SparseSecAgg masks every upload, an "
                              "omniscient attack cannot see the honest ones")
        return
    if cfg.num_clients % cfg.buffer_size:
        raise ConfigError(f"run config key 'buffer-size' ({cfg.buffer_size}) must divide 'num-clients' "
                          f"({cfg.num_clients}) (spec 11.6)")
    if cfg.secagg_mode == "masked" and cfg.buffer_size < 2:
        raise ConfigError("run config key 'secagg-mode' is 'masked' but 'buffer-size' is 1: a buffer of one client "
                          "is its update in the clear; use secagg-mode=plain for s = 1")
    if cfg.secagg_mode == "masked" and cfg.attack in ("alie", "foe"):
        raise ConfigError(f"run config key 'attack' is {cfg.attack!r}, an omniscient attack that needs the honest "
                          "clients' uploads: it can run only with secagg-mode=plain (masking hides them by design)")


def validate_flower_robust(cfg: Any) -> None:
    """Run-config rules of Flower's Krum / FedMedian / FedTrimmedAvg on the FedREP setup (``flwr-krum``,
    ``flwr-fedmedian``, ``flwr-fedtrimmedavg``): a torch network, fewer Byzantine clients than clients, and no
    coordinate attack (there is no proposal phase to attack). Every client trains every round; buffers, masking
    and ConSpar do not exist here, so ALIE / FoE are always possible (the server sees each model in the clear)."""
    from fedapp.config import ConfigError

    _check_torch_setup(cfg)
    if cfg.coord_attack != "none":
        raise ConfigError(f"run config key 'coord-attack' is {cfg.coord_attack!r}, but {cfg.algorithm} has no "
                          "coordinate proposals to attack: use coord-attack=none")
