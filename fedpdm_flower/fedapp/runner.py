"""Build a run's strategy from the registry and turn its history into results.json + plot + summary.

Results are never lost once rounds have run: the output directory is checked before round 1
(:func:`prepare_out_dir`), a run that stops early still writes results.json with ``"status": "failed"``
(:func:`run_to_results`), and if the output directory fails at the end anyway the results go to a fresh temporary
directory, and the log says where (:func:`finish`).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX
from fedpdm_flower.fedapp.config import ConfigError, RunConfig
from fedpdm_flower.fedapp.registry import ALGORITHMS
from fedpdm_flower.fedapp.results import build_results, write_results
from fedpdm_flower.strategies.base import RoundFailed

#: the files a run writes into its output directory
OUTPUT_FILES = ("results.json", "accuracy.png", "model.npy")
#: kernel pseudo-filesystems: a path there is not storage (writes fail, or change kernel settings)
PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))


class RunFailed(RuntimeError):
    """The run stopped before its last round; ``results`` is the results.json (status "failed") of the rounds that
    ran. The message is the one line that says why (for a :class:`~fedpdm_flower.strategies.base.RoundFailed`, the
    clients' errors quoted)."""

    def __init__(self, message: str, results: Path, rounds: int) -> None:
        super().__init__(message)
        self.results = results
        self.rounds = rounds

#: what each privacy figure in a results.json summary is (only the keys a run reports are echoed)
ACCOUNTANT_DOCS = {
    "eps_dpsgd": "record-level DP-SGD on the device: Renyi DP of the Poisson-subsampled Gaussian (Mironov, Talwar & "
                 "Zhang 2019; Opacus's analysis) composed over every step the device ever took, worst client; the "
                 "calibration target of dp-calibration = dpsgd",
    "eps_gdp": "Gaussian DP (Dong, Roth & Su 2022): the exact epsilon of the composed Gaussian releases, no "
               "subsampling amplification (the server samples and sees every upload), worst client; the "
               "calibration target of dp-calibration = gdp",
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


#: summary key -> (accountant name, rigorous?) of the named entries in results.json's summary["privacy_by_accountant"]
_ACCOUNTANT_NAMES = {"eps_dpsgd": ("rdp, subsampled Gaussian (DP-SGD)", True), "eps_gdp": ("gdp", True), "eps_rdp": ("rdp", True), "eps_basic": ("basic composition", False),
                     "eps_eq36": ("paper eq. (36)", False), "eps_advanced": ("advanced composition", True),
                     "eps_theorem3_realised": ("paper Theorem 3 (zCDP)", True), "dpq_eps": ("paper Theorem 1", False)}
#: algorithm family -> the unit the sensitivity protects
_UNITS = {"iadmm": "one sample of an agent's data", "recal": "one sample of an agent's data",
          "dpq": "one sample of a node's data"}


def privacy_entries(cfg: RunConfig, privacy: dict[str, float]) -> list[dict[str, Any]]:
    """Each accountant of the run, named: ``{accountant, epsilon, delta, unit, rigorous}`` (worst client)."""
    unit = next((u for fam, u in _UNITS.items() if fam in cfg.algorithm), "one record of a client's data")
    out = []
    for key, value in privacy.items():
        if key not in _ACCOUNTANT_NAMES:
            continue
        name, rigorous = _ACCOUNTANT_NAMES[key]
        delta = privacy.get("delta_basic") if key == "eps_basic" else privacy.get(
            "dpq_delta_hat" if key == "dpq_eps" else "delta_advanced" if key == "eps_advanced" else "", cfg.delta)
        out.append({"accountant": name, "epsilon": value, "delta": delta, "unit": unit, "rigorous": rigorous})
    return out


def build_strategy(cfg: RunConfig, *, evaluate: bool = True) -> Any:
    """The configured algorithm's Strategy, holding its initial model and central evaluation on the test set.

    Raises ConfigError when the initial global model cannot be sent: every model travels as float32, so an entry
    beyond FLOAT32_MAX (a huge init-std, the only key that scales x_0) would reach every client as inf.
    """
    strategy = ALGORITHMS[cfg.algorithm].make_strategy(cfg, evaluate=evaluate)
    if getattr(strategy, "resume_unsupported", "no") is None:  # resumable: label the run (see setup_checkpoints)
        strategy.run_token = secrets.token_hex(16)
    x0 = np.asarray(strategy.global_model(), dtype=np.float64)
    largest = float(np.max(np.abs(x0))) if x0.size else 0.0
    if not largest <= FLOAT32_MAX:
        raise ConfigError(f"run config key 'init-std' ({cfg.init_std:g}) draws an initial model with entries up to "
                          f"{largest:.3g}, beyond the float32 range of the wire format ({FLOAT32_MAX:.3g}): every "
                          "client would receive inf; lower init-std")
    return strategy


def default_out_dir(cfg: RunConfig) -> Path:
    """``<cwd>/outputs/<algorithm>-<dataset>-<YYYYmmdd-HHMMSS>``, absolute, for an empty out-dir.

    The working directory is the writing process's: the shell's for `python -m simulations`, the SuperLink's for
    a ServerApp under `flwr run` (the run logs the absolute path at its start and end).
    """
    return Path.cwd() / "outputs" / f"{cfg.algorithm}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_out_dir(cfg: RunConfig, out_dir: str | None = None) -> Path:
    """The run's absolute output directory: ``out_dir`` (the CLI's --out), else the run config's out-dir, else
    :func:`default_out_dir`. An empty string counts as not given (it used to mean the current directory)."""
    raw = (out_dir or "").strip() or cfg.out_dir.strip()
    return Path(raw).expanduser().resolve() if raw else default_out_dir(cfg)


def check_out_dir(out: Path) -> None:
    """Raise ConfigError naming out-dir unless results can be written into ``out`` (created if missing).

    Run before round 1, so that a bad location costs nothing; it writes and removes one probe file.
    """
    where = f"run config key 'out-dir' is {str(out)!r}"
    for fs in PSEUDO_FILESYSTEMS:
        if out == fs or fs in out.parents:
            raise ConfigError(f"{where}, inside {fs}, a kernel pseudo-filesystem; choose a directory on disk")
    try:  # stat() itself can fail (a directory we may not search): that is an unwritable location too
        existing = out
        while not existing.exists():  # the nearest existing ancestor (the root always exists)
            existing = existing.parent
        if not existing.is_dir():
            what = "is a file" if existing == out else f"is inside {str(existing)!r}, which is a file"
            raise ConfigError(f"{where}: it {what}, not a directory")
        for name in OUTPUT_FILES:
            target = out / name
            if target.exists() and not target.is_file():
                raise ConfigError(f"{where}: {name} there exists and is not a regular file, so it cannot be replaced")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".fedapp-write-check-"):
            pass
    except OSError as err:
        raise ConfigError(f"{where}: it cannot be written ({err.strerror or err})") from None


def prepare_out_dir(cfg: RunConfig, out_dir: str | None = None) -> Path:
    """:func:`resolve_out_dir`, checked with :func:`check_out_dir`: the absolute directory results will go to."""
    out = resolve_out_dir(cfg, out_dir)
    check_out_dir(out)
    return out


def finish(
    cfg: RunConfig, strategy: Any, engine: str, *, wall_s: float, out_dir: str | None = None,
    error: str | None = None,
) -> tuple[dict[str, Any], Path]:
    """Write results.json, accuracy.png (unless run config ``plot`` is false) and model.npy; return the document
    and the json path.

    ``error`` marks the run failed (results.json ``"status": "failed"``, ``"error"``) with the rounds that ran. If
    the output directory cannot be written, everything goes to a new temporary directory instead (logged).
    """
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
        "privacy_by_accountant": privacy_entries(cfg, strategy.privacy_summary()),
    }
    per_device = getattr(strategy, "client_privacy", None)
    if per_device:  # each client's latest figures (and what recomputes them, e.g. DP-SGD's z, q, steps)
        summary["privacy_per_device"] = {str(cid): dict(v) for cid, v in sorted(per_device.items())}
    out = resolve_out_dir(cfg, out_dir)
    config = {**ALGORITHMS[cfg.algorithm].used_config(cfg), "out-dir": str(out)}
    doc = build_results(
        algorithm=cfg.algorithm, dataset=cfg.dataset, config=config, seed=cfg.seed, rounds=hist, engine=engine,
        summary=summary, error=error,
    )
    model = strategy.global_model()  # the final global model (of the last completed round), float64
    try:
        path = write_results(doc, out, plot=cfg.plot)
        np.save(out / "model.npy", model)
    except OSError as err:  # the work is done: keep it somewhere rather than lose it
        fallback = Path(tempfile.mkdtemp(prefix="fedapp-results-"))
        log(WARNING, "could not write the results to %s (%s: %s); writing them to %s instead", out,
            type(err).__name__, err, fallback)
        doc["config"]["out-dir"] = str(fallback)
        path = write_results(doc, fallback, plot=cfg.plot)
        np.save(fallback / "model.npy", model)
    return doc, path


def failure_text(err: BaseException, strategy: Any) -> str:
    """The one line that says why a run stopped: a RoundFailed or ConfigError as is (they name the round or the
    key), anything else with its type and the round it happened in."""
    if isinstance(err, RoundFailed | ConfigError):
        return str(err)
    current = getattr(strategy, "current_round", 0)
    where = f"round {current}" if current else "before round 1"
    return f"{where}: {type(err).__name__}: {err}"


def run_to_results(
    cfg: RunConfig, strategy: Any, engine: str, drive: Callable[[], None], *, out: Path, t0: float,
) -> tuple[dict[str, Any], Path]:
    """Run ``drive()`` (all rounds), then write the results; return the document and the json path.

    If ``drive`` raises, results.json is still written, with ``"status": "failed"``, the error and the rounds
    that ran, and :class:`RunFailed` is raised from the original error. KeyboardInterrupt counts: the rounds that
    ran are kept.
    """
    try:
        drive()
    except (Exception, KeyboardInterrupt) as err:
        error = failure_text(err, strategy)
        doc, path = finish(cfg, strategy, engine, wall_s=time.perf_counter() - t0, out_dir=str(out), error=error)
        raise RunFailed(error, path, len(doc["rounds"])) from err
    return finish(cfg, strategy, engine, wall_s=time.perf_counter() - t0, out_dir=str(out))


class SimulatedCrash(RuntimeError):
    """Raised after the checkpoint of run config ``crash-after-round``'s round: a test's stand-in for a ServerApp
    that dies between rounds (the checkpoint on disk is all a resumed run gets)."""


def setup_checkpoints(cfg: RunConfig, strategy: Any, out: Path) -> None:
    """Before round 1: load the checkpoint when the run config asks to ``resume``, and (``checkpoint``, default on)
    make the strategy write one into ``out/checkpoint`` after every round (docs/deployment.md "Checkpoints and resume").

    A fresh run keeps the run token :func:`build_strategy` drew (clients that persist their state key it by the
    token, so a new run never starts from an old run's client state) and removes a checkpoint left in out-dir by an
    earlier run; a resumed run takes the checkpoint's token. Raises ConfigError naming the keys when the checkpoint's run config differs from
    this one, or when the algorithm cannot resume.
    """
    from fedpdm_flower.fedapp.checkpoint import (
        CHECKPOINT_DIR,
        CheckpointError,
        config_differences,
        read_checkpoint,
        write_checkpoint,
    )

    run_config = {**cfg.to_run_config(), "out-dir": str(out)}
    resumable = hasattr(strategy, "state_dict") and getattr(strategy, "resume_unsupported", None) is None
    if cfg.resume:
        if not resumable:
            why = getattr(strategy, "resume_unsupported", None) or "its server state is Flower's, not checkpointed"
            raise ConfigError(f"run config key 'resume' is true, but algorithm {cfg.algorithm!r} cannot resume: {why}")
        try:
            doc, state = read_checkpoint(out)
        except CheckpointError as err:
            raise ConfigError(f"run config key 'resume' is true, but {err}") from None
        diff = config_differences(doc["run_config"], run_config)
        if diff:
            raise ConfigError(f"run config key 'resume' is true, but the checkpoint in {out / CHECKPOINT_DIR} is of "
                              f"another run config; differing key(s): {'; '.join(diff)}")
        try:
            strategy.load_state_dict(state)
        except ValueError as err:
            raise ConfigError(f"the checkpoint in {out / CHECKPOINT_DIR} cannot be resumed: {err}") from None
        log(INFO, "resuming from the checkpoint of round %d in %s", doc["round"], out / CHECKPOINT_DIR)
    else:
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)  # an earlier run's: resuming it now would be wrong
    if not (cfg.checkpoint and resumable):
        if cfg.checkpoint and getattr(strategy, "resume_unsupported", None):
            log(INFO, "no checkpoints: %s", strategy.resume_unsupported)
        return

    def after_round(server_round: int) -> None:
        write_checkpoint(out, server_round, run_config, strategy.state_dict())
        if cfg.crash_after_round == server_round:
            raise SimulatedCrash(f"crash-after-round = {server_round}: stopped after the round's checkpoint")

    strategy.after_round = after_round


def summary_lines(doc: dict[str, Any], path: Path, *, plot: bool = True) -> list[str]:
    """Human-readable end-of-run summary (``plot``: whether the run drew accuracy.png beside ``path``)."""
    s = doc.get("summary", {})
    acc = s.get("final_test_accuracy")
    lines = [
        f"algorithm={doc['algorithm']} dataset={doc['dataset']} engine={doc['engine']} rounds={len(doc['rounds'])} "
        f"status={doc.get('status', 'completed')}",
        f"final test accuracy: {acc:.4f} (best {s.get('best_test_accuracy'):.4f})" if acc is not None else "no evaluation",
        f"bytes: uplink {s.get('total_uplink_bytes', 0) / 1e6:.2f} MB, downlink {s.get('total_downlink_bytes', 0) / 1e6:.2f} MB",
    ]
    priv = s.get("privacy") or {}
    if priv:
        # results.json writes an infinite epsilon (no noise; a mechanism without a rigorous bound) as null
        lines.append("privacy (worst client): " + ", ".join(f"{k}={v:.4g}" if isinstance(v, int | float) else f"{k}=inf"
                                                          for k, v in priv.items()))
    if s.get("rejected_replies"):
        lines.append(f"rejected replies: {s['rejected_replies']}")
    lines.append(f"results: {path}" + (f" (plot: {path.parent / 'accuracy.png'})" if plot else ""))
    return lines
