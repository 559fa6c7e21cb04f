"""The engine-side cache runtime: requests' leases, pages, state rows, taps and copy plans.

It drives `vllm_hpc.index` for one engine and turns its decisions into per-step copy plans.
It imports neither torch nor vLLM: `vllm_hpc.glue` adapts vLLM's scheduler and workers to it.
"""
