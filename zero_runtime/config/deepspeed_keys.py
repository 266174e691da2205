"""DeepSpeed's config schema as far as the import needs it: which keys DeepSpeed accepts
(sourced from DeepSpeed's own files, cited per table), which ZeroConfig key each maps to,
and how the Hugging Face Trainer resolves ``"auto"``."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# DeepSpeed ``zero_optimization`` scalar key -> ZeroConfig key. Both the documented
# ``stage3_*`` names and DeepSpeed's own field names (its pydantic aliases) are accepted.
DS_ZERO_SCALARS: Mapping[str, str] = MappingProxyType(
    {
        "stage3_param_persistence_threshold": "persistence_threshold",
        "param_persistence_threshold": "persistence_threshold",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_max_live_parameters": "max_live_parameters",
        "max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "max_reuse_distance": "max_reuse_distance",
        "reduce_bucket_size": "reduce_bucket_size",
        "allgather_bucket_size": "allgather_bucket_size",
        "overlap_comm": "overlap_comm",
        "sub_group_size": "sub_group_size",
    }
)
# Top-level DeepSpeed key -> ZeroConfig key.
DS_TOP_SCALARS: Mapping[str, str] = MappingProxyType(
    {"gradient_accumulation_steps": "gradient_accumulation_steps"}
)
# Keys whose "auto" has no sensible default here: rejected.
DS_AUTO_REJECTED = frozenset({"stage", "offload_optimizer", "offload_param", "nvme_path"})

# Every key DeepSpeed's ``DeepSpeedZeroConfig`` accepts (field names and their ``stage3_*``
# aliases), from deepspeed/runtime/zero/config.py (deepspeedai/DeepSpeed edaa7221,
# 2026-08-22). DeepSpeed's model forbids other keys (``extra="forbid"``), and so do we.
DS_ZERO_KEYS = frozenset(
    {
        "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
        "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
        "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
        "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size",
        "stage3_prefetch_bucket_size", "param_persistence_threshold",
        "stage3_param_persistence_threshold", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "max_live_parameters",
        "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential", "stage3_allgather_sequential",
        "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
        "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
        "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    }
)  # fmt: skip
# DeepSpeedZeroOffloadParamConfig / DeepSpeedZeroOffloadOptimizerConfig fields
# (deepspeed/runtime/zero/offload_config.py; ``extra="forbid"`` there too).
DS_OFFLOAD_KEYS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "offload_param": frozenset(
            {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
        ),
        "offload_optimizer": frozenset(
            {
                "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
            }
        ),
    }
)  # fmt: skip
# DeepSpeed's deprecated boolean offload keys -> the section DeepSpeed builds from them
# (``new_param_fn``: ``{"device": "cpu"}`` if true, no section if false). Giving one with
# its replacement is an error in DeepSpeed ("Cannot provide deprecated parameter ... and
# replacing parameter ... together"), and here.
DS_LEGACY_OFFLOAD: Mapping[str, str] = MappingProxyType(
    {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
)
# Top-level sections of a DeepSpeed config (deepspeed/runtime/constants.py and config.py).
# Another top-level key within difflib's reach of one of these is taken for a misspelling
# and rejected; a key far from all of them is ignored with a warning (DeepSpeed ignores
# unknown top-level keys).
DS_TOP_KEYS = frozenset(
    {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
        "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
        "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
        "sparse_gradients", "sparse_attention", "activation_checkpointing", "flops_profiler",
        "tensorboard", "wandb", "csv_monitor", "comet", "aio", "elasticity", "pipeline",
        "communication_data_type", "seq_parallel_communication_data_type", "data_types",
        "checkpoint", "compression_training", "data_efficiency", "curriculum_learning",
        "autotuning", "nebula", "progressive_layer_drop", "eigenvalue", "quantize_training",
        "hybrid_engine", "compile", "disable_allgather", "dataloader_drop_last",
        "gradient_allreduce_op", "graph_harvesting", "use_data_before_expert_parallel_",
        "vocabulary_size", "weight_quantization", "zero_optimization_stage", "comms_logger",
        "monitor_config", "sequence_parallel_size", "expert_parallel", "timers",
    }
)  # fmt: skip
# HF Trainer's "auto" keys resolved from the model's hidden size
# (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize):
# ZeroConfig key -> (function of hidden size, stage-3 only).
HF_HIDDEN_AUTO: Mapping[str, tuple[Any, bool]] = MappingProxyType(
    {
        "reduce_bucket_size": (lambda h: h * h, False),
        "prefetch_bucket_size": (lambda h: int(0.9 * h * h), True),
        "persistence_threshold": (lambda h: 10 * h, True),
    }
)
