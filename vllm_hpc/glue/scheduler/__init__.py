"""Glue that runs in vLLM's engine core, beside its scheduler: the KV cache manager over the
runtime, the scheduler subclass, the connector's scheduler half, and what a request's prompt
gives the cache (template hints, cache keys)."""
