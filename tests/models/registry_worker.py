"""Code for a spawned worker in the registry tests; imports only the registry so laziness can be observed."""

import sys


def report_registrations(snapshot: dict[str, str], queue) -> None:
    from tritonllm.models import registry

    before = "ToyForCausalLM" in registry.supported_architectures()
    llama_imported_early = "tritonllm.models.llama" in sys.modules
    registry.restore_registrations(snapshot)
    cls = registry.get_model_class("ToyForCausalLM")
    queue.put((before, llama_imported_early, f"{cls.__module__}:{cls.__qualname__}"))
