"""Glue that runs in vLLM's workers: the model classes and their state pool, the connector's
worker half (state copies, host tier copies, layer waits), in-pass captures."""
