"""Client-level differential privacy with secret Poisson sampling, for Flower's FedAvg: DP-FedAvg done honestly.

The algorithm is DP-FedAvg (McMahan, Ramage, Talwar & Zhang, "Learning differentially private recurrent language
models", ICLR 2018, Alg. 1 with the fixed denominator): each round every client takes part independently with
probability q, decided by the server with the OS CSPRNG and never revealed; the server clips each update
``w_k - w`` to L2 norm C, adds ``N(0, (z C)^2 I)`` to their sum and divides by the expected count ``q N``:

    w  <-  w + (sum_{k in S} clip(w_k - w, C) + N(0, (z C)^2 I)) / (q N).

A round is the Poisson-subsampled Gaussian mechanism on the clients' data sets (add or remove one client changes
the clipped sum by at most C), T rounds its composition; PLD accounting (``dp-accounting``) gives the exact-up-to-
discretization (epsilon, delta), and z is calibrated to a target (:func:`fedpdm_flower.fedapp.privacy.pld.poisson_noise_multiplier_for`).
The release happens every round, with no client sampled too (then the model moves by the noise alone): skipping
it would reveal that the sample was empty.

**The model mean is unweighted** (the fixed denominator q N: every sampled client's clipped update counts once, as
the analysis needs; Flower's DP wrappers require uniform weights for accounting too). The clients' train metrics
are aggregated as the inner FedAvg aggregates them (``train_metrics_aggr_fn``, weighted by ``num-examples``) into
``Result.train_metrics_clientapp``, **without noise: they are outside the (epsilon, delta) guarantee**, as Flower
says of its own DP wrappers ("training and evaluation metrics are not included").

**Unit and adversary.** The unit is one client (all of its data). The guarantee holds against everyone who sees
the released global models: the clients, the public, anyone the model is shipped to. **The server is trusted**:
it draws the sample and sees each clipped update before the noise, as in Flower's own
``DifferentialPrivacyServerSideFixedClipping``. Amplification by sampling is claimed because the sampling is
Poisson and secret from that adversary; against a curious server it is no guarantee at all (use local noise,
:class:`fedpdm_flower.fedapp.privacy.gaussian.GaussianTarget`, or secure aggregation).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.wire import recorddict_nbytes
from fedpdm_flower.strategies.base import aggregate_metric_replies, arrays_of
from fedpdm_flower.strategies.wrappers import StrategyWrapper, _record

__all__ = ["CentralDP"]


class _SampledGrid:
    """The real grid, with ``get_node_ids`` narrowed to this round's secret sample (the inner FedAvg then builds
    its messages for exactly those nodes)."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self._grid, self._nodes = grid, nodes

    def get_node_ids(self) -> list[int]:
        return list(self._nodes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class CentralDP(StrategyWrapper):
    """DP-FedAvg with secret Poisson sampling and PLD accounting around Flower's FedAvg (module docstring).

    Parameters
    ----------
    inner
        Flower's ``FedAvg`` (or a subclass keeping its ``aggregate_train``), built with ``fraction_train=1.0,
        min_train_nodes=1, min_available_nodes=1``: this wrapper samples the clients itself.
    epsilon, delta
        The target: over ``num_rounds`` rounds the released models are (epsilon, delta)-DP for one client.
    clip_norm
        C, the L2 bound of each client's update (default 1.0).
    sample_rate
        q, each client's probability of taking part in a round (default 0.1).
    num_rounds
        T, the rounds the noise is calibrated for; the run stops with ``PrivacyBudgetExhausted`` before a
        round past the target.
    min_available_nodes
        N is the number of nodes connected at round 1; wait for at least this many (default 2).
    noise_multiplier
        z directly instead of calibrating it to ``epsilon`` (then ``epsilon`` is only the budget the run stops at).
        0 turns the noise off: no privacy at all (``privacy_spent`` reports an infinite epsilon), for checking the
        rest of the mechanism.
    """

    bytes_prefix = "central_dp"

    def __init__(self, inner: Strategy, *, epsilon: float, delta: float = 1e-5, clip_norm: float = 1.0,
                 sample_rate: float = 0.1, num_rounds: int, min_available_nodes: int = 2,
                 noise_multiplier: float | None = None) -> None:
        from fedpdm_flower.fedapp.privacy.dpsgd import check_clip_norm, check_sample_rate
        from fedpdm_flower.fedapp.privacy.pld import poisson_noise_multiplier_for

        super().__init__(inner)
        if not isinstance(inner, FedAvg) or type(inner).aggregate_train is not FedAvg.aggregate_train:
            raise TypeError("CentralDP needs Flower's FedAvg (or a subclass with FedAvg.aggregate_train) inside: the "
                            "model it releases is the noisy mean it computes")
        if inner.fraction_train != 1.0 or inner.min_train_nodes != 1 or inner.min_available_nodes != 1:
            raise ValueError("CentralDP samples the clients itself (Poisson, secret): build the inner strategy with "
                             "FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, ...)")
        if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not (math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
        # q and C are checked where every privacy setting checks them (the DP-SGD core's validators)
        self.clip_norm, self.q = check_clip_norm(clip_norm), check_sample_rate(sample_rate)
        self.epsilon, self.delta = float(epsilon), float(delta)
        self.num_rounds, self.min_available_nodes = num_rounds, min_available_nodes
        if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        self.z = (float(noise_multiplier) if noise_multiplier is not None
                  else poisson_noise_multiplier_for(epsilon, delta, sample_rate, num_rounds))
        self._releases = 0
        self._rng = secrets.SystemRandom()  # the sample is secret: never seeded, never logged
        self._noise = np.random.default_rng(secrets.randbits(128))
        self.accountant: Any = None
        self.population = 0
        self._sent: FloatArray | None = None
        self._sent_arrays: ArrayRecord | None = None

    def summary(self) -> None:
        log(INFO, "CentralDP: epsilon=%g delta=%g over %d rounds, q=%g, clip C=%g, noise multiplier z=%.4f (PLD), "
            "client-level, trusted server, secret Poisson sampling", self.epsilon, self.delta, self.num_rounds, self.q,
            self.clip_norm, self.z)
        super().summary()

    # ------------------------------------------------------------------ checkpoints (strategies/checkpointed.py)
    def state_dict(self) -> dict[str, Any]:
        """The accountant (its composed releases), the population N and the release count. The secret sample's and
        the noise's randomness is never written down (a resumed run draws afresh from the OS): the accounting
        does not depend on which clients were drawn, only on q, z and the number of releases."""
        return {**super().state_dict(), "accountant": None if self.accountant is None else self.accountant.state_dict(),
                "population": self.population, "releases": self._releases, "z": self.z}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod

        from fedpdm_flower.fedapp.privacy.protocol import PldAccountant

        if float(state["z"]) != self.z:
            raise ValueError(f"the checkpoint's noise multiplier is {state['z']}, this CentralDP's is {self.z}")
        super().load_state_dict(state)
        self.population, self._releases = int(state["population"]), int(state["releases"])
        self.accountant = None
        if state["accountant"] is not None:
            self.accountant = PldAccountant(PrivacyConfig(
                target_delta=self.delta, population_size=self.population, max_epsilon=self.epsilon * (1 + 1e-6),
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE, sampling_method=SamplingMethod.POISSON))
            self.accountant.load_state_dict(dict(state["accountant"]))

    def privacy_spent(self) -> Any:
        """Flower's protocol: the (epsilon, delta) spent so far (PLD, Poisson sampling), or None before round 1."""
        if self.z == 0.0 and self._releases:
            from flwr.supercore.privacy_accounting import PrivacySpent

            return PrivacySpent(epsilon=math.inf, delta=self.delta, num_releases=self._releases,
                                accounting_method="none (noise off)")
        return None if self.accountant is None else self.accountant.get_privacy_spent()

    # ------------------------------------------------------------------ round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        from flwr.serverapp.exception import PrivacyBudgetExhausted
        from flwr.supercore.privacy_accounting import (
            GaussianPrivacyEvent,
            NeighboringRelation,
            PrivacyConfig,
            SamplingMethod,
        )

        from fedpdm_flower.fedapp.privacy.protocol import PldAccountant

        if self.accountant is None:  # N: the nodes connected at the first round
            while len(nodes := list(grid.get_node_ids())) < self.min_available_nodes:
                log(INFO, "CentralDP: waiting for nodes (%d of %d)", len(nodes), self.min_available_nodes)
                time.sleep(1.0)
            self.population = len(nodes)
            self.accountant = PldAccountant(PrivacyConfig(
                target_delta=self.delta, population_size=self.population, max_epsilon=self.epsilon * (1 + 1e-6),
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE, sampling_method=SamplingMethod.POISSON))
        event = None if self.z == 0 else GaussianPrivacyEvent(
            noise_multiplier=self.z, sample_size=max(1, round(self.q * self.population)), population_size=self.population)
        if event is not None and self.accountant.would_exceed(event):
            spent = self.accountant.get_privacy_spent()
            raise PrivacyBudgetExhausted(f"round {server_round}: the next release would exceed epsilon = {self.epsilon} "
                                         f"(spent {spent.epsilon:.4g} at delta = {spent.delta:g} in "
                                         f"{spent.num_releases} rounds)")
        self._event: Any = event
        self._round_stats = {}
        self.check_user_config(config or {})
        sample = [n for n in grid.get_node_ids() if self._rng.random() < self.q]
        named = arrays_of(arrays)
        self.learn_layout(Message(RecordDict({"arrays": arrays}), dst_node_id=0, message_type="train"))
        assert self.layout is not None
        self._sent, self._sent_arrays = self.layout.flatten(named), arrays
        self._carried = {e.name: named[e.name] for e in self.layout.entries if not e.in_vector}
        if not sample:
            return []
        messages = list(self.inner.configure_train(server_round, arrays, config, _SampledGrid(grid, sample)))  # type: ignore[arg-type]
        self._round_stats["central_dp.down_bytes"] = float(sum(recorddict_nbytes(m.content) for m in messages))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = [r for r in self.screen(server_round, replies) if not r.has_error()]
        assert self.layout is not None and self._sent is not None
        total = np.zeros(self.layout.dim)
        clipped = 0
        for r in kept:
            u = self.layout.flatten(arrays_of(next(iter(r.content.array_records.values())))) - self._sent
            norm = float(np.linalg.norm(u))
            if norm > self.clip_norm:
                u, clipped = u * (self.clip_norm / norm), clipped + 1
            total += u
        noise = self._noise.normal(0.0, self.z * self.clip_norm, size=self.layout.dim) if self.z > 0 else 0.0
        update = (total + noise) / (self.q * self.population)  # the fixed denominator of the analysis
        model = self.layout.unflatten(self._sent + update, self._carried)
        self._releases += 1
        if self.z > 0:
            self.accountant.compose(self._event)  # the release happened, with or without sampled clients
        spent = self.privacy_spent()
        self._round_stats.update({"central_dp.sampled": float(len(kept)), "central_dp.clipped": float(clipped),
                                  "central_dp.noise_multiplier": self.z, "central_dp.sample_rate": self.q,
                                  "central_dp.epsilon": spent.epsilon, "central_dp.releases": float(spent.num_releases)})
        if not kept:
            log(WARNING, "round %d: no client in the sample (or none answered): the model moves by the noise alone",
                server_round)
        self.record_diagnostics(server_round, self._round_stats)
        inner = self.inner
        assert isinstance(inner, FedAvg)
        metrics = aggregate_metric_replies([r.content for r in kept], inner.weighted_by_key, inner.train_metrics_aggr_fn)
        return self.restore_dtypes(_record(model)), metrics
