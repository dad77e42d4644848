"""FedREP's clients (Alg. 2 of Yang, Wang, Li, arXiv 2303.05206; spec shared/specs/fedrep.md 3.4): the user's torch
model and data, FedREP's local algorithm, and the client side of ConSpar and the buffered secure aggregation.

:class:`FedREPClient` answers the exchanges of a FedREP round (fedpdm_flower/strategies/fedrep.py):

``propose`` (message ``query.propose``, phase 1)
    Bring the local model to w^t (apply the sparse aggregate of the last round, or take the dense model), train
    I steps of Eq. (180), form the error-compensated update g = u + (w^t - w_k^{t+1}), propose k coordinates
    with ConSpar (Sec. 3.2). Reply: the proposal (uint32 indices); in secure mode also this round's fresh key,
    signed with the device's long-term identity.
``fit`` (message ``train``, phase 2)
    Receive the consensus set I^t and the buffer; upload g[I^t] and keep u = g with I^t zeroed. In secure mode
    the message must be a mask request of the threshold protocol: the device checks the buffer and its mates'
    signed keys against its own trust store, then uploads g[I^t] masked (:mod:`fedpdm_flower.clients.secure`).
``unmask`` (message ``query.unmask``, phase 3, secure mode only)
    Once per round, per buffer-mate: the share of its self-mask seed (it survived) or the pairwise seed (it
    dropped), never both; the server then learns the survivors' sum.

**Secure mode** (``secure=SecureDevice(identity, trust_store, min_buffer=...)``) is the device's own policy: it
never sends an update in the clear, whatever a message says (a plain round, ``masked=False``, is refused in phase
1 already), and refuses buffers below ``min_buffer``, unsigned or untrusted keys, replayed rounds and a second
unmask request. Its train metrics stay on the device. The secure aggregation is the one of
:class:`fedpdm_flower.strategies.wrappers.SecureBuffers` / :func:`fedpdm_flower.clients.mods.secure_buffers_mod` (:mod:`fedpdm_flower.fedapp.secagg`).

:class:`MomentumSGDClient` runs the same local algorithm for one plain Flower ``train`` message (the model in,
the trained model out, in the arrays it was sent): the client of Flower's own Krum / FedMedian / FedTrimmedAvg
(fedpdm_flower/strategies/flower_robust.py), or of any strategy that sends the model and the keys below.

Everything algorithmic arrives in the message config, read through :class:`fedpdm_flower.clients.base.MessageConfig`:

=====================  =============================================================================================
key                    meaning
=====================  =============================================================================================
``lr``                 eta_t of Eq. (180) this round (> 0)
``momentum``           beta of Eq. (180), in [0, 1)
``local-steps``        I
``batch-size``         B (absent: the batch size of the client's DataLoader)
``k``, ``alpha``       ConSpar's per-client budget (k = d: propose nothing, upload every coordinate) and obfuscation
``error-feedback``     keep the error memory u (false: u = 0, SparseSecAgg)
``masked``             uploads masked with the threshold protocol (needs secure mode; ``secure.*`` keys carry the run
                       label, the buffer, its members and threshold, as in :mod:`fedpdm_flower.fedapp.secagg`)
``sparse-secagg-key``  phase 1 draws SparseSecAgg's unsigned key pair (that baseline's own exchange)
``dense-model``        the downlink is the dense w^t (else the last sparse aggregate, checked by ``model-crc``)
``sparse-downlink``    keep w^t in the state: the next downlink will be sparse
``upload``             phase 2: ``conspar`` (g on I^t) or ``sparse-secagg`` (pairwise location masks)
``buffer-id``          phase 2: the buffer
``client-id``,         SparseSecAgg's phase 2: the id that orders the pairwise masks, the other clients and their
``peer-ids``,          keys, the label of this run's masks, the location probability
``peer-keys``,
``mask-session``, ``p``
=====================  =============================================================================================

Persistent state in ``context.state`` (spec 3.5): the error memory u, the momentum m of Eq. (180), the pending g
between the phases (with its round tag), the data cursor, the local copy of w (sparse downlink), and in secure mode
the protocol's keys and pending shares (:mod:`fedpdm_flower.clients.secure`). A pending g that was never asked for (the client was left out of phase 2) is folded back into u at the
next phase 1: nothing of it was transmitted.

Byzantine behaviour exists only for simulations: a client built with ``attack=ClientAttack(...)``
(:mod:`fedpdm_flower.fedapp.attacks`, simulation only) runs this same honest pipeline and corrupts only what it transmits (spec
11.10). Without that argument no attack code runs.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.clients.base import ROUND_KEY, FedClient, MessageConfig
from fedpdm_flower.clients.secure import (
    SecureDevice,
    accept_mask,
    check_new_round,
    config_int,
    key_reply,
    mask_reply,
    unmask_reply,
)
from fedpdm_flower.fedapp.algorithms.fedrep import (
    LocalResult,
    buffer_indices,
    local_momentum_sgd,
    model_crc,
    server_step,
)
from fedpdm_flower.fedapp.compression import conspar
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.localdata import ArrayData, TorchData
from fedpdm_flower.fedapp.sampling import STREAM_CLIENT, rng_for
from fedpdm_flower.fedapp.secagg import S_PHASE, S_RECORD, S_ROUND, S_RUN
from fedpdm_flower.fedapp.wire import numpy_list

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.attacks import ClientAttack

__all__ = ["FedREPClient", "LocalMomentumClient", "MomentumSGDClient"]

# RNG streams of a client round (0 is the data order of fedpdm_flower.clients.base)
STREAM_ORDER, STREAM_PROPOSE, STREAM_QUANT, STREAM_ATTACK = 10, 11, 12, 13
STATE = "fedrep"
#: the in-place torch primitives Eq. (180) trains with (fedpdm_flower.fedapp.models.torch_model.TorchModel)
_TORCH_API = ("batch_gradient", "add_to_trainable", "set_flat", "get_flat", "num_trainable")

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class LocalMomentumClient(FedClient):
    """What FedREP's clients share: the user's torch model and data, Eq. (180), the state in ``context.state``.

    Parameters
    ----------
    model
        The user's torch ``nn.Module`` (FedREP trains it in place over its trainable parameters; float buffers such
        as BatchNorm's running statistics travel in w like every other floating-point entry, spec 11.2).
    data
        The local training data: ``(x, y)`` arrays or a torch ``Dataset`` / ``DataLoader`` (its batch size is the
        default B). Sampled by shuffled passes with a persistent cursor (spec 11.13).
    loss_fn
        ``loss_fn(outputs, targets)`` with mean reduction (default cross-entropy).
    context
        The node's Flower Context (bound on every message by :meth:`client_app` / :func:`fedpdm_flower.clients.base.register`).
    seed
        The device's seed (data order, ConSpar's random coordinates, stochastic rounding); None (default) draws
        from the OS (the pass order is then drawn once and kept in the state).
    attack
        SIMULATION ONLY: :class:`fedpdm_flower.fedapp.attacks.ClientAttack` for a client a simulation made Byzantine; it corrupts
        what this client transmits. None (default): an honest client.
    test_data, test_fn
        Flower's federated evaluation (:meth:`fedpdm_flower.clients.base.FedClient.evaluate`).
    """

    buffers = "in-vector"  # FedREP's w holds the float buffers (spec 11.2); see FedREPClient for how they travel

    def __init__(self, model: Any, data: Any, loss_fn: Any = None, *, context: Any = None, seed: int | None = None,
                 attack: ClientAttack | None = None, test_data: Any = None, test_fn: Any = None) -> None:
        super().__init__(model, data, loss_fn, context=context, seed=seed, test_data=test_data, test_fn=test_fn)
        missing = [a for a in _TORCH_API if not hasattr(self.model, a)]
        if missing:
            raise TypeError(f"{type(self).__name__} trains a torch nn.Module in place (Eq. 180); "
                            f"{type(model).__name__} lacks {missing}")
        if self.data is None:
            raise ValueError(f"{type(self).__name__} needs local training data")
        for name in ("corrupt_values", "corrupt_proposal"):
            if attack is not None and not callable(getattr(attack, name, None)):
                raise TypeError(f"attack must be a fedpdm_flower.fedapp.attacks.ClientAttack, got {type(attack).__name__}")
        self.attack = attack
        #: the coordinates of w holding this model's floating-point buffers (never proposed, no error memory)
        self.buffer_idx = buffer_indices(self.model.layout, self.model.buffer_names)

    # ---------------------------------------------------------------- state helpers
    def _state(self) -> dict[str, Any]:
        rec = self.state.config_records.get(STATE)
        return {} if rec is None else dict(rec)

    def _save_state(self, st: dict[str, Any]) -> None:
        self.state[STATE] = ConfigRecord(st)

    def _load(self, name: str, dtype: Any) -> NDArray[Any] | None:
        rec = self.state.array_records.get(name)
        return None if rec is None else np.asarray(numpy_list(rec)[0], dtype=dtype)

    def _save(self, name: str, value: NDArray[Any] | None) -> None:
        if value is None:
            if name in self.state.array_records:
                del self.state.array_records[name]
            return
        self.state[name] = ArrayRecord([np.ascontiguousarray(value)])

    # ---------------------------------------------------------------- Eq. (180)
    def batch_size(self, cfg: MessageConfig) -> int:
        """B from the message, else the batch size of the client's DataLoader."""
        if "batch-size" in cfg:
            return cfg.integer("batch-size", lo=1)
        data = self.require_data()
        if data.default_batch_size:
            return int(data.default_batch_size)
        raise ValueError("the strategy was built with batch_size=None (each client's DataLoader batch size), and this "
                         "client's data has none: give the client a DataLoader, or pass batch_size=... to the strategy")

    def local_round(self, w: NDArray[Any], cfg: MessageConfig, st: dict[str, Any]) -> LocalResult:
        """I steps of Eq. (180) from w^t with the message's eta_t, beta, I and B; the persistent momentum and data
        cursor come from the state (``st`` gets the pass-order seed of a device without a seed)."""
        lr = cfg.number("lr", lo=0.0, lo_open=True)
        beta = cfg.number("momentum", lo=0.0, hi=1.0, hi_open=True)
        steps = cfg.integer("local-steps", lo=1)
        b = self.batch_size(cfg)
        data: ArrayData | TorchData = self.require_data()
        momentum = self._load("m", np.float32)
        if momentum is not None and momentum.shape != (self.model.num_trainable,):
            raise ValueError(f"stored momentum has {momentum.size} entries, the model {self.model.num_trainable}")
        order = self.seed if self.seed is not None else int(st.setdefault("order-seed", secrets.randbits(62)))
        n, cid = len(data), self.client_id

        def permutation(epoch: int) -> NDArray[np.int64]:
            return rng_for(order, STREAM_CLIENT, cid, STREAM_ORDER, epoch).permutation(n).astype(np.int64)

        return local_momentum_sgd(self.model, np.asarray(w, dtype=np.float64), momentum, data, lr=lr, beta=beta,
                                  steps=steps, batch_size=b, cursor=int(st.get("cursor", 0)), permutation=permutation)

    def _flat_model(self, parameters: list[NDArray[Any]]) -> FloatArray:
        """w from the arrays of a message, in this model's state-dict layout (float32 values, as the device holds
        them); the integer entries of the layout are not part of w."""
        layout = self.model.layout
        if len(parameters) != len(layout.entries):
            raise ValueError(f"the message holds {len(parameters)} arrays, this model's state dict "
                             f"{len(layout.entries)}: start the strategy with initial_arrays=ArrayRecord(net.state_dict())")
        parts = []
        for e, a in zip(layout.entries, parameters, strict=True):
            if tuple(np.shape(a)) != e.shape:
                raise ValueError(f"array for {e.name!r} has shape {tuple(np.shape(a))}, expected {e.shape}")
            if e.in_vector:
                parts.append(np.asarray(a, dtype=np.float32).reshape(-1))
        return np.concatenate(parts).astype(np.float64)


class MomentumSGDClient(LocalMomentumClient):
    """FedREP's local algorithm for one plain ``train`` message: Flower's own strategies can drive it.

    The message carries the global model w^t (the user's arrays, as Flower's built-in strategies send it) and a
    config with "server-round", "lr", "momentum", "local-steps" and optionally "batch-size". The client runs I steps
    of Eq. (180) from w^t with its persistent momentum and data cursor and replies with its model w_k^{t+1} in the
    arrays it was sent (names, shapes, dtypes; integer entries echoed), "num-examples" = |D_k| and its
    "partition-id" (which a simulation's oracle needs to find the Byzantine replies). No error memory: the whole
    dense model goes up every round. Keys ``flwr-krum``, ``flwr-fedmedian``, ``flwr-fedtrimmedavg``.

    Parameters are those of :class:`LocalMomentumClient`; a ``ClientAttack(values="bit-flip")`` client (simulation
    only) replies w^t + (w^t - w_k^{t+1}), its update flipped.
    """

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """One local round on the dense global model; the reply is the trained model (or its flipped update)."""
        cfg = MessageConfig(config)
        cfg.integer(ROUND_KEY, lo=1)
        w = self._flat_model(parameters)
        st = self._state()
        res = self.local_round(w, cfg, st)
        model = res.w
        if self.attack is not None and self.attack.values != "none":
            model = w - self.attack.corrupt_values(w - res.w)  # w^t - (-(w^t - w_k)) = w^t + (w^t - w_k)
        st["cursor"] = res.cursor
        self._save("m", res.momentum)
        self._save_state(st)
        return self._arrays_like(model, parameters), self.num_examples, {"train_loss": res.loss,
                                                                          "partition-id": self.client_id}

    def _arrays_like(self, x: FloatArray, parameters: list[NDArray[Any]]) -> list[NDArray[Any]]:
        """x in the arrays of the message (their dtypes and shapes); integer entries echoed as received."""
        out: list[NDArray[Any]] = []
        for e, a in zip(self.model.layout.entries, parameters, strict=True):
            arr = np.asarray(a)
            if e.in_vector:
                assert e.offset is not None
                out.append(x[e.offset:e.offset + e.size].astype(arr.dtype).reshape(arr.shape))
            else:
                out.append(arr)
        return out

    def handle(self, message_type: str, content: RecordDict) -> RecordDict:
        """As :meth:`FedClient.handle`; a train reply keeps the names of the arrays it was sent (a user's
        ``load_state_dict`` needs them)."""
        reply = super().handle(message_type, content)
        if message_type == "train" and len(content.array_records) >= 1:
            key = "arrays" if "arrays" in content.array_records else next(iter(content.array_records))
            names = list(content.array_records[key].keys())
            sent = reply.array_records[key]
            reply[key] = ArrayRecord(dict(zip(names, sent.values(), strict=True)))
        return reply


class FedREPClient(LocalMomentumClient):
    """A FedREP client (Alg. 2): phase 1 ``propose`` (``query.propose``), phase 2 ``fit`` (``train``), and in
    secure mode phase 3 ``unmask`` (``query.unmask``).

    It answers every strategy of fedpdm_flower/strategies/fedrep.py: :class:`fedpdm_flower.strategies.fedrep.FedREP` and ``SHARE`` (k = d),
    masked (secure mode) or plain, and in plain mode ``DenseFedAvg`` and ``SparseSecAgg`` (whose phase 2 uploads
    through pairwise location masks, no error memory). Register every action with
    ``FedREPClient.client_app(client_fn)`` (or ``register(app, client_fn, FedREPClient.actions)`` in an existing
    ClientApp).

    Parameters are those of :class:`LocalMomentumClient`, and

    secure
        :class:`fedpdm_flower.clients.secure.SecureDevice` (the node's identity, its trust store, the smallest buffer it accepts)
        puts the device in secure mode: it answers masked rounds only. None (default): plain rounds only.

    The model the device holds when the client is built is its w^0 for a strategy built with
    ``clients_hold_initial=True`` (checked against the server's by CRC; a client out of sync is sent the dense
    model).

    Examples
    --------
    >>> def client_fn(context: Context) -> FedREPClient:
    ...     return FedREPClient(Net(), load_my_partition(context.node_config), loss_fn=nn.CrossEntropyLoss(),
    ...                         secure=SecureDevice(my_identity, my_trust_store, min_buffer=3))
    >>> app = FedREPClient.client_app(client_fn)
    """

    actions = ("query.propose", "query.unmask")

    def __init__(self, model: Any, data: Any, loss_fn: Any = None, *, context: Any = None, seed: int | None = None,
                 attack: ClientAttack | None = None, secure: SecureDevice | None = None, test_data: Any = None,
                 test_fn: Any = None) -> None:
        super().__init__(model, data, loss_fn, context=context, seed=seed, attack=attack, test_data=test_data,
                         test_fn=test_fn)
        if secure is not None and not isinstance(secure, SecureDevice):
            raise TypeError(f"secure must be a fedpdm_flower.clients.secure.SecureDevice or None, got {type(secure).__name__}")
        self.secure = secure
        self._w0 = self.model.get_flat().astype(np.float32)  # w^0 if the server says the clients hold it

    def _pending(self, server_round: int) -> tuple[dict[str, Any], FloatArray]:
        """The state record and the update g saved by this round's phase 1 (an error if there is none)."""
        st = self._state()
        g = self._load("g", np.float64)
        if g is None or int(st.get("pending-round", -1)) != server_round:
            raise ValueError(f"no pending update for round {server_round} (phase 1 missing)")
        return st, g

    # ---------------------------------------------------------------- phase 1
    def current_model(self, parameters: list[NDArray[Any]], cfg: MessageConfig) -> NDArray[np.float32]:
        """w^t: the dense model if the server sent one, else the local copy plus the last sparse aggregate, proved
        equal to the server's by its CRC."""
        d = self.model.dim
        if cfg.flag("dense-model", True):
            if len(parameters) != 1 or np.asarray(parameters[0]).size != d:
                raise ValueError(f"the dense downlink must be one array of the model's {d} parameters")
            return np.asarray(parameters[0], dtype=np.float32).reshape(-1)
        w = self._load("w", np.float32)
        if w is None:
            w = self._w0
        if len(parameters) == 2 and len(parameters[1]):
            values = np.asarray(parameters[1], dtype=np.float32).astype(np.float64)
            # empty indices with values: an update on every coordinate (k = d)
            idx = np.asarray(parameters[0], dtype=np.int64) if len(parameters[0]) else np.arange(d)
            if idx.shape != values.shape:
                raise ValueError(f"sparse downlink has {len(idx)} indices but {len(values)} values")
            if idx.size and (idx.min() < 0 or idx.max() >= d):
                raise ValueError(f"sparse downlink has an index outside [0, {d})")
            w = server_step(w, idx, values)
        if model_crc(w) != cfg.integer("model-crc"):
            raise ValueError(f"local model out of sync with the server at round {cfg.integer(ROUND_KEY)} (CRC "
                             "mismatch): it needs the dense model")
        return w

    def propose(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """Phase 1 (C1-C4 of spec 3.4): train, error-compensate, propose coordinates, new key pair."""
        cfg = MessageConfig(config)
        t = cfg.integer(ROUND_KEY, lo=1)
        self.check_model(cfg)
        d = self.model.dim
        k = cfg.integer("k", lo=1, hi=d)
        alpha = cfg.number("alpha", 0.0, lo=0.0, hi=1.0)
        error_feedback = cfg.flag("error-feedback", True)
        if cfg.flag("masked") and self.secure is None:
            raise ValueError(_NOT_SECURE)
        w = self.current_model(parameters, cfg)
        st = self._state()
        u = self._load("u", np.float64)
        u = np.zeros(d) if u is None or not error_feedback else u
        stale = self._load("g", np.float64)
        if stale is not None and error_feedback:  # never asked to submit last time: nothing of g was sent
            u = stale
        u = _without(u, self.buffer_idx)  # a buffer's change is a distance to this device's statistics, not a step
        res = self.local_round(w, cfg, st)
        g = u + (w.astype(np.float64) - res.w)  # Alg. 2: g_k^t = u_k^t + (w^t - w_k^{t+1})
        rng = self.rng(t, STREAM_PROPOSE)
        if k >= d:
            proposal = np.zeros(0, dtype=np.int64)  # SHARE (k = d): every coordinate, nothing to send
        else:  # the buffers' coordinates are sent every round (the server adds them to I^t): not proposed
            proposal = conspar.propose(_without(g, self.buffer_idx), k, alpha, rng)
            if self.attack is not None:  # simulation only (App. C.2, non-omniscient attacks)
                proposal = self.attack.corrupt_proposal(proposal, g, k, self.rng(t, STREAM_ATTACK))
        arrays: list[NDArray[Any]] = [proposal.astype(np.uint32)]
        if cfg.flag("sparse-secagg-key", False):  # SparseSecAgg's own, unsigned, per-round key (plain mode only)
            from fedpdm_flower.fedapp import secagg

            sk, pk = secagg.new_keypair()
            st["sk"] = sk
            arrays.append(np.frombuffer(pk, dtype=np.uint8).copy())
        st.update({"cursor": res.cursor, "pending-round": t})
        self._save("u", u)
        self._save("g", g)
        self._save("m", res.momentum)
        if cfg.flag("sparse-downlink", False):  # the next round's downlink is only (I^t, G~^t): keep w^t
            self._save("w", w)
        self._save_state(st)
        return arrays, {"train_loss": res.loss}

    # ---------------------------------------------------------------- phase 2
    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """Phase 2 (C5-C6): upload g[I^t] (masked inside the buffer), keep u = g with I^t zeroed."""
        cfg = MessageConfig(config)
        t = cfg.integer(ROUND_KEY, lo=1)
        st, g = self._pending(t)
        if cfg.choice("upload", ("conspar", "sparse-secagg"), "conspar") == "sparse-secagg":
            return self._sparse_secagg_upload(g, t, cfg, st)
        if cfg.flag("masked", False):
            raise ValueError(_NOT_SECURE)
        payload, u_next = self._consensus_payload(parameters, g)
        self._save("u", u_next)
        self._save("g", None)
        st.pop("pending-round", None)
        self._save_state(st)
        return [payload.astype(np.float32)], 1, {}

    def _consensus_payload(self, parameters: list[NDArray[Any]], g: FloatArray) -> tuple[FloatArray, FloatArray]:
        """C5: (g[I^t], u = g with I^t zeroed) for the consensus set the message carries (what a Byzantine client
        of a simulation corrupts is the payload only)."""
        d = len(g)
        if len(parameters) != 1:
            raise ValueError(f"phase 2 carries one array (the consensus set), got {len(parameters)}")
        idx = np.asarray(parameters[0], dtype=np.int64) if len(parameters[0]) else np.arange(d)
        if idx.size and (idx.min() < 0 or idx.max() >= d or np.any(np.diff(idx) <= 0)):
            raise ValueError("consensus set must be ascending unique indices in [0, d)")
        payload, u_next = conspar.compress(g, idx)
        u_next = _without(u_next, self.buffer_idx)  # no error memory on buffers, whether or not the server sent them
        if self.attack is not None:  # simulation only (bit-flip)
            payload = self.attack.corrupt_values(payload)
        return payload, u_next

    # ---------------------------------------------------------------- secure mode
    def handle(self, message_type: str, content: RecordDict) -> RecordDict:
        """As :meth:`FedClient.handle`; in secure mode the three phases go through the threshold protocol."""
        if self.secure is None:
            if message_type == "query.unmask":
                raise ValueError(_NOT_SECURE)
            reply = super().handle(message_type, content)
            if message_type == "query.propose" and "metrics" in reply.metric_records:
                # phase 1 is where the device trains: its metrics are the round's train metrics, weighted by |D_k|
                # (Flower's "num-examples"; the server aggregates them as FedAvg does)
                reply.metric_records["metrics"]["num-examples"] = self.num_examples
            return reply
        if message_type == "query.propose":
            return self._secure_propose(content)
        if message_type == "train":
            return self._secure_submit(content)
        if message_type == "query.unmask":
            return self._secure_unmask(content)
        return super().handle(message_type, content)

    def _secure_context(self) -> tuple[Any, Any, int]:
        assert self.secure is not None
        if self.node_context is None:
            raise RuntimeError("FedREPClient has no Context: pass context=... or build it through register()")
        ident, trust = self.secure.resolve(self.node_context)
        return ident, trust, self.secure.client_id(self.node_context)

    def _secure_propose(self, content: RecordDict) -> RecordDict:
        """Phase 1 in secure mode: refuse a plain round or a replayed one before training; then the proposal and
        this round's signed key. The train loss stays on the device (it would leak what the masks hide)."""
        cfg = _config_of(content)
        if cfg.get("masked") is not True:
            raise ValueError("this device is in secure mode: it sends its update only masked inside a secure buffer, "
                             "and this round asks for plain uploads (masked is not true)")
        run = cfg.get(S_RUN)
        if not isinstance(run, str) or not run:
            raise ValueError(f"message config {S_RUN!r} (the run label the device signs its key for) is missing")
        t = MessageConfig(cfg).integer(ROUND_KEY, lo=1)
        check_new_round(self.state, t)
        ident, _, me = self._secure_context()
        reply = super().handle("query.propose", content)
        for name, record in key_reply(self.state, ident, me, run, t).items():
            reply[name] = record
        reply["metrics"] = MetricRecord({"num-examples": 0})
        return reply

    def _secure_submit(self, content: RecordDict) -> RecordDict:
        """Phase 2 in secure mode: a mask request only; the buffer and the mates' keys are checked before anything
        is sent, then g[I^t] goes up masked (its rounding drawn from the device's own randomness)."""
        cfg = _config_of(content)
        mcfg = MessageConfig(cfg)
        t = mcfg.integer(ROUND_KEY, lo=1)
        if cfg.get("masked") is not True or cfg.get(S_PHASE) != "mask":
            raise ValueError("this device is in secure mode: it uploads its update only masked inside a secure buffer, "
                             "and this train message is not a mask request (masked=true, secure.phase='mask')")
        mcfg.choice("upload", ("conspar",), "conspar")
        if config_int(cfg, S_ROUND) != t:
            raise ValueError(f"the mask request is for round {cfg[S_ROUND]}, the message for round {t}")
        assert self.secure is not None
        _, trust, me = self._secure_context()
        request = accept_mask(self.state, cfg, content.array_records.get(S_RECORD), me, trust, self.secure.min_buffer)
        st, g = self._pending(t)
        key = "arrays" if "arrays" in content.array_records else next(
            (k for k in content.array_records if k != S_RECORD), None)
        parameters = numpy_list(content.array_records[key]) if key is not None else []
        payload, u_next = self._consensus_payload(parameters, g)
        record = mask_reply(self.state, request, payload, self.rng(t, STREAM_QUANT))
        self._save("u", u_next)
        self._save("g", None)
        st.pop("pending-round", None)
        self._save_state(st)
        return RecordDict({S_RECORD: record, "metrics": MetricRecord({"num-examples": 1})})

    def _secure_unmask(self, content: RecordDict) -> RecordDict:
        """Phase 3: this round's unmask answer, once (FedREP's next key comes with the next proposal)."""
        ident, _, me = self._secure_context()
        return unmask_reply(self.state, ident, _config_of(content), content.array_records.get(S_RECORD), me,
                            next_key=False)

    def _sparse_secagg_upload(self, g: FloatArray, t: int, cfg: MessageConfig, st: dict[str, Any]) -> Fit:
        """SparseSecAgg's phase 2 (:mod:`fedpdm_flower.fedapp.sparse_secagg`): (U_i, y_i) of the update g = w^t - w_k^{t+1}."""
        from fedpdm_flower.fedapp.sparse_secagg import mask_label, sparse_masked_upload

        if self.attack is not None:  # simulation only (bit-flip)
            g = self.attack.corrupt_values(g)
        label = mask_label(cfg.integer("mask-session"), t)
        idx, vals = sparse_masked_upload(g, cfg.integer("client-id"), self._secret_key(st), self._peers(cfg), label,
                                         cfg.number("p", lo=0.0, hi=1.0, lo_open=True), self.rng(t, STREAM_QUANT))
        self._save("g", None)
        st.pop("pending-round", None)
        self._save_state(st)
        return [idx, vals], 1, {}

    @staticmethod
    def _secret_key(st: dict[str, Any]) -> bytes:
        sk = st.pop("sk", None)
        if not isinstance(sk, bytes):
            raise ValueError("a SparseSecAgg upload needs this round's key pair, drawn in its phase 1")
        return sk

    @staticmethod
    def _peers(cfg: MessageConfig) -> Mapping[int, bytes]:
        """The buffer-mates' public keys by client id (an untrusted list pair: checked)."""
        ids, keys = cfg.config.get("peer-ids"), cfg.config.get("peer-keys")
        if not isinstance(ids, list) or not isinstance(keys, list) or len(ids) != len(keys) or not ids:
            raise ValueError("message config 'peer-ids' / 'peer-keys' must be two non-empty lists of one length")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or not all(isinstance(b, bytes) for b in keys):
            raise ValueError("message config 'peer-ids' must hold integers and 'peer-keys' bytes")
        return dict(zip(ids, keys, strict=True))


def _without(g: FloatArray, idx: NDArray[np.int64]) -> FloatArray:
    """g with the coordinates ``idx`` zeroed (a copy)."""
    out = np.array(g, dtype=np.float64)
    out[idx] = 0.0
    return out


_NOT_SECURE = ("masked buffers need a device in secure mode: FedREPClient(..., secure=SecureDevice(identity, "
               "trust_store)) signs its keys and checks its buffer-mates' (this device is in plain mode)")


def _config_of(content: RecordDict) -> dict[str, Any]:
    """The message's config record ("config", or its only one)."""
    records = content.config_records
    key = "config" if "config" in records else (next(iter(records)) if len(records) == 1 else None)
    return {} if key is None else dict(records[key])
