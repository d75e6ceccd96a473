import openai
import pytest

from tests.entrypoints.serving_utils import API_KEY, ENGINE_KWARGS, ServerProcess, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def reference_llm(tiny_model_dir):
    """The offline engine on the same checkpoint and options as the server: the source of expected answers."""
    from tritonllm import LLM

    return LLM(str(tiny_model_dir), **ENGINE_KWARGS)


@pytest.fixture(scope="session")
def server(tiny_model_dir, request):
    """One real server process (with an API key) for the whole session."""
    proc = ServerProcess(tiny_model_dir, ["--api-key", API_KEY])
    try:
        request.getfixturevalue("reference_llm")  # built while the server starts
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
