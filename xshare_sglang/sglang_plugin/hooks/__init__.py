"""The SGLang targets the plugin hooks: one module per target, each headed by why, how, and when it
can be removed.  Every module defines ``TARGET`` (dotted path), ``KIND`` (before / after / around /
replace, as ``HookType`` values) and ``hook``.
"""

from . import (
    adaptive_params_init,
    adaptive_params_verify,
    decode_graph_load_batch,
    dispatch_transform_inputs,
    eagle_build_verify_input,
    eagle_organize_draft_results,
    eagle_sample,
    eagle_worker_step,
    eplb_update,
    model_runner_forward_raw,
    model_runner_init,
    model_runner_init_cuda_graphs,
    moe_config_lookup,
    server_args_add_cli_args,
    server_args_from_cli_args,
    topk_forward_cuda,
    topk_post_process,
    topk_select_experts,
)

#: Registered in every process: the flags must parse wherever SGLang parses arguments.
CLI_HOOKS = (server_args_add_cli_args, server_args_from_cli_args)

#: Registered where the pruner is on: what routing and CUDA graphs need.
ROUTING_HOOKS = (
    model_runner_init,
    model_runner_init_cuda_graphs,
    model_runner_forward_raw,
    decode_graph_load_batch,
    topk_select_experts,
    dispatch_transform_inputs,
    topk_post_process,
    topk_forward_cuda,
    eplb_update,
    moe_config_lookup,
)

#: Registered where the pruner is on in a server started with ``--speculative-adaptive``.
ADAPTIVE_HOOKS = (adaptive_params_init, adaptive_params_verify, eagle_worker_step)

#: Registered where ECHO schedules draft trees or logs their confidences.
ECHO_HOOKS = (eagle_organize_draft_results, eagle_build_verify_input, eagle_sample)
