"""Structured output: parameters, grammar compiler, the batch's grammar state and its
per-step budget."""
