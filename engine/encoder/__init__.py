"""The vision encoder's runner and its embedding cache."""
