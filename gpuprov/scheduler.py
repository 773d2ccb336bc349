"""The batch scheduler decision: does the bundle install Slurm, use one the site has, or none,
and where its controller runs. One rule for every target; the Plan carries the result.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data


@lru_cache(maxsize=1)
def catalog() -> dict:
    return load_data("scheduler.yaml")


def decide(spec: Any, cloud: str, nodes: int, hosts: list | None = None, head_node: str | None = None) -> Any:
    """Plan.scheduler for a cluster of `nodes` on `cloud` (spec.slurm: auto, install, existing, none).

    auto: Slurm on multi-node clusters (requeue on node failure, one `sbatch`); one node runs
    torchrun directly. existing (on-prem): the site's Slurm; the bundle renders jobs only.
    """
    from gpuprov.plan import Scheduler

    cat = catalog()
    want = getattr(spec, "slurm", "auto")
    partition = cat["slurm"]["partition"]
    requeues = int(cat["slurm"]["max_requeues"])
    source = f"{cat['slurm']['source']} ({cat['slurm']['date']})"
    if want == "none" or (want == "auto" and nodes < 2):
        why = "asked for none" if want == "none" else "one node: torchrun runs directly, no scheduler needed"
        return Scheduler(kind="none", reason=why, source=source)
    if want == "existing":
        return Scheduler(kind="existing", controller="site", max_requeues=requeues,
                         reason="the site's Slurm runs the job in its default partition (sbatch -p NAME for "
                                "another); the bundle renders the job script only",
                         source=source)
    install = {"packages": {k: list(v) for k, v in cat["slurm"]["packages"].items()},
               "nvml_plugin_package": cat["slurm"]["nvml_plugin_package"], "partition": partition,
               "max_requeues": requeues,
               "source": source}
    if head_node:
        return Scheduler(kind="slurm", controller="head-node", controller_host=head_node,
                         reason=" ".join(cat["controller"]["head_node_reason"].split()), **install)
    # on-prem the first host of the list; on clouds the first node of terraform's inventory
    first = hosts[0].name if hosts else None
    return Scheduler(kind="slurm", controller="first-node", controller_host=first,
                     reason=" ".join(cat["controller"]["first_node_reason"].split()), **install)
