"""The inference engine: model files -> weights, tokenizer and chat template -> KV arena,
prefix rule, forward pass on the kernels -> sampler -> the generate loop (`Engine`)."""
