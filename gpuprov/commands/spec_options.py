"""The spec flags shared by `gpuprov plan`, `explain` and `generate`: one decorator, one TrainingSpec.

    @click.command()
    @spec_options
    def plan(spec: TrainingSpec, ...): ...

Flags default to None so that only what the user typed overrides `-f gpuprov.yaml` (and the
model's defaults apply last). Counts take units: `--tokens 20B`, `--tokens 1T`,
`--global-batch-tokens 4M` (binary: 4M = 4,194,304), `--deadline 30d` / `12h`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import click

from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import AC_MODES, OFFLOADS, OPTIMIZERS, PP_SCHEDULES, PRECISIONS, TASKS
from gpuprov.spec import TrainingSpec
from gpuprov.specfile import apply_units, build_spec, load_hosts, load_spec_data
from gpuprov.targets import CHOICES

# field -> (flag declarations, click type, help). Defaults and help come from TrainingSpec's
# fields where they exist, so `--help` and `gpuprov schema` agree.
_CLOUDS = CHOICES
_FLAGS: dict[str, tuple[tuple[str, ...], Any, str]] = {
    "model": (("--model", "-m"), str, "Preset (70b, llama-3.1-8b, ...), Hugging Face id (ORG/NAME) or config.json path"),
    "task": (("--task",), click.Choice(TASKS), "Fine-tune the pretrained weights: full, lora or qlora"),
    "init": (("--from-scratch",), "switch", "Train from random weights (pre-training; spec init: random) instead "
             "of fine-tuning the pretrained ones"),
    "recipe": (("--recipe",), click.Choice(("torchtune", "axolotl", "trl")),
               "Published fine-tuning recipe for batch, learning rate, warmup, epochs  [default: torchtune]"),
    "export_merged": (("--export-merged",), "switch", "LoRA/QLoRA: also export the base with the adapter merged "
                      "in (a plain transformers model), beside the peft adapter"),
    "seq_len": (("--seq-len",), click.IntRange(min=1), "Tokens per sample"),
    "dataset": (("--dataset",), str, "Training data: a token count (100M), a prepared data dir / meta.json, or a "
                "text/JSONL file; sizes the run with --epochs"),
    "epochs": (("--epochs",), click.FloatRange(min=0, min_open=True), "Passes over --dataset (default: the recipe's)"),
    "checkpoint_every_steps": (("--checkpoint-every",), click.IntRange(min=1),
                               "Optimizer steps between checkpoints (default: about an hour of training)"),
    "global_batch": (("--global-batch",), click.IntRange(min=1), "Sequences per optimizer step (default: the recipe's)"),
    "global_batch_tokens": (("--global-batch-tokens", "--batch-tokens"), str,
                            "Tokens per optimizer step (4M = 4,194,304)"),
    "tokens": (("--tokens",), str, "Training tokens (20B, 1T, ...)"),
    "deadline_hours": (("--deadline",), str, "Finish within (30d, 12h, 90m; bare number = hours)"),
    "budget_usd": (("--budget",), float, "Spend at most this many USD"),
    "cloud": (("--cloud",), click.Choice(_CLOUDS), "Where to run; 'any' compares all clouds"),
    "region": (("--region",), str, "Cloud region"),
    "zone": (("--zone",), str, "Zone of the nodes (AWS, GCP): the reservation's (looked up when the CLI is "
             "signed in)"),
    "gpus": (("--gpu",), str, "Allowed GPU type (repeat or comma-separate)"),
    "gpu_count": (("--gpus",), click.IntRange(min=1), "Exactly this many GPUs in total (the GPUs you have)"),
    "max_nodes": (("--max-nodes",), click.IntRange(min=1), "Largest node count to consider"),
    "objective": (("--objective",), click.Choice(("cost", "time", "gpus")), "Rank by cost, time or GPU count"),
    "precision": (("--precision",), click.Choice(PRECISIONS), "Training precision"),
    "optimizer": (("--optimizer",), click.Choice(OPTIMIZERS), "Optimizer"),
    "offload": (("--offload",), click.Choice(OFFLOADS), "CPU offload"),
    "lora_rank": (("--lora-rank",), click.IntRange(min=1), "LoRA rank"),
    "lora_targets": (("--lora-targets",), str, "qv, attention, all-linear, or comma-separated module names"),
    "safety_margin": (("--safety-margin",), float, "Fraction of GPU memory kept free"),
    "ssh_cidr": (("--ssh-cidr",), str, "CIDR allowed to SSH to the nodes (default: SSM only)"),
    "capacity_reservation_id": (("--capacity-reservation-id",), str, "AWS capacity reservation / block id"),
    "reservation": (("--reservation",), str, "GCP reservation name (or projects/P/reservations/R)"),
    "shared_nfs": (("--shared-nfs",), str, "On-prem: NFS export (server:/path) the nodes mount at /shared "
                   "for multi-node checkpoints"),
    "framework": (("--framework",), str, "Size memory for this training stack (see `gpuprov estimate --help`); "
                  "the bundle runs gpuprov's own trainer"),
    "purchase": (("--purchase",), str, "Allowed purchase options, comma-separated: on-demand, spot, "
                 "capacity-block, reservation, flex-start"),
    "placement_group": (("--placement-group",), str, "AWS: an existing placement group to launch into"),
    "tp": (("--tp",), click.IntRange(min=1), "Tensor-parallel degree (default: the planner chooses)"),
    "cp": (("--cp",), click.IntRange(min=1), "Context-parallel degree (default: the planner chooses)"),
    "pp": (("--pp",), click.IntRange(min=1),
           "Pipeline stages (default: the planner also tries 2, 4, 8 where the trainer pipelines the run; 1: no PP)"),
    "pp_schedule": (("--pp-schedule",), click.Choice(PP_SCHEDULES),
                    "Pipeline schedule with --pp (Interleaved1F1B: two stages per rank)"),
    "slurm": (("--slurm",), click.Choice(("auto", "install", "existing", "none")),
              "Scheduler: auto (Slurm on multi-node clusters), install, existing (on-prem site Slurm: jobs only), none"),
    "gpu_power_limit_w": (("--gpu-power-limit",), click.IntRange(min=1),
                          "The GPUs' power limit in W where below their TDP (nvidia-smi -pl): the plan times them at the "
                          "clocks that limit holds, e.g. 500 for H100s run at 500 W"),
    "calibration": (("--calibration",), click.Path(dir_okay=False),
                    "Calibration file from `gpuprov calibrate` (repeatable, one per GPU type): plans on its GPU type "
                    "scale their step time by the measured run's predicted/measured tokens/s"),
    # the training settings `gpuprov estimate` takes too (SETTING_FLAGS: one declaration for both commands)
    "activation_checkpointing": (("--activation-checkpointing",), click.Choice(AC_MODES),
                                 "Activation checkpointing: none, selective (attention core) or full (every block)"),
    "micro_batch": (("--micro-batch",), click.IntRange(min=1), "Samples per GPU per forward"),
    "grad_accumulation": (("--grad-accumulation",), click.IntRange(min=1),
                          "Micro-batches per optimizer step (with --pp: the pipeline's micro-batches per step)"),
    "compile": (("--compile/--no-compile",), None, "torch.compile"),
    "float8": (("--float8/--no-float8",), None, "Allow torchao float8 training where a measured speed-up covers the "
               "GPU (Hopper: full bf16-mixed, TP up to 8); the plan counts its gain and memory"),
}

FLAG_NAMES = {field: decls[0].split("/")[0] for field, (decls, _, _) in _FLAGS.items()}
# the settings a user may fix for plan/generate as for estimate; plan and generate choose the rest
SETTING_FLAGS = ("activation_checkpointing", "micro_batch", "grad_accumulation", "compile")
_CHOOSES = {f: "  [default: the planner chooses]" for f in SETTING_FLAGS} | {
    "compile": " of each decoder block  [default: on for full and LoRA training, off for QLoRA]"}
FLAG_NAMES["hosts"] = "--hosts"


def _default_text(field: str) -> str | None:
    info = TrainingSpec.model_fields.get(field)
    if info is None or info.default is None:
        return None
    return str(info.default)


def spec_from_flags(spec_file: str | None, hosts_file: str | None, values: dict[str, Any]):
    """Build the TrainingSpec: file values, overridden by the flags the user gave."""
    # `--spec "$SPEC"` with SPEC unset must not plan the defaults as if no file were meant
    for flag, path in (("--spec", spec_file), ("--hosts", hosts_file)):
        if path is not None and not path.strip():
            raise GpuprovError(f"{flag} is empty: give a file, or leave {flag} out")
    overrides: dict[str, Any] = {}
    for field, value in values.items():
        if value is None or value == ():
            continue
        if field == "init":  # --from-scratch: a switch for init: random
            overrides["init"] = "random" if value else "pretrained"
            continue
        if field == "export_merged":  # a switch: only turned on, never off over a spec file's value
            if value:
                overrides[field] = True
            continue
        if field == "calibration":
            from gpuprov.calibration import load_calibration

            overrides["calibration"] = [load_calibration(path) for path in value]
            continue
        if field in ("gpus", "purchase", "lora_targets"):
            items = value if field == "gpus" else (value,)
            parts = [t.strip() for item in items for t in item.split(",") if t.strip()]
            if not parts:  # an empty list would mean "no restriction": say so instead of widening the search
                raise GpuprovError(f"{FLAG_NAMES[field]} {', '.join(map(repr, items))} names nothing; "
                                   f"leave {FLAG_NAMES[field]} out for the default")
            overrides[field] = parts if field != "lora_targets" or len(parts) > 1 else parts[0]
        else:
            overrides[field] = value
    apply_units(overrides, where=FLAG_NAMES)
    file_data, tree = load_spec_data(spec_file) if spec_file else ({}, None)
    from gpuprov.userconfig import apply_defaults, user_defaults  # the user's defaults file, lowest precedence

    file_data = apply_defaults(user_defaults(), file_data, overrides, hosts=bool(hosts_file))
    if hosts_file:
        overrides["hosts"] = [h.model_dump(exclude_none=True) for h in load_hosts(hosts_file)]
        cloud = overrides.get("cloud", file_data.get("cloud"))
        if cloud is None:
            overrides["cloud"] = "onprem"  # a host list means owned machines
        elif cloud != "onprem":
            raise GpuprovError(f"--hosts lists on-prem machines but the spec says cloud: {cloud}; "
                               "use --cloud onprem or drop --hosts")
    return build_spec(file_data, overrides, source=spec_file, tree=tree, flag_names=FLAG_NAMES)


def setting_option(field: str, dest: str | None = None, default: Any = None, help_tail: str = "",
                   kind: Any = None) -> Callable:
    """A SETTING_FLAGS option as another command (`gpuprov estimate`) declares it: the same flag and help,
    with that command's own default (and `kind` where it checks the value itself)."""
    decls, own_kind, help_text = _FLAGS[field]
    kind = kind or own_kind
    extra = {} if kind is None else {"type": kind}
    return click.option(*decls, dest or field, default=default, show_default=default is not None, **extra,
                        help=help_text + help_tail)


def spec_options(func: Callable) -> Callable:
    """Add the spec flags plus `-f/--spec FILE` and `--hosts FILE`; pass `spec=TrainingSpec`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {field: kwargs.pop(field, None) for field in _FLAGS}
        spec_file = kwargs.pop("spec_file", None)
        hosts_file = kwargs.pop("hosts_file", None)
        kwargs["spec"] = spec_from_flags(spec_file, hosts_file, values)
        return func(*args, **kwargs)

    options = [
        click.option("-f", "--spec", "spec_file", type=click.Path(dir_okay=False),
                     help="Spec file (gpuprov.yaml); flags override its values"),
        click.option("--hosts", "hosts_file", type=click.Path(dir_okay=False),
                     help="On-prem hosts: YAML list of name/address, or ini lines (implies --cloud onprem)"),
    ]
    for field, (decls, kind, help_text) in _FLAGS.items():
        default = _default_text(field)
        # None: an on/off pair (--x/--no-x); "switch": a flag that is only ever turned on
        extra = {} if kind is None else {"is_flag": True} if kind == "switch" else {
            "type": kind, "multiple": field in ("gpus", "calibration")}
        options.append(click.option(
            *decls, field, default=None, **extra,
            help=help_text + (f"  [default: {default}]" if default else _CHOOSES.get(field, "")),
        ))
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper
