"""FedREP's local algorithm and server step, framework-free (no Flower imports).

Yang, Wang, Li, "FedREP: A Byzantine-Robust, Communication-Efficient and Privacy-Preserving Framework for
Federated Learning" (arXiv 2303.05206; spec ``shared/specs/fedrep.md``).

* Local momentum SGD, Eq. (180) (spec 3.2 b): the weights restart from the global model every round, the
  momentum persists across rounds, and the momentum is *dampened* (factor 1 - beta on the gradient, starting
  from m = 0, which is not PyTorch's first step):

      m^{t+1,j+1} = beta m^{t+1,j} + (1 - beta) grad f_i(w^{t+1,j}),     w^{t+1,j+1} = w^{t+1,j} - eta m^{t+1,j+1}

* Error compensation (Alg. 2): g_k^t = u_k^t + (w^t - w_k^{t+1}); ConSpar keeps g on the agreed set I^t and
  u_k^{t+1} = g_k^t - g~_k^t (:mod:`fedpdm_flower.fedapp.compression.conspar`). [OURS] The coordinates of buffers
  (BatchNorm's running statistics, :func:`buffer_indices`) are in I^t every round and have no error memory.
* Server step (Alg. 1 last line): w^{t+1} = w^t - G~^t, no server learning rate; the model is float32 on both
  ends, and :func:`model_crc` proves that a client's copy is the server's.
* Data order (spec 11.13, our reading): per-client shuffled passes over the local data, one fresh seeded
  permutation per pass; the position is a single integer cursor kept in the client's state.

The model is a user's torch module behind :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` (trained in place over its
trainable parameters; BatchNorm running statistics move with the forward passes and travel in w like every
other floating-point entry, spec 11.2), the data anything with ``len(data)`` and ``data.batch(idx)``
(:mod:`fedpdm_flower.fedapp.localdata`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.layout import NORM_BUFFERS, ArrayLayout, FloatArray

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.localdata import LocalData
    from fedpdm_flower.fedapp.models.torch_model import TorchModel

__all__ = [
    "NORM_BUFFERS",
    "LocalResult",
    "buffer_indices",
    "learning_rate",
    "local_momentum_sgd",
    "model_crc",
    "next_batch",
    "server_step",
    "trainable_count",
]


def buffer_indices(layout: ArrayLayout, names: Iterable[str] | None = None) -> NDArray[np.int64]:
    """The coordinates of w that hold buffers: the entries named ``names`` (a device knows its buffers), or, for a
    server that holds only the state dict's names, torch's normalisation buffers (:data:`NORM_BUFFERS`).

    FedREP sends them on every round, outside ConSpar's proposals, and keeps no error memory on them: a running
    statistic's change ``w^t - w_k^{t+1}`` is the distance to the device's statistics, not a step, so summing the
    changes of rounds it was not sent (error feedback) counts that distance once per round and overshoots -- a
    running variance driven below zero makes every evaluation NaN (the BatchNorm collapse of issue 23).
    """
    wanted = set(names) if names is not None else None
    parts = [np.arange(e.offset, e.offset + e.size, dtype=np.int64) for e in layout.entries if e.offset is not None
             and (e.name in wanted if wanted is not None else e.name.endswith(NORM_BUFFERS))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


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
    model: TorchModel,
    w0: FloatArray,
    momentum: NDArray[np.float32] | None,
    data: LocalData,
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
    model
        The network (:class:`TorchModel`; its module is overwritten with w0 and trained in place).
    w0
        The global model w^t (flat, the model's state-dict layout).
    momentum
        m_k from the previous round over the trainable parameters; None means m = 0 (first round).
    data
        The client's samples: ``len(data)`` and ``data.batch(idx) -> (inputs, targets)``.
    lr, beta
        eta and beta of Eq. (180); beta = 0 is plain local SGD (spec 3.2 a).
    steps, batch_size
        I and B.
    cursor, permutation
        Data order (see :func:`next_batch`).
    """
    import torch  # here, not at the top: the server side of FedREP (server_step, model_crc, ...) is numpy only

    model.set_flat(w0)
    m = torch.zeros(model.num_trainable) if momentum is None else torch.from_numpy(np.array(momentum, dtype=np.float32))
    losses = []
    for _ in range(steps):
        idx, cursor = next_batch(len(data), batch_size, cursor, permutation)
        grad, loss = model.batch_gradient(*data.batch(idx))
        m.mul_(beta).add_(grad, alpha=1.0 - beta)  # m = beta m + (1 - beta) grad
        model.add_to_trainable(-lr * m)  # w = w - eta m
        losses.append(loss)
    return LocalResult(w=model.get_flat(), momentum=m.numpy().astype(np.float32), cursor=cursor, loss=float(np.mean(losses)))


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


def model_crc(w: NDArray[Any]) -> int:
    """CRC-32 of the float32 model bytes: server and client compare it to prove they hold the same w."""
    return zlib.crc32(np.ascontiguousarray(w, dtype=np.float32).tobytes())


def trainable_count(layout: ArrayLayout) -> int:
    """The trainable entries of a model's flat vector: every floating-point entry except torch's normalisation
    buffers (names ending in ``running_mean`` / ``running_var``). ConSpar's budget K is a fraction of this count
    (the paper's d is ResNet-20's 269,722 trainable parameters; spec 11.2)."""
    return sum(e.size for e in layout.entries if e.in_vector and not e.name.endswith(NORM_BUFFERS))
