"""Every template interpolates user-derived values through an escaping filter (gpuprov/render/escape.py).

Static: each `{{ expression }}` of every templates/**/*.j2 that reads a user-derived value
(escape.USER_VALUES: the spec, hosts, model names and paths, and context values built from them)
must end in one of escape.ESCAPING_FILTERS. The list itself is checked against the renderers:
a plan whose every user string carries a marker is rendered, and every context value or Plan
path that then holds the marker must be listed, or be a slug of [a-z0-9-] (pre-escaped).
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
from jinja2 import nodes

from gpuprov.render import escape
from gpuprov.resources import templates_dir
from plan_fixtures import sample_plan

TEMPLATES = sorted(templates_dir().rglob("*.j2"))
MARK = "zqxjmark"
SLUGS = set(escape.SLUG_VALUES)  # pre-escaped: the renderer reduces them to [a-z0-9-]
# filters that keep an escaped value escaped (a comment shortened stays one line)
AFTER_ESCAPE = {"truncate"}
NUMERIC = {"length", "count"}  # filters whose result is a number whatever they read


def _path(node: nodes.Node) -> str | None:
    """`plan.spec.hosts[0].name` -> 'plan.spec.hosts.name' (subscripts dropped), else None."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Getattr):
        base = _path(node.node)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, nodes.Getitem):
        return _path(node.node)
    return None


def _reads(node: nodes.Node) -> list[str]:
    """Every variable path an expression reads."""
    found = []
    for sub in [node, *node.find_all((nodes.Name, nodes.Getattr, nodes.Getitem))]:
        path = _path(sub)
        if path:
            found.append(path)
    return found


def _escaped(node: nodes.Node) -> bool:
    while isinstance(node, nodes.Filter) and node.name in AFTER_ESCAPE:
        node = node.node
    return isinstance(node, nodes.Filter) and node.name in escape.ESCAPING_FILTERS | NUMERIC


def _loop_sources(tree: nodes.Template) -> dict[str, str]:
    """Loop or `set` variable -> the path it reads (`for host in plan.hosts`: host -> plan.hosts)."""
    sources = {}
    for assign in tree.find_all(nodes.Assign):  # {% set r = region %}
        if isinstance(assign.target, nodes.Name) and _reads(assign.node):
            sources[assign.target.name] = _reads(assign.node)[0]
    for loop in tree.find_all(nodes.For):
        source = _path(loop.iter)
        for target in loop.target.find_all(nodes.Name) if not isinstance(loop.target, nodes.Name) else [loop.target]:
            if source:
                sources[target.name] = source
    return sources


def _resolved(path: str, loops: dict[str, str]) -> str:
    head, _, rest = path.partition(".")
    return loops[head] + ("." + rest if rest else "") if head in loops else path


def unescaped_user_values(source: str) -> list[str]:
    env = jinja2.Environment(comment_start_string="<#-", comment_end_string="-#>")
    tree = env.parse(source)
    loops = _loop_sources(tree)
    problems = []
    for output in tree.find_all(nodes.Output):
        for expr in output.nodes:
            if isinstance(expr, nodes.TemplateData) or _escaped(expr):
                continue
            bad = [p for p in map(lambda p: _resolved(p, loops), _reads(expr)) if _listed(p)]
            if bad:
                problems.append(f"line {expr.lineno}: {bad[0]}")
    return problems


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.relative_to(templates_dir()).as_posix())
def test_template_escapes_user_values(template: Path) -> None:
    assert unescaped_user_values(template.read_text()) == []


def test_the_check_fails_on_raw_interpolation() -> None:
    assert unescaped_user_values("# {{ plan.model.display_name }}\n") == ["line 1: plan.model.display_name"]
    assert unescaped_user_values("{% for h in plan.hosts %}{{ h.name }}:{% endfor %}") == ["line 1: plan.hosts.name"]
    assert unescaped_user_values('zone = "{{ region }}-a"') == ['line 1: region']
    assert unescaped_user_values("x: {{ plan.spec.region | upper }}") == ["line 1: plan.spec.region"]
    assert unescaped_user_values("x: {{ plan.spec.region | yaml }} {{ plan.cluster.nodes }}") == []
    assert unescaped_user_values("# {{ plan.notes | comment | truncate(9) }}") == []
    assert unescaped_user_values("{% set r = region %}x = {{ r }}") == ["line 1: region"]


# ---- the list of user-derived values is complete ------------------------------------------------

def _marked_plan(cloud: str):
    """The sample plan with a marker in every user-string field (validators bypassed on purpose)."""
    plan = sample_plan(cloud, nodes=2)
    spec = plan.spec.model_copy(update={
        "region": f"r{MARK}", "ssh_cidr": f"c{MARK}", "capacity_reservation_id": f"cr{MARK}",
        "reservation": f"g{MARK}", "model": f"/m/{MARK}/config.json"})
    hosts = [h.model_copy(update={"name": f"n{MARK}{i}", "address": f"a{MARK}{i}", "user": f"u{MARK}"})
             for i, h in enumerate(plan.hosts or [])]
    model = plan.model.model_copy(update={"name": f"/m/{MARK}/config.json", "display_name": f"d{MARK}",
                                          "source": f"s{MARK}",
                                          "hf_config": {**plan.model.hf_config, f"k{MARK}": f"v{MARK}"}})
    return plan.model_copy(update={
        "spec": spec.model_copy(update={"hosts": hosts or None}), "hosts": hosts or plan.hosts, "model": model,
        "cluster": plan.cluster.model_copy(update={"region": f"r{MARK}"}),
        "instance": plan.instance.model_copy(update={"region": f"r{MARK}"}),
        "notes": [*plan.notes, f"note {MARK}"]})


def _contexts(plan) -> dict[str, object]:
    from gpuprov.render import ansible, launch, terraform
    from gpuprov.targets import get_target

    found: dict[str, object] = {}
    if plan.instance.cloud != "onprem":
        found.update(terraform._common(plan))
        found.update(get_target(plan.instance.cloud).terraform_inputs(plan))
    found.update(launch._context(plan))
    found.update({"hosts_left_out": ansible.hosts_left_out(plan)})
    return found


def _marked_paths(value: object, path: str) -> list[str]:
    if hasattr(type(value), "model_fields"):
        return [p for name in type(value).model_fields for p in _marked_paths(getattr(value, name), f"{path}.{name}")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _marked_paths(v, path) + ([path] if MARK in str(k) else [])]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _marked_paths(v, path)]
    return [path] if MARK in str(value) else []


def _listed(path: str) -> bool:
    return any(path == u or path.startswith(u + ".") for u in escape.USER_VALUES)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci", "onprem"])
def test_user_values_list_is_complete(cloud: str) -> None:
    plan = _marked_plan(cloud)
    assert "plan.spec.region" in _marked_paths(plan, "plan")  # the marker made it in
    unlisted = sorted({p for p in _marked_paths(plan, "plan") if not _listed(p)})
    assert unlisted == [], "Plan fields holding user strings, missing from escape.USER_VALUES"
    for name, value in _contexts(plan).items():
        if name == "plan" or not _marked_paths(value, name):
            continue
        if name in SLUGS:
            for text in (value.values() if isinstance(value, dict) else [value]):
                assert re.fullmatch(r"[a-z0-9-]+", str(text)), f"{name} is not a slug: {text!r}"
        else:
            assert _listed(name), f"context value {name} holds user input but is not in escape.USER_VALUES"


def test_the_printable_fast_path_never_passes_an_unsafe_character() -> None:
    """comment() and svg() skip their per-character scan for a printable text: no code point is both."""
    both = [cp for cp in range(0x110000) if chr(cp).isprintable() and escape._unsafe_char(chr(cp))]
    assert both == []
    # and the scan still runs where it must: a control, a format character, a line separator
    for bad in ("\x07", "\u202e", "\ue000"):  # a control, a format character, a private-use one
        assert escape.comment(f"a{bad}b") == escape.svg(f"a{bad}b") == "a?b"
    assert escape.svg("a\u2028b") == "a?b"
    assert escape.comment("a\u2028b") == "a b"  # a line separator is whitespace there: one space
