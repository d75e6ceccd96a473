"""Many streaming clients at once: the engine batches them, and each gets exactly its own answer."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

from tests.entrypoints.serving_utils import SERVED_NAME, wait_for_idle_pool
from tritonllm import SamplingParams

NUM_CLIENTS = 32
CLIENT_TIMEOUT_S = 240
SEED = 0


def test_concurrent_streaming_clients_each_get_their_own_tokens(server, client, reference_llm):
    rng = random.Random(SEED)
    # Distinct prompts of mixed lengths (one crosses a KV block) and output lengths, so requests join and leave
    # the batch at different steps. Short, since the interpreter pays for every sequence of every step.
    firsts = rng.sample(range(6, 420), NUM_CLIENTS)  # no two prompts alike
    lengths = [17] + [rng.choice([1, 3, 5]) for _ in range(NUM_CLIENTS - 1)]
    prompts = [
        [first] + [rng.randrange(6, 420) for _ in range(n - 1)] for first, n in zip(firsts, lengths, strict=True)
    ]
    max_tokens = [rng.randint(2, 3) for _ in range(NUM_CLIENTS)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]

    start = threading.Barrier(NUM_CLIENTS, timeout=60)

    def one_client(i: int) -> tuple[str, int, str | None]:
        start.wait()  # all requests in flight together
        stream = client.with_options(timeout=CLIENT_TIMEOUT_S).completions.create(
            model=SERVED_NAME,
            prompt=prompts[i],
            max_tokens=max_tokens[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", 0, None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(one_client, i) for i in range(NUM_CLIENTS)]
        # Expected answers are computed here while the server works (two processes, two cores).
        want = reference_llm.generate(prompts, params, use_tqdm=False)
        # Batch invariance spot check: a request alone gives what it gives inside the batch.
        alone = reference_llm.generate([prompts[0]], params[0], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == want[0].outputs[0].token_ids
        results = [f.result(timeout=CLIENT_TIMEOUT_S) for f in futures]

    for i, (text, usage, finish) in enumerate(results):
        assert text == want[i].outputs[0].text, f"client {i}"
        assert usage == max_tokens[i] == len(want[i].outputs[0].token_ids), f"client {i}"
        assert finish == "length", f"client {i}"
    m = wait_for_idle_pool(server.url)
    assert m["tritonllm:kv_cache_free_blocks"] == m["tritonllm:kv_cache_total_blocks"]
