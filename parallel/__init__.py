"""Tensor parallelism: worker groups, ranks, collectives, KV slicing and the encoder's
data mode (patch-balanced split)."""
