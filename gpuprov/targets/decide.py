"""The target's bring-up decisions, recorded in the Plan (`Plan.provisioning`, `Plan.infra`) when it is made.

Renderers (render/ansible.py, render/launch.py, render/terraform.py) read the record; the rules live
in the target module (gpuprov/targets/<name>.py) and here, once.
"""

from __future__ import annotations

from gpuprov.plan import SHARED_MOUNT, Infra, Plan, Provisioning
from gpuprov.targets import get_target


def checkpoint_root(plan: Plan) -> str:
    """Several nodes: the filesystem they all mount (a node-local array cannot hold the other
    nodes' shards for a resume; on-prem: the site's NFS at /shared); one node: its NVMe array."""
    if plan.cluster.nodes == 1:
        return plan.storage.mount_point.rstrip("/")
    shared = plan.shared_storage.mount_point if plan.shared_storage else SHARED_MOUNT
    return shared.rstrip("/")


def provisioning_for(plan: Plan) -> Provisioning:
    target = get_target(plan.instance.cloud)
    return Provisioning(
        target=plan.instance.cloud, provisioner=target.provisioner,
        # a fabric nobody stated (plan.fabric.probe) gets no role: the bring-up skips it and says why
        fabric_role=None if plan.fabric.probe else target.fabric_role(plan.fabric.name),
        # cuFile needs a local filesystem to serve: GDS only where the plan has the RAID
        gds=bool(plan.software.gds and plan.storage.devices > 0),
        checkpoint_root=checkpoint_root(plan), reboot_allowed=target.reboot_allowed)


def infra_for(plan: Plan) -> Infra:
    """What the target's Terraform templates read, decided once for this plan (nothing for an inventory)."""
    target = get_target(plan.instance.cloud)
    target.check_nodes(plan.cluster.nodes)
    inputs = target.terraform_inputs(plan) if target.provisioner == "terraform" else {}
    return Infra(target=plan.instance.cloud, inputs=inputs)


def decided(plan: Plan) -> Plan:
    """The plan with its target's decisions recorded."""
    from gpuprov.staging import staging_for

    plan = plan.model_copy(update={"provisioning": provisioning_for(plan), "infra": infra_for(plan)})
    return plan.model_copy(update={"staging": staging_for(plan)})
