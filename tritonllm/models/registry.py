"""Architecture name (config.json `architectures`) -> model class.

The registry maps names to import paths ("package.module:Class"), not to class objects, so that it can be copied
into worker processes started with multiprocessing spawn: a worker calls `restore_registrations(snapshot)` with
the parent's `registered_models()` and imports each class on first use. Built-in models are listed the same way,
so importing the registry imports no model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "tritonllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tritonllm.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "tritonllm.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "tritonllm.models.qwen3:Qwen3ForCausalLM",
}

_paths: dict[str, str] = dict(_BUILTIN)
_classes: dict[str, type] = {}  # resolved (or directly registered) classes, a cache over _paths


def register_model(arch: str, model_cls: type | str | None = None) -> Callable[[T], T] | type | None:
    """Register `model_cls` for the architecture name `arch`.

    As a decorator: `@register_model("MyForCausalLM")` above the class. As a call:
    `register_model("MyForCausalLM", MyForCausalLM)` or `register_model("MyForCausalLM", "my_pkg.my_model:MyModel")`
    (nothing is imported until the architecture is used). A class must live at module level in an importable
    module (or the `__main__` script) for worker processes to find it again. Re-registering a name replaces it.
    """
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"register_model needs an architecture name string, got {arch!r}")
    if model_cls is None:

        def decorator(cls: T) -> T:
            register_model(arch, cls)
            return cls

        return decorator
    if isinstance(model_cls, str):
        _check_path(model_cls)
        _paths[arch] = model_cls
        _classes.pop(arch, None)
        return None
    if not isinstance(model_cls, type):
        raise ValueError(f"register_model({arch!r}, ...) needs a class or a 'module:Class' string, got {model_cls!r}")
    _paths[arch] = f"{model_cls.__module__}:{model_cls.__qualname__}"
    _classes[arch] = model_cls
    return model_cls


def supported_architectures() -> list[str]:
    return sorted(_paths)


def registered_models() -> dict[str, str]:
    """A picklable snapshot of the registry (arch -> "module:Class"), for `restore_registrations` in a worker."""
    return dict(_paths)


def restore_registrations(snapshot: dict[str, str]) -> None:
    """Make this process's registry match a parent's `registered_models()` (entries it lacks are added)."""
    for arch, path in snapshot.items():
        if _paths.get(arch) != path:
            register_model(arch, path)


def get_model_class(arch: str) -> type:
    cls = _classes.get(arch)
    if cls is not None:
        return cls
    path = _paths.get(arch)
    if path is None:
        raise ValueError(
            f"model architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}. "
            "Add one with tritonllm.register_model(name, cls) (see docs/adding_a_model.md)"
        )
    cls = _import(arch, path)
    _classes[arch] = cls
    return cls


def model_class_for(architectures: list[str]) -> tuple[str, type]:
    """The first of a config's `architectures` that is registered, with its class."""
    for arch in architectures:
        if arch in _paths:
            return arch, get_model_class(arch)
    raise ValueError(
        f"none of the config's architectures {architectures} is supported; supported: "
        f"{', '.join(supported_architectures())}. Add one with tritonllm.register_model(name, cls)"
    )


def _check_path(path: str) -> None:
    module, sep, qualname = path.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"model import path {path!r} must look like 'package.module:ClassName'")


def _import(arch: str, path: str) -> type:
    module_name, _, qualname = path.partition(":")
    hint = (
        "a class registered with register_model must be defined at module level of an importable module "
        "so every process can import it"
    )
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import {module_name!r} for architecture {arch!r} ({path}): {e}; {hint}") from e
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise ImportError(f"{module_name!r} has no {qualname!r} for architecture {arch!r}; {hint}") from e
    if not isinstance(obj, type):
        raise ImportError(f"{path} for architecture {arch!r} is not a class")
    return obj
