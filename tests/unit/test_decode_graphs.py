"""The static, padded decode inputs that CUDA graphs replay, run eagerly on the CPU.

A CUDA graph cannot be captured here; what it replays can: every decode step of up to 8
sequences goes through the static buffers padded to the next captured size (a padded row
stores nothing and attends to one cached token), and the greedy tokens must still equal
transformers' on stories260K.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from engine.cuda_graphs import DecodeGraphs
from tests.helpers import (
    STORIES_260K,
    assert_greedy_matches,
    greedy,
    hf_greedy,
    make_engine,
    run_to_completion,
)

PROMPTS = [[1, 403, 407, 261, 378], [1, 320, 201, 352], [1, 77], [1, 403, 60, 61, 62, 63, 64]]


def test_decode_steps_through_padded_static_buffers_match_transformers():
    engine = make_engine(kv_cache_gib=0.05, max_num_seqs=8)
    graphs = DecodeGraphs(engine.runner.decode_model(), max_batch=8, capture=False)
    assert graphs.sizes == [1, 2, 4, 8] and not graphs.graphs
    used: list[int] = []
    run = graphs.run
    graphs.run = lambda scheduled: used.append(len(scheduled)) or run(scheduled)
    engine.runner.decode_graphs = graphs
    params = greedy(24)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    first = [out for _ in range(3) for out in engine.step()]  # prefill; 2 decodes of 3 (pad 1)
    engine.add_request("r3", PROMPTS[3], params)  # joins mid-decode: a mixed step, eager
    tokens = run_to_completion(engine)
    for out in reversed(first):
        tokens[out.request_id] = out.new_token_ids + tokens[out.request_id]
    assert 3 in used and 4 in used, f"decode batches through the static buffers: {used}"
    hf_model = AutoModelForCausalLM.from_pretrained(STORIES_260K).eval()
    for i, prompt in enumerate(PROMPTS):
        assert_greedy_matches(tokens[f"r{i}"], hf_greedy(hf_model, prompt, 24), f"prompt {i}")


def test_steps_that_do_not_fit_run_eagerly():
    engine = make_engine(kv_cache_gib=0.05, max_num_seqs=8)
    graphs = DecodeGraphs(engine.runner.decode_model(), max_batch=2, capture=False)
    engine.runner.decode_graphs = graphs
    params = greedy(4)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    out = engine.scheduler.schedule()
    assert not graphs.fits(out.scheduled), "a prefill step is not a decode step"
    engine._update(out, engine.runner.execute(out))
    decode = engine.scheduler.schedule()
    assert len(decode.scheduled) == 4 and not graphs.fits(decode.scheduled), "4 > 2 captured"
