"""Helpers for the bundle/generate/check/up tests: renderer sets that do not wait on other helpers.

`available_renderers()` is the real renderers that exist in this build (skipping only the ones
truly absent); `standin_renderers()` adds minimal, valid Terraform/Ansible/launch files for tests
about the bundle machinery itself (writing, swapping, bring-up order), not about renderer content.
"""

from __future__ import annotations

import importlib.util

from gpuprov.bundle import RENDERERS, load_renderer


def module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def available_renderers() -> list:
    found = []
    for folder, module, attr in RENDERERS:
        function = load_renderer(module, attr)
        if function is not None:
            found.append((folder, function))
    return found


def all_pieces_present() -> bool:
    return module_present("gpuprov.planner") and all(module_present(m) for _, m, _ in RENDERERS)


def _terraform(plan) -> dict:
    if plan.cluster.cloud == "onprem":
        return {}
    return {
        "main.tf": 'terraform {\n  required_version = ">= 1.5"\n}\n\n'
                   'output "ansible_inventory" {\n  value = {}\n}\n',
    }


def _ansible(plan) -> dict:
    files = {"site.yml": "- name: GPU nodes\n  hosts: gpu_nodes\n  gather_facts: false\n  tasks:\n"
                         "    - name: Ping\n      ansible.builtin.ping:\n      tags: [health]\n"}
    if plan.hosts:
        hosts = "".join(f"        {h.name}:\n          ansible_host: {h.address}\n" for h in plan.hosts)
        files["inventory.yml"] = f"all:\n  children:\n    gpu_nodes:\n      hosts:\n{hosts}"
    return files


def _launch(plan) -> dict:
    return {"train.sh": "#!/usr/bin/env bash\nset -euo pipefail\necho train\n",
            "env.sh": "#!/usr/bin/env bash\nexport NCCL_DEBUG=WARN\n"}


def standin_renderers() -> list:
    from gpuprov.render.report import render_report

    return [("terraform", _terraform), ("ansible", _ansible), ("launch", _launch), ("", render_report)]
