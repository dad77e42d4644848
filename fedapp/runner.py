"""Build a run's strategy from the registry and turn its history into results.json + plot + summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.config import RunConfig
from fedapp.registry import ALGORITHMS
from fedapp.results import build_results, write_results

#: what each privacy figure in a results.json summary is (only the keys a run reports are echoed)
ACCOUNTANT_DOCS = {
    "eps_eq36": "seed 000: paper eq. (36) (moments-accountant bound, constant c0), worst client",
    "eps_rdp": "Renyi-DP composition of the per-round Gaussian mechanisms (Opacus RDP analysis), no subsampling "
               "amplification, worst client",
    "eps_basic": "basic composition: sum of per-round epsilons (delta_basic = releases * delta), worst client",
    "eps_advanced": "advanced composition (Dwork-Roth Thm 3.20), worst client",
    "eps_theorem3_realised": "seed 001: Theorem 3 (per-activation zCDP, Prop. 4 conversion) at the realised LCI; "
                             "covers the u~ messages only (the x message leaks y_i, spec 8 A1)",
    "dpq_eps": "seed 004: the paper's accountant, sum of eps_k over the releases (Theorem 1 as computed exactly), "
               "worst node; dpq_delta_hat is vacuous (>= 1) for the paper's delta_0 = 1",
}


def accountant_docs(privacy: dict[str, float]) -> dict[str, str]:
    """The descriptions of the accountants present in a run's privacy summary (per-agent keys share one entry)."""
    out = {k: ACCOUNTANT_DOCS[k] for k in privacy if k in ACCOUNTANT_DOCS}
    if any(k.startswith("eps_agent") for k in privacy):
        out["eps_agent<i>"] = "seed 001: agent i's own zCDP budget over its activations, Prop. 4 conversion"
    return out


def build_strategy(cfg: RunConfig, *, evaluate: bool = True) -> Any:
    """The configured algorithm's Strategy, holding its initial model and central evaluation on the test set."""
    return ALGORITHMS[cfg.algorithm].make_strategy(cfg, evaluate=evaluate)


def default_out_dir(cfg: RunConfig) -> Path:
    """outputs/<algorithm>-<dataset>-<timestamp> under the current directory when out-dir is empty."""
    return Path("outputs") / f"{cfg.algorithm}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def finish(cfg: RunConfig, strategy: Any, engine: str, *, wall_s: float, out_dir: str | None = None) -> tuple[dict[str, Any], Path]:
    """Write results.json, accuracy.png and model.npy; return the document and the json path."""
    hist = strategy.history
    accs = [r.test_accuracy for r in hist if r.test_accuracy is not None]
    summary = {
        "final_test_accuracy": accs[-1] if accs else None,
        "best_test_accuracy": max(accs) if accs else None,
        "total_uplink_bytes": sum(r.uplink_bytes for r in hist),
        "total_downlink_bytes": sum(r.downlink_bytes for r in hist),
        "rejected_replies": strategy.rejected_total,
        "wall_s": wall_s,
        "privacy": strategy.privacy_summary(),
        "privacy_accountants": accountant_docs(strategy.privacy_summary()),
    }
    out = Path(out_dir or cfg.out_dir or default_out_dir(cfg)).resolve()
    config = {**ALGORITHMS[cfg.algorithm].used_config(cfg), "out-dir": str(out)}
    doc = build_results(
        algorithm=cfg.algorithm, dataset=cfg.dataset, config=config, seed=cfg.seed, rounds=hist, engine=engine,
        summary=summary,
    )
    path = write_results(doc, out)
    np.save(path.parent / "model.npy", strategy.global_model())  # the final global model, float64
    return doc, path


def summary_lines(doc: dict[str, Any], path: Path) -> list[str]:
    """Human-readable end-of-run summary."""
    s = doc.get("summary", {})
    acc = s.get("final_test_accuracy")
    lines = [
        f"algorithm={doc['algorithm']} dataset={doc['dataset']} engine={doc['engine']} rounds={len(doc['rounds'])}",
        f"final test accuracy: {acc:.4f} (best {s.get('best_test_accuracy'):.4f})" if acc is not None else "no evaluation",
        f"bytes: uplink {s.get('total_uplink_bytes', 0) / 1e6:.2f} MB, downlink {s.get('total_downlink_bytes', 0) / 1e6:.2f} MB",
    ]
    priv = s.get("privacy") or {}
    if priv:
        lines.append("privacy (worst client): " + ", ".join(f"{k}={v:.4g}" for k, v in priv.items()))
    if s.get("rejected_replies"):
        lines.append(f"rejected replies: {s['rejected_replies']}")
    lines.append(f"results: {path} (plot: {path.parent / 'accuracy.png'})")
    return lines
