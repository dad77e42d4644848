"""The results contract of DESIGN.md: one results.json per run (Flower or in-process) and a PNG plot beside it.

Beyond DESIGN.md's keys a document carries ``"status"`` ("completed" or "failed") and, for a failed run, ``"error"``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("flower-simulation", "flower-deployment", "in-process")
#: "completed": every round ran; "failed": the run stopped early, "error" says why and "rounds" holds those that ran
STATUSES = ("completed", "failed")


@dataclass
class RoundRecord:
    """One round of the contract; `extra` holds algorithm diagnostics (privacy by accountant, mean Q, nnz, ...)."""

    round: int
    test_accuracy: float | None = None
    test_loss: float | None = None
    objective_gap: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def _clean(obj: Any) -> Any:
    """JSON has no NaN/Inf: write them as null rather than producing an invalid file."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def build_results(
    *, algorithm: str, dataset: str, config: dict[str, Any], seed: int, rounds: list[RoundRecord], engine: str,
    summary: dict[str, Any] | None = None, error: str | None = None,
) -> dict[str, Any]:
    """Assemble the results document; "final" repeats the last round's keys.

    ``error`` None gives ``"status": "completed"``; a text gives ``"status": "failed"`` and ``"error": text``
    (the rounds are then those that ran before the failure).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    rows = [r.to_json() for r in rounds]
    doc: dict[str, Any] = {
        "algorithm": algorithm,
        "dataset": dataset,
        "config": config,
        "seed": seed,
        "rounds": rows,
        "final": rows[-1] if rows else {},
        "engine": engine,
        "status": "completed" if error is None else "failed",
    }
    if error is not None:
        doc["error"] = error
    if summary:
        doc["summary"] = summary
    return _clean(doc)  # type: ignore[no-any-return]


def write_results(doc: dict[str, Any], out_dir: str | os.PathLike[str], *, plot: bool = True) -> Path:
    """Write out_dir/results.json (atomically) and out_dir/accuracy.png; return the json path.

    Raises OSError when the json cannot be written; a plot that fails only costs the plot (logged).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    if plot:
        try:
            plot_results([doc], out / "accuracy.png")
        except Exception as err:  # the numbers are written; a plotting problem must not lose the run
            from logging import WARNING

            from flwr.common.logger import log

            log(WARNING, "results written to %s, but the plot failed: %s: %s", path, type(err).__name__, err)
    return path


def plot_results(docs: list[dict[str, Any]], png: str | os.PathLike[str], *, labels: list[str] | None = None, title: str | None = None) -> None:
    """Test accuracy per round, one line per results document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, doc in enumerate(docs):
        pts = [(r["round"], r["test_accuracy"]) for r in doc["rounds"] if r.get("test_accuracy") is not None]
        if not pts:
            continue
        label = labels[i] if labels else f"{doc['algorithm']} ({doc['dataset']})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None, label=label)
    ax.set_xlabel("communication round")
    ax.set_ylabel("test accuracy")
    if title is None and len(docs) == 1:
        d = docs[0]
        title = f"{d['algorithm']} on {d['dataset']} ({d['engine']})"
    ax.set_title(title or "test accuracy")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run without evaluated rounds has nothing to label
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
