"""What a target (a place gpuprov brings nodes up) must say, in one place per target.

A target is a cloud, an on-prem host list, or later a Kubernetes cluster. Its module answers:
which catalog entries it serves (`serves`), the limits the planner obeys (`limits`), how nodes come
to exist (`provisioner`: Terraform templates/terraform/<name>/ or the user's inventory), the
Terraform inputs its templates read (`terraform_inputs`), the image reference keys and tfvars keys
the pre-flight reads, the fabric role that sets up its fabric, and its live checks (`live`, `live_checks`).
Renderers, the planner and the pre-flight ask the target; none of them branches on a cloud name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gpuprov.errors import GpuprovError
from gpuprov.targets.live import LiveCheck, LiveCli

if TYPE_CHECKING:  # the Plan model imports pydantic; targets stay cheap to import (catalog, click choices)
    from gpuprov.plan import Plan


@dataclass(frozen=True)
class Limits:
    """What the planner must obey on this target."""

    max_nodes: int | None = None  # nodes one placement unit holds (None: the spec's --max-nodes only)
    why: str = ""  # the rule in words, for the planner's messages
    source: str = ""  # the page that states it


@dataclass(frozen=True)
class TfvarsKeys:
    """Names of the Terraform variables that carry the plan's instance, region, reservation and zone."""

    instance: str
    region: str = "region"
    held: str = ""  # "" when the target takes no reservation id
    zone: str = "zone"
    subnet: str = ""  # the user's own subnet, whose routes the live checks inspect ("" when none are)
    shared: str = ""  # the variable that switches the shared filesystem off (0 / false)


class Target:
    """Defaults shared by every target; a target module subclasses it and sets what differs."""

    name: str = ""
    title: str = ""
    provisioner: Literal["terraform", "inventory"] = "terraform"
    limits: Limits = Limits()
    image_ref_keys: tuple[str, ...] = ()  # keys of its bringup.yaml image entry the templates read
    tfvars: TfvarsKeys | None = None
    live: LiveCli | None = None  # validate's live checks reach this target's CLI (None: it has none)
    held_flag: str = "--reservation"  # the flag that names a reservation the user holds here

    def serves(self, instance: Any) -> bool:
        """Whether a catalog instance entry is bought here."""
        return bool(instance.cloud == self.name)

    def node_cap(self, max_nodes: int, hosts: int | None = None) -> int:
        """The most nodes the planner may try: the spec's cap within this target's limit."""
        return max_nodes if self.limits.max_nodes is None else min(max_nodes, self.limits.max_nodes)

    def check_nodes(self, nodes: int) -> None:
        """One-line refusal for a node count beyond this target's limit (a hand-edited plan)."""
        cap = self.limits.max_nodes
        if cap is not None and nodes > cap:
            raise GpuprovError(f"{self.title}: {nodes} nodes exceed {self.limits.why}; plan at most {cap} nodes")

    def held_id(self, spec: Any, option: str) -> str | None:
        """The reservation id the user holds for `option` here (None: none given, or none applies)."""
        return None

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        """The variables this target's Terraform templates read beyond the common ones."""
        return {}

    def generate_note(self, plan: Plan) -> str | None:
        """One line generate prints about what this target's bundle could not default (None: nothing)."""
        return None

    def live_checks(self, s: dict[str, Any]) -> list[LiveCheck]:
        """validate's live checks for these settings (terraform.tfvars over the plan); `live` says how to log in."""
        return []

    def quota_family(self, instance: str) -> str:
        """The name the cloud's quota for `instance` is kept under (the catalog's quota entry is keyed by it)."""
        return instance

    def offerings_command(self, instance: str, region: str) -> str:
        """A command that lists where `instance` is offered in `region` ("": none to suggest)."""
        return ""

    def reservation_zone_fix(self, held: str) -> str | None:
        """A command that prints the zone of reservation `held`, where the tfvars must name that zone
        (None: the templates find the zone themselves)."""
        return None

    def held_zone(self, held: str, region: str | None, run: Any) -> str | None:
        """The zone reservation `held` lives in, asked of the signed-in CLI through `run` (None: unknown)."""
        return None

    def held_note(self, option: str, held: str | None) -> str | None:
        """What the plan's note says about launching into a held reservation (None: nothing to add)."""
        return None

    def connection_problem(self, plan: Plan, value: Any) -> str | None:
        """Why Ansible could not reach this target's nodes with these Terraform values (None: it can).
        `value(name, default)` reads a variable as `terraform plan` will (TF_VAR_, tfvars, default)."""
        return None

    replaces_lost_nodes = False  # `up` finds nodes the cloud no longer runs and has Terraform replace them

    @property
    def keeps_node_names(self) -> bool:
        """Whether a replacement comes back under the lost node's name (catalog node_launch.<cloud>
        same_names; true where the catalog states nothing else)."""
        from gpuprov.catalog import bringup as cat

        return bool(cat.node_launch(self.name).get("same_names", True))

    def node_states_argv(self, s: dict[str, Any], nodes: dict[str, str]) -> list[str] | None:
        """The CLI call that lists the states of the recorded nodes ({name: instance id}) for the
        values the bundle applies with (`s`: preflight.settings, and under "outputs" the values of
        the recorded `terraform output -json`); None: not looked for here."""
        return None

    def lost_nodes(self, nodes: dict[str, str], answer: str) -> list[str]:
        """The names of `nodes` the cloud no longer runs, from node_states_argv's output (a
        GpuprovError when the answer cannot be read)."""
        raise GpuprovError(f"{self.title}: lost nodes are not looked for")

    def replacement_vars(self, names: list[str], settings: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
        """The Terraform variables that replace the lost nodes `names` under their names, for the
        values the bundle applies with (`settings`: preflight.settings), keeping what `earlier` (the
        variables an earlier run wrote) still holds."""
        raise GpuprovError(f"{self.title}: lost nodes are not replaced")

    reboot_allowed = True  # the bundle's roles may reboot nodes it created
    boot_disk_gib = 0  # each node's boot disk the Terraform creates (0: none, an inventory target)

    def plan_fabric(self, fabric: Any, unknown: tuple[str, ...] | list[str], nodes: int) -> Any:
        """The fabric the plan records for these nodes (a cloud's catalog entry is a fact: as is)."""
        return fabric

    def fabric_role(self, fabric: str) -> str | None:
        """The Ansible role that sets up `fabric` on this target's hosts (None: nothing beyond Ethernet)."""
        if fabric == "efa":
            return "efa"
        if fabric in ("infiniband", "roce"):
            return "infiniband"
        if fabric == "tcpxo":
            raise GpuprovError(f"fabric tcpxo exists only on GCP, not {self.name}")
        return None


HEAD_HOW = ('set bastion_cidr = "<your address>/32" in terraform/terraform.tfvars (the CIDR allowed to SSH to '
            'the head, the jump host the bundle creates), or bastion_host = "user@host" (a jump host of your '
            'own in the network), or ssh_cidr (public node addresses, SSH from that CIDR)')


def head_connection_problem(plan: Plan, value: Any) -> str | None:
    """Azure and OCI: the nodes are private; the head (a jump host VM), the user's own bastion_host
    or public addresses (ssh_cidr) lead to them."""
    if value("bastion_host", None) or value("ssh_cidr", plan.spec.ssh_cidr):
        return None
    head_default = plan.access is not None and plan.access.method == "bastion"
    if value("create_head", head_default) in (False, "false"):
        return f"create_head is false and the nodes have no public address: the nodes cannot be reached; {HEAD_HOW}"
    if not value("bastion_cidr", None):
        return f"the head (jump host) admits SSH from bastion_cidr, which is not set; {HEAD_HOW}"
    return None

