"""Helpers for the bundle/generate/check/up tests.

`standin_renderers()` gives minimal, valid Terraform/Ansible/launch files for tests about the
bundle machinery itself (writing, swapping, bring-up order), not about renderer content; the
real renderers are tested in their own modules and end to end in test_generate_cli/test_examples.
"""

from __future__ import annotations


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
