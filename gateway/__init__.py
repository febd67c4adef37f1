"""kvgate gateway: the public gRPC API, tokenization, detokenization, stop strings, sessions."""
