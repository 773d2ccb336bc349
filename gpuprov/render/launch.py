"""Render the bundle's launch/ folder: env.sh, train.sh, slurm.sbatch, train.yaml and the trainer.

Pure: Plan in, {path relative to launch/: text} out. Every number comes from the plan; the
trainer (templates/launch/train.py) is copied as is and reads train.yaml at run time.
"""

from __future__ import annotations

import math
import re

from gpuprov import __version__
from gpuprov.errors import GpuprovError
from gpuprov.plan import Plan
from gpuprov.render import RenderedFiles
from gpuprov.render.escape import FILTERS, yaml_scalar, yaml_string
from gpuprov.render.jinja_env import environment
from gpuprov.resources import templates_dir

RDZV_PORT = 29500  # torchrun's default c10d port, as torchtitan's multinode_trainer.slurm uses
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TEMPLATES = ("env.sh", "train.sh", "slurm.sbatch", "train.yaml", "fetch_weights.sh", "stage_data.sh")
# the trainer's Python files (train.py and the train_*.py it imports, parallel.py,
# prepare_data.py) ship as they are: every *.py in templates/launch
_COPIED_GLOB = "*.py"


def yaml_value(value, indent: int = 0) -> str:
    """A YAML value both ruamel and PyYAML read back exactly (JSON flow style is YAML).

    Floats always carry a '.' before any exponent: PyYAML (YAML 1.1) reads `1e-05` as a string.
    Dicts nest as block mappings at `indent` spaces so a config.json stays readable.
    """
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = " " * indent
        lines = [f"{pad}{yaml_string(str(k))}: {yaml_value(v, indent + 2)}" for k, v in value.items()]
        return "\n" + "\n".join(lines)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise GpuprovError(f"cannot write a non-finite number ({value}) to train.yaml")
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        if "." not in mantissa:
            mantissa += ".0"
        return mantissa + (e + exponent if e else "")
    return yaml_scalar(value)  # str, int, bool, None


def _run_id(plan: Plan) -> str:
    name = re.sub(r"(^|/)[^/]*\.json$", "", plan.model.name.rstrip("/"))  # a config.json path: named by its folder
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name.rsplit("/", 1)[-1]).strip("-").lower() or "model"
    return f"gpuprov-{slug}-{plan.task}"


def run_paths(plan: Plan) -> dict[str, str]:
    """Where the run keeps its checkpoints, metrics and job logs (`gpuprov status` reads the same).

    Under the checkpoint root the target decided (several nodes: the filesystem they all mount, so
    the job log and metrics outlive any one node; one node: its own NVMe array).
    """
    if plan.provisioning is None:
        raise GpuprovError("the plan records no provisioning decisions: run `gpuprov plan` again")
    run_id = _run_id(plan)
    mount = plan.storage.mount_point.rstrip("/") or ""
    root = plan.provisioning.checkpoint_root  # the target decided it (gpuprov/targets/decide.py)
    return {"run_id": run_id, "job_dir": f"{root}/jobs/{run_id}", "checkpoint_dir": f"{root}/checkpoints/{run_id}",
            "log_dir": f"{root}/logs/{run_id}", "metrics_file": f"{root}/logs/{run_id}/metrics.jsonl",
            "flight_recorder_dir": f"{mount}/logs/{run_id}/flight-recorder"}


def _context(plan: Plan) -> dict:
    for key in plan.fabric.nccl_env:
        if not _ENV_NAME.match(key):
            raise GpuprovError(f"fabric variable {key!r} is not a valid environment variable name")
    if plan.stack is None:
        raise GpuprovError("the plan records no training stack for the trainer: run `gpuprov plan` again")
    c = plan.cluster
    if c.pp * c.replicate * c.shard_group != c.total_gpus and c.sharding in ("fsdp", "hsdp", "zero1", "zero2"):
        raise GpuprovError(f"plan mesh pp {c.pp} x replicate {c.replicate} x shard {c.shard_group} "
                           f"!= {c.total_gpus} GPUs")
    if plan.task != "full" and not (plan.training.lora_rank and plan.training.lora_alpha):
        raise GpuprovError(f"task {plan.task} needs lora_rank and lora_alpha in the plan")
    vocab = int(plan.model.hf_config.get("vocab_size") or 0)
    paths = run_paths(plan)
    run_id = paths["run_id"]
    from gpuprov.staging import staging_of

    staging = staging_of(plan)
    return {
        "plan": plan,
        "version": __version__,
        "nccl_env": sorted(plan.fabric.nccl_env.items()),
        # physical cores (vCPUs / 2 hyperthreads) per GPU rank
        "omp_threads": max(1, plan.instance.vcpus // 2 // max(1, plan.cluster.gpus_per_node)),
        "port": RDZV_PORT,
        "run_id": run_id,
        "plan_hosts": [h.address for h in plan.hosts or []],
        "stack": plan.stack,
        "lora_targets": list(plan.training.lora_targets) or "all-linear",
        "vocab_size": vocab or "unknown",
        "data_dtype": "uint16" if 0 < vocab <= 2**16 else "uint32",
        "checkpoint_dir": paths["checkpoint_dir"],
        "flight_recorder_dir": paths["flight_recorder_dir"],
        "metrics_file": paths["metrics_file"],
        "log_dir": paths["log_dir"],
        "scheduler": plan.scheduler,
        "max_requeues": plan.scheduler.max_requeues,
        "init": plan.training.init or ("random" if plan.task == "full" else "pretrained"),
        # what `up` stages (gpuprov/staging.py): train.yaml's pretrained_path and data.path
        "staging": staging,
        "weights_dir": staging.weights_dir,
        "max_requeues_without_progress": plan.scheduler.max_requeues_without_progress,
    }


def render_launch(plan: Plan) -> RenderedFiles:
    src = templates_dir() / "launch"
    # bash's ${#array[@]} would open a Jinja comment
    env = environment(src, comment_start_string="<#-", comment_end_string="-#>")
    env.filters.update(FILTERS)
    env.filters["y"] = yaml_value
    ctx = _context(plan)
    files = {}
    for name in _TEMPLATES:
        text = env.get_template(f"{name}.j2").render(**ctx)
        files[name] = "\n".join(line.rstrip() for line in text.split("\n"))
    for path in sorted(src.glob(_COPIED_GLOB)):
        files[path.name] = path.read_text()
    return files
