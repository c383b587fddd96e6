"""The KV side: block pool, prefix-cache block hashes, the KV cache manager."""
