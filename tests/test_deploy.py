"""Deployment: ONNX export run by ONNX Runtime, torch.export with a dynamic batch (and image size), no compile
behind a request, and no CUDA notice on a CPU machine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import polar_vit_hf as P
from polar_vit_hf.deploy import ONNX_FILE, ExportSpec, example_pixels, export_program, onnx_logits
from polar_vit_hf.modeling import cpu_kernels
from polar_vit_hf.modeling.runtime import runtime_options, use_runtime_options

RADII = (0.0, 1e-3, 4.0, 8.0, 12.0)


def pixels_at_radius(config, radius: float, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Images whose every patch token has radius ``radius`` (the RMS of a patch's values): values ``+-radius``."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randn(batch, config.num_channels, config.image_size, config.image_size, generator=generator)
    return radius * signs.sign()


def relative_error(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), reference.to(torch.float64)
    return float((value - reference).abs().max() / reference.abs().max().clamp_min(1e-300))


@pytest.fixture(scope="module")
def onnx_folder(digits_run, tmp_path_factory) -> Path:
    """The digits run exported by the console script with ``--onnx``."""
    from polar_vit_hf.conversion.export import main

    out = tmp_path_factory.mktemp("onnx-export") / "digits"
    assert main([str(digits_run), str(out), "--onnx"]) == 0
    return out


@pytest.mark.slow
def test_the_onnx_model_equals_pytorch_and_keeps_float32_precision_at_every_radius(onnx_folder):
    """ONNX Runtime's logits equal PyTorch's (float32, 1e-5 relative) and the float64 model's to the same
    precision, at patch radii 0 to 12 and at batch sizes other than the exported example's."""
    model = P.PolarViTForImageClassification.from_pretrained(onnx_folder).eval()
    exact = P.PolarViTForImageClassification.from_pretrained(onnx_folder, dtype=torch.float64).eval()
    for radius in RADII:
        for batch in (1, 5):
            pixels = pixels_at_radius(model.config, radius, batch, seed=batch)
            with torch.no_grad():
                eager, reference = model(pixel_values=pixels).logits, exact(pixel_values=pixels.double()).logits
            onnx = onnx_logits(onnx_folder / ONNX_FILE, pixels)
            assert onnx.shape == (batch, model.config.num_labels)
            assert relative_error(onnx, eager) <= 1e-5, radius
            assert relative_error(onnx, reference) <= 1e-5, radius


@pytest.mark.slow
def test_verify_checks_the_onnx_model_and_catches_a_mismatch(onnx_folder, digits_run, capsys):
    from polar_vit_hf.conversion.verify import MARKER, check_onnx, folder_digest, verify

    assert verify(onnx_folder, source=digits_run)
    out = capsys.readouterr().out
    assert "ONNX Runtime (model.onnx)" in out and "MISMATCH" not in out
    assert ONNX_FILE in folder_digest(onnx_folder) and (onnx_folder / MARKER).exists()
    model = P.PolarViTForImageClassification.from_pretrained(onnx_folder).eval()
    pixels = pixels_at_radius(model.config, 1.0, 3)
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    assert check_onnx(onnx_folder / ONNX_FILE, pixels, logits, 1e-5)
    assert not check_onnx(onnx_folder / ONNX_FILE, pixels, logits * (1 + 1e-3), 1e-5)
    assert not check_onnx(onnx_folder / "README.md", pixels, logits, 1e-5)  # not a model: reported, no crash
    assert "FAILED to run" in capsys.readouterr().out


@pytest.mark.slow
def test_the_documented_request_handler_classifies_photographs_as_pytorch_does(onnx_folder):
    """docs/deploy.md's handler: the exported image processor (NumPy arrays) and an ONNX Runtime session."""
    import onnxruntime as ort
    from PIL import Image

    from polar_vit_hf.conversion.verify import sample_images

    processor = P.PolarViTImageProcessor.from_pretrained(onnx_folder)
    session = ort.InferenceSession(str(onnx_folder / ONNX_FILE), providers=["CPUExecutionProvider"])
    images = [Image.fromarray(image) for image in sample_images()]
    pixel_values = processor(images=images, return_tensors="np")["pixel_values"]
    (logits,) = session.run(["logits"], {"pixel_values": pixel_values})
    model = P.PolarViTForImageClassification.from_pretrained(onnx_folder).eval()
    with torch.no_grad():
        expected = model(pixel_values=torch.from_numpy(pixel_values)).logits
    assert relative_error(logits, expected) <= 1e-5
    assert torch.equal(torch.from_numpy(logits).argmax(-1), expected.argmax(-1))


class _Functions(torch.nn.Module):
    """The elementary functions of the stable formulas, as an exported graph holds them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.stack([torch.expm1(x), torch.log1p(x.abs()), torch.sinh(x), torch.asinh(x), torch.cosh(x)])


def test_the_onnx_functions_are_exact_to_float32_against_float64(tmp_path):
    """``expm1``, ``log1p`` (ONNX has neither: Kahan's forms, :func:`deploy.precise_translations`), ``sinh``,
    ``asinh`` and ``cosh`` as ONNX Runtime runs the exported graph: within 2 ulp of float64 at 0, tiny and small
    arguments, the radii 4, 8, 12 and beyond, and the signs and infinities of an overflow."""
    from polar_vit_hf.deploy import save_onnx

    x = torch.tensor(
        [0.0, -0.0, 1e-30, 1e-10, 1e-7, -1e-7, 1e-4, 1e-3, 0.1, 0.5, 1.0, 4.0, 8.0, 12.0, 20.0, -20.0, 80.0, -88.0]
        + [89.0, -200.0, float("inf"), float("-inf")]
    )
    path = save_onnx(torch.export.export(_Functions(), (x,)), tmp_path / "functions.onnx")
    got = torch.from_numpy(onnx_logits(path, x)).double()  # (save_onnx names any input and output so)
    want = _Functions()(x.double())
    in_range = want.abs() <= torch.finfo(torch.float32).max
    assert torch.equal(got[~in_range], want[~in_range].float().double())  # overflows: the same infinities
    ulp = torch.from_numpy(np.spacing(want.abs().float().numpy())).double()
    errors = ((got - want).abs() / ulp)[in_range]
    assert errors.max() <= 2.0, errors


@pytest.mark.slow
def test_torch_export_with_a_dynamic_batch_round_trips_and_equals_eager(tmp_path):
    """``torch.export`` with batches 1 .. 512: the program saved and loaded equals eager at sizes it was not traced
    at, keeps the input check as an assertion, and refuses a batch above its range."""
    config = P.PolarViTConfig.from_preset("demo")
    model = P.PolarViTForImageClassification(config).eval()
    program = export_program(model, ExportSpec(max_batch=512))
    torch.export.save(program, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    for batch in (1, 7, 64):
        pixels = example_pixels(config, batch, seed=batch)
        with torch.no_grad():
            assert relative_error(loaded(pixels), model(pixel_values=pixels).logits) <= 1e-5
    with pytest.raises(RuntimeError, match="(?i)pixel_values contain NaN"):
        loaded(torch.full((1, 3, 32, 32), float("nan")))
    with pytest.raises((AssertionError, RuntimeError), match=r"size\(\)\[0\] <= 512"):
        loaded(example_pixels(config, 513))


@pytest.mark.slow
def test_torch_export_with_a_dynamic_image_size_interpolates_the_position_table():
    config = P.PolarViTConfig.from_preset("demo")
    model = P.PolarViTForImageClassification(config).eval()
    program = export_program(model, ExportSpec(max_batch=8, dynamic_image_size=True)).module()
    for height, width in ((32, 32), (24, 40), (16, 64)):
        pixels = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(height))
        with torch.no_grad():
            eager = model(pixel_values=pixels, interpolate_pos_encoding=True).logits
        assert relative_error(program(pixels), eager) <= 1e-5


def test_dynamic_image_sizes_are_refused_where_the_config_has_one_size():
    for config in (
        P.PolarViTSphericalConfig.from_preset("sphere-cpu"),
        P.PolarViTConfig.from_preset("demo", position_embedding="hypformer"),
    ):
        model = (
            P.PolarViTSphericalForImageClassification(config)
            if config.is_spherical
            else P.PolarViTForImageClassification(config)
        )
        with pytest.raises(ValueError, match="dynamic_image_size"):
            export_program(model, ExportSpec(dynamic_image_size=True))
    with pytest.raises(ValueError, match="max_batch"):
        export_program(P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo")), ExportSpec(0))


def test_after_the_warm_up_a_gradient_free_pass_never_compiles_a_kernel():
    """After ``compile_cpu_kernels()`` (the warm-up) the model's forward turns ``kernel_compiles`` off where it
    records no gradients (a request): a call of any size runs a variant at hand or eagerly. Before it, and in
    training passes, large calls compile as they did (what runs never depends on the kernel cache's state)."""
    config = P.PolarViTConfig.from_preset("demo", num_hidden_layers=1)
    model = P.PolarViTForImageClassification(config)
    seen = []
    model.polar_vit.norm.register_forward_hook(lambda *_: seen.append(runtime_options().kernel_compiles))
    pixels = example_pixels(config, 2)

    def passes() -> None:
        with torch.no_grad():
            model(pixel_values=pixels)
        with torch.inference_mode():
            model(pixel_values=pixels)
        model(pixel_values=pixels)

    passes()
    assert seen == [True, True, True]
    with use_runtime_options(cpu_kernels=False):
        model.compile_cpu_kernels()  # (the kernels are off here: nothing compiles)
    seen.clear()
    passes()
    assert seen == [False, False, True] and runtime_options().kernel_compiles
    large, small = torch.zeros(1 << 20), torch.zeros(8)
    with use_runtime_options(cpu_kernels=True, kernel_compiles=False):
        assert cpu_kernels.kernel_use(large) is cpu_kernels.KernelUse.AT_HAND
        assert cpu_kernels.kernel_use(small) is None  # (small calls: at hand only with kernels_at_hand)
    with use_runtime_options(cpu_kernels=True):
        assert cpu_kernels.kernel_use(large) is cpu_kernels.KernelUse.COMPILE


def test_no_cuda_notice_when_a_cpu_kernel_compiles(caplog):
    """torch's C++ extension loader announces "No CUDA runtime is found" where a CUDA toolkit but no GPU is
    present; the package drops that one notice (a CPU kernel needs no CUDA) and nothing else of that logger."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
        logger.warning("another notice")
    assert [record.getMessage() for record in caplog.records] == ["another notice"]
    if torch.cuda.is_available():
        return
    # in a fresh process with a CUDA_HOME and no GPU: torch prints it, unless the package is imported first
    script = "import sys; {}import torch.utils.cpp_extension"
    env = {**os.environ, "CUDA_HOME": str(Path(sys.executable).parent)}
    plain, quiet = (
        subprocess.run([sys.executable, "-c", script.format(first)], capture_output=True, text=True, env=env)
        for first in ("", "import polar_vit_hf; ")
    )
    assert "No CUDA runtime is found" in plain.stderr
    assert "No CUDA runtime is found" not in quiet.stderr and quiet.returncode == 0


def test_the_switch_survey_reads_overrides_and_plots_failed_rows(tmp_path):
    from polar_vit_hf.benchmarks import export_switches

    assert export_switches.parse_switch("k=0.5") == {"k": 0.5}
    assert export_switches.parse_switch("residual=space") == {"residual": "space"}
    rows = [
        {"switch": "default", "export_s": 1.0, "pt2_error": 3e-6, "onnx_s": 2.0, "onnx_error": 4e-6},
        {"switch": "bad", "error": "ValueError: no"},
    ]
    export_switches.plot(rows, tmp_path / "switches.png")
    assert (tmp_path / "switches.png").stat().st_size > 0


def test_export_without_the_onnx_extra_says_what_to_install(monkeypatch, tmp_path):
    from polar_vit_hf.conversion.export import ExportError, write_onnx

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as where the extra is not installed
    model = P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo"))
    with pytest.raises(ExportError, match=r'--onnx needs the ONNX exporter: pip install "polar-vit-hf\[onnx\]"'):
        write_onnx(model, tmp_path)
    assert not (tmp_path / ONNX_FILE).exists()
