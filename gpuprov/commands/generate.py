"""`gpuprov generate` (the bundle), `gpuprov init` (a starter spec) and `gpuprov schema`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import click

from gpuprov.commands.spec_options import spec_options
from gpuprov.errors import GpuprovError
from gpuprov.render.escape import shell_word
from gpuprov.spec import TrainingSpec
from gpuprov.specfile import UNIT_KEYS, build_spec, load_spec
from gpuprov.targets import CHOICES, get_target
from gpuprov.validators import safe_text


def make_plan(spec):
    from gpuprov.planner import make_plan as planner  # lazy: the search is only needed here

    return planner(spec)


def portable_model(spec, output: str | None):
    """A config.json model as a path relative to the bundle, so the lock, plan.json and README hold
    no path of this machine and `check` passes in another checkout (it rebuilds from plan.json's
    config). A tar (-o -) unpacks as TAR_PREFIX/ in the current directory: relative to that.
    Returns (spec, pin for pinned_model) or (spec, None) for presets and HF ids."""
    model = spec.model
    if output is None or not os.path.isabs(model) or not Path(model).exists():
        return spec, None
    from gpuprov.catalog.models import get_model  # lazy: init and schema, in this module too, do not need it

    arch = get_model(model)
    target = Path(model) if Path(model).is_file() else Path(model) / "config.json"
    rel = Path(os.path.relpath(target, Path(output).absolute())).as_posix()
    pin = {"name": rel, "config": dict(arch.hf_config), "display_name": arch.display_name,
           "source": f"config.json at {rel} (relative to the bundle)"}
    return spec.model_copy(update={"model": rel}), pin


def _assumed(plan, assumed: bool) -> str:
    """Said when the token count is gpuprov's fine-tune default, not the user's data."""
    return (f"; the {plan.training.tokens:,} tokens are assumed: give --dataset FILE|TOKENS to size the run from "
            "your data") if assumed else ""


def _summary(plan, where: str, files: int, assumed: bool = False) -> str:
    # lazy: the planner loads both (70 ms); init and schema, in this module too, need neither
    from gpuprov.candidates import layout_label
    from gpuprov.host import hosts_left_out

    c = plan.cluster
    cost = "" if plan.cost_usd is None else f", ~${plan.cost_usd:,.0f}"
    unused = hosts_left_out(plan) if c.cloud == "onprem" else []
    left_out = f"; hosts left out: {', '.join(h.name for h in unused)} (see README.md)" if unused else ""
    layout = layout_label(c.sharding, c.replica_gpus, c.total_gpus, c.tp, c.cp, c.pp)  # as plan's table names it
    return (f"wrote {where} ({files} files): {c.nodes} x {c.instance_type} ({c.total_gpus} x {c.gpu}, {c.cloud}), "
            f"{layout}, {plan.training.tokens:,} training tokens in {plan.training.steps:,} optimizer steps, "
            f"~{plan.time_hours:,.1f} h{cost}{left_out}{_assumed(plan, assumed)}")


def _check_output_path(output: str) -> None:
    """An empty -o resolved to the current directory; a control character makes a folder no shell
    line or Makefile names cleanly. Both are refused before anything is planned or written."""
    if not output.strip():
        raise GpuprovError("-o is empty: give the bundle directory (e.g. -o infra/), or - for a tar on stdout")
    try:
        safe_text(output, "-o")
    except ValueError as exc:
        raise GpuprovError(f"{exc}; choose a plain directory name") from None


@click.command()
@spec_options
@click.option("-o", "--output", "output", metavar="DIR|-",
              help="Bundle directory, or - for a tar stream on stdout")
@click.option("--force", is_flag=True, help="Overwrite files edited by hand since the last generate")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was written as one JSON object on stdout (README: JSON output); not with -o -")
def generate(spec, output: str | None, force: bool, as_json: bool) -> None:
    """Plan the cluster and write the bundle: Terraform, Ansible, launch scripts, README, lock.

    \b
    gpuprov generate --model 70b -o infra/
    gpuprov generate -f gpuprov.yaml -o - > infra.tar
    gpuprov generate --model 8b --task lora -o infra/ --json
    """
    from gpuprov import bundle  # lazy, with the next: init and schema write no bundle (25 ms together)
    from gpuprov.catalog.models import pinned_model

    if output is None:  # a tar only when asked for: `generate | head` must not get binary in its pipe
        raise GpuprovError("say where the bundle goes: -o DIR, or -o - for a tar on stdout (-o - > infra.tar)")
    if output != "-":
        _check_output_path(output)
    elif as_json:
        raise GpuprovError("--json prints to stdout, where -o - writes the tar: give -o DIR with --json")

    from gpuprov.preflight import locate_reservation, shared_storage_rule  # lazy: init and schema skip it (9 ms)

    spec = locate_reservation(spec)  # a reservation's zone and region, when the cloud CLI can say
    spec, pin = portable_model(spec, bundle.TAR_PREFIX if output == "-" else output)
    with pinned_model(**pin) if pin else contextlib.nullcontext():
        plan = make_plan(spec)
        files = bundle.build_bundle(plan)  # everything in memory first: a renderer failure writes nothing
    from gpuprov.recipes import tokens_assumed

    assumed = tokens_assumed(spec)
    if output == "-":
        from gpuprov.bundle_tar import write_tar

        stream = sys.stdout.buffer
        write_tar(files, stream)
        stream.flush()
        click.echo(_summary(plan, "tar to stdout", len(files), assumed), err=True)
        return
    result = bundle.write_bundle(output, files, force=force)
    notes = []
    if result.cleaned:
        notes.append(f"removed {len(result.cleaned)} unfinished bundle folder(s) an interrupted run left")
    if result.leftover:
        notes.append(f"the previous bundle is replaced, but {result.leftover}")
    target_note = get_target(plan.instance.cloud).generate_note(plan)
    if target_note:
        notes.append(target_note)
    storage = shared_storage_rule(plan, Path(output))  # validate's rule, said before validate fails on it
    fix = None
    if storage.status == "fail":
        notes.append(storage.detail)
        fix = f"generate again with --shared-nfs SERVER:/PATH, or {storage.fix}"
    where = shell_word(output)  # a line to paste into a shell: the path as one word, whatever it holds
    # validate fails on a bundle that needs the fix: then no `&& up` to paste
    after = f"gpuprov validate {where}" if fix else f"gpuprov validate {where} && gpuprov up {where} --dry-run"
    if as_json:
        click.echo(json.dumps(_report(plan, output, result, notes, fix, after, assumed), indent=2))
        return
    kept = f"; kept {len(result.carried)} of your files" if result.carried else ""
    click.echo(_summary(plan, output, result.files, assumed) + kept, err=True)
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if fix:
        click.echo(f"fix: {fix}", err=True)
    click.echo(f"next: {after}", err=True)


def _report(plan, output: str, result, notes: list[str], fix: str | None, after: str, assumed: bool) -> dict:
    """`generate --json`: what was written and what it plans (README: JSON output)."""
    from gpuprov.candidates import layout_label

    c = plan.cluster
    return {"bundle": output, "files": result.files, "kept": sorted(result.carried),
            "cloud": c.cloud, "region": c.region, "instance_type": c.instance_type, "nodes": c.nodes,
            "gpu": c.gpu, "total_gpus": c.total_gpus,
            "layout": layout_label(c.sharding, c.replica_gpus, c.total_gpus, c.tp, c.cp, c.pp),
            "purchase": plan.purchase.option, "training_tokens": plan.training.tokens, "tokens_assumed": assumed,
            "steps": plan.training.steps, "time_hours": plan.time_hours, "cost_usd": plan.cost_usd,
            "notes": notes, "fix": fix, "next": after}


STARTER = """\
# gpuprov spec: what to train; gpuprov plans the cluster (`gpuprov generate -f gpuprov.yaml -o infra/`).
# Every key is optional; `gpuprov schema` prints the full JSON Schema for editors and CI.

# Preset name (gpuprov models), Hugging Face id (ORG/NAME) or a path to a config.json
model: {model}
# Fine-tune the pretrained weights: full, lora or qlora
task: {task}
# pretrained (fine-tune) or random (train from scratch: full only, pre-training defaults)
init: {init}
# Batch, learning rate, warmup and epochs from a published recipe: torchtune, axolotl or trl
# recipe: torchtune
# Tokens per sample (documents are packed into windows of this length)
seq_len: {seq_len}
# Your data: a token count (100M), a prepared data dir / meta.json, or a text/JSONL file; and passes over it
# dataset: 100M
# epochs: 1
# Or set the budget directly: sequences per optimizer step (default: the recipe's for the plan's GPU count)
# and training tokens for the whole run
# global_batch: 32
# tokens: 100M
# Constraints: finish within this many hours (or 30d, 12h, ...) and spend at most (USD); remove to leave open
# deadline_hours: 48
# budget_usd: 50000
# Where: aws, gcp, azure, oci, onprem or any (compares all clouds)
cloud: {cloud}
# Allowed GPU types (gpuprov gpus); leave out to consider all
# gpus: [h100-80gb, a100-80gb]
max_nodes: {max_nodes}
# Rank candidates by cost, time or gpus
objective: {objective}
precision: {precision}
optimizer: {optimizer}
# CPU offload: none, optimizer or full
offload: {offload}
# torchao float8 training where a published speed-up covers the GPU (Hopper; full bf16-mixed, TP up to 8)
float8: {float8}
# LoRA/QLoRA only
lora_rank: {lora_rank}
lora_targets: {lora_targets}
# Fraction of GPU memory kept free for fragmentation and spikes
safety_margin: {safety_margin}
# On-prem hosts (cloud: onprem); or pass --hosts FILE
# hosts:
#   - name: gpu0
#     address: 10.0.0.10
# Who may SSH to the nodes (default: none, use SSM / IAP)
# ssh_cidr: 203.0.113.0/24
"""


def starter_spec() -> str:
    """The commented starter, filled from TrainingSpec's defaults (so it cannot fall out of date)."""
    defaults = TrainingSpec()
    targets = defaults.lora_targets if isinstance(defaults.lora_targets, str) else json.dumps(defaults.lora_targets)
    return STARTER.format(model=defaults.model, task=defaults.task, init=defaults.init, seq_len=defaults.seq_len, cloud=defaults.cloud,
                          max_nodes=defaults.max_nodes, objective=defaults.objective, precision=defaults.precision,
                          optimizer=defaults.optimizer, offload=defaults.offload, float8=str(defaults.float8).lower(),
                          lora_rank=defaults.lora_rank,
                          lora_targets=targets, safety_margin=defaults.safety_margin)


@click.command()
@click.argument("path", default="gpuprov.yaml", type=click.Path(dir_okay=False))
@click.option("--model", "-m", default=None, help="Model to put in the starter spec")
@click.option("--cloud", default=None, type=click.Choice(CHOICES))
def init(path: str, model: str | None, cloud: str | None) -> None:
    """Write a commented starter spec (default gpuprov.yaml); never overwrites.

    \b
    gpuprov init
    gpuprov init my-run.yaml
    """
    from ruamel.yaml import YAML  # lazy: only init writes commented YAML (7 ms)

    target = Path(path)
    if target.exists():
        raise GpuprovError(f"{target} exists; not overwriting it (remove it or pick another name)")
    if model is not None:  # checked as a flag, before anything is written ("" too: `-m "$MODEL"` unset)
        resolved = build_spec({}, {"model": model}, flag_names={"model": "--model"}).model
        if resolved != model:  # a path, given from here: in the spec it is read relative to the spec's folder
            model = os.path.relpath(resolved, target.absolute().parent)
    yaml = YAML(typ="rt")
    document = yaml.load(starter_spec())
    # edits through ruamel's round trip keep every comment in place
    if model is not None:
        document["model"] = model
    if cloud:
        document["cloud"] = cloud
    buffer = io.StringIO()
    yaml.dump(document, buffer)
    try:
        with open(target, "x", encoding="utf-8") as handle:
            handle.write(buffer.getvalue())
    except FileExistsError:
        raise GpuprovError(f"{target} exists; not overwriting it") from None
    except OSError as exc:
        raise GpuprovError(f"cannot write {target}: {exc.strerror}") from None
    try:
        load_spec(target)  # the starter must itself be a valid spec
    except GpuprovError:
        target.unlink()  # never leave a starter that does not load
        raise

    click.echo(f"wrote {target}; edit it, then: gpuprov generate -f {shell_word(target)} -o infra/", err=True)


UNIT_PATTERNS = {
    "decimal": r"^\s*[0-9][0-9_]*(\.[0-9]+)?([eE][+-]?[0-9]+)?\s*([kKmMbBgGtT]i?)?\s*$",
    "binary": r"^\s*[0-9][0-9_]*(\.[0-9]+)?([eE][+-]?[0-9]+)?\s*([kKmMbBgGtT]i?)?\s*$",
    "duration": r"^\s*[0-9]+(\.[0-9]+)?\s*[smhdw]?\s*$",
}


def spec_schema() -> dict:
    """TrainingSpec's JSON Schema, widened where the spec file takes units (`tokens: 20B`,
    `deadline_hours: 30d`), so editors accept what gpuprov accepts (and what `init` writes)."""
    schema = TrainingSpec.model_json_schema()
    for key, kind in UNIT_KEYS.items():
        prop = schema["properties"][key]
        numeric = {k: v for k, v in prop.items() if k not in ("title", "description", "default")}
        unit = {"type": "string", "pattern": UNIT_PATTERNS[kind]}
        branches = numeric["anyOf"] if "anyOf" in numeric else [numeric]
        schema["properties"][key] = {
            **{k: v for k, v in prop.items() if k in ("title", "description", "default")},
            "anyOf": [*branches, unit],
        }
    return schema


@click.command()
def schema() -> None:
    """Print the JSON Schema of the spec file (for editors and CI).

    \b
    gpuprov schema > gpuprov.schema.json
    """
    click.echo(json.dumps(spec_schema(), indent=2, sort_keys=True))
