"""transformers' own ``ModelTesterMixin`` and ``ConfigTester`` (from the installed version's sdist) on Polar-ViT.

Every mixin test runs on the default configuration and on each variant that changes the parameters (heads,
residuals, position encodings, linear layers, readouts, the ambient arithmetic); a test the design rules out is
skipped below with its reason.  The sdist is fetched by ``make install`` (``tests/support/transformers_sdist.py``).
"""

from __future__ import annotations

import os
import tempfile
import unittest
from unittest import mock

import pytest
import torch
import transformers_sdist
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, MODEL_MAPPING_NAMES

import polar_vit_hf as P
from polar_vit_hf.modeling import cpu_kernels
from polar_vit_hf.modeling.runtime import use_runtime_options

ModelTesterMixin, ConfigTester = transformers_sdist.load()  # FileNotFoundError naming `make install` if missing

# one configuration per variant that changes parameters; the mixin's tests run on each
VARIANTS = {
    "default": {},
    "tangent_linear": dict(head="tangent_linear"),
    "poincare_mlr": dict(head="poincare_mlr"),
    "cls_readout": dict(readout="cls"),
    "lorentz_midpoint": dict(residual="lorentz_midpoint"),
    "sincos": dict(position_embedding="sincos"),
    "hypformer": dict(position_embedding="hypformer"),
    "beta_concat": dict(head_merge="beta_concat"),
    "lorentz_linear": dict(linear="lorentz"),
    "ambient": dict(arithmetic="ambient"),
}


class PolarViTModelTester:
    """Small configurations and inputs for the mixin (ViT's tester in transformers plays this part for ViT)."""

    def __init__(self, parent: unittest.TestCase, overrides: dict) -> None:
        self.parent = parent
        self.overrides = overrides
        self.batch_size = 2
        self.image_size = 16
        self.patch_size = 4
        self.num_channels = 3
        self.hidden_size = 24
        self.num_hidden_layers = 2
        self.num_attention_heads = 2
        self.num_labels = 3
        self.is_training = True
        num_patches = (self.image_size // self.patch_size) ** 2
        self.seq_length = num_patches + (1 if overrides.get("readout") == "cls" else 0)

    def get_config(self) -> P.PolarViTConfig:
        return P.PolarViTConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_channels=self.num_channels,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=2 * self.hidden_size,
            num_labels=self.num_labels,
            **self.overrides,
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[P.PolarViTConfig, dict]:
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(self.batch_size, self.num_channels, self.image_size, self.image_size, generator=generator)
        return self.get_config(), {"pixel_values": pixels}


class PolarViTCommonTests(ModelTesterMixin):  # type: ignore[misc, valid-type]
    """The mixin's tests for one variant (subclasses below set ``overrides``)."""

    overrides: dict = {}
    all_model_classes = (P.PolarViTModel, P.PolarViTForImageClassification)
    test_resize_embeddings = False  # no token embedding table: patches are projected (as transformers' ViT)
    test_torch_exportable = False  # ExportTesterMixin is not in the sdist
    test_can_init_all_missing_weights_before_2023 = True  # the mixin skips models without a copyright year
    has_attentions = True

    def setUp(self) -> None:
        self.model_tester = PolarViTModelTester(self, self.overrides)
        self.config_tester = ConfigTester(self, config_class=P.PolarViTConfig, has_text_modality=False)
        # the mixin tells a base model from a head model (training tests, labels) by transformers' own name
        # mappings; an out-of-tree model is in neither, so name it there for the test, as an in-tree one would be
        for mapping, name in (
            (MODEL_MAPPING_NAMES, "PolarViTModel"),
            (MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, "PolarViTForImageClassification"),
        ):
            patcher = mock.patch.dict(mapping, {P.PolarViTConfig.model_type: name})
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_config(self) -> None:
        self.config_tester.run_common_tests()

    @pytest.mark.slow
    def test_batching_equivalence_whatever_the_kernel_cache_holds(self) -> None:
        """The mixin's batching test with the compiled CPU kernels on: from an empty kernel cache; from one holding
        this configuration's variants of gradient-free passes (``compile_cpu_kernels()`` of other instances), for
        models that do not run them and for models that do (single images and batches through their own
        variants)."""
        with (
            tempfile.TemporaryDirectory() as cache,
            mock.patch.dict(os.environ, {"POLAR_VIT_KERNEL_CACHE": cache}),
            use_runtime_options(cpu_kernels=True),
        ):
            cpu_kernels.clear_compiled()
            self.test_batching_equivalence()  # cold
            config, _ = self.model_tester.prepare_config_and_inputs_for_common()
            assert sum(model_class(config).compile_cpu_kernels() for model_class in self.all_model_classes) > 0
            cpu_kernels.clear_compiled()  # as a new process, the cache warm
            self.test_batching_equivalence()
            with mock.patch.object(P.PolarViTPreTrainedModel, "kernels_for_inference", True):
                self.test_batching_equivalence()
                assert cpu_kernels.compiled_variants() == 0  # every variant was at hand
            cpu_kernels.clear_compiled()

    def test_model_get_set_embeddings(self) -> None:
        """As transformers' ViT test: the input embedding is the patch embedding (a Polar-FC), not a token table."""
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config)
            self.assertIs(model.get_input_embeddings(), model.get_input_embeddings())
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)
            self.assertIsNone(model.get_output_embeddings())

    @unittest.skip("hidden states are points of the Lorentz model: hidden_size + 1 ambient coordinates per token")
    def test_hidden_states_output(self) -> None:
        pass

    def test_retain_grad_hidden_states_attentions(self) -> None:
        """The mixin's test for attention probabilities (attribution methods need them in the graph).  The hidden
        states are not checked: they are an ambient read-out of the polar tokens the layers pass on, not on the
        path to the loss (the polar form is what keeps them exact), so their ``.grad`` stays ``None``."""
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_attentions = True
        model = P.PolarViTForImageClassification(config)
        outputs = model(**self._prepare_for_class(inputs_dict, P.PolarViTForImageClassification))
        attentions = outputs.attentions[0]
        attentions.retain_grad()
        outputs.logits.flatten()[0].backward(retain_graph=True)
        self.assertIsNotNone(attentions.grad)


# what a variant's parameters can change: initialisation, saving and loading, training, outputs; every other
# mixin test (device maps, attention back ends, chunking, hooks, ...) runs on the default configuration only
PARAMETER_TESTS = {
    "test_all_tensors_are_parameter_or_buffer",
    "test_attention_outputs",
    "test_base_model_prefix_loads_base_weights",
    "test_batching_equivalence",
    "test_can_init_all_missing_weights",
    "test_can_load_ignoring_mismatched_shapes",
    "test_can_use_safetensors",
    "test_correct_missing_keys",
    "test_determinism",
    "test_init_weights_can_init_buffers",
    "test_load_with_mismatched_shapes",
    "test_model_forward_default_config_values",
    "test_model_outputs_equivalence",
    "test_problem_types",
    "test_retain_grad_hidden_states_attentions",
    "test_save_load",
    "test_torch_save_load",
    "test_training",
    "test_training_gradient_checkpointing",
}


def _on_default_only(name: str) -> unittest.case._SkipDecorator:
    return unittest.skip(f"{name} does not depend on the variant's parameters: run on the default configuration")


for _name, _overrides in VARIANTS.items():
    _body: dict = {"overrides": _overrides}
    if _overrides:  # the variants: slow (`make test`); the default configuration runs in `make test-fast` too
        _body["pytestmark"] = [pytest.mark.slow]
        for _test in dir(PolarViTCommonTests):
            if _test.startswith("test_") and _test not in PARAMETER_TESTS:
                _body[_test] = _on_default_only(_test)(lambda self: None)
    _cls = type(f"TestPolarViTCommon_{_name}", (PolarViTCommonTests, unittest.TestCase), _body)
    globals()[_cls.__name__] = _cls
del _cls, _name, _overrides, _body, _test
