"""The page-in of the vectorised math functions (:func:`stable_math.page_in_vector_math`) and its benchmark.

Not timed: a fresh process reads its own page table (``/proc/self/pagemap``) over torch's CPU library; after
``stable_math`` is imported, evaluating the functions on special inputs (``-0`` among them, the input whose
constant sits on a page nothing else reads) maps no new page there: the import already mapped them all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes

PAGES_MAPPED_BY_SPECIAL_INPUTS = r"""
import json, os, struct
import torch

def library_pages():
    pages = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) == 6 and fields[5].endswith("libtorch_cpu.so") and "w" not in fields[1]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            pages.extend(range(low // 4096, high // 4096))
    return pages

def present(pages):
    with open("/proc/self/pagemap", "rb") as pagemap:
        found = set()
        for page in pages:
            pagemap.seek(8 * page)
            if struct.unpack("<Q", pagemap.read(8))[0] >> 63:
                found.add(page)
        return found

from polar_vit_hf.modeling import stable_math

pages = library_pages()
before = present(pages)
stable_math.page_in_vector_math()
print(json.dumps({"pages": len(pages), "present": len(before), "new": len(present(pages) - before)}))
"""


def test_import_maps_every_page_that_special_inputs_need():
    if not Path("/proc/self/pagemap").exists():
        pytest.skip("no /proc/self/pagemap on this system")
    done = subprocess.run(
        [sys.executable, "-c", PAGES_MAPPED_BY_SPECIAL_INPUTS], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    if counts["pages"] == 0:
        pytest.skip("torch's CPU library is not a separate shared object here")
    assert counts["present"] > 0
    assert counts["new"] == 0, counts


def test_vector_math_benchmark_reports_every_function(tmp_path, capsys):
    from polar_vit_hf.benchmarks import vector_math

    assert vector_math.main(["--size", "4096", "--rounds", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for function in vector_math.FUNCTIONS:
        for dtype in vector_math.DTYPES:
            assert f"{function} {dtype}" in out
    rows = (tmp_path / "vector_math.csv").read_text().splitlines()
    assert len(rows) == 1 + len(vector_math.FUNCTIONS) * len(vector_math.DTYPES)
