"""Render the Ansible bundle for a plan: the glue (site.yml, health.yml, group_vars/all.yml,
ansible.cfg, and inventory.yml on-prem) from templates/ansible/, plus every role of the repo's
ansible/roles/ copied as it is. Paths are relative to the bundle's ansible/ folder.

The renderer only reads the plan: which fabric role runs follows plan.fabric.name and the cloud,
every version and threshold comes from plan.software / plan.fabric / plan.storage / plan.health.
"""

from __future__ import annotations

from pathlib import Path

from gpuprov import __version__
from gpuprov.errors import GpuprovError
from gpuprov.host import hosts_left_out
from gpuprov.plan import Plan
from gpuprov.render import RenderedFiles
from gpuprov.render.escape import FILTERS, yaml_flow, yaml_string
from gpuprov.resources import ansible_dir, templates_dir

GLUE = ("ansible.cfg", "site.yml", "health.yml", "group_vars/all.yml")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")


def fabric_role(plan: Plan) -> str | None:
    """The role that sets up this plan's fabric on the hosts (None: nothing beyond Ethernet)."""
    name = plan.fabric.name
    if name == "efa":
        return "efa"
    if plan.instance.cloud == "gcp" and name in ("roce", "tcpxo"):
        return "gcp_rdma"
    if name in ("infiniband", "roce"):
        return "infiniband"
    if name == "tcpxo":
        raise GpuprovError(f"fabric tcpxo exists only on GCP, not {plan.instance.cloud}")
    return None


_FLOW_WIDTH = 100  # longer collections go block style: yamllint (ansible-lint) allows 160 a line


def _yaml(value: object) -> str:
    """A value for `key: {{ value | yaml }}`: JSON flow style (JSON is YAML; strings stay quoted
    and escaped), or an indented block under the key when the flow form would be too long."""
    flow = yaml_flow(value)
    if len(flow) <= _FLOW_WIDTH or not value or not isinstance(value, (dict, list, tuple)):
        return flow
    if isinstance(value, dict):
        items = [f"{yaml_string(str(k))}: {yaml_flow(v)}" for k, v in value.items()]
    else:
        items = [f"- {yaml_flow(v)}" for v in value]
    return "".join(f"\n  {item}" for item in items)


def _environment():
    import jinja2  # lazy: `gpuprov plan` must start fast

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir() / "ansible")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters.update(FILTERS)
    env.filters["yaml"] = _yaml
    return env


def copy_roles(roots: Path | None = None) -> RenderedFiles:
    """Every file of every role under ansible/roles/, keyed roles/<role>/<path> (text only)."""
    root = (roots or ansible_dir()) / "roles"
    files: RenderedFiles = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or _SKIP_PARTS & set(rel.parts) or path.name.endswith(_SKIP_SUFFIXES):
            continue
        try:
            files[f"roles/{rel.as_posix()}"] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise GpuprovError(f"role file {rel} is not UTF-8 text; roles must ship text only") from exc
    if not files:
        raise GpuprovError(f"no Ansible roles found under {root}")
    return files


def render_ansible(plan: Plan) -> RenderedFiles:
    storage = plan.storage.devices > 0
    context = {
        "plan": plan,
        "version": __version__,
        "fabric_role": fabric_role(plan),
        "storage": storage,
        # cuFile needs a local filesystem to serve: GDS only where the plan has the RAID
        "gds": bool(plan.software.gds and storage),
        "forks": max(10, min(100, plan.cluster.nodes)),
        "hosts_left_out": hosts_left_out(plan),
    }
    env = _environment()

    def render(name: str) -> str:
        # no trailing spaces (yamllint), e.g. after `key:` when `| yaml` wrote a block
        text = env.get_template(f"{name}.j2").render(context)
        return "\n".join(line.rstrip() for line in text.split("\n"))

    files: RenderedFiles = {name: render(name) for name in GLUE}
    if plan.instance.cloud == "onprem":
        if not plan.hosts:
            raise GpuprovError("an on-prem plan needs hosts (--hosts FILE) for the Ansible inventory")
        files["inventory.yml"] = render("inventory.yml")
    files.update(copy_roles())
    return files
