"""The on-disk calibration cache (fedpdm_flower/fedapp/privacy/calibration_cache.py): a second process reads a
DP-SGD calibration instead of searching for it, gets the same z, and checks it against the target first; a
tampered entry is searched again (too little noise never comes out of the cache); off or unwritable, nothing
changes but the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpdm_flower.fedapp.privacy import calibration_cache, dpsgd
from fedpdm_flower.fedapp.privacy.dpsgd import dpsgd_epsilon, noise_multiplier_for

ROOT = Path(__file__).resolve().parents[1]
#: epsilon, delta, q, steps. Full batches (q = 1): the cache does the same whatever the plan, and the accountant's
#: unsampled Gaussian is closed-form, where one subsampled evaluation (q = 0.064, the dp_seeds example's) sums a
#: series at each of its 99 fractional orders, 0.3-0.4 s: these tests search about 12 times
TARGET = (8.0, 1e-5, 1.0, 30)


def _fresh() -> None:
    noise_multiplier_for.cache_clear()
    dpsgd._step_rdp.cache_clear()


def _search() -> tuple[float, int]:
    """z and the number of accountant evaluations of a calibration in this process, from empty in-process caches."""
    _fresh()
    z = noise_multiplier_for(*TARGET)
    return z, dpsgd._step_rdp.cache_info().misses


def _in_a_new_process(cache: Path) -> tuple[float, int]:
    code = ("from fedpdm_flower.fedapp.privacy import dpsgd\n"
            f"z = dpsgd.noise_multiplier_for{TARGET!r}\n"
            "print(repr(z), dpsgd._step_rdp.cache_info().misses)\n")
    env = {**os.environ, calibration_cache.CACHE_VAR: str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    z, misses = out.stdout.split()
    return float(z), int(misses)


def test_a_second_process_reads_the_calibration_and_checks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "calibrations.json"
    monkeypatch.setenv(calibration_cache.CACHE_VAR, "off")
    z_search, searched = _search()
    monkeypatch.setenv(calibration_cache.CACHE_VAR, str(cache))
    z_first, _ = _search()
    assert z_first == z_search and len(json.loads(cache.read_text())["entries"]) == 1
    z_read, checked = _in_a_new_process(cache)
    assert z_read == z_search  # the same float: the results of a run do not depend on the cache
    assert checked == 2 < searched  # the two evaluations of the check, not the search's
    eps, delta, q, steps = TARGET
    assert dpsgd_epsilon(z_read, q, steps, delta) <= eps < dpsgd_epsilon(z_read / (1 + 1e-4), q, steps, delta)
    _fresh()


@pytest.mark.parametrize("factor", [0.9, 1.1, float("nan")], ids=["too-little-noise", "too-much-noise", "nan"])
def test_a_tampered_entry_is_searched_again_and_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         factor: float) -> None:
    cache = tmp_path / "calibrations.json"
    monkeypatch.setenv(calibration_cache.CACHE_VAR, str(cache))
    z, _ = _search()
    doc = json.loads(cache.read_text())
    (key,) = doc["entries"]
    cache.write_text(json.dumps({"entries": {key: z * factor}}))
    z_again, searched = _search()
    assert z_again == z and searched > 2
    assert json.loads(cache.read_text())["entries"] == {key: z}
    _fresh()


def test_off_or_unwritable_changes_nothing_but_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(calibration_cache.CACHE_VAR, "off")
    z, _ = _search()
    assert calibration_cache.cache_path() is None and not list(tmp_path.iterdir())
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(calibration_cache.CACHE_VAR, str(blocker / "calibrations.json"))
    assert _search()[0] == z  # the cache's directory cannot be made: the search runs, nothing is raised
    (tmp_path / "garbage.json").write_text("{not json")
    monkeypatch.setenv(calibration_cache.CACHE_VAR, str(tmp_path / "garbage.json"))
    assert _search()[0] == z  # an unreadable file is an empty cache, and is replaced
    assert len(json.loads((tmp_path / "garbage.json").read_text())["entries"]) == 1
    _fresh()
