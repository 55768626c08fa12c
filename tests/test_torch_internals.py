"""Each private PyTorch interface the package calls (``modeling/torch_internals.py``) against the behaviour it
stands for: a torch upgrade that moves or changes one fails here, by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from polar_vit_hf.modeling import cpu_kernels, torch_internals

MODELING = Path(torch_internals.__file__).parent


def test_functorch_transforms_are_seen_inside_grad_and_vmap_only():
    seen = []

    def probe(x):
        seen.append(torch_internals.functorch_transforms_active())
        return x.sin().sum()

    probe(torch.ones(3))
    torch.func.grad(probe)(torch.ones(3))
    torch.vmap(probe)(torch.ones(2, 3))
    assert seen == [False, True, True]


def test_saved_tensor_hooks_are_seen_while_in_force():
    assert not torch_internals.saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert torch_internals.saved_tensor_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert torch_internals.saved_tensor_hooks_active()
    assert not torch_internals.saved_tensor_hooks_active()


def test_global_state_snapshot_sees_grad_mode_and_thread_count():
    state = torch_internals.global_state()
    assert state.check()
    with torch.no_grad():
        assert not state.check()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not state.check()
    finally:
        torch.set_num_threads(threads)
    assert state.check()


def test_torch_function_mode_depth_counts_the_modes():
    assert torch_internals.torch_function_mode_depth() == 0
    with TorchFunctionMode(), TorchFunctionMode():
        assert torch_internals.torch_function_mode_depth() == 2


def test_inductor_option_names_hold_the_options_the_kernels_pass():
    names = torch_internals.inductor_option_names()
    assert {"cpp.threads", "cpp.dynamic_threads", "cpp_cache_precompile_headers"} <= names
    assert set(cpu_kernels.GPU_NUMERICS) <= names  # this torch knows all three


def test_inductor_threads_follow_torch_and_inductors_own_setting():
    assert torch_internals.inductor_threads() == torch.get_num_threads()
    with torch._inductor.config.patch({"cpp.threads": 3}):
        assert torch_internals.inductor_threads() == 3


def _traced_sizes(fn, *args):
    """The sizes of ``fn``'s inputs as dynamo hands them to its backend (``dynamic=True``)."""
    seen = []

    def backend(graph, inputs):
        values = [node.meta.get("example_value") for node in graph.graph.nodes if node.op == "placeholder"]
        seen.extend(tuple(t.shape) for t in values if isinstance(t, torch.Tensor))
        return graph.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    return seen


def test_a_size_marked_static_is_a_constant_the_others_symbols():
    x = torch.randn(4, 6)
    torch_internals.mark_size_static(x, 1)
    ((batch, width),) = _traced_sizes(lambda x: x.exp().sum(-1), x)
    assert isinstance(width, int) and width == 6 and isinstance(batch, torch.SymInt)


@pytest.mark.parametrize("duck", [True, False])
def test_without_duck_sizing_equal_sizes_stay_separate_symbols(duck):
    def fn(x, y):
        return x.sum(0) + y.sum(0)

    x, y = torch.randn(5, 3), torch.randn(5, 3)
    if duck:
        (x_rows, _), (y_rows, _) = _traced_sizes(fn, x, y)
    else:
        with torch_internals.no_duck_sizing():
            (x_rows, _), (y_rows, _) = _traced_sizes(fn, x, y)
    assert (str(x_rows) == str(y_rows)) is duck


def test_a_device_side_assertion_raises_its_message_where_false():
    torch_internals.assert_on_device(torch.tensor(True), "never raised")
    with pytest.raises(RuntimeError, match="pixel values out of range"):
        torch_internals.assert_on_device(torch.tensor(False), "pixel values out of range")


def test_precompiled_headers_are_kept_whole_by_link_or_copy_and_only_those_built_since_a_time(tmp_path, monkeypatch):
    """Headers the target lacks arrive under their own names, linked or (across file systems) copied with their
    times, never half-written; headers older than ``built_since`` and other files stay behind; inductor's folder
    of them is the one this module names."""
    import os

    from torch._inductor import codecache

    assert Path(codecache._HEADER_DIR) == Path(torch_internals.inductor_default_cache_dir()) / "precompiled_headers"
    source, kept = tmp_path / "inductor", tmp_path / "kept"
    source.mkdir()
    files = {"new.h": b"#include <x.h>\n", "new.h.gch": b"pch" * 1000, "old.h.gch": b"old", "notes.txt": b"-"}
    for name, content in files.items():
        (source / name).write_bytes(content)
    os.utime(source / "old.h.gch", ns=(10**18, 10**18))
    torch_internals.keep_precompiled_headers(source, kept, built_since=10**9 + 1.0)
    assert sorted(path.name for path in kept.iterdir()) == ["new.h", "new.h.gch"]
    assert (kept / "new.h.gch").read_bytes() == files["new.h.gch"]
    back = tmp_path / "empty-tmp" / torch_internals.PRECOMPILED_HEADERS

    def no_links(*_):
        raise OSError("cross-device link")

    monkeypatch.setattr(torch_internals.os, "link", no_links)
    torch_internals.keep_precompiled_headers(kept, back)
    assert sorted(path.name for path in back.iterdir()) == ["new.h", "new.h.gch"]
    assert (back / "new.h.gch").stat().st_mtime_ns == (kept / "new.h.gch").stat().st_mtime_ns
    (back / "new.h").write_bytes(b"its own")  # present: left as it is
    torch_internals.keep_precompiled_headers(kept, back)
    assert (back / "new.h").read_bytes() == b"its own"
    torch_internals.keep_precompiled_headers(tmp_path / "missing", back)  # nothing to keep: nothing happens
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if not os.access(read_only, os.W_OK):  # (root may write anyway)
        torch_internals.keep_precompiled_headers(kept, read_only / "headers")
        assert not list(read_only.iterdir())


def test_no_other_module_of_the_package_reaches_into_private_torch():
    """Only this module names ``torch._*`` or ``torch.fx.experimental._*`` (the remote code's one place)."""
    offenders = []
    for path in sorted(MODELING.glob("*.py")):
        if path.name == "torch_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.ImportFrom)) else ""
            if isinstance(node, ast.ImportFrom):
                name = node.module or ""
            if name.startswith(("torch._", "torch.fx.experimental._")) and not name.startswith("torch.__"):
                offenders.append(f"{path.name}:{node.lineno} {name}")
    assert not offenders, offenders
