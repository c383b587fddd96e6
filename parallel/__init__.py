"""Tensor parallelism and the model loader: ``loader.load_for_role`` (what a worker runs:
one process, or rank 0 of a group), worker groups, ranks, collectives, KV slicing and the
encoder's data mode (patch-balanced split)."""
