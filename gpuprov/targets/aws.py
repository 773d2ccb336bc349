"""AWS: EC2 instances from templates/terraform/aws/, EFA fabric, FSx for Lustre."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuprov.errors import GpuprovError
from gpuprov.targets.base import Target, TfvarsKeys
from gpuprov.targets.live import LiveCheck, LiveCli, q

if TYPE_CHECKING:
    from gpuprov.plan import Plan


class Aws(Target):
    name, title = "aws", "AWS"
    boot_disk_gib = 512  # each node's gp3 root volume (priced in storage_cost.py)
    image_ref_keys = ("ssm_parameter",)
    tfvars = TfvarsKeys(instance="instance_type", held="capacity_reservation_id", zone="availability_zone",
                        subnet="subnet_id", shared="shared_storage_gib")
    live = LiveCli(login=("aws", "sts", "get-caller-identity", "--output", "json"), identity_key="Account",
                   install_fix="install the AWS CLI v2: "
                               "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html",
                   login_fix="aws sso login (or aws configure)")
    held_flag = "--capacity-reservation-id"
    replaces_lost_nodes = True  # aws_instance.replacement, one per name in replaced_nodes

    def held_id(self, spec: Any, option: str) -> str | None:
        return spec.capacity_reservation_id  # one id names an ODCR or a Capacity Block

    def live_checks(self, s: dict[str, Any]) -> list[LiveCheck]:
        from gpuprov.targets import aws_live  # lazy: it reads the catalog, which imports this registry

        return aws_live.checks(s)

    def quota_family(self, instance: str) -> str:
        return instance[:1]  # EC2 quotas are per family letter: p5en -> p, g6e -> g

    def offerings_command(self, instance: str, region: str) -> str:
        return (f"aws ec2 describe-instance-type-offerings --location-type availability-zone "
                f"--filters {q('Name=instance-type,Values=' + instance)} --region {q(region)}")

    def reservation_zone_fix(self, held: str) -> str | None:
        # an ODCR or Capacity Block lives in one availability zone; the subnet must be in it
        return (f"aws ec2 describe-capacity-reservations --capacity-reservation-ids {q(held)} "
                "--query 'CapacityReservations[0].AvailabilityZone'")

    def held_zone(self, held: str, region: str | None, run: Any) -> str | None:
        from gpuprov.targets import aws_live

        return aws_live.held_zone(held, region, run)

    def held_note(self, option: str, held: str | None) -> str | None:
        if option not in ("reservation", "capacity-block"):
            return None
        other = "capacity-block" if option == "reservation" else "reservation"  # one id names either
        return f"Launching into {held} as a {option}; if it is a {other}, pass --purchase {other}"

    def node_states_argv(self, s: dict[str, Any], nodes: dict[str, str]) -> list[str] | None:
        # ids in a filter: one EC2 no longer lists is left out of the answer, not an error
        return ["aws", "ec2", "describe-instances", "--region", str(s["region"]), "--filters",
                "Name=instance-id,Values=" + ",".join(nodes.values()),
                "--query", "Reservations[].Instances[].[InstanceId,State.Name]", "--output", "json"]

    def lost_nodes(self, nodes: dict[str, str], answer: str) -> list[str]:
        import json

        from gpuprov.catalog import bringup as cat

        lost_states = set(cat.node_launch(self.name)["lost_states"])
        try:
            rows = json.loads(answer)
        except ValueError:
            rows = None
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(v, str) for v in r)
                                                 for r in rows):
            raise GpuprovError("aws ec2 describe-instances answered no [[id, state], ...] list")
        states = dict(rows)
        return [name for name, i in nodes.items() if states.get(i, "terminated") in lost_states]

    def replacement_vars(self, names: list[str], settings: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
        # aws_instance.replacement: one instance per name, for the fleet request the names were lost
        # from; names replaced under another request (a new fleet launched them again) are dropped
        request = {"node_count": settings["nodes"], "purchase_option": settings["purchase"]}
        old = earlier.get("replaced_nodes")
        kept = old.get("names") if isinstance(old, dict) and {k: old.get(k) for k in request} == request else None
        listed = set(names) | ({n for n in kept if isinstance(n, str)} if isinstance(kept, list) else set())
        return {"replaced_nodes": {"names": sorted(listed), **request}}

    def terraform_inputs(self, plan: Plan) -> dict[str, Any]:
        efa = plan.fabric.name == "efa" and plan.instance.efa_interfaces > 0
        if efa and plan.instance.network_cards < 1:
            raise GpuprovError(f"plan says EFA on {plan.instance.name} but no network cards")
        options = plan.shared_storage.options if plan.shared_storage else {}
        return {
            "efa_enabled": efa,
            "network_cards": max(1, plan.instance.network_cards),
            "capacity_reservation_id": plan.purchase.held,
            "availability_zone": plan.spec.zone,  # a reservation's zone (given, or looked up at generate)
            "placement_group_name": plan.spec.placement_group,
            "ami_ssm_parameter": plan.image.ref["ssm_parameter"] if plan.image else "",
            "root_volume_size_gib": self.boot_disk_gib,
            "shared_storage_deployment_type": options.get("deployment_type", "PERSISTENT_2"),
            "shared_storage_throughput_per_tib": options.get("throughput_mb_per_tib", 125),
        }


TARGET = Aws()
