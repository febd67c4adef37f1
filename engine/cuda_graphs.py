"""Decode steps replayed from CUDA graphs, captured at start for the common batch sizes.

At small batches a GPU decode step is mostly kernel launches from Python: one graph replay
launches them all. A graph replays fixed shapes and addresses, so every input lives in a static
buffer sized for the largest batch; a step of n sequences uses the graph of the smallest
captured size >= n, its extra rows padded with a sequence that stores nothing (slot -1) and
attends to one cached token of block 0, and returns the first n rows of the graph's logits.
Block tables are as wide as max_model_len needs, so one graph serves every context length.

Only steps whose every sequence decodes one token take this path; steps with a prompt chunk,
and batches above the largest size, run eagerly. With capture=False the same padded static
buffers run eagerly (CPU tests check the padding gives the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_cache import slot_of
from engine.step_scheduler import ScheduledRequest
from kernels import AttentionStep

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """What the graphs need of the model runner."""

    device: torch.device
    block_size: int
    max_model_len: int
    # (positions, slot_mapping, decode_block_tables, decode_context_lens) -> a decode-only step
    decode_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], AttentionStep]
    # (input_ids, step) -> [rows, vocab] float32 logits
    logits: Callable[[torch.Tensor, AttentionStep], torch.Tensor]


class DecodeGraphs:
    """Static input buffers and one captured graph per batch size (see the module)."""

    def __init__(self, model: DecodeModel, max_batch: int, capture: bool) -> None:
        self.model = model
        self.sizes = [size for size in CAPTURE_SIZES if size <= max_batch] or [1]
        self.capture = capture
        self.max_blocks = -(-model.max_model_len // model.block_size)
        largest, device = self.sizes[-1], model.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether a step is all one-token decodes within the largest size and the tables."""
        return (
            0 < len(scheduled) <= self.sizes[-1]
            and all(s.num_new_tokens == 1 for s in scheduled)
            and all(len(s.request.block_table) <= self.max_blocks for s in scheduled)
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """[len(scheduled), vocab] float32 logits of a step that `fits`."""
        n = len(scheduled)
        size = next(s for s in self.sizes if s >= n)
        self._fill(scheduled, size)
        if not self.capture:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.logits[size][:n]

    def _fill(self, scheduled: list[ScheduledRequest], size: int) -> None:
        """Copy the step's inputs into the static buffers; rows n..size-1 get the padding."""
        bs, pad = self.model.block_size, size - len(scheduled)
        tokens, positions, slots, lens, tables = [], [], [], [], []
        for s in scheduled:
            req = s.request
            position = req.num_computed_tokens
            tokens.append(req.all_token_ids[position])
            positions.append(position)
            slots.append(slot_of(req.block_table, position, bs))
            lens.append(position + 1)
            tables.append(req.block_table + [0] * (self.max_blocks - len(req.block_table)))
        rows = [
            (self.input_ids, tokens + [0] * pad),
            (self.positions, positions + [0] * pad),
            (self.slot_mapping, slots + [-1] * pad),
            (self.context_lens, lens + [1] * pad),
            (self.block_tables, tables + [[0] * self.max_blocks] * pad),
        ]
        for buffer, values in rows:
            host = torch.tensor(values, dtype=buffer.dtype)
            buffer[:size].copy_(host.view(buffer[:size].shape), non_blocking=True)

    def _forward(self, size: int) -> torch.Tensor:
        step = self.model.decode_step(
            self.positions[:size],
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.context_lens[:size],
        )
        return self.model.logits(self.input_ids[:size], step)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture the largest size first; the others share its memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, the allocator settles
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.model.device)
