"""The executor's `lpm` policy on stories260K: the waiting request with the longest cached
prefix is admitted first, aging bounds how long a prompt nobody shares waits, and the order
never changes a request's greedy tokens."""

from __future__ import annotations

from engine.engine import Engine
from tests import helpers
from tests.helpers import greedy, run_to_completion

BLOCK_SIZE = 4
SHARED = [1, *range(300, 332)]  # a 33-token prefix: 8 full blocks once cached
LONELY = [1, *range(100, 133)]  # as long, shares no block with it


def make_engine(**overrides) -> Engine:
    return helpers.make_engine(**({"num_gpu_blocks": 128, "block_size": BLOCK_SIZE} | overrides))


def warm_engine(**overrides) -> Engine:
    """An engine whose prefix cache holds SHARED."""
    engine = make_engine(**({"max_num_seqs": 1} | overrides))
    engine.add_request("warm", SHARED, greedy(1))
    run_to_completion(engine)
    return engine


def admission_order(engine: Engine, num_steps: int) -> tuple[list[str], int | None]:
    """Adds LONELY, then one SHARED-prefixed request every step for `num_steps` steps.

    Returns: the ids in the order their first token came, and the step LONELY's came in.
    """
    engine.add_request("lonely", LONELY, greedy(2))
    order: list[str] = []
    lonely_step = None
    for step in range(num_steps):
        engine.add_request(f"shared-{step}", [*SHARED, 400 + step, 401], greedy(2))
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
            if out.request_id == "lonely" and lonely_step is None:
                lonely_step = step
    return order, lonely_step


def test_lpm_admits_the_longest_cached_prefix_first():
    order, _ = admission_order(warm_engine(policy="lpm", lpm_aging_steps=1000), 3)
    assert order[0] == "shared-0", f"lpm must start a cached-prefix request first, got {order}"
    order, _ = admission_order(warm_engine(policy="fcfs"), 3)
    assert order[0] == "lonely", f"fcfs must start the first arrival first, got {order}"


def test_aging_bounds_the_wait_of_a_prompt_nobody_shares():
    aging_steps = 4
    # once aged it goes first; the one request running then (max_num_seqs 1) needs at most
    # 3 more steps (a cached-prefix prefill and two decodes), its own prefill is one step
    bound = aging_steps + 4
    order, lonely_step = admission_order(
        warm_engine(policy="lpm", lpm_aging_steps=aging_steps), bound + 1
    )
    assert lonely_step is not None and lonely_step <= bound, (
        f"expected the unshared request's first token by step {bound}, got {lonely_step}"
    )
    assert order.index("lonely") >= 2, f"younger cached-prefix requests went first: {order}"
    _, starved_step = admission_order(warm_engine(policy="lpm", lpm_aging_steps=10**6), bound + 1)
    assert starved_step is None, "without aging the stream of cached-prefix requests starves it"


def test_lpm_and_fcfs_give_the_same_greedy_tokens():
    prompts = {
        "a": LONELY,
        "b": [*SHARED, 7, 8],
        "c": [*SHARED, 9],
        "d": [*LONELY[:20], 5],
        "e": [*SHARED[:17], 11, 12, 13],
    }
    results = []
    for policy in ("fcfs", "lpm"):
        engine = warm_engine(policy=policy, max_num_seqs=2)
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, greedy(12))
        results.append(run_to_completion(engine))
    assert results[0] == results[1]
