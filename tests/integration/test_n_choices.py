"""n and best_of through a real stack (redis, scheduler, executor, gateway processes): the
official `openai` package on the HTTP front and the generated stubs on kvgate.v1. A request's
choices run as one sequence group on one executor (tests/unit/test_engine_groups.py holds the
engine's side: block sharing, copy on write, preemption)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from client.api import KvgateClient, choice_texts, sampling_params
from deploy.stack import Stack, free_port
from protos.kvgate.v1 import inference_pb2 as pb
from tests.helpers import wait_for
from tests.integration.conftest import log_lines

MODEL_ID = "stories260K"
PROMPT = "Once upon a time"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
MAX_NUM_SEQS = ["--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def stack(stack_factory) -> Stack:
    # a batch of 8 sequences: a request of more choices is refused by the gateway
    return stack_factory(num_executors=1, http_port=free_port(), executor_flags=MAX_NUM_SEQS)


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0) as sdk:
        yield sdk


def _completion(client: openai.OpenAI, **fields):
    fields = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 12, **fields}
    return client.completions.create(**fields)


def test_greedy_n4_equals_four_separate_greedy_requests(client: openai.OpenAI):
    grouped = _completion(client, n=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [_completion(client, temperature=0, extra_body={"ignore_eos": True}) for _ in range(4)]
    assert [c.index for c in grouped.choices] == [0, 1, 2, 3], grouped
    for choice, single in zip(grouped.choices, alone, strict=True):
        assert choice.text == single.choices[0].text, (choice, single)
    assert grouped.usage.prompt_tokens == alone[0].usage.prompt_tokens, "the prompt counts once"
    assert grouped.usage.completion_tokens == 4 * 12, grouped.usage


def test_streamed_chat_choices_carry_their_index(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=STORY, max_tokens=10, temperature=0, n=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", "", ""]
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    whole = client.chat.completions.create(
        model=MODEL_ID, messages=STORY, max_tokens=10, temperature=0
    )
    assert finished == {0, 1, 2}, finished
    assert texts == [whole.choices[0].message.content] * 3, texts
    assert usage.prompt_tokens == whole.usage.prompt_tokens, usage


def test_seeded_choices_are_reproducible(client: openai.OpenAI):
    fields = dict(n=3, temperature=1.0, seed=4242)
    first = [c.text for c in _completion(client, **fields).choices]
    second = [c.text for c in _completion(client, **fields).choices]
    assert first == second, "a seeded request must give the same choices again"
    assert len(set(first)) > 1, f"the choices should be streams of their own: {first}"


def test_best_of_returns_the_choice_of_highest_cumulative_logprob(client: openai.OpenAI):
    winners = []
    for seed in (99, 100, 101):
        fields = dict(temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        every = _completion(client, n=3, logprobs=0, **fields)
        sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
        winners.append(sums.index(max(sums)))
        best = _completion(client, n=1, best_of=3, **fields)
        assert len(best.choices) == 1 and best.choices[0].index == 0, best
        assert best.choices[0].text == every.choices[winners[-1]].text, (best, sums)
        assert best.choices[0].logprobs is None, "logprobs were not asked for"
        assert best.usage.completion_tokens == 3 * 12, "every sequence run is counted"
        assert best.usage.prompt_tokens == every.usage.prompt_tokens, (best.usage, every.usage)
    assert any(winners), f"no seed chose a choice other than the first: {winners}"


def test_kvgate_v1_generate_streams_each_choice_with_its_index(stack: Stack):
    params = sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
    params.n = 2
    with KvgateClient(stack.address, timeout_s=60.0, retry=False) as kvgate:
        request = pb.GenerateRequest(prompt=PROMPT, params=params)
        chunks = list(kvgate.stub.Generate(request, metadata=kvgate.metadata, timeout=60.0))
    tokens = {0: [], 1: []}
    for chunk in chunks:
        tokens[chunk.index].extend(chunk.token_ids)
    last = [c for c in chunks if c.finish_reason]
    assert sorted(c.index for c in last) == [0, 1], last
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8, tokens
    assert [c.usage.prompt_tokens > 0 for c in sorted(last, key=lambda c: c.index)] == [
        True,
        False,
    ], "the prompt counts on choice 0 only"


def test_the_clients_choice_texts_gather_each_choice(stack: Stack):
    params = sampling_params(max_tokens=10, temperature=0.0, ignore_eos=True, n=3)
    with KvgateClient(stack.address, timeout_s=60.0, retry=False) as kvgate:
        texts = ["", "", ""]
        for index, text in choice_texts(kvgate.generate_stream(PROMPT, params)):
            texts[index] += text
        alone = kvgate.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert texts == [alone.text] * 3, (texts, alone.text)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
    ],
)
def test_bad_n_and_best_of_are_refused_naming_the_field(client: openai.OpenAI, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        _completion(client, **fields)
    assert raised.value.param == param, raised.value.body
    assert raised.value.body["message"].startswith(param), raised.value.body
    assert _completion(client, temperature=0).choices[0].text, "the stack keeps serving"


def test_chat_turns_refuse_several_choices_naming_n(stack: Stack):
    params = sampling_params(max_tokens=4)
    params.n = 2
    with KvgateClient(stack.address, timeout_s=60.0, retry=False) as kvgate:
        turn = pb.ChatRequest(turn=pb.ChatTurn(content="hi", params=params))
        with pytest.raises(grpc.RpcError) as raised:
            list(kvgate.stub.Chat(iter([turn]), metadata=kvgate.metadata, timeout=60.0))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    assert raised.value.details().startswith("turn.params.n"), raised.value.details()


def test_more_choices_than_an_executor_batch_are_refused_naming_n_before_queueing(stack: Stack):
    params = sampling_params(max_tokens=4, temperature=0.0)
    params.n = 16
    with KvgateClient(stack.address, timeout_s=60.0, retry=False) as kvgate:
        request = pb.GenerateRequest(prompt=PROMPT, params=params)
        with pytest.raises(grpc.RpcError) as raised:
            list(kvgate.stub.Generate(request, metadata=kvgate.metadata, timeout=60.0))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert raised.value.details().startswith("params.n: 16 sequences"), raised.value.details()
        assert "at most 8 at once" in raised.value.details(), raised.value.details()
        params.n = 8
        request = pb.GenerateRequest(prompt=PROMPT, params=params)
        chunks = list(kvgate.stub.Generate(request, metadata=kvgate.metadata, timeout=60.0))
    finished = [c for c in chunks if c.finish_reason == pb.FINISH_REASON_LENGTH]
    assert len(finished) == 8, chunks
    assert stack.procs["executor-0"].poll() is None, "the executor died"


@pytest.mark.parametrize(("fields", "param"), [({"n": 9}, "n"), ({"best_of": 9}, "best_of")])
def test_openai_choices_past_max_num_seqs_are_a_400_naming_the_field(
    client: openai.OpenAI, fields, param
):
    with pytest.raises(openai.BadRequestError) as raised:
        _completion(client, **fields)
    assert raised.value.param == param, raised.value.body
    assert raised.value.body["message"].startswith(f"{param}: 9 sequences"), raised.value.body


def test_vllm_choices_past_max_num_seqs_are_invalid_argument_naming_the_field(stack: Stack):
    request = vllm_engine_pb2.GenerateRequest(
        text=PROMPT, sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=4, n=9)
    )
    with grpc.insecure_channel(stack.address) as channel:
        engine = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(engine.Generate(request, timeout=60.0))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    details = raised.value.details()
    assert details.startswith("sampling_params.n: 9 sequences"), details


def test_a_list_of_prompts_numbers_choices_prompt_by_prompt(client: openai.OpenAI):
    prompts = [PROMPT, "The little dog"]
    answer = _completion(client, prompt=prompts, n=2, temperature=0)
    singles = [_completion(client, prompt=p, temperature=0).choices[0].text for p in prompts]
    by_index = {c.index: c.text for c in answer.choices}
    assert by_index == {0: singles[0], 1: singles[0], 2: singles[1], 3: singles[1]}, by_index


def test_choices_go_to_an_executor_that_runs_them_all_at_once(stack: Stack):
    """A second executor runs 2 sequences at once: requests of 4 choices are placed on the
    one that runs 8 (it is busier, so by load alone some would go to the small one, which
    would refuse them), while requests of one sequence still go to both."""
    stack.start_executor("executor-1", extra_flags=["--max-num-seqs", "2"])
    try:
        with KvgateClient(stack.address, timeout_s=60.0, retry=False) as kvgate:

            def one_sequence_ran_on_executor_1() -> list[str]:
                kvgate.generate(PROMPT, max_tokens=2, temperature=0.0)
                return log_lines(stack, "executor-1", "request admitted")

            wait_for(one_sequence_ran_on_executor_1, "executor-1 to take a one-sequence request")
            params = sampling_params(max_tokens=24, temperature=0.0, ignore_eos=True, n=4)
            with ThreadPoolExecutor(6) as pool:
                streams = [kvgate.generate_stream(PROMPT, params) for _ in range(6)]
                results = [c.result(timeout=60.0) for c in [pool.submit(list, s) for s in streams]]
        for chunks in results:
            last = [c for c in chunks if c.finish_reason]
            assert sorted(c.index for c in last) == [0, 1, 2, 3], chunks[-1]
            assert all(c.finish_reason == pb.FINISH_REASON_LENGTH for c in last), last
        assert not log_lines(stack, "executor-1", "must be <= max_num_seqs")
    finally:
        stack.stop("executor-1")
