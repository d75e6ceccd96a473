"""Registering architectures from user code, lazily importing built-ins, and carrying both into spawned workers."""

import multiprocessing as mp

import pytest

import tritonllm
from tests.models.registry_worker import report_registrations
from tritonllm.models import registry
from tritonllm.models.llama import LlamaForCausalLM
from tritonllm.models.registry import (
    get_model_class,
    model_class_for,
    register_model,
    registered_models,
    restore_registrations,
    supported_architectures,
)

BUILTINS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


class ToyForCausalLM(LlamaForCausalLM):
    """A user architecture defined outside the package (registered inside the tests, not at import)."""


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    # Each test edits a copy; other test modules keep seeing only the built-ins.
    monkeypatch.setattr(registry, "_paths", dict(registry._paths))
    monkeypatch.setattr(registry, "_classes", dict(registry._classes))


def test_builtins_are_listed():
    assert set(BUILTINS) <= set(supported_architectures())
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"


def test_decorator_and_call_forms():
    returned = register_model("ToyForCausalLM")(ToyForCausalLM)
    assert returned is ToyForCausalLM
    assert get_model_class("ToyForCausalLM") is ToyForCausalLM
    assert registered_models()["ToyForCausalLM"] == "tests.models.test_registry:ToyForCausalLM"

    @register_model("LocalForCausalLM")
    class Local(LlamaForCausalLM):
        pass

    assert get_model_class("LocalForCausalLM") is Local
    assert register_model("Toy2ForCausalLM", ToyForCausalLM) is ToyForCausalLM
    assert "Toy2ForCausalLM" in supported_architectures()


def test_top_level_export():
    assert tritonllm.register_model is register_model


def test_string_registration_is_lazy_and_validated():
    register_model("LazyForCausalLM", "tests.models.test_registry:ToyForCausalLM")
    assert registry._classes.get("LazyForCausalLM") is None
    assert get_model_class("LazyForCausalLM") is ToyForCausalLM
    with pytest.raises(ValueError, match="module:ClassName"):
        register_model("BadForCausalLM", "tests.models.test_registry.ToyForCausalLM")
    register_model("GoneForCausalLM", "tests.models.test_registry:NoSuchClass")
    with pytest.raises(ImportError, match="NoSuchClass"):
        get_model_class("GoneForCausalLM")


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="not supported") as e:
        get_model_class("GPTNeoXForCausalLM")
    for arch in BUILTINS:
        assert arch in str(e.value)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        model_class_for(["BertModel", "T5Model"])
    assert model_class_for(["BertModel", "MistralForCausalLM"])[0] == "MistralForCausalLM"


def test_restore_into_a_fresh_registry(monkeypatch):
    register_model("ToyForCausalLM", ToyForCausalLM)
    snapshot = registered_models()
    monkeypatch.setattr(registry, "_paths", dict(registry._BUILTIN))
    monkeypatch.setattr(registry, "_classes", {})
    assert "ToyForCausalLM" not in supported_architectures()
    restore_registrations(snapshot)
    assert get_model_class("ToyForCausalLM") is ToyForCausalLM


def test_spawned_worker_sees_user_registrations():
    register_model("ToyForCausalLM")(ToyForCausalLM)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=report_registrations, args=(registered_models(), queue))
    proc.start()
    result = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    before, llama_imported_early, path = result
    assert not before
    assert not llama_imported_early  # built-ins stay unimported until used
    assert path == "tests.models.test_registry:ToyForCausalLM"
