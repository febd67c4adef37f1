"""Batched next-token sampling: masks, penalties, temperature, top-k/top-p/min-p, logprobs.

Order of operations per step (as in vLLM):
  0. logit masks: logit_bias is added, then tokens outside allowed_token_ids and
     tokens the request's constraint forbids (its llguidance bitmask) get -inf;
  1. min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf until a
     request has produced min_tokens tokens;
  2. penalties: repetition over prompt + output tokens, presence and frequency
     over output tokens;
  3. greedy rows take the argmax; the others go through
     temperature -> min_p -> top_k -> top_p and are sampled.

Sampling uses the exponential race: token = argmax(probs / q) with q ~ Exp(1)
drawn independently per vocabulary entry, which picks token i with probability
probs[i]. A seeded request draws its q from its own generator, one row of
vocab_size numbers per sampled step, so its tokens do not depend on what else
is in the batch.

Logprobs are the log_softmax of the model logits after step 0 (for a request
without logit_bias, allowed_token_ids or a constraint: the raw logits), before
min_tokens masking, penalties and temperature: they describe what the model
predicted over the tokens the request may take, not the distribution the token
was drawn from (vLLM's default "raw_logprobs").

A row left with no allowed token (a constraint that admits only end-of-sequence
while min_tokens masks it, or allowed_token_ids the constraint forbids) samples
nothing: the output names it in `blocked_rows` and the engine ends that request.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch

from common.sampling_params import SamplingParams
from kernels import reference


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token and the model's top candidates at that step."""

    token_id: int  # the sampled token
    logprob: float  # its logprob under the raw model logits
    top: list[tuple[int, float]]  # top-n (token_id, logprob), best first


@dataclass(slots=True)
class SamplingBatch:
    """Sampling inputs, one row per request whose next token is sampled this step."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens the request has produced so far
    generators: list[torch.Generator | None]  # the request's own generator when seeded
    # int32 [num_rows, ceil(vocab_size / 32)] on the CPU, bit i of word j allowing token
    # 32 * j + i (llguidance's layout), all ones for rows without a constraint; None: no row has one
    token_bitmask: torch.Tensor | None = None
    # Per row, for a row that verifies a token a draft model sampled: (that token, the
    # draft's probabilities it was sampled from, [vocab]); None: the row samples as usual.
    # Such a row keeps the token with probability min(1, p / q), else samples max(0, p - q)
    # normalised: its token then has the target's distribution p (speculative sampling).
    draft_probs: list[tuple[int, torch.Tensor] | None] | None = None


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per batch row, with logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    blocked_rows: set[int] = field(default_factory=set)  # rows with no allowed token


class Sampler:
    """Chooses the next token of every row of a batch of logits."""

    def __init__(
        self,
        eos_token_ids: list[int],
        device: torch.device | str = "cpu",
        argmax: Callable[[torch.Tensor], torch.Tensor] = reference.argmax,
    ) -> None:
        """Build a sampler for one model on one device.

        Args:
            eos_token_ids: the model's end-of-sequence ids, masked by min_tokens
                unless a request sets ignore_eos.
            device: where the logits live; seeded requests' generators must be
                made there (`Sampler.make_generator(seed, sampler.device)`).
            argmax: the kernel that picks greedy rows' tokens (the backend's `argmax`).
        """
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_rows, vocab_size] logits of the last position of each
                row, on the sampler's device (float32; other float dtypes are
                converted outside the argmax fast path). Not modified.
            batch: the rows' parameters, token histories and generators.

        Returns:
            The sampled token ids, and per row its logprobs or None.
        """
        if _argmax_only(batch):
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(batch.params))
        masked = apply_logit_masks(logits.float(), batch)
        processed = apply_min_tokens(masked, batch, self.eos_token_ids)
        processed = apply_penalties(processed, batch)
        token_ids = self._choose(processed, batch)
        logprobs = _token_logprobs(masked, token_ids, batch)
        return SamplerOutput(
            token_ids.tolist(), logprobs, _blocked_rows(processed, token_ids, batch)
        )

    @staticmethod
    def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
        """Build the per-request generator of a seeded request.

        Args:
            seed: the request's SamplingParams.seed.
            device: the sampler's device (a generator draws only on its own device).

        Returns:
            A generator to keep with the request for its whole life.
        """
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return generator

    def skip_draws(self, generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
        """Advance a seeded request's generator past the draws of `num_tokens` sampled
        tokens (one row of vocab_size Exp(1) numbers each, as `_exponentials` draws them), so
        that a request resumed after that many tokens samples what one undisturbed run
        would have."""
        row = torch.empty(vocab_size, device=self.device)
        for _ in range(num_tokens):
            row.exponential_(generator=generator)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        token_ids = self.argmax(logits)
        rows = [i for i, params in enumerate(batch.params) if not params.is_greedy]
        if not rows:
            return token_ids
        row_index = torch.tensor(rows, device=logits.device)
        probs = filtered_probs(logits[row_index], [batch.params[i] for i in rows])
        races = _exponentials(probs, [batch.generators[i] for i in rows])
        token_ids[row_index] = (probs / races).argmax(dim=-1)
        for position, row in enumerate(rows):
            draft = batch.draft_probs[row] if batch.draft_probs else None
            if draft is not None:
                token_ids[row] = verify_draft(probs[position], *draft)
        return token_ids


def verify_draft(probs: torch.Tensor, token_id: int, draft_probs: torch.Tensor) -> int:
    """Speculative sampling of one position: the draft's `token_id`, sampled from
    `draft_probs` (q), kept with probability min(1, p / q) under the target's `probs` (p);
    else a token drawn from max(0, p - q) normalised, which is never `token_id`. The token
    returned has distribution p whatever q is."""
    q = torch.zeros_like(probs)
    q[: draft_probs.shape[-1]] = draft_probs[: probs.shape[-1]].to(probs)
    if torch.rand((), device=probs.device) * q[token_id] < probs[token_id]:
        return token_id
    residual = (probs - q).clamp_(min=0.0)
    if residual.sum() <= 0.0:  # p == q up to rounding: p's own draw
        residual = probs
    return int(torch.multinomial(residual, 1))


def apply_logit_masks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Add logit_bias, then mask tokens outside allowed_token_ids and the constraint's bitmask.

    Args:
        logits: [num_rows, vocab_size] float32 logits.
        batch: the rows' parameters and the constraints' bitmask.

    Returns:
        The masked logits; the input itself when no row has a mask or a bias, else a new tensor.
    """
    rows = [i for i, params in enumerate(batch.params) if params.masks_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        params = batch.params[row]
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
            logits[row].index_add_(0, ids, bias)
        if params.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[params.allowed_token_ids] = True
            logits[row].masked_fill_(~keep, float("-inf"))
    if batch.token_bitmask is not None:
        allowed = unpack_bitmask(batch.token_bitmask.to(logits.device), logits.shape[-1])
        logits.masked_fill_(~allowed, float("-inf"))
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, words] bitmask (llguidance's layout) as a bool [rows, vocab_size] tensor,
    on the bitmask's device (torch ops only: the same on the CPU and CUDA)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_min_tokens(
    logits: torch.Tensor, batch: SamplingBatch, eos_token_ids: list[int]
) -> torch.Tensor:
    """Mask stop tokens of rows that have not produced min_tokens tokens yet.

    Args:
        logits: [num_rows, vocab_size] logits.
        batch: the rows' parameters and output tokens.
        eos_token_ids: masked too, except for rows with ignore_eos.

    Returns:
        The logits with -inf at every masked (row, token); the input itself when
        nothing is masked, else a new tensor.
    """
    rows: list[int] = []
    token_ids: list[int] = []
    vocab_size = logits.shape[-1]
    for row, (params, output) in enumerate(zip(batch.params, batch.output_token_ids, strict=True)):
        if len(output) >= params.min_tokens:
            continue
        stops = (
            params.stop_token_ids if params.ignore_eos else params.stop_token_ids + eos_token_ids
        )
        masked = {token_id for token_id in stops if token_id < vocab_size}
        rows.extend([row] * len(masked))
        token_ids.extend(masked)
    if not rows:
        return logits
    index = (
        torch.tensor(rows, device=logits.device),
        torch.tensor(token_ids, device=logits.device),
    )
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties to the rows that set them.

    Repetition (HF/vLLM): a token seen in the prompt or the output has its logit
    divided by the penalty when positive, multiplied when not. Presence and
    frequency (OpenAI): logit -= frequency * count_in_output + presence * (count > 0).

    Args:
        logits: [num_rows, vocab_size] logits.
        batch: the rows' parameters and token histories.

    Returns:
        The penalized logits; the input itself when no row has penalties, else a new tensor.
    """
    rows = [i for i, params in enumerate(batch.params) if params.has_penalties]
    if not rows:
        return logits
    device, vocab_size = logits.device, logits.shape[-1]
    params = [batch.params[i] for i in rows]
    output_counts = _token_counts([batch.output_token_ids[i] for i in rows], vocab_size, device)
    prompt_counts = _token_counts([batch.prompt_token_ids[i] for i in rows], vocab_size, device)
    row_index = torch.tensor(rows, device=device)
    penalized = _repetition_penalized(
        logits[row_index],
        (prompt_counts + output_counts) > 0,
        _column(params, "repetition_penalty", device),
    )
    penalized -= _column(params, "frequency_penalty", device) * output_counts
    penalized -= _column(params, "presence_penalty", device) * (output_counts > 0)
    return logits.index_put((row_index,), penalized)


def _argmax_only(batch: SamplingBatch) -> bool:
    """True when every row is a plain argmax: greedy, no penalties, masks or logprobs."""
    for params, output in zip(batch.params, batch.output_token_ids, strict=True):
        if (
            not params.is_greedy
            or params.has_penalties
            or params.logprobs is not None
            or params.masks_logits
            or len(output) < params.min_tokens
        ):
            return False
    return True


def _blocked_rows(logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> set[int]:
    """Rows that had no allowed token: their chosen token's logit is -inf (a row with any
    finite logit never chooses a -inf one; only a logit mask can leave none)."""
    if not any(params.masks_logits for params in batch.params):
        return set()
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return set(torch.isneginf(chosen).nonzero().flatten().tolist())


def _column(params: list[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    """One parameter of every row as a float32 [num_rows, 1] tensor."""
    values = [getattr(p, name) for p in params]
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each list, as a float32 [num_lists, vocab_size] tensor."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    list_index = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    counts = torch.bincount(list_index * vocab_size + flat, minlength=len(token_lists) * vocab_size)
    return counts.view(len(token_lists), vocab_size).to(torch.float32)


def _repetition_penalized(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p masks; the probabilities to sample from."""
    device = logits.device
    logits = logits / _column(params, "temperature", device)
    if any(p.min_p > 0.0 for p in params):
        logits = _apply_min_p(logits, _column(params, "min_p", device))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _apply_top_k_top_p(logits, params)
    return logits.softmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest prefix holding top_p of their mass.

    Sorts once (stable, so ties keep the lower token id first). top_k = 0 and
    top_p = 1 leave a row unchanged; the most likely token is always kept.
    """
    device, vocab_size = logits.device, logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    top_k = torch.tensor([p.top_k or vocab_size for p in params], device=device).unsqueeze(1)
    positions = torch.arange(vocab_size, device=device)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1)[:, :-1]
    mass_before = torch.cat([torch.zeros_like(mass_before[:, :1]), mass_before], dim=-1)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _exponentials(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) draws shaped like probs: seeded rows from their own generator, others shared."""
    races = torch.empty_like(probs)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if len(unseeded) == len(generators):
        races.exponential_()
    else:
        for row, generator in enumerate(generators):
            if generator is not None:
                races[row].exponential_(generator=generator)
        if unseeded:
            races[torch.tensor(unseeded, device=probs.device)] = torch.empty(
                len(unseeded), probs.shape[-1], device=probs.device
            ).exponential_()
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax picks.
    return races.clamp_(min=torch.finfo(races.dtype).tiny)


def _token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    """Logprobs under the raw logits for the rows that asked for them."""
    result: list[TokenLogprobs | None] = [None] * len(batch.params)
    rows = [i for i, params in enumerate(batch.params) if params.logprobs is not None]
    if not rows:
        return result
    row_index = torch.tensor(rows, device=logits.device)
    num_top = max(batch.params[i].logprobs for i in rows)
    found = token_logprobs(logits[row_index], token_ids[row_index].tolist(), num_top)
    for row, entry in zip(rows, found, strict=True):
        entry.top = entry.top[: batch.params[row].logprobs]
        result[row] = entry
    return result


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's logprob of its token in `token_ids`, with the row's `num_top` most likely
    tokens, under the log-softmax of `logits` ([rows, vocab])."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(token_id, logprob, list(zip(ids, values, strict=True)))
        for token_id, logprob, ids, values in zip(
            token_ids, chosen_logprobs, top_ids, top_logprobs, strict=True
        )
    ]
