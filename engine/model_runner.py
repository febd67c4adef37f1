"""Owns the model, its KV cache tensors and the per-step input tensors; with tensor
parallelism, this rank's share of them (engine/ranks.py)."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, DecodeModel
from engine.host_memory import release_freed_memory, retain_freed_memory, zeroed_tensor
from engine.kv_cache import slot_of
from engine.kv_swap import HostKVPool, KVOp, copy_device_blocks
from engine.models.config import ModelConfig
from engine.models.llama import ForwardContext
from engine.models.loader import load_model
from engine.ranks import RankGroup, rank_device, with_all_reduce
from engine.step_scheduler import ScheduledRequest, SchedulerOutput
from kernels import AttentionStep, build_cos_sin_cache, get_kernels
from kernels.kv_format import (
    KV_CACHE_DTYPES,
    SCALED_DTYPES,
    bytes_per_token,
    cache_token_shape,
    format_name,
)

logger = logging.getLogger("kvgate.executor")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CUDA_ACTIVATION_RESERVE_BYTES = 1 << 30  # headroom for activations and the allocator


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, and runs one step's forward pass.

    With config.tensor_parallel_size > 1 the runner made with no `group` is rank 0: it starts
    the other ranks once its own share has loaded (a follower is made with its `group`).
    """

    def __init__(self, config: EngineConfig, group: RankGroup | None = None) -> None:
        self.group = group
        self.rank = 0 if group is None else group.rank
        num_ranks = config.tensor_parallel_size
        self.device = torch.device(config.device)
        if num_ranks > 1:
            rank_device(config, num_ranks - 1)  # every rank has its device, or a clear error
            self.device = rank_device(config, self.rank)
        self.dtype = _DTYPES[
            config.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        ]
        # The KV cache's own dtype: the kernels take it apart from the activations' dtype.
        self.kv_cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.kernels = get_kernels(self.device, config.kernels, self.dtype)
        self.model, self.model_config = load_model(
            config.model,
            self.device,
            self.dtype,
            config.quantization,
            self.rank,
            num_ranks,
            config.int8_activations,
        )
        self.rank_config: ModelConfig = self.model.config  # this rank's heads and columns
        head_dim = self.model_config.head_dim
        if self.kv_cache_dtype in SCALED_DTYPES and head_dim % 4:
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} needs a head_dim "
                             f"divisible by 4; this model's is {head_dim}")  # fmt: skip
        if self.device.type == "cpu":
            # The checkpoint's float tensors are freed by now: hand their pages back first.
            release_freed_memory()
            if config.retain_freed_memory:
                retain_freed_memory()
        if num_ranks > 1:
            self.group = RankGroup.start(config) if group is None else group.ready()
            self.kernels = with_all_reduce(self.kernels, self.group)
        try:
            self._allocate(config)
        except BaseException:
            if self.group is not None:
                self.group.abort()
            raise

    def _allocate(self, config: EngineConfig) -> None:
        """Size and allocate the KV cache (the same block count on every rank), then prepare
        the kernels' view of the model and, on CUDA, capture the decode graphs."""
        self.num_blocks = config.num_gpu_blocks or self._num_blocks_from_memory(config)
        if self.group is not None:
            self.num_blocks = self.group.min(self.num_blocks)
        self.kv_caches = self._allocate_kv_caches()
        self.num_host_blocks = self._num_host_blocks(config)
        self.host_pool = (
            HostKVPool(self.kv_caches, self.num_host_blocks) if self.num_host_blocks else None
        )
        self.max_model_len = self._max_model_len(config)
        mc = self.model_config
        self.cos_sin_cache = build_cos_sin_cache(
            mc.head_dim, self.max_model_len, mc.rope_theta, mc.rope_scaling, self.device
        )
        self.decoder = self.kernels.prepare_decoder(self.model.decoder_weights(self.kv_caches))
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.decode_graphs = DecodeGraphs(self.decode_model(), config.max_num_seqs, True)
            logger.info("CUDA graphs captured for decode batches of %s", self.decode_graphs.sizes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its key/value heads) over every layer, K and V
        (an int8 or fp8 cache's scales included)."""
        mc = self.rank_config
        per_token = bytes_per_token(mc.num_key_value_heads, mc.head_dim, self.kv_cache_dtype)
        return 2 * mc.num_hidden_layers * per_token * self.block_size

    def _num_blocks_from_memory(self, config: EngineConfig) -> int:
        if self.device.type == "cpu":
            budget = int(config.kv_cache_gib * (1 << 30))
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * config.gpu_memory_utilization) - used
            budget -= _CUDA_ACTIVATION_RESERVE_BYTES
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"no room for a single KV block of {self.block_bytes} bytes: raise "
                "kv_cache_gib (CPU) or gpu_memory_utilization (CUDA)"
            )
        return num_blocks

    def _num_host_blocks(self, config: EngineConfig) -> int:
        if config.swap_space_gib == 0:
            return 0
        num_blocks = int(config.swap_space_gib * (1 << 30)) // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"--swap-space-gib {config.swap_space_gib} holds no KV block of "
                f"{self.block_bytes} bytes: raise it, or 0 for no host tier"
            )
        logger.info("kv host tier: %d blocks", num_blocks)
        return num_blocks

    def swap_blocks(self, ops: list[KVOp]) -> None:
        """Run the block manager's copies between the device and the host tier, and between
        device blocks (copy on write), in order."""
        if not ops:
            return
        if self.host_pool is not None:
            self.host_pool.copy(ops)
        else:
            copy_device_blocks(self.kv_caches, ops)  # no host tier: only device copies

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.rank_config
        token = cache_token_shape(mc.num_key_value_heads, mc.head_dim, self.kv_cache_dtype)
        shape = (2, self.num_blocks, self.block_size, *token)
        if self.device.type == "cpu":  # resident only where blocks are written
            layers = zeroed_tensor((mc.num_hidden_layers, *shape), self.kv_cache_dtype).unbind()
        else:
            layers = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                      for _ in range(mc.num_hidden_layers)]  # fmt: skip
        caches = [(kv[0], kv[1]) for kv in layers]
        logger.info("kv cache: %d blocks of %d tokens, %s", self.num_blocks, self.block_size,
                    format_name(self.kv_cache_dtype))  # fmt: skip
        return caches

    def _max_model_len(self, config: EngineConfig) -> int:
        mc: ModelConfig = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            logger.warning("sliding window attention is not implemented: max_model_len is "
                           "capped at the window, %d tokens", mc.sliding_window)  # fmt: skip
            limit = mc.sliding_window
        limit = min(limit, self.num_blocks * self.block_size)
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len must be <= {limit} (the model's positions, window and KV "
                f"cache), got {config.max_model_len}"
            )
        return config.max_model_len

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, every_row: bool = False) -> torch.Tensor:
        """Run one forward pass.

        Args:
            out: the step's requests and token counts.
            every_row: return the logits of every new token, not only of the wanted ones.

        Returns:
            [num_rows, vocab] float32 logits: each scheduled request's last `logit_rows` new
            tokens (with proposed tokens, theirs too), in batch order (every_row:
            [num_batched_tokens, vocab]).
        """
        if self.host_pool is not None and self.host_pool.has_copies_in_flight:
            self.host_pool.wait_for({b for s in out.scheduled for b in s.request.block_table})
        graphs = self.decode_graphs
        if not every_row and graphs is not None and graphs.fits(out.scheduled):
            logits = graphs.run(out.scheduled)
            rows = [i for i, s in enumerate(out.scheduled) if s.logit_rows]
            return logits if len(rows) == len(out.scheduled) else logits[rows]
        input_ids, step, logit_rows = self._prepare(out.scheduled)
        if every_row:
            logit_rows = None
        step = self.kernels.prepare_attention(step, self.kv_caches[0][0])
        if self.group is None:
            hidden = self.forward(input_ids, step)
        else:
            try:
                self.group.send_step(input_ids, step)
                hidden = self.forward(input_ids, step)
            except Exception as error:
                self.group.fail(error)
                raise
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.model.compute_logits(hidden, self.kernels)

    def decode_model(self) -> DecodeModel:
        """This runner as the decode graphs see it."""
        return DecodeModel(
            self.device, self.block_size, self.max_model_len, self._decode_step, self._logits
        )

    def _logits(self, input_ids: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        step = self.kernels.prepare_attention(step, self.kv_caches[0][0])
        return self.model.compute_logits(self.forward(input_ids, step), self.kernels)

    def forward(self, input_ids: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """Hidden states of a step prepared by the kernels (every rank runs this)."""
        return self.model(input_ids, ForwardContext(step, self.decoder, self.kernels))

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower rank: run rank 0's steps on this rank's share until rank 0 stops."""
        template = self._attention_step([], [], [])
        while (received := self.group.receive_step(template)) is not None:
            input_ids, step = received
            self.forward(input_ids, self.kernels.prepare_attention(step, self.kv_caches[0][0]))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do with one rank)."""
        if self.group is not None and self.rank == 0:
            self.group.close()

    def _prepare(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, AttentionStep, torch.Tensor | None]:
        """The step's token ids, its attention inputs, and the rows whose logits are wanted
        (None: all)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for s in scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            table = req.block_table
            tokens = req.all_token_ids + s.spec_token_ids if s.spec_token_ids else req.all_token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(slot_of(table, p, bs) for p in range(start, end))
            logit_rows.extend(range(len(input_ids) - s.logit_rows, len(input_ids)))
        step = self._attention_step(scheduled, positions, slots)
        rows = None if len(logit_rows) == len(input_ids) else self._tensor(logit_rows, torch.int64)
        return self._tensor(input_ids, torch.int64), step, rows

    def _attention_step(
        self, scheduled: list[ScheduledRequest], positions: list[int], slots: list[int]
    ) -> AttentionStep:
        num_decode = sum(1 for s in scheduled if s.num_new_tokens == 1)
        decode, prefill = scheduled[:num_decode], scheduled[num_decode:]
        cu_seqlens = [0]
        for s in prefill:
            cu_seqlens.append(cu_seqlens[-1] + s.num_new_tokens)
        return self._step(
            self._tensor(positions, torch.int64),
            self._tensor(slots, torch.int64),
            num_decode,
            (self._block_tables(decode), self._context_lens(decode)),
            (
                self._block_tables(prefill),
                self._tensor(cu_seqlens, torch.int32),
                self._context_lens(prefill),
            ),
        )

    def _decode_step(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> AttentionStep:
        no_prefill = (
            torch.zeros(0, block_tables.shape[1], dtype=torch.int32, device=self.device),
            torch.zeros(1, dtype=torch.int32, device=self.device),
            torch.zeros(0, dtype=torch.int32, device=self.device),
        )
        num_decode = positions.shape[0]
        return self._step(
            positions, slot_mapping, num_decode, (block_tables, context_lens), no_prefill
        )

    def _step(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_decode: int,
        decode: tuple[torch.Tensor, torch.Tensor],
        prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> AttentionStep:
        """An AttentionStep with this rank's model constants; decode = (block tables, context
        lens), prefill = (block tables, cu_seqlens_q, context lens)."""
        mc = self.rank_config
        return AttentionStep(
            positions=positions,
            slot_mapping=slot_mapping,
            cos_sin_cache=self.cos_sin_cache,
            num_decode_tokens=num_decode,
            decode_block_tables=decode[0],
            decode_context_lens=decode[1],
            prefill_block_tables=prefill[0],
            prefill_cu_seqlens_q=prefill[1],
            prefill_context_lens=prefill[2],
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            scale=mc.head_dim**-0.5,
        )

    def _block_tables(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        width = max((len(s.request.block_table) for s in scheduled), default=0)
        rows = [
            s.request.block_table + [0] * (width - len(s.request.block_table)) for s in scheduled
        ]
        return self._tensor(rows, torch.int32).view(len(scheduled), width)

    def _context_lens(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        lens = [s.request.num_computed_tokens + s.num_new_tokens for s in scheduled]
        return self._tensor(lens, torch.int32)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)
