"""Draft-model proposals for speculative decoding (`{"model": PATH}` in --speculative-config).

A smaller model with the target's tokenizer runs in the same engine with its own paged KV
cache. Each running request the rule lets propose has a shadow sequence in the draft's cache
holding the same tokens; a step first brings the shadow up to the request's tokens (keeping the
K/V of the common prefix, so only what the target accepted since is computed), then runs k
decode steps of the draft for all shadows together.

For a greedy or seeded request the draft proposes its own argmax (a one-hot q): the verifier
of engine/speculative.py keeps a proposal when the target samples the same token, so a
seeded request's tokens stay those of a run without proposals. For an unseeded sampled
request the draft samples each proposal from its own distribution q (the request's
temperature, min_p, top_k and top_p applied to the draft's logits) and keeps q; the
sampler keeps the proposal with probability min(1, p / q) under the target's p, else draws
from max(0, p - q) (engine/sampler.py `verify_draft`): the output has the target's
distribution, and a draft close to the target is accepted more often than its argmax.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.model_text import ModelText
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, common_prefix_len
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampler import filtered_probs
from engine.speculative import cut_at_stop, proposal_room, proposes
from engine.speculative_config import SpeculativeConfig
from engine.step_scheduler import ScheduledRequest, SchedulerOutput


class DraftProposer:
    """Proposes each step's tokens with the draft model (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: EngineConfig,
        max_model_len: int,
        eos_token_ids: list[int],
        num_blocks: int,
    ) -> None:
        """Load the draft on the target's device, with as many KV blocks as the target has
        (as many tokens; smaller blocks).

        Raises:
            ValueError: naming speculative_config.model when its vocabulary or tokenizer
                is not the target's.
        """
        self.config = config
        vocab_size = _check_same_tokenizer(config.model, target.model)
        draft_config = replace(
            target, model=config.model, speculative_config=None, enable_prefix_caching=False,
            max_model_len=None, quantization="none", tensor_parallel_size=1,
            num_gpu_blocks=num_blocks,
        )  # fmt: skip
        self.runner = ModelRunner(draft_config)
        if self.runner.model_config.vocab_size < vocab_size:
            raise ValueError(
                f"speculative_config.model {config.model!r} has "
                f"{self.runner.model_config.vocab_size} logits for {vocab_size} tokens"
            )
        self.vocab_size = vocab_size
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, target.block_size, enable_prefix_caching=False
        )
        self.max_model_len = min(max_model_len, self.runner.max_model_len)
        self.eos_token_ids = set(eos_token_ids)
        self.shadows: dict[str, Request] = {}
        # The last proposals' q, [k, vocab] by request id, for unseeded sampled requests
        self.draft_probs: dict[str, torch.Tensor] = {}

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposals by request id, for decoding requests only (one token left to compute)."""
        self._forget_gone(running)
        self.draft_probs = {}
        rooms = {}
        for req in running:
            if not proposes(self.config, req, len(running)):
                continue
            room = proposal_room(req, self.config, self.max_model_len)
            if room > 0:
                self._sync(req)
                rooms[req.request_id] = room
        if not rooms:
            return {}
        running_by_id = {req.request_id: req for req in running}
        drafted = self._draft(rooms, running_by_id).items()
        proposals = {i: cut_at_stop(t, running_by_id[i], self.eos_token_ids) for i, t in drafted}
        return {request_id: tokens for request_id, tokens in proposals.items() if tokens}

    def _forget_gone(self, running: list[Request]) -> None:
        """Free the shadows of requests no longer running (finished, aborted, preempted)."""
        ids = {req.request_id for req in running}
        for request_id in [i for i in self.shadows if i not in ids]:
            self.kv_cache.free(self.shadows.pop(request_id))

    def _sync(self, req: Request) -> None:
        """Give the request's shadow its tokens, keeping the K/V of their common prefix (and
        at least the last token to compute: its logits give the first proposal)."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, [], SamplingParams(max_tokens=1), 0)
            self.shadows[req.request_id] = shadow
        common = common_prefix_len(shadow.all_token_ids, req.all_token_ids, req.num_tokens)
        shadow.all_token_ids = list(req.all_token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, req.num_tokens - 1)
        self.kv_cache.trim_slots(shadow)

    def _draft(self, rooms: dict[str, int], running: dict[str, Request]) -> dict[str, list[int]]:
        """k steps of the draft over every shadow in `rooms`; their new tokens (argmax, or
        sampled from q for an unseeded sampled request, whose q go to `draft_probs`)."""
        proposals: dict[str, list[int]] = {request_id: [] for request_id in rooms}
        sampled = {i for i in rooms if is_sampled_freely(running[i])}
        q_rows: dict[str, list[torch.Tensor]] = {i: [] for i in sampled}
        for step in range(max(rooms.values())):
            shadows = [self.shadows[i] for i, room in rooms.items() if room > step]
            shadows = [s for s in shadows if self._allocate(s)]
            if not shadows:
                break
            scheduled = [ScheduledRequest(s, s.num_tokens - s.num_computed_tokens, True, 1)
                         for s in shadows]  # fmt: skip
            scheduled.sort(key=lambda s: s.num_new_tokens != 1)
            logits = self.runner.execute(
                SchedulerOutput(scheduled, sum(s.num_new_tokens for s in scheduled))
            )
            logits = logits[:, : self.vocab_size].float()
            token_ids = torch.argmax(logits, dim=-1).tolist()
            for row, s in enumerate(scheduled):
                request_id = s.request.request_id
                if request_id in sampled:
                    q = filtered_probs(logits[row : row + 1], [running[request_id].params])[0]
                    token_ids[row] = int(torch.multinomial(q, 1))
                    q_rows[request_id].append(q)
                s.request.num_computed_tokens = s.request.num_tokens
                s.request.all_token_ids.append(token_ids[row])
                proposals[request_id].append(token_ids[row])
        self.draft_probs = {i: torch.stack(rows) for i, rows in q_rows.items() if rows}
        return proposals

    def _allocate(self, shadow: Request) -> bool:
        """Slots for the shadow's uncomputed tokens; a shadow without room is dropped."""
        if self.kv_cache.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens):
            return True
        self.kv_cache.free(self.shadows.pop(shadow.request_id))
        return False


def is_sampled_freely(req: Request) -> bool:
    """A sampled request without a seed: its proposals are sampled from the draft's q."""
    return not req.params.is_greedy and req.generator is None


def _check_same_tokenizer(draft: str, target: str) -> int:
    """The size of the shared vocabulary.

    Raises:
        ValueError: naming speculative_config.model when the draft's tokenizer differs.
    """
    vocab = ModelText(draft).hf_tokenizer.get_vocab()
    if vocab != ModelText(target).hf_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_config.model {draft!r} has another tokenizer than the model "
            f"{target!r}: a draft must share its vocabulary"
        )
    return len(vocab)
