"""Glue that runs in vLLM's front end (and wherever `EngineArgs` or requests are built): the
plugin's flags and engine configuration, and request validation."""
