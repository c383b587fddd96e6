"""Sampling: parameters, the sampler, penalties, the n-gram guard, beam search."""
