import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import seeds
from tritonllm.outputs import CompletionOutput, Logprob, RequestOutput, logprobs_dict
from tritonllm.runtime.sampler import compute_prompt_logprobs


@given(seed=seeds(), k=st.sampled_from([0, 1, 3]))
def test_prompt_logprobs_in_vllm_shape(seed, k):
    prompt = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(seed))
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(seed + 1))
    lp = compute_prompt_logprobs(logits, prompt[1:], k)
    entries = [None] + [
        logprobs_dict(lp.token_ids[i].tolist(), lp.logprobs[i].tolist(), int(lp.ranks[i]), decode=str) for i in range(5)
    ]
    raw = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(entries[1:]):
        actual = int(prompt[i + 1])
        assert actual in entry and k <= len(entry) <= k + 1
        assert entry[actual].decoded_token == str(actual)
        assert abs(entry[actual].logprob - float(raw[i, actual])) < 1e-5
        assert entry[actual].rank == 1 + int((raw[i] > raw[i, actual]).sum())
        top = raw[i].topk(k).indices.tolist()
        assert [entry[t].rank for t in top] == list(range(1, k + 1))
    out = RequestOutput("r0", "text", prompt.tolist(), entries, [CompletionOutput(0, "", [], None, None)])
    assert out.prompt_logprobs[0] is None and not out.finished and not out.outputs[0].finished()
    assert Logprob(-1.0) == Logprob(logprob=-1.0, rank=None, decoded_token=None)
