"""The matmul roofline of a generation workload: the output tokens/s an engine would reach if
all its time went to the workload's linear layers at the machine's best matmul FLOP/s.

The workload's matmul FLOPs, per request of P prompt and O output tokens, greedy:

- the decoder's linear layers (q/k/v, output projection, gate/up, down) for every prompt token
  and every output token but the last (which is returned, never fed back): P + O - 1 tokens;
- the output layer (hidden x vocabulary) only where logits are needed: the last prompt token
  (it gives the first output token) and the O - 1 fed-back output tokens: O rows.

Each weight element is one multiply and one add per token (2 FLOPs). Attention's own products
(scores and the weighted sum over the context), norms, rotary and sampling are not counted:
they are the engine's overhead against this bound, not part of it. Biases are not counted
either (one add per output element).

The older figure, FLOP/s / (2 x parameters), counts one forward of every parameter per output
token and none for the prompt: for 128 prompt and 128 output tokens on SmolLM2 it is about
1.8x this bound, so no engine can reach it (`output_tokens_only_tokens_per_s` keeps it).
"""

from __future__ import annotations


def decoder_linear_parameters(config) -> int:
    """Weight elements of every decoder layer's linear layers, summed over the layers.

    `config`: a transformers Llama-family config (hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, optional head_dim).
    """
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp)


def workload_matmul_flops(config, num_requests: int, prompt_len: int, output_len: int) -> int:
    """Matmul FLOPs of `num_requests` greedy requests of `prompt_len` + `output_len` tokens."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    decoder_tokens = prompt_len + output_len - 1
    head = config.hidden_size * config.vocab_size
    per_request = decoder_linear_parameters(config) * decoder_tokens + head * output_len
    return 2 * num_requests * per_request


def roofline_tokens_per_s(flops_per_s: float, config, workload) -> float:
    """Output tokens/s of `workload` (num_requests, prompt_len, output_len) if its matmuls ran
    at `flops_per_s` and nothing else took time."""
    flops = workload_matmul_flops(
        config, workload.num_requests, workload.prompt_len, workload.output_len
    )
    return flops_per_s * workload.num_requests * workload.output_len / flops


def output_tokens_only_tokens_per_s(flops_per_s: float, num_parameters: int) -> float:
    """FLOP/s / (2 x parameters): one forward of every parameter per output token, the prompt
    free. Not a bound of the workload (see the module); kept to compare with older runs."""
    return flops_per_s / (2 * num_parameters)
