"""`make run`: BSDP-FedPDM on MNIST with record-level DP-SGD at (epsilon, delta) = (8, 1e-5), through Flower's simulation.

The task (docs/private-learning.md says why each choice was made):

* the algorithm is the paper's BSDP-FedPDM (Alg. 2: duals on the devices, a sparse uplink -- rand-k here, whose
  data-independent support keeps the mean of noisy uploads unbiased where top-k's is not --, top-k down, l1 prox at
  the server), its local steps (8a) made DP-SGD steps on every device (``dp-calibration = dpsgd``);
* the data keep seed 000's non-IID flavour: label skew, every device holds exactly 4 of the 10 digits (the paper's
  partitioner), 6,000 records each;
* 10 devices, all in every round, a 20,522-parameter CNN (``tiny-cnn``). Local DP-SGD noise on the mean of K devices
  has std z C / (q n sqrt(K)) per coordinate: at a fixed compute budget, fewer devices with more records each (larger
  expected batches q n at the same q) lose less to the noise than the paper's 100 devices of 600.

The summary names the unit, the adversary, the accountant and every device's epsilon, recomputed from the (z, q,
steps) it reported by a second library (dp-accounting's RdpAccountant).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["QUICKSTART", "main", "privacy_report"]

#: the run-config keys of `make run` (everything else is pyproject.toml's default); `--set key=value` overrides them
QUICKSTART: dict[str, Any] = {
    "algorithm": "bsdp-fedpdm",
    "dataset": "mnist",
    "model": "tiny-cnn",
    "partitioner": "paper",
    "labels-per-client": 4,
    "num-clients": 10,
    "clients-per-round": 10,
    "samples-per-client": 6000,
    "num-server-rounds": 12,
    "batch-size": 256,
    "max-local-steps": 15,
    "eta0": 0.2,
    "rho": 0.1,
    "gamma": 0.0,
    "nu": 0.0,
    "uplink-sparsifier": "randk",
    "alpha-up": 0.5,
    "alpha-down": 0.75,
    "dp": True,
    "dp-calibration": "dpsgd",
    "epsilon-total": 8.0,
    "delta": 1e-5,
    "clip-norm": 5.0,
}

UNIT = "one record (image) of a device's data, add-or-remove-one neighbours"
ADVERSARY = ("everyone who sees anything a device sends, the server and the other devices included: the noise is "
             "added on the device, and the records each step uses are Poisson-sampled from the device's own entropy")
ACCOUNTANT = ("Renyi DP of the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019; Opacus's analysis), composed "
              "over every DP-SGD step each device was charged for (Q_max per round), converted at delta")


def privacy_report(doc: dict[str, Any], delta: float) -> list[str]:
    """The summary's privacy lines: unit, adversary, accountant, and each device's epsilon beside its recomputation
    by dp-accounting's RdpAccountant (a second implementation of the same analysis, at Opacus's orders)."""
    from fedpdm_flower.fedapp.privacy.dpsgd import recompute_epsilon

    per = doc.get("summary", {}).get("privacy_per_device") or {}
    lines = [f"  unit:       {UNIT}", f"  adversary:  {ADVERSARY}", f"  accountant: {ACCOUNTANT}",
             "  device  steps   z       q        epsilon (ours)  epsilon (dp-accounting)  ours / theirs"]
    worst = 0.0
    for cid, p in sorted(per.items(), key=lambda kv: int(kv[0])):
        if "eps_dpsgd" not in p:
            continue
        ours = float(p["eps_dpsgd"])
        if int(p.get("dp_mechanisms", 1)) != 1:
            lines.append(f"  {cid:>6}  {int(p['dp_steps']):>5}  several (z, q) in its ledger: {ours:.4f} (ours only)")
            continue
        theirs = recompute_epsilon([(float(p["dp_noise_multiplier"]), float(p["dp_sample_rate"]),
                                     int(p["dp_steps"]))], delta)
        worst = max(worst, ours)
        lines.append(f"  {cid:>6}  {int(p['dp_steps']):>5}  {p['dp_noise_multiplier']:.4f}  {p['dp_sample_rate']:.5f}  "
                     f"{ours:>14.4f}  {theirs:>23.4f}  {ours / theirs:>13.4f}")
    if not any("eps_dpsgd" in p for p in per.values()):
        return ["  privacy: none (dp = false): no noise, no guarantee"]
    lines.append(f"  every device's epsilon <= {worst:.4f} at delta = {delta:g}")
    return lines


def main(out: str, sets: dict[str, Any]) -> int:
    """Run the quick start (QUICKSTART, then ``sets``) through Flower's simulation engine and print the summary."""
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.runner import prepare_out_dir
    from simulations.deploy import local_simulation
    from simulations.flower_driver import CONNECTION_VAR, ROOT, run_flower

    overrides = {**QUICKSTART, **sets}
    cfg = parse_run_config(overrides)
    where = prepare_out_dir(cfg, out)  # '' means the default under outputs/, never the current directory
    t0 = time.time()
    dp = (f"record-level DP-SGD at epsilon = {cfg.epsilon_total:g}, delta = {cfg.delta:g}"
          if cfg.dp and cfg.dp_calibration == "dpsgd" else f"dp = {cfg.dp}, dp-calibration = {cfg.dp_calibration}")
    print(f"[quickstart] {cfg.algorithm} on {cfg.dataset} ({cfg.model}, {cfg.labels_per_client} labels per device): "
          f"N={cfg.num_clients}, K={cfg.clients_per_round}, {cfg.num_server_rounds} rounds of {cfg.max_local_steps} "
          f"local steps, {dp}; Flower simulation engine (on a SuperLink of its own)", flush=True)
    if os.environ.get(CONNECTION_VAR):  # a SuperLink of the caller's own (the test session's)
        res = run_flower(overrides, where, num_supernodes=cfg.num_clients)
    else:
        # A simulation SuperLink of our own on free ports, stopped afterwards: `flwr run .` reuses whatever local
        # daemon already answers on 127.0.0.1:39091 (another checkout's, or an older one), with that daemon's
        # environment, FLWR_HOME and so possibly another copy of this package.
        with local_simulation(flwr_home=Path(os.environ.get("FLWR_HOME") or ROOT / ".flwr")) as sim:
            res = run_flower(overrides, where, num_supernodes=cfg.num_clients, connection=sim.connection,
                             env=sim.env, simulation=True)
    doc = json.loads(res.results.read_text())
    s = doc["summary"]
    print(f"\n[quickstart] run {res.run_id} {res.status} in {time.time() - t0:.0f} s (rounds: {s['wall_s']:.0f} s)")
    print(f"  final test accuracy {s['final_test_accuracy']:.4f} (best {s['best_test_accuracy']:.4f}) "
          f"after {len(doc['rounds'])} rounds")
    print(f"  uplink {s['total_uplink_bytes'] / 1e6:.2f} MB, downlink {s['total_downlink_bytes'] / 1e6:.2f} MB")
    if cfg.dp and cfg.dp_calibration == "dpsgd":
        print("\n".join(privacy_report(doc, cfg.delta)))
    elif s.get("privacy"):
        print("  privacy, worst client: " + ", ".join(f"{k}={v:.4g}" for k, v in s["privacy"].items()))
    else:
        print("  privacy: none (dp = false): no noise, no guarantee")
    print(f"  {res.results}\n  {Path(res.results).parent / 'accuracy.png'}")
    return 0
