"""The model side of a step: flattened step inputs, attention backends (paged CPU kernel, SDPA),
prepacked CPU linears, the sampler, torch.compile, and the model runner that owns the KV cache."""
