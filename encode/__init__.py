"""Encode pool: the worker that runs the vision tower for other pools (``encode/worker.py``).

The vision tower's runner and the encoder cache live in ``engine/`` (every model-running
worker uses them); this room holds only what the encode pool adds."""
