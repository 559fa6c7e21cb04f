"""Everything that depends on the pinned vLLM version lives in this package.

Each module here hooks one vLLM extension point, in a folder by the vLLM process it runs in:
`frontend/` (flags, engine configuration, request validation), `scheduler/` (engine core) and
`worker/` (model and copies). What more than one process uses sits here: the connector class
(vLLM builds it in the engine core and in every worker, and it dispatches by role), the records
its two halves exchange, the stats pipeline, the model registration and the request hints.

`versions.check_vllm_version` guards them all: the hooks are written against the releases in
`versions.SUPPORTED_VLLM_VERSIONS` and are not installed on any other, except the `EngineArgs`
hooks' version guard, which refuses `--kv-cache-manager hybrid-prefix` there
(`glue.frontend.engine_args.install_version_guard`). What differs between the supported
releases lives in `versions` alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, ParamSpec

P = ParamSpec("P")


class InstallOnce(Generic[P]):
    """A hook installer that runs once per process: vLLM calls the plugin's `register` more
    than once, and wrapping a vLLM method twice would run its hook twice. ``installed`` is set
    once the installer has returned (a test that swaps the wrapped methods back may clear it)."""

    def __init__(self, install: Callable[P, None]) -> None:
        self._install = install
        self.installed = False
        functools.update_wrapper(self, install)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        if not self.installed:
            self._install(*args, **kwargs)
            self.installed = True
