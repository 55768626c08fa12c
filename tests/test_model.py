"""PolarViT as a transformers model: config, layers, arithmetics, switches, HF behaviour, bad inputs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from helpers import SWITCHES
from torch._dynamo.utils import counters

import polar_vit_hf as P
from polar_vit_hf.geometry import input_checks
from polar_vit_hf.modeling.manifold_ops import PolarOps
from polar_vit_hf.modeling.modeling_polar_vit import PolarFC
from polar_vit_hf.modeling.operators import operator_namespace

F64 = torch.float64


def demo_config(**overrides) -> P.PolarViTConfig:
    return P.PolarViTConfig.from_preset("demo", **overrides)


def small_model(**overrides) -> P.PolarViTForImageClassification:
    torch.manual_seed(0)
    return P.PolarViTForImageClassification(demo_config(**overrides))


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(hidden_size=50, num_attention_heads=4), "hidden_size"),
        (dict(hidden_size=12, num_attention_heads=4), "relative_position"),
        (dict(k=0.0), "k"),
        (dict(k=-2.0), "k"),
        (dict(k=float("nan")), "k"),
        (dict(relative_position="alibi"), "relative_position"),
        (dict(residual="add"), "residual"),
        (dict(linear="dense"), "linear"),
        (dict(readout="mean"), "readout"),
        (dict(head="softmax"), "head"),
        (dict(arithmetic="mixed"), "arithmetic"),
        (dict(position_embedding="rope"), "position_embedding"),
        (dict(image_size=30, patch_size=8), "image_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(drop_path_rate=1.0), "drop_path_rate"),
        (dict(polar_attn_implementation="flash"), "polar_attn_implementation"),
    ],
)
def test_invalid_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        demo_config(**kwargs)


def test_head_width_without_positional_axes_is_allowed():
    config = demo_config(hidden_size=12, num_attention_heads=4, intermediate_size=24, relative_position="none")
    assert config.head_dim == 3


def test_presets_and_overrides():
    config = P.PolarViTConfig.from_preset("small", num_labels=7, k=2.0)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (384, 12, 6)
    assert config.position_embedding == "sincos" and config.num_labels == 7 and config.k == 2.0
    with pytest.raises(ValueError, match="unknown preset"):
        P.PolarViTConfig.from_preset("huge")
    round_trip = P.PolarViTConfig.from_dict(config.to_dict())
    assert round_trip.to_dict() == config.to_dict()


def test_polar_fc_parameter_count_and_anchor():
    """Eq. 8: n'(n+1) + n + 3 parameters; at the anchor sinh a' = ||h|| (the Lorentz FC)."""
    layer = PolarFC(7, 5)
    torch.nn.init.normal_(layer.weight)
    assert sum(p.numel() for p in layer.parameters()) == 5 * 8 + 7 + 3
    lorentz = PolarFC(7, 5, radius_rule=False)
    assert sum(p.numel() for p in lorentz.parameters()) == 5 * 8
    ops = PolarOps()
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(4, dtype=F64, generator=gen) * 3
    u = torch.nn.functional.normalize(torch.randn(4, 7, dtype=F64, generator=gen), dim=-1)
    layer = layer.double()
    out = layer(ops.make(r, u), ops)
    h = ops.unit_coords(ops.make(r, u)) @ layer.weight.t()
    assert torch.allclose(torch.sinh(out[..., 0]), h.norm(dim=-1), rtol=1e-12)
    assert torch.allclose(out[..., 1:], h / h.norm(dim=-1, keepdim=True), atol=1e-12)


# --------------------------------------------------------------------------------------------
# polar vs ambient arithmetic
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", SWITCHES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_polar_and_ambient_models_agree_in_float64(overrides):
    model = small_model(**overrides).double().eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0) if hasattr(model.classifier, "weight") else None
    x = torch.randn(3, 3, 32, 32, dtype=F64)
    polar = model(x).logits
    model.set_arithmetic("ambient")
    ambient = model(x).logits
    assert torch.allclose(polar, ambient, rtol=0, atol=1e-10)
    assert polar.abs().max() > 1e-3


def test_state_dict_of_one_arithmetic_loads_into_the_other():
    polar = small_model().double()
    torch.manual_seed(1)  # different initial weights: the load must be what makes the two agree
    ambient = P.PolarViTForImageClassification(demo_config(arithmetic="ambient")).double()
    x = torch.randn(2, 3, 32, 32, dtype=F64)
    assert not torch.allclose(polar(x).logits, ambient(x).logits, atol=1e-6)
    ambient.load_state_dict(polar.state_dict())
    assert torch.allclose(polar(x).logits, ambient(x).logits, rtol=0, atol=1e-10)


def _drive_to_radius_12(model: P.PolarViTForImageClassification) -> None:
    """Embeddings at radius 12 with geodesic spread ~4 via the patch Polar-FC's radius bias."""
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0)
        projection = model.polar_vit.embeddings.patch_projection
        projection.weight[:, 1:].mul_(3e-4 / math.sinh(2.0))
        projection.norm_power.zero_()
        projection.radius_bias.fill_(math.log(math.sinh(12.0)))
        model.polar_vit.embeddings.position_embeddings.zero_()


def test_at_radius_12_polar_float32_stays_accurate_and_ambient_fails():
    model = small_model().eval()
    _drive_to_radius_12(model)
    x = torch.randn(4, 3, 32, 32)
    reference = copy.deepcopy(model).double()
    hidden = reference.polar_vit(x.double(), output_hidden_states=True).hidden_states[0]
    radius = P.geometry.from_ambient(hidden)[0]
    assert torch.allclose(radius, torch.full_like(radius, 12.0), atol=1e-6)
    expected = reference(x.double()).logits
    polar = model(x).logits.double()
    assert torch.isfinite(polar).all()
    assert (polar - expected).abs().max() < 0.02 * expected.abs().max()
    assert (polar.argmax(-1) == expected.argmax(-1)).all()
    model.set_arithmetic("ambient")
    with input_checks(False):
        ambient = model(x).logits.double()
    broken = ~torch.isfinite(ambient) | ((ambient - expected).abs() > 0.5 * expected.abs().max())
    assert broken.any()


# --------------------------------------------------------------------------------------------
# every switch value trains
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    SWITCHES + [dict(arithmetic="ambient"), dict(drop_path_rate=0.3)],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_every_switch_runs_forward_and_backward(overrides):
    model = small_model(**overrides).train()
    x = torch.randn(4, 3, 32, 32)
    out = model(x, labels=torch.tensor([0, 1, 2, 3]))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name


# --------------------------------------------------------------------------------------------
# standard transformers behaviour
# --------------------------------------------------------------------------------------------
def test_outputs_hidden_states_attentions_and_polar_view():
    model = small_model().eval()
    config = model.config
    x = torch.randn(2, 3, 32, 32)
    out = model.polar_vit(x, output_hidden_states=True, output_attentions=True)
    tokens = config.num_patches
    assert out.last_hidden_state.shape == (2, tokens, config.hidden_size + 1)
    assert out.pooler_output.shape == (2, config.hidden_size + 1)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert len(out.attentions) == config.num_hidden_layers
    assert out.attentions[0].shape == (2, config.num_attention_heads, tokens, tokens)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(2, config.num_attention_heads, tokens))
    # the ambient tensor is on the hyperboloid and agrees with the polar view
    x_amb = out.last_hidden_state.double()
    inner = -(x_amb[..., 0] ** 2) + (x_amb[..., 1:] ** 2).sum(-1)
    assert torch.allclose(inner, torch.full_like(inner, -config.k), rtol=1e-4)
    r, u = out.last_hidden_polar[..., 0], out.last_hidden_polar[..., 1:]
    assert torch.allclose(P.geometry.to_ambient(r, u, config.k), out.last_hidden_state, rtol=1e-5, atol=1e-5)
    as_tuple = model(x, return_dict=False)
    assert torch.equal(as_tuple[0], model(x).logits)


def test_labels_give_a_loss_and_id2label_is_kept():
    model = small_model(id2label={i: f"digit-{i}" for i in range(10)})
    out = model(torch.randn(3, 3, 32, 32), labels=torch.tensor([1, 2, 3]))
    assert out.loss.ndim == 0 and out.logits.shape == (3, 10)
    assert model.config.id2label[3] == "digit-3" and model.config.label2id["digit-3"] == 3


def test_gradient_checkpointing_gives_the_same_gradients():
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    model = small_model()
    model(x, labels=y).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable()
    model.train()
    assert model.is_activation_checkpointing
    calls = []  # a hook inside the block (transformers checkpoints the block's forward, not its hooks)
    model.polar_vit.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    model(x, labels=y).loss.backward()
    assert len(calls) == 2  # the block ran again during backward: its activations were not kept
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6), name


def test_other_image_sizes_need_interpolation_for_learned_positions():
    model = small_model().eval()
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        model(torch.randn(1, 3, 48, 48))
    out = model(torch.randn(1, 3, 48, 48), interpolate_pos_encoding=True)
    assert out.logits.shape == (1, 10)
    # interpolating to the training size is the identity
    x = torch.randn(1, 3, 32, 32)
    assert torch.allclose(model(x, interpolate_pos_encoding=True).logits, model(x).logits)
    sincos = small_model(position_embedding="sincos").eval()
    assert sincos(torch.randn(1, 3, 40, 24)).logits.shape == (1, 10)


def test_bad_inputs_raise_clear_errors():
    model = small_model().eval()
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="patch_size"):
        model(torch.randn(1, 3, 30, 30))
    with pytest.raises(ValueError, match=r"shape \(batch, channels, height, width\)"):
        model(torch.randn(3, 32, 32))
    bad = torch.randn(1, 3, 32, 32)
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        model(bad)
    with pytest.raises(ValueError, match="pixel_values"):
        model(None)


def graph_breaks(model, *args, **kwargs) -> int:
    """``torch._dynamo.explain``'s graph breaks of ``model(*args, **kwargs)`` (tracing only)."""
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(*args, **kwargs).graph_break_count


@pytest.mark.parametrize(
    "switch",
    [{}, *(pytest.param(switch, marks=pytest.mark.slow) for switch in SWITCHES)],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "default",
)
@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
def test_torch_compile_traces_every_config_as_one_graph(arithmetic, switch, traced_kernels):
    """With the compiled CPU kernels on (the default outside this suite) a training step's forward and loss and
    an inference pass trace as one graph, for every ablation switch in both arithmetics: the fused layers are
    registered operators in it (:mod:`operators`), nothing breaks it."""
    traced_kernels(True)
    model = small_model(num_hidden_layers=1, arithmetic=arithmetic, **switch).train()
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    assert graph_breaks(lambda: model(pixel_values=x, labels=labels).loss) == 0
    model.eval()
    with torch.no_grad():
        assert graph_breaks(lambda: model(x).logits) == 0


@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
def test_torch_compile_keeps_the_fused_layers_as_operators_and_shares_them_across_layers(arithmetic, traced_kernels):
    """Inside ``torch.compile`` on float32 CPU tensors with the kernels on, each fused layer is one call of its
    registered operator in the graph (its formulas are not traced); the compiled model gives eager's logits, and
    what it compiles does not grow with depth (each operator serves every layer)."""
    traced_kernels(True)
    x = torch.randn(2, 3, 32, 32)
    graphs, nodes, fused_calls = [], [], []
    for layers in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        model = small_model(num_hidden_layers=layers, arithmetic=arithmetic).eval()
        captured: list[torch.fx.GraphModule] = []

        def backend(gm, example_inputs, captured=captured):
            captured.append(gm)
            return gm.forward

        with torch.no_grad():
            got = torch.compile(model, backend=backend, fullgraph=True)(x).logits
            assert torch.allclose(got, model(x).logits, atol=1e-5)
        called = [str(node.target) for gm in captured for node in gm.graph.nodes if node.op == "call_function"]
        namespace = operator_namespace()
        nodes.append(len(called))
        fused_calls.append(len([name for name in called if name.startswith(namespace)]))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == 1
    per_layer = (nodes[1] - nodes[0]) // 2
    assert (fused_calls[1] - fused_calls[0]) // 2 >= 5  # norms, projections, attention, residuals
    assert per_layer < 50  # the layers' formulas stay inside the operators


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a torch built with CUDA")
@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
def test_a_forward_on_a_gpu_reads_no_tensor_value(arithmetic):
    """On a CUDA device a training forward, its input check included (a device-side assertion there), never makes
    the host read a tensor value (no synchronisation, CUDA graphs can capture it): it runs to the loss on fake CUDA
    tensors, which have no values (a read raises), and counts no ``_local_scalar_dense``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from polar_vit_hf.benchmarks.launches import OperatorCounter

    model = small_model(num_hidden_layers=1, arithmetic=arithmetic, polar_attn_implementation="fused").train()
    fake = FakeTensorMode()
    with fake:
        state = {
            name: fake.from_tensor(t).to("cuda").requires_grad_(t.requires_grad)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        }
        x, labels = torch.randn(4, 3, 32, 32, device="cuda"), torch.arange(4, device="cuda")
        with OperatorCounter() as counter:
            loss = torch.func.functional_call(model, state, (), {"pixel_values": x, "labels": labels}).loss
    assert loss.device.type == "cuda" and counter.syncs == 0 and counter.operators > 0


def test_torch_compile_traces_one_graph_where_the_kernels_are_off(traced_kernels):
    """With the compiled kernels off in the traced options (``POLAR_VIT_CPU_KERNELS=0``) the fused layers are
    traced: one graph, no breaks (``fullgraph=True``), eager's logits."""
    traced_kernels(False)
    model = small_model(num_hidden_layers=1).eval()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x).logits, model(x).logits, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arithmetic", ["polar", "ambient"])
@pytest.mark.parametrize("traced", [True, False], ids=["layers-traced", "layers-as-operators"])
def test_torch_compile_trains_like_eager_without_warnings(arithmetic, traced, recwarn, traced_kernels):
    """A compiled training step gives eager's gradients, with the fused layers traced into its graph (their
    autograd Functions and recomputed functions) or called as its registered operators, and compiling it warns
    about nothing of this package and hits no recompile limit."""
    traced_kernels(not traced)
    model = small_model(num_hidden_layers=1, arithmetic=arithmetic, drop_path_rate=0.0).train()
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # (it would only log)
        torch.compile(model, backend="aot_eager")(pixel_values=x, labels=labels).loss.backward()
    compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(pixel_values=x, labels=labels).loss.backward()
    for got, want in zip(compiled, (p.grad for p in model.parameters())):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    assert not [w for w in recwarn if "polar_vit_hf" in str(w.filename) or "lru_cache" in str(w.message)]


def test_manifold_parameters_are_named_plain_parameters():
    model = small_model(readout="cls")
    names = model.manifold_parameter_names()
    assert "polar_vit.embeddings.cls_token" in names
    assert "polar_vit.norm.bias_point" in names
    assert sum(name.endswith("attention_norm.bias_point") for name in names) == model.config.num_hidden_layers
    params = dict(model.named_parameters())
    assert all(type(params[name]) is torch.nn.Parameter for name in names)


def test_initialisation_follows_appendix_d2():
    model = small_model()
    config = model.config
    layer = model.polar_vit.layers[0]
    gain = math.exp(layer.attention_norm.log_gain.item())
    assert math.isclose(gain, math.sqrt(config.k) * math.asinh(math.sqrt(config.hidden_size / config.k)), rel_tol=1e-6)
    assert torch.all(layer.attention_norm.bias_point == 0)
    assert math.isclose(layer.attention_residual.alpha.item(), 0.1, rel_tol=1e-6)
    q = layer.attention.q_proj.weight
    assert torch.allclose(q @ q.t(), torch.eye(q.shape[0]), atol=1e-5)  # orthogonal rows
    fc = layer.mlp.fc1
    assert torch.all(fc.norm_power == 1) and torch.all(fc.radius_weight == 0)
    assert torch.all(fc.klein_weight == 0) and torch.all(fc.radius_bias == 0)
    rates = layer.attention.position.rates
    assert math.isclose(rates.min().item(), 0.5, rel_tol=1e-5) and math.isclose(rates.max().item(), 4.0, rel_tol=1e-5)


# --------------------------------------------------------------------------------------------
# structure: checkpoints from before the restructuring, variants, registry, parameter roles
# --------------------------------------------------------------------------------------------
PRE_REFACTOR = Path(__file__).resolve().parent / "data" / "pre_refactor"


@pytest.mark.parametrize("name", ["default", "variants", "space"])
def test_checkpoints_saved_before_the_restructuring_still_load(name):
    """Tiny checkpoints written by the code before the encoder/variant classes existed (checked in with their
    inputs and logits): every key loads (no missing or unexpected weights) and the logits are unchanged."""
    from safetensors.torch import load_file

    model, info = P.PolarViTForImageClassification.from_pretrained(PRE_REFACTOR / name, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected = load_file(PRE_REFACTOR / name / "expected.safetensors")
    with torch.no_grad():
        logits = model.eval()(pixel_values=expected["pixel_values"]).logits
    assert torch.allclose(logits, expected["logits"], rtol=1e-5, atol=1e-6)


def test_variant_classes_come_from_the_config_mappings():
    from polar_vit_hf.modeling import modeling_polar_vit as M

    for overrides, attribute, cls in (
        (dict(residual="space"), "attention_residual", M.SpaceResidual),
        (dict(residual="lorentz_midpoint"), "mlp_residual", M.LorentzMidpointResidual),
        (dict(relative_position="rotation"), "attention.position", M.RotationEncoding),
    ):
        layer = small_model(**overrides).polar_vit.encoder[0]
        assert isinstance(layer.get_submodule(attribute), cls)
    assert isinstance(small_model(head="poincare_mlr").classifier, M.PoincareMLRHead)
    assert isinstance(small_model(readout="cls").polar_vit.pooler, M.PolarViTClassTokenPooler)
    assert isinstance(small_model().polar_vit.pooler, M.PolarViTCentroidPooler)
    assert small_model(relative_position="none").polar_vit.encoder[0].attention.position is None


def test_the_two_arithmetics_are_siblings_of_one_interface():
    from polar_vit_hf.modeling.manifold_ops import AmbientOps, ManifoldOps

    assert issubclass(PolarOps, ManifoldOps) and issubclass(AmbientOps, ManifoldOps)
    assert not issubclass(AmbientOps, PolarOps)

    class Incomplete(ManifoldOps):  # an arithmetic that forgets an operation cannot be created
        name = "incomplete"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_a_registered_attention_implementation_is_used_by_the_model():
    from polar_vit_hf.modeling.attention import PolarAttentionInterface

    calls = []

    def logged(*args):
        calls.append(args[0].shape)
        return P.attention.POLAR_ATTENTION_FUNCTIONS["eager"](*args)

    PolarAttentionInterface.register("logged_eager", logged)
    try:
        model = small_model(polar_attn_implementation="logged_eager").eval()
        reference = small_model(polar_attn_implementation="eager").eval()
        x = torch.randn(2, 3, 32, 32)
        assert torch.allclose(model(x).logits, reference(x).logits, rtol=0, atol=0)
        assert len(calls) == model.config.num_hidden_layers
    finally:
        del PolarAttentionInterface._global_mapping["logged_eager"]
    with pytest.raises(ValueError, match="polar_attn_implementation='logged_eager' is not one of"):
        demo_config(polar_attn_implementation="logged_eager")


def test_modules_declare_the_roles_of_their_parameters():
    from polar_vit_hf.modeling.modeling_polar_vit import MANIFOLD, NO_DECAY, RADIUS_RULE_ANCHOR, parameter_roles

    model = small_model(readout="cls", residual="lorentz_midpoint")
    roles = parameter_roles(model)
    assert {name for name, role in roles.items() if role == MANIFOLD} == set(model.manifold_parameter_names())
    assert roles["polar_vit.embeddings.cls_token"] == MANIFOLD
    assert roles["polar_vit.layers.0.attention_norm.bias_point"] == MANIFOLD
    assert roles["polar_vit.layers.0.mlp_residual.midpoint_weight"] == NO_DECAY
    assert roles["polar_vit.layers.1.attention.position.rates"] == NO_DECAY
    assert roles["polar_vit.layers.0.mlp.fc1.norm_power"] == ("decay_to", RADIUS_RULE_ANCHOR["norm_power"])
    assert "polar_vit.layers.0.mlp.fc1.weight" not in roles
    # the anchor is also the initial value: one place for both
    fc = model.polar_vit.layers[0].mlp.fc1
    assert all(torch.all(getattr(fc, name) == value) for name, value in RADIUS_RULE_ANCHOR.items())


def test_init_weights_restores_the_declared_initial_values():
    model = small_model(residual="lorentz_midpoint")
    fresh = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    for module in model.modules():
        model._init_weights(module)
    for name, value in model.state_dict().items():
        if name.endswith(
            (
                "log_gain",
                "bias_point",
                "midpoint_weight",
                "log_temperature",
                "rates",
                "norm_power",
                "radius_weight",
                "klein_weight",
                "radius_bias",
                "alpha",
            )
        ):
            assert torch.allclose(value, fresh[name]), name
