"""The gateway: OpenAI-compatible HTTP and gRPC `Generate` in front of the workers.

It validates and tokenizes requests, routes them (gateway/routing: filter -> score ->
pick, plus the prefill decider) over the workers its registry watches, and streams the
chosen worker's tokens back. It must not import torch (tests check): it uses only the
torch-free parts of `engine` (config, tokenizer, sampling_params, block_hash).
"""
