"""What a choice repeats of its prompt on the OpenAI front: completions' `echo` (the prompt's
text, and its tokens' logprobs with `logprobs`, before the completion's) and vLLM's
`prompt_logprobs` (each prompt token's logprob and alternatives, in vLLM's shape).

Every choice's first chunk carries its prompt's logprobs (SamplingParams.prompt_logprobs);
the first prompt token has none (no context), so it is reported as null, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.finish_reason import FinishReason
from gateway.generation import Chunk


@dataclass(frozen=True, slots=True)
class NoLogprob:
    """The first prompt token in echoed logprobs: its text, and a null logprob."""

    token_id: int
    logprob: None = None
    top: None = None


@dataclass(slots=True)
class PromptEcho:
    """Rewrites each choice's chunks for `echo`; a no-op without it."""

    echo: bool = False
    only: bool = False  # max_tokens 0: the prompt alone, the one token run is left out
    n: int = 1  # choices per prompt: choice i echoes prompt i // n
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> its text
    first_ids: dict[int, int] = field(default_factory=dict)  # prompt index -> its first token
    started: set[int] = field(default_factory=set)  # choices whose first chunk went out

    def record(self, prompt_index: int, text: str, token_ids: list[int]) -> None:
        """A prompt as encoded: the text it echoes and its first token."""
        self.texts[prompt_index] = text
        self.first_ids[prompt_index] = token_ids[0]

    def rewrite(self, index: int, chunk: Chunk) -> Chunk:
        """Choice `index`'s chunk as the client sees it."""
        if not self.echo:
            return chunk
        if self.only:
            chunk = _without_output(chunk)
        if index in self.started:
            return chunk
        self.started.add(index)
        prompt = index // self.n
        head = [NoLogprob(self.first_ids[prompt]), *(chunk.prompt_logprobs or [])]
        return dataclasses.replace(
            chunk,
            text=self.texts[prompt] + chunk.text,
            logprobs=head + chunk.logprobs if chunk.prompt_logprobs is not None else chunk.logprobs,
        )


def _without_output(chunk: Chunk) -> Chunk:
    """The chunk with the generated tokens left out (echo with max_tokens 0)."""
    reason = chunk.finish_reason
    if reason is not None and reason != FinishReason.ERROR:
        reason = FinishReason.LENGTH
    usage = chunk.usage and dataclasses.replace(chunk.usage, completion_tokens=0)
    return dataclasses.replace(
        chunk, text="", token_ids=[], logprobs=[], finish_reason=reason, usage=usage
    )


def vllm_prompt_logprobs(entries: list, token_text) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first token, then for each later one a map from
    token id to {logprob, rank, decoded_token} holding it and its alternatives (rank: the
    place among the alternatives, 1 the most likely; null for the prompt token when it is
    not among them)."""
    answer: list[dict | None] = [None]
    for lp in entries:
        found = {
            str(top.token_id): {
                "logprob": top.logprob,
                "rank": rank,
                "decoded_token": token_text.of(top.token_id),
            }
            for rank, top in enumerate(lp.top, start=1)
        }
        found.setdefault(
            str(lp.token_id),
            {"logprob": lp.logprob, "rank": None, "decoded_token": token_text.of(lp.token_id)},
        )
        answer.append(found)
    return answer
