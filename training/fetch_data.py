"""Fetch a data set the training scripts read offline afterwards.

    python -m polar_vit_hf.training.fetch_data fashion-mnist [--dest DIR]

``fashion-mnist``: the four gzipped IDX files into ``DIR`` (default: the package cache,
``$POLAR_VIT_DATA/fashion-mnist`` or ``~/.cache/polar_vit_hf/fashion-mnist``), taken from the first
of: Debian's ``/usr/share/datasets/fashion-mnist`` (package ``dataset-fashion-mnist``), or the same
package downloaded and unpacked without root (``apt-get download dataset-fashion-mnist``,
``dpkg-deb -x``).  Every file is checked (:func:`fashion_mnist.read_split`) before it is kept.  Where
neither works, the message says what to install; ``--dataset fashion_mnist`` then also tries the
Hub (``zalando-datasets/fashion_mnist``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from polar_vit_hf.cli import UserError, add_debug_flag, command
from polar_vit_hf.training import fashion_mnist as fm

DEBIAN_PACKAGE = "dataset-fashion-mnist"


def _unpack_debian_package(scratch: Path) -> Path:
    """``apt-get download`` + ``dpkg-deb -x`` of the package into ``scratch``; the directory with the files."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise UserError(
                f"Fashion-MNIST is not installed and {tool} is missing: install the Debian package "
                f"{DEBIAN_PACKAGE}, or download the four IDX files (github.com/zalandoresearch/"
                f"fashion-mnist) and pass --data_dir DIR"
            )
    done = subprocess.run(["apt-get", "download", DEBIAN_PACKAGE], cwd=scratch, capture_output=True, text=True)
    debs = sorted(scratch.glob(f"{DEBIAN_PACKAGE}_*.deb"))
    if done.returncode != 0 or not debs:
        raise UserError(
            f"'apt-get download {DEBIAN_PACKAGE}' failed ({(done.stderr or done.stdout).strip()[-300:]}); "
            f"run 'apt-get update' or install the package ({DEBIAN_PACKAGE}) some other way"
        )
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(scratch / "root")], check=True)
    return scratch / "root" / str(fm.DEBIAN_DIR).lstrip("/")


def fetch_fashion_mnist(dest: Path) -> Path:
    """Copy the four files into ``dest`` (checked); returns ``dest``."""
    with tempfile.TemporaryDirectory() as tmp:
        source = fm.DEBIAN_DIR if fm.idx_directory() == fm.DEBIAN_DIR else _unpack_debian_package(Path(tmp))
        for split in fm.FILES:
            fm.read_split(source, split)  # a damaged file is an error here, not in the first epoch
        dest.mkdir(parents=True, exist_ok=True)
        for stems in fm.FILES.values():
            for stem in stems:
                found = fm.find_file(source, stem)
                shutil.copyfile(found, dest / found.name)
    return dest


@command("polar-vit-fetch-data")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=["fashion-mnist"])
    parser.add_argument("--dest", type=Path, help="target directory (default: the package cache)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    dest = fetch_fashion_mnist(args.dest or fm.cache_dir())
    print(f"Fashion-MNIST: 60,000 + 10,000 images checked, files in {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
