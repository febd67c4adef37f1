"""The engine as a library: continuous batching over a paged KV cache, the step scheduler,
the sampler, speculative decoding and the models; it runs without Redis or gRPC (the
executor process around it is executor/)."""
