"""Where the time of an engine step goes: each kernel, the scheduler, input preparation, the
output layer, sampling, and the rest (Python between them).

The engine's parts are wrapped with timers for the measured steps and restored after. Times
are exclusive: a part's children (the kernels an output layer calls) are counted on their own.
The timers cost about a microsecond a call, which lands in the parts they wrap.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable

from engine.engine import Engine
from kernels import cpu_decoder
from kernels.decoder import decoder_layers_with


class ExclusiveTimers:
    """Timers that subtract nested timed calls from their caller's time."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._children: list[float] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed

        return timed


def profile_step(engine: Engine, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part over the next `steps` steps (the engine must have
    that many steps of work left), with "other" the untimed rest and "step" the total."""
    timers = ExclusiveTimers()
    runner, model = engine.runner, engine.runner.model
    kernels = runner.kernels
    fields = [f.name for f in dataclasses.fields(kernels) if f.name != "name"]
    timed = dataclasses.replace(
        kernels, **{f: timers.wrap(f"kernel {f}", getattr(kernels, f)) for f in fields}
    )
    runner.kernels = dataclasses.replace(timed, decoder_layers=_visible_stack(kernels, timed))
    head = model.lm_head.forward

    def output_layer(x, _kernels, out_dtype=None):  # its matmul counts here, not as a kernel
        return head(x, kernels, out_dtype)

    patched = [
        (engine.scheduler, "schedule", "schedule", engine.scheduler.schedule),
        (runner, "_prepare", "prepare inputs", runner._prepare),
        (model.embed_tokens, "forward", "embedding", model.embed_tokens.forward),
        (model.lm_head, "forward", "output layer", output_layer),
        (engine, "sampler", "sampling", engine.sampler),
        (engine.kv_cache, "register_computed_blocks", "block bookkeeping",
         engine.kv_cache.register_computed_blocks),
    ]  # fmt: skip
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _, _ in patched]
    for obj, attr, name, fn in patched:
        setattr(obj, attr, timers.wrap(name, fn))
    inside = _c_stack_timing(kernels, start=True)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        runner.kernels = kernels
        for obj, attr, original in originals:
            setattr(obj, attr, original)
        inside = _c_stack_timing(kernels, start=False) if inside is not None else None
    per_step = {name: 1000 * s / steps for name, s in timers.seconds.items()}
    if inside:
        # The one-call decoder stack, split by the kernels it ran (timed in C).
        stack = per_step.pop("kernel decoder_layers", 0.0)
        for kind, seconds in inside.items():
            per_step[f"kernel {kind} (in the stack)"] = 1000 * seconds / steps
        per_step["stack, between its kernels"] = stack - 1000 * sum(inside.values()) / steps
    per_step["other"] = 1000 * total / steps - sum(per_step.values())
    per_step["step"] = 1000 * total / steps
    return per_step


def _visible_stack(kernels, timed) -> Callable:
    """The decoder stack with each kernel call timed: the one-call C stack (timed in C) when the
    step is small enough for it, else the layers one timed kernel call at a time."""
    one_call = timed.decoder_layers
    per_call = decoder_layers_with(timed.linear, timed.linear_quantized, timed.rms_norm,
                                   timed.attention, timed.silu_and_mul)  # fmt: skip

    def decoder_layers(weights, hidden, step):
        if kernels.name == "cpu" and hidden.shape[0] <= cpu_decoder.one_call_rows(weights):
            return one_call(weights, hidden, step)
        return per_call(weights, hidden, step)

    return decoder_layers


def _c_stack_timing(kernels, start: bool) -> dict[str, float] | None:
    """Turn the CPU decoder stack's own timing on (start) or read it and turn it off; None
    when the kernels are not the CPU ones."""
    if kernels.name != "cpu":
        return None
    return cpu_decoder.kernel_seconds(keep_timing=start)
