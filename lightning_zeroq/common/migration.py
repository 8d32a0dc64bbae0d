"""DeepSpeed's and FSDP's option names that ZeroQ does not take, each with what to do instead.

The migration guide's tables (``docs/migrating.md``) say the same for every name here;
``tests/unit/common/test_migration.py`` compares the two, so the error a strategy raises for such an option
(``common/strategy.py``) and the guide cannot drift apart.
"""

from __future__ import annotations

_UNITS = (
    "not needed: with offload the host steps unit by unit (units of reduce_bucket_size elements, or the "
    "stage-3 blocks); each unit's gradients are one flat buffer, reduce-scattered, and its weights all-gathered"
)
_AIO = (
    "not supported (DeepSpeed's asynchronous-I/O tuning): NVMe swap buffers are sized per unit, one unit is "
    "read ahead and one written back, with O_DIRECT where the file system allows it"
)
_ACTIVATIONS = (
    "not supported (DeepSpeed's activation checkpointing): name the blocks to recompute with "
    'activation_checkpointing_policy=["Block"], or use torch.utils.checkpoint in your module; both work '
    "with every stage"
)
_LOGGING = "not needed: messages go to Python's logging (logger lightning_zeroq)"
_FSDP_CHECKPOINTING = (
    "activation_checkpointing_policy (the same classes, or their names): torch's non-reentrant "
    "checkpoint around each instance's forward, every stage; names and checkpoints unchanged"
)
_FSDP_KWARGS = (
    "not accepted. Prefetch: stage3_prefetch, stage3_prefetch_depth; parameters keep their names and "
    "shapes (as with use_orig_params); every rank starts from rank 0's values (as with sync_module_states)"
)

_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    # DeepSpeedStrategy
    (("hysteresis",), "not supported: every overflow halves the scale at once (DeepSpeed's hysteresis=1)"),
    (("zero_optimization",), 'not needed: always ZeRO (strategy="ddp" for none)'),
    (
        ("remote_device",),
        (
            "not needed: stage 3 builds the model on the meta device in configure_model() or "
            "trainer.init_module() / fabric.init_module(empty_init=True)"
        ),
    ),
    (
        ("load_full_weights",),
        (
            "not needed: fit(ckpt_path=...) reads a single-file checkpoint (say from "
            'strategy="ddp") as well as a checkpoint directory'
        ),
    ),
    (
        ("zero_allow_untested_optimizer",),
        ("not needed: every elementwise optimizer is accepted (see Optimizers); others are refused by name"),
    ),
    (("sub_group_size", "contiguous_gradients", "allgather_partitions", "reduce_scatter"), _UNITS),
    (("pin_memory",), "not needed: offloaded host buffers are pinned whenever the device is a GPU"),
    (
        (
            "params_buffer_count",
            "params_buffer_size",
            "max_in_cpu",
            "optimizer_buffer_count",
            "block_size",
            "queue_depth",
            "single_submit",
            "overlap_events",
            "thread_count",
        ),
        _AIO,
    ),
    (
        ("cpu_checkpointing",),
        (
            "activation_offloading_policy naming the blocks activation_checkpointing_policy names "
            '(activation_checkpointing_policy=["Block"], activation_offloading_policy=["Block"]): each '
            "recomputes and keeps its checkpoint input in pinned host memory; a block named only in "
            "activation_offloading_policy keeps everything it saves there instead, with no "
            "recomputation (see Activation offload)"
        ),
    ),
    (("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary"), _ACTIVATIONS),
    (("logging_level", "logging_batch_size_per_gpu"), _LOGGING),
    # FSDPStrategy
    (
        ("sharding_strategy",),
        (
            'sharding_strategy="FULL_SHARD": stage=3; "SHARD_GRAD_OP": stage=3, reshard_after_forward=False (the same '
            "schedule: gathered once per step), or stage=2 (whole parameters on every rank, no gathers); "
            '"NO_SHARD": strategy="ddp", or stage=1 to shard only the optimizer state; "HYBRID_SHARD" / '
            '"_HYBRID_SHARD_ZERO2": stage=3 / stage=2, with shard_group_size="node"'
        ),
    ),
    (("device_mesh",), "device_mesh=(replicas, shard_size): shard_group_size=shard_size (groups of consecutive ranks)"),
    (
        ("auto_wrap_policy",),
        (
            'stage3_wrap_classes=["Block"] (class names) or stage3_unit_size=N (a size policy); '
            "default: the model's repeated block class, found automatically"
        ),
    ),
    (
        ("cpu_offload",),
        (
            "cpu_offload=True: offload_optimizer=True, offload_parameters=True (stage 3; the optimizer "
            "steps on the CPU in both). ZeroQ can also offload the optimizer only, a share of it "
            "(offload_optimizer_ratio) or to NVMe"
        ),
    ),
    (
        ("mixed_precision",),
        (
            'the Trainer\'s precision= ("bf16-mixed", "16-mixed", "bf16-true", "32-true"); '
            "fp32 masters always, gradients accumulated in fp32"
        ),
    ),
    (("activation_checkpointing",), _FSDP_CHECKPOINTING),
    (
        ("state_dict_type",),
        (
            'state_dict_type="sharded": what ZeroQ always writes: a DCP directory, which FSDP2 loads '
            'too; "full": ModelCheckpoint(save_weights_only=True) (one full weights file), or '
            "zeroq-convert CKPT OUT.ckpt --optimizer offline (a full Lightning checkpoint that "
            'strategy="ddp" resumes)'
        ),
    ),
    (
        ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states"),
        _FSDP_KWARGS,
    ),
)

ADVICE: dict[str, str] = {name: advice for names, advice in _GROUPS for name in names}
"""Option name (DeepSpeed's or FSDP's) -> what ZeroQ offers instead, as the migration guide's tables say."""

GUIDE = "the migration guide (docs/migrating.md)"


def unknown_options_message(owner: str, unknown: list[str], known: list[str]) -> str:
    """The error for options that are not ``ZeroConfig`` fields: the advice for each DeepSpeed or FSDP
    name among them, then the valid names."""
    advised = [f"{name} -> {ADVICE[name]}" for name in unknown if name in ADVICE]
    text = f"{owner} got unknown option(s) {unknown}"
    if advised:
        text += f". From DeepSpeed or FSDP ({GUIDE}): " + "; ".join(advised)
    return f"{text}. Valid options are {known}."
