"""Non-finite logits (an fp16 model that overflowed) never stop the engine: NaN counts as -inf, so every request
still gets in-range tokens; and an out-of-range id from the sampler is refused before the model can gather it."""

import pytest
import torch

from tests.runtime.tiny_engine import VOCAB, fresh_thread, greedy, make_engine, random_prompt, run_to_completion
from tritonllm.runtime.sampler import SamplerOutput
from tritonllm.sampling_params import SamplingParams

PARAMS = {
    "greedy": greedy(3, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=7, max_tokens=3, ignore_eos=True),
    "filtered": SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, max_tokens=3, ignore_eos=True),
}


@fresh_thread
def test_nan_logits_give_token_zero_and_a_finished_run():
    engine = make_engine()
    with torch.no_grad():
        engine.runner.model.lm_head.weight.fill_(float("nan"))  # every logit NaN, like an overflowed fp16 model
    for i, (name, params) in enumerate(PARAMS.items()):
        engine.add_request(name, random_prompt(i, 5 + i), params)
    outs = run_to_completion(engine)
    # A row with nothing above -inf gives token 0 (decode steps then gather a valid embedding row).
    assert {name: o.outputs[0].token_ids for name, o in outs.items()} == {name: [0, 0, 0] for name in PARAMS}


@fresh_thread
def test_out_of_range_sampled_ids_are_refused():
    engine = make_engine()
    sampler = engine.sampler

    def broken(logits, meta):
        out = sampler(logits, meta)
        return SamplerOutput(sampled_token_ids=torch.full_like(out.sampled_token_ids, VOCAB), logprobs=None)

    engine.sampler = broken
    engine.add_request("r", random_prompt(3, 6), greedy(3))
    with pytest.raises(RuntimeError, match=rf"token ids \[{VOCAB}\] outside the vocabulary \[0, {VOCAB}\)"):
        engine.step()
    seq = engine.scheduler._groups["r"].seqs[0]
    assert seq.output_token_ids == []
