"""Standard PyTorch / transformers idioms on Polar-ViT: each works, or is refused with a one-line reason."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image
from torch.func import functional_call, grad, vmap
from transformers import AutoConfig, AutoModelForImageClassification

import polar_vit_hf as P
from polar_vit_hf.modeling.cpu_kernels import DOUBLE_BACKWARD_MESSAGE
from polar_vit_hf.training.data import to_rgb

F64 = torch.float64


def demo_model(**overrides) -> P.PolarViTForImageClassification:
    torch.manual_seed(0)
    return P.PolarViTForImageClassification(P.PolarViTConfig.from_preset("demo", **overrides))


def batch(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen)


# 1. initialisation through transformers' own mechanism ----------------------------------------------------------
@pytest.mark.parametrize("head", ["lorentz_mlr", "poincare_mlr", "tangent_linear"])
def test_new_heads_are_initialised_by_transformers(tmp_path, head):
    model = demo_model(head=head)
    model.polar_vit.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "classifier")
    fresh = [
        AutoModelForImageClassification.from_pretrained(tmp_path / "base"),  # a base model loaded as a classifier
        AutoModelForImageClassification.from_pretrained(  # another label count
            tmp_path / "classifier", num_labels=200, ignore_mismatched_sizes=True
        ),
    ]
    std = model.config.initializer_range
    for loaded in fresh:
        weights = {n: p for n, p in loaded.classifier.named_parameters()}
        matrix = next(p for n, p in weights.items() if p.dim() == 2)
        assert torch.isfinite(matrix).all() and 0.5 * std < float(matrix.detach().std()) < 1.5 * std, head
        assert all(torch.all(p == 0) for n, p in weights.items() if p.dim() == 1), head  # zero biases
        for name, p in loaded.polar_vit.named_parameters():  # the encoder loaded unchanged
            assert torch.equal(p, dict(model.polar_vit.named_parameters())[name]), name


# 2. the checks are per thread ------------------------------------------------------------------------------------
def test_forwards_from_four_threads_leave_every_check_on():
    model = demo_model().eval()
    x, _ = batch()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for _ in range(3):
                with torch.no_grad():
                    model(x)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    bad_radius, direction = torch.tensor([float("nan")]), torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="NaN"):
        P.geometry.to_ambient(bad_radius, direction)
    with pytest.raises(ValueError, match="NaN"):
        model(torch.full_like(x, float("nan")))


# 3. gradient checkpointing after ordinary steps -----------------------------------------------------------------
@pytest.mark.parametrize("overrides", [dict(), dict(fused_ops=False), dict(arithmetic="ambient")])
def test_gradient_checkpointing_after_a_training_step(overrides):
    model = demo_model(**overrides).train()
    x, labels = batch()
    model(pixel_values=x, labels=labels).loss.backward()  # the usual order: a step first
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(pixel_values=x, labels=labels).loss.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-5, atol=1e-7), name


# 4. double backward ----------------------------------------------------------------------------------------------
def test_double_backward_through_fused_layers_names_the_reference_layers():
    model = demo_model()
    x, labels = batch()
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(model(pixel_values=x, labels=labels).loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="fused_ops=False") as raised:
        g.square().sum().backward()
    assert DOUBLE_BACKWARD_MESSAGE in str(raised.value) and "\n" not in DOUBLE_BACKWARD_MESSAGE


def test_double_backward_with_reference_layers_matches_finite_differences():
    """A Hessian-vector product with respect to the pixels (gradient penalties, influence functions) against
    central differences of the gradient, in float64."""
    model = demo_model(fused_ops=False).double().eval()
    x, labels = batch(2)
    x = x.double()
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=F64)

    def gradient(point: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
        point = point.detach().requires_grad_(True) if not create_graph else point
        return torch.autograd.grad(model(pixel_values=point, labels=labels).loss, point, create_graph=create_graph)[0]

    xr = x.clone().requires_grad_(True)
    (hvp,) = torch.autograd.grad((gradient(xr, create_graph=True) * v).sum(), xr)
    h = 1e-4
    numeric = (gradient(x + h * v) - gradient(x - h * v)) / (2 * h)
    assert torch.allclose(hvp, numeric, rtol=1e-5, atol=1e-8 * float(numeric.abs().max()))


# 5. saved-tensor hooks around forward and backward ---------------------------------------------------------------
@pytest.mark.parametrize("hooks", ["save_on_cpu", "saved_tensors_hooks"])
def test_saved_tensor_hooks_around_forward_and_backward(hooks):
    model = demo_model().train()
    x, labels = batch()
    model(pixel_values=x, labels=labels).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packed: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.numel())
        return tensor.clone()

    context = (
        torch.autograd.graph.save_on_cpu()
        if hooks == "save_on_cpu"
        else torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    )
    with context:
        model(pixel_values=x, labels=labels).loss.backward()
    assert hooks == "save_on_cpu" or packed
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, want[name], rtol=1e-5, atol=1e-7), name


# 6. torch.func transforms ----------------------------------------------------------------------------------------
def test_per_sample_gradients_by_vmap_and_grad_equal_a_loop():
    model = demo_model().eval()  # dropout-free: the per-sample losses are deterministic
    x, labels = batch(3)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(weights: dict, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return functional_call(model, weights, (image[None],), {"labels": label[None]}).loss

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, labels)
    for i in range(len(x)):
        model.zero_grad()
        model(pixel_values=x[i : i + 1], labels=labels[i : i + 1]).loss.backward()
        for name, p in model.named_parameters():
            scale = float(p.grad.abs().max()) + 1e-12
            assert torch.allclose(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-4 * scale), (i, name)


def test_pairwise_chord_under_vmap_and_grad():
    u = torch.nn.functional.normalize(torch.randn(3, 5, 4, dtype=F64), dim=-1)
    v = torch.nn.functional.normalize(torch.randn(3, 6, 4, dtype=F64), dim=-1)
    chords = P.geometry.pairwise_chord
    assert torch.allclose(vmap(chords)(u, v), chords(u, v))
    per_row = vmap(grad(lambda a, b: chords(a, b).square().sum()))(u, v)
    u_leaf = u.clone().requires_grad_(True)
    chords(u_leaf, v).square().sum().backward()
    assert torch.allclose(per_row, u_leaf.grad)


# 7. one pixel conversion ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "array",
    [
        np.full((8, 8), 32768, np.uint16),  # I;16
        np.linspace(0, 65535, 64, dtype=np.float64).astype(np.uint16).reshape(8, 8),
        np.full((8, 8), 0.5, np.float32),  # F within [0, 1]
        np.full((8, 8), 1000, np.int32),  # I above 255
        np.arange(64, dtype=np.int32).reshape(8, 8),  # I within 8 bits
    ],
)
def test_processor_and_training_see_the_same_pixels(array):
    image = Image.fromarray(array)
    processor = P.PolarViTImageProcessor(size={"height": 8, "width": 8}, do_normalize=False)
    seen_by_processor = processor(images=image, return_tensors="pt")["pixel_values"][0]
    seen_in_training = torch.from_numpy(np.asarray(to_rgb(image), dtype=np.float32) / 255).permute(2, 0, 1)
    assert torch.allclose(seen_by_processor, seen_in_training, atol=1e-6)


# 8. config validation on every construction path ----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field", [(dict(residual="bogus"), "residual"), (dict(k=-1.0), "k"), (dict(num_hidden_layers=0), "layers")]
)
def test_config_overrides_are_validated_on_every_path(tmp_path, kwargs, field):
    demo_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):
        P.PolarViTForImageClassification.from_pretrained(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=field):
        AutoConfig.from_pretrained(tmp_path, **kwargs)
    config = P.PolarViTConfig.from_preset("demo")
    with pytest.raises(ValueError, match=field):
        P.PolarViTConfig.from_dict({**config.to_dict(), **kwargs})
    with pytest.raises(ValueError, match=field):
        P.PolarViTConfig.from_preset("demo").update(kwargs)
    assigned = P.PolarViTConfig.from_preset("demo")
    for name, value in kwargs.items():
        setattr(assigned, name, value)
    with pytest.raises(ValueError, match=field):  # plain assignment: checked when a model is built from it
        P.PolarViTModel(assigned)
    with pytest.raises(ValueError, match="residual"):
        P.PolarViTConfig.from_preset("demo").update_from_string("residual=bogus")


# 9. input embeddings, empty batches, attention gradients --------------------------------------------------------
def test_input_embeddings_are_the_patch_embedding():
    model = demo_model()
    assert model.get_input_embeddings() is model.polar_vit.embeddings.patch_projection
    assert model.polar_vit.get_input_embeddings() is model.polar_vit.embeddings.patch_projection


def test_empty_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="empty batch"):
        demo_model()(torch.randn(0, 3, 32, 32))


def test_attention_probabilities_are_in_the_graph():
    model = demo_model()
    x, labels = batch(2)
    out = model(pixel_values=x, labels=labels, output_attentions=True)
    for attention in out.attentions:
        attention.retain_grad()
    out.loss.backward()
    assert all(a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0 for a in out.attentions)
