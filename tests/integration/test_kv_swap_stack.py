"""Sessions taking turns through the whole stack on an executor whose device KV holds half of
them: with a host tier their KV moves there and back, against the same stack without one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from client.api import KvgateClient
from tests.integration.conftest import scrape

NUM_SESSIONS = 4
# 24 blocks of 4 tokens: two sessions' turns (about 9 blocks each) fit, not four.
TIGHT_FLAGS = ["--num-gpu-blocks", "24", "--block-size", "4"]
SUBJECTS = ("a cat", "a red ball", "the sea", "a big tree")  # one per session: no shared history


def take_turns(address: str) -> list[list[tuple[list[int], int, int]]]:
    """Every session's turn 1, then every session's turn 2.

    Returns:
        Per turn, per session: (reply tokens, prompt tokens, cached prompt tokens).
    """
    results: list[list[tuple[list[int], int, int]]] = []
    with KvgateClient(address, timeout_s=60) as client:
        chats = [client.chat() for _ in range(NUM_SESSIONS)]
        for turn_text in ("Tell me a story about {}.", "What did {} do next?"):
            turn = []
            for chat, subject in zip(chats, SUBJECTS, strict=True):
                content = turn_text.format(subject)
                reply = chat.ask(content, max_tokens=12, temperature=0.0, ignore_eos=True)
                usage = reply.usage
                turn.append((reply.token_ids, usage.prompt_tokens, usage.cached_prompt_tokens))
            results.append(turn)
        for chat in chats:
            chat.close()
    return results


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in the executor's metrics")


def test_sessions_taking_turns_swap_to_the_host_tier_and_back(stack_factory):
    offload = stack_factory(executor_flags=[*TIGHT_FLAGS, "--swap-space-gib", "0.01"])
    plain = stack_factory(executor_flags=TIGHT_FLAGS)
    got = take_turns(offload.address)
    want = take_turns(plain.address)
    for turn, (got_turn, want_turn) in enumerate(zip(got, want, strict=True), start=1):
        got_tokens = [tokens for tokens, _, _ in got_turn]
        assert got_tokens == [tokens for tokens, _, _ in want_turn], f"turn {turn} differs"
    turn1, turn2 = got
    for (_, prompt1, _), (_, _, cached2) in zip(turn1, turn2, strict=True):
        # the whole of turn 1 (but its reply's last token) came back from one tier or the other
        assert cached2 >= prompt1 + 11, f"turn 2 prefilled its history again: {got}"
    cached_plain = sum(cached for _, _, cached in want[1])
    assert sum(cached for _, _, cached in turn2) > cached_plain
    text = scrape(offload, "executor-0")
    assert metric(text, "kvgate_executor_offloaded_sessions_total") >= NUM_SESSIONS - 2
    assert metric(text, "kvgate_executor_swapped_in_blocks_total") > 0
    assert metric(text, "kvgate_executor_host_kv_blocks") > 0
    assert metric(scrape(plain, "executor-0"), "kvgate_executor_host_kv_blocks") == 0
