"""transformers' own common model tests, from the source distribution of the installed version.

``make install`` downloads the sdist of the installed ``transformers`` from the package index into
``.venv/transformers-sdist/`` (``pip download --no-binary :all: --no-deps``) and unpacks its ``tests/``; the
suite then imports ``tests/test_modeling_common.py`` and ``tests/test_configuration_common.py`` from there, as
the package ``transformers_sdist_tests``.  The sdist ships only the ``*_common`` modules, not the helper modules
they import relatively; :func:`load` supplies those three (the export and generation mixins, which Polar-ViT
does not use: an image classifier neither generates nor takes the ``torch.export`` path the mixin tests, and the
configuration kwargs the config tester sets) before importing.  ``TRANSFORMERS_SDIST_TESTS`` points at another
unpacked ``tests/`` folder.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import transformers

PACKAGE = "transformers_sdist_tests"
ROOT = Path(__file__).resolve().parents[2]


def tests_dir() -> Path:
    """The unpacked ``tests/`` folder of the installed transformers' sdist (may not exist)."""
    override = os.environ.get("TRANSFORMERS_SDIST_TESTS")
    if override:
        return Path(override)
    return ROOT / ".venv" / "transformers-sdist" / f"transformers-{transformers.__version__}" / "tests"


def _module(name: str, **attributes: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


class ExportTesterMixin:
    """Stands in for ``tests/exporters/test_export.py`` (not in the sdist): no ``torch.export`` tests."""


class GenerationTesterMixin:
    """Stands in for ``tests/generation/test_utils.py`` (not in the sdist): Polar-ViT does not generate."""


# stands in for ``tests/utils/test_configuration_utils.py``: common PreTrainedConfig kwargs, each away from its
# default, that ConfigTester sets and reads back
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "problem_type": "single_label_classification",
    "chunk_size_feed_forward": 5,
    "id2label": {0: "first", 1: "second"},
    "label2id": {"first": 0, "second": 1},
}


def load() -> tuple[type, type]:
    """``(ModelTesterMixin, ConfigTester)`` from the sdist's tests; raises ``FileNotFoundError`` naming the
    command that fetches them."""
    folder = tests_dir()
    if not (folder / "test_modeling_common.py").is_file():
        raise FileNotFoundError(f"{folder}/test_modeling_common.py is missing: run `make install` to fetch it")
    init = folder / "__init__.py"  # the repository's tests/ is a package; the sdist leaves its empty __init__ out
    if not init.exists():
        init.write_text("")
    if PACKAGE not in sys.modules:
        package = _module(PACKAGE)
        package.__path__ = [str(folder)]  # type: ignore[attr-defined]
        for sub in ("exporters", "generation", "utils"):
            _module(f"{PACKAGE}.{sub}").__path__ = []  # type: ignore[attr-defined]
        _module(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
        _module(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)
        _module(f"{PACKAGE}.utils.test_configuration_utils", config_common_kwargs=CONFIG_COMMON_KWARGS)
    modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    return modeling.ModelTesterMixin, configuration.ConfigTester
