"""The `vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (the CLI, the engine core, each worker),
possibly more than once, so it must be idempotent and cheap: it imports no model code.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.vllm_hpc")


def register() -> None:
    from vllm_hpc.glue.versions import UnsupportedVLLMVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as error:
        # Refusing to start vLLM would also break users who never select the plugin; a user
        # who does select it is refused at start-up, naming both versions.
        logger.error(
            "%s The vllm_hpc plugin is disabled: --kv-cache-manager hybrid-prefix is refused.",
            error,
        )
        from vllm_hpc.glue.frontend.engine_args import install_version_guard

        install_version_guard(error)
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_hpc.glue.architecture import register_models
    from vllm_hpc.glue.frontend.cache_control import install_cache_control
    from vllm_hpc.glue.frontend.engine_args import CONNECTOR, install_engine_args_hooks
    from vllm_hpc.glue.frontend.save_grace import install_save_grace
    from vllm_hpc.glue.frontend.token_ids import install_token_id_check
    from vllm_hpc.glue.sampling import install_sampling_params_hook
    from vllm_hpc.glue.scheduler.engine_core import install_engine_core_hooks
    from vllm_hpc.glue.versions import front_end_checks_token_ids

    install_engine_args_hooks()
    install_engine_core_hooks()
    install_save_grace()
    install_sampling_params_hook()
    if not front_end_checks_token_ids():
        install_token_id_check()
    install_cache_control()
    register_models()
    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR, "vllm_hpc.glue.kv_connector", CONNECTOR)
