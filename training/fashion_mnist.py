"""Fashion-MNIST from its original IDX files, as a ``datasets.DatasetDict`` (``image``, ``label``).

The 70,000 28 x 28 greyscale images (60,000 training, 10,000 test, 10 classes; Xiao et al. 2017,
MIT licence) are read from the first place that has the four gzipped IDX files:

1. ``--data_dir`` (the files themselves, gzipped or not);
2. Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``);
3. this package's cache (``$POLAR_VIT_DATA``, default ``~/.cache/polar_vit_hf/fashion-mnist``), filled by
   ``python -m polar_vit_hf.training.fetch_data fashion-mnist``;
4. the Hub (``zalando-datasets/fashion_mnist`` through ``datasets.load_dataset``) where it is reachable.

A truncated, corrupt or mismatched IDX file is an error naming the file (:class:`IdxError`).
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from polar_vit_hf.cli import UserError

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIZES = {"train": 60000, "test": 10000}
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
HUB_NAME = "zalando-datasets/fashion_mnist"
IDX_UBYTE = 0x08
VALIDATION_FRACTION = 0.1


class IdxError(UserError):
    """An IDX file that cannot be read as what it should be."""


def cache_dir() -> Path:
    """Where ``fetch_data`` puts the files: ``$POLAR_VIT_DATA/fashion-mnist`` or ``~/.cache/polar_vit_hf/...``."""
    root = os.environ.get("POLAR_VIT_DATA") or Path.home() / ".cache" / "polar_vit_hf"
    return Path(root) / "fashion-mnist"


def read_idx(path: Path, expect_dims: int | None = None) -> np.ndarray:
    """An unsigned-byte IDX file (gzipped or not) as a ``uint8`` array of its declared shape.

    Format: two zero bytes, the type code (``0x08``: unsigned byte), the number of dimensions, one
    big-endian ``uint32`` per dimension, then the values.  Raises :class:`IdxError` naming the file
    when it is not gzip or IDX, has another type or rank, or holds fewer or more bytes than declared.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:
        raise IdxError(
            f"{path}: cannot be read as {'gzip' if path.suffix == '.gz' else 'a file'} ({error}); "
            f"the download is damaged, fetch it again"
        ) from None
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise IdxError(f"{path}: not an IDX file (it starts with {raw[:4].hex() or 'nothing'}, expected 0000 08 0n)")
    code, dims = raw[2], raw[3]
    if code != IDX_UBYTE:
        raise IdxError(f"{path}: IDX type code 0x{code:02x}, expected 0x08 (unsigned bytes)")
    if expect_dims is not None and dims != expect_dims:
        raise IdxError(f"{path}: {dims} dimensions, expected {expect_dims}")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise IdxError(f"{path}: truncated inside its header ({len(raw)} bytes)")
    shape = struct.unpack(f">{dims}I", raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count:
        state = "truncated" if len(raw) - header < count else "longer than declared"
        raise IdxError(
            f"{path}: {state}: the header declares shape {tuple(shape)} ({count} bytes of data), "
            f"the file holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_file(directory: Path, stem: str) -> Path | None:
    """``directory/stem.gz`` or ``directory/stem``, whichever exists."""
    for name in (f"{stem}.gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def idx_directory(data_dir: str | Path | None = None) -> Path | None:
    """The first of ``data_dir``, the Debian location and the cache that holds all four files."""
    stems = [stem for pair in FILES.values() for stem in pair]
    if data_dir is not None:
        directory = Path(data_dir)
        missing = [stem for stem in stems if find_file(directory, stem) is None]
        if missing:
            raise UserError(
                f"--data_dir {directory}: missing Fashion-MNIST file(s) {', '.join(missing)} "
                f"(.gz or not); python -m polar_vit_hf.training.fetch_data fashion-mnist fetches them"
            )
        return directory
    for directory in (DEBIAN_DIR, cache_dir()):
        if all(find_file(directory, stem) is not None for stem in stems):
            return directory
    return None


def read_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 28, 28) uint8, labels (N,) uint8)`` of ``train`` or ``test``, checked against each other."""
    images_path, labels_path = (find_file(directory, stem) for stem in FILES[split])
    images, labels = read_idx(images_path, expect_dims=3), read_idx(labels_path, expect_dims=1)
    if len(images) != len(labels):
        raise IdxError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    if labels.size and labels.max() >= len(CLASS_NAMES):
        raise IdxError(f"{labels_path}: label {int(labels.max())} outside the {len(CLASS_NAMES)} classes")
    return images, labels


def to_dataset(images: np.ndarray, labels: np.ndarray):
    """A ``datasets.Dataset`` with an ``Image`` column (greyscale PNGs) and a ``ClassLabel`` column."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASS_NAMES))})
    return datasets.Dataset.from_dict({"image": list(images), "label": labels.astype(np.int64)}, features=features)


def with_validation(splits, fraction: float = VALIDATION_FRACTION, seed: int = 0):
    """Add ``fit`` and ``validation``: a fixed random ``fraction`` of ``train`` held out for tuning (not ``test``)."""
    import datasets

    order = np.random.default_rng(seed).permutation(len(splits["train"]))
    cut = int(round(fraction * len(order)))
    return datasets.DatasetDict(
        {
            **splits,
            "fit": splits["train"].select(np.sort(order[cut:])),
            "validation": splits["train"].select(np.sort(order[:cut])),
        }
    )


@functools.lru_cache(maxsize=2)
def load_fashion_mnist(data_dir: str | Path | None = None):
    """``datasets.DatasetDict``: ``train`` (60,000), ``test`` (10,000), and ``fit`` / ``validation`` (54,000 /
    6,000 of ``train``, for learning-rate sweeps); see the module docstring for where the files come from.
    Cached per process (the benchmark trains many models on it)."""
    import datasets

    directory = idx_directory(data_dir)
    if directory is not None:
        return with_validation(
            datasets.DatasetDict({split: to_dataset(*read_split(directory, split)) for split in FILES})
        )
    try:
        return with_validation(datasets.load_dataset(HUB_NAME))
    except Exception as error:  # offline, or the Hub refused: explain both ways to get the files
        raise UserError(
            f"Fashion-MNIST is not on this machine (not in {DEBIAN_DIR} nor {cache_dir()}) and the Hub copy "
            f"{HUB_NAME!r} could not be loaded ({type(error).__name__}). Fetch it with "
            f"'python -m polar_vit_hf.training.fetch_data fashion-mnist' (Debian package dataset-fashion-mnist, "
            f"no root needed), or pass --data_dir DIR with the four IDX files"
        ) from None
