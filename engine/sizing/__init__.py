"""How big things are: model shape, device memory, the profile run that sizes the KV cache."""
