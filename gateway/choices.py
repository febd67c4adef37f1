"""A request of several sequences (SamplingParams.n, best_of) on the gateway.

One QueuedRequest carries them all, so one executor runs them as a sequence group sharing the
prompt's KV blocks. Each choice is a Generation of its own under its own id
(common.choices.choice_request_id): its tokens are de-duplicated, detokenized, stopped and
aborted alone, and if its executor is lost it is re-queued alone (n = 1, its choice_index,
its own tokens). With best_of > n every sequence runs to its end, and the n with the highest
cumulative logprob are sent, best first, re-indexed from 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TypeVar

from common.sampling_pb import sampling_params_to_pb
from gateway.generation import Chunk, Generation, GenerationDeps, Usage, internal_request_id
from gateway.quotas import Admission
from gateway.validation import GenerationSpec
from protos.kvgate.v1 import internal_pb2

T = TypeVar("T")
_ENDED = object()  # a stream's last item in interleaved's queue


class ChoiceGroup:
    """Streams the choices of one validated request of several sequences."""

    def __init__(
        self,
        spec: GenerationSpec,
        deps: GenerationDeps,
        tenant: str,
        session_executor_id: str = "",
        admission: Admission | None = None,
    ) -> None:
        sampling = spec.sampling
        self.returns_logprobs = sampling.logprobs is not None
        if sampling.num_sequences > sampling.n and not self.returns_logprobs:
            # ranking needs each sampled token's logprob
            spec = dataclasses.replace(spec, sampling=dataclasses.replace(sampling, logprobs=0))
        self.spec = spec
        self.request_id = internal_request_id(tenant, spec.request_id)
        self.params = sampling_params_to_pb(spec.sampling)
        # Each choice samples one sequence; their parameters are built once, for all of them.
        choice_params = sampling_params_to_pb(dataclasses.replace(spec.sampling, n=1, best_of=None))
        self.choices = [
            # quotas are taken once, as the group is queued (by choice 0)
            Generation(spec, deps, tenant, session_executor_id, admission if i == 0 else None,
                       (self.request_id, i), choice_params)
            for i in range(spec.sampling.num_sequences)
        ]  # fmt: skip

    def queued_request(self) -> internal_pb2.QueuedRequest:
        """The one QueuedRequest of all the choices' first attempt."""
        queued = self.choices[0].queued_request()
        queued.request_id = self.request_id
        queued.params.CopyFrom(self.params)
        queued.choice_index = 0
        return queued

    async def stream(self) -> AsyncIterator[Chunk]:
        """Queue the request and yield every choice's chunks (chunk.index) as they come, or
        with best_of > n the chosen ones once all have finished.

        Raises:
            as Generation.stream.
        """
        inboxes = []
        try:
            for choice in self.choices:
                inboxes.append(choice.track())
            await self.choices[0].enqueue(self.queued_request())
        except BaseException:
            for choice in self.choices[: len(inboxes)]:
                self.choices[0].deps.router.untrack(choice.request_id)
            raise
        runs = [c.run(inbox, None) for c, inbox in zip(self.choices, inboxes, strict=True)]
        chunks = (chunk async for _, chunk in interleaved(runs))
        if self.spec.sampling.num_sequences > self.spec.sampling.n:
            chunks = self._best(chunks)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _best(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """The n choices of the highest cumulative logprob, best first, once all ended; the
        tokens of the others count in the usage of the first."""
        by_choice: dict[int, list[Chunk]] = {c.index: [] for c in self.choices}
        async for chunk in chunks:
            by_choice[chunk.index].append(chunk)
        ranked = sorted(by_choice, key=lambda i: -_cumulative_logprob(by_choice[i]))
        chosen, dropped = ranked[: self.spec.sampling.n], ranked[self.spec.sampling.n :]
        dropped_tokens = sum(len(c.token_ids) for i in dropped for c in by_choice[i])
        # Choice 0 carries the prompt's counts; they move to whichever choice is now first.
        prompt = next((c.usage for c in by_choice[0] if c.usage is not None), None)
        for new_index, old_index in enumerate(chosen):
            for chunk in by_choice[old_index]:
                chunk.index = new_index
                if not self.returns_logprobs:
                    chunk.logprobs = []
                if chunk.usage is not None:
                    chunk.usage = _moved_usage(chunk.usage, new_index, prompt, dropped_tokens)
                yield chunk


def _moved_usage(usage: Usage, new_index: int, prompt: Usage | None, dropped: int) -> Usage:
    """The usage of a chosen choice now at `new_index`: the first holds the prompt's counts
    and the tokens of the choices dropped; the others only their own completion."""
    if new_index != 0:
        return dataclasses.replace(usage, prompt_tokens=0, cached_prompt_tokens=0)
    return dataclasses.replace(
        usage,
        prompt_tokens=prompt.prompt_tokens if prompt else usage.prompt_tokens,
        cached_prompt_tokens=prompt.cached_prompt_tokens if prompt else usage.cached_prompt_tokens,
        completion_tokens=usage.completion_tokens + dropped,
    )


def _cumulative_logprob(chunks: list[Chunk]) -> float:
    return sum(lp.logprob for chunk in chunks for lp in chunk.logprobs)


async def interleaved(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(the stream's position in `streams`, an item) of every stream as items come; an error
    of one stream ends them all (raised here)."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as error:  # noqa: BLE001 (re-raised by the consumer)
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, _ENDED))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(tasks):
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _ENDED:
                ended += 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
