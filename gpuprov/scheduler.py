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


def profile_build(name: str) -> tuple[str, Any]:
    """(OS id, SlurmBuild) of one image profile: the build images.yaml names, from scheduler.yaml."""
    from gpuprov.catalog import images
    from gpuprov.plan import SlurmBuild

    profile = images.profile(name)
    build_name = profile["slurm"]["build"]
    entry = catalog()["slurm"]["builds"][build_name]
    return profile["os"], SlurmBuild(
        name=build_name, version=str(entry["version"]),
        packages={k: list(v) for k, v in entry["packages"].items()},
        nvml_plugin_package=entry.get("nvml_plugin_package") or "", cgroup_plugin=entry["cgroup_plugin"],
        proctrack=entry["proctrack"], task_plugin=entry["task_plugin"], plugin_dirs=list(entry["plugin_dirs"]),
        source=f"{' '.join(str(entry['source']).split())} ({entry['date']}); image profile {name}: "
               f"{' '.join(str(profile['slurm']['source']).split())}")


def builds(cloud: str, instance: str | None) -> dict[str, Any]:
    """OS id -> the SlurmBuild the image of that OS gets: the cloud's one image profile, or every
    on-prem profile (each host then takes its own OS's entry)."""
    from gpuprov.catalog import images

    names = ([n for n, p in images.profiles().items() if p["cloud"] == "onprem"] if cloud == "onprem"
             else [images.profile_for(cloud, instance or "")])
    return dict(profile_build(name) for name in names)


def node_size(instance: Any) -> dict[str, int | None]:
    """Every node's CPUs and RealMemory (MiB) for slurm.conf, from the plan's instance: a fraction of
    the nominal memory (the kernel keeps some; a node reporting less than RealMemory is drained).
    On-prem facts the hosts file does not state stay None."""
    if instance is None:
        return {"node_cpus": None, "node_real_memory_mb": None}
    unknown = set(getattr(instance, "unknown", ()) or ())
    rule = catalog()["slurm"]["node_memory"]
    cpus = instance.vcpus
    if instance.cloud == "onprem":  # the hosts file states physical cores (vcpus assumes 2 threads each)
        cpus = instance.vcpus // 2 if instance.vcpus else None
    mem = int(instance.ram_bytes / 2**20 * float(rule["fraction"])) if instance.ram_bytes else None
    return {"node_cpus": None if "cores" in unknown else cpus, "node_real_memory_mb": None if "ram" in unknown else mem}


def records(shared_mount: str | None) -> dict[str, Any]:
    """Where slurmctld keeps its state and job completion records, and the requeue and health rules."""
    cat = catalog()["slurm"]
    state = f"{shared_mount.rstrip('/')}/{cat['state_dir_shared']}" if shared_mount else cat["state_dir_local"]
    return {"state_save_location": state, "jobcomp_loc": f"{state}/jobcomp.log",
            "max_requeues_without_progress": int(cat["max_requeues_without_progress"]),
            "health_check_interval": int(cat["health_check_interval"])}


def decide(spec: Any, cloud: str, nodes: int, hosts: list | None = None,
           instance: Any = None, shared_mount: str | None = None) -> Any:
    """Plan.scheduler for a cluster of `nodes` on `cloud` (spec.slurm: auto, install, existing, none).

    auto: Slurm on multi-node clusters (requeue on node failure, one `sbatch`); one node runs
    torchrun directly. existing (on-prem): the site's Slurm; the bundle renders jobs only.
    """
    from gpuprov.plan import Scheduler

    cat = catalog()
    want = getattr(spec, "slurm", "auto")
    partition = cat["slurm"]["partition"]
    requeues = int(cat["slurm"]["max_requeues"])
    source = f"{' '.join(str(cat['slurm']['source']).split())} ({cat['slurm']['date']}); " \
             f"{' '.join(str(cat['slurm']['records_source']).split())}"
    if want == "none" or (want == "auto" and nodes < 2):
        why = "asked for none" if want == "none" else "one node: torchrun runs directly, no scheduler needed"
        return Scheduler(kind="none", reason=why, source=source)
    if want == "existing":
        return Scheduler(kind="existing", controller="site", max_requeues=requeues,
                         max_requeues_without_progress=records(None)["max_requeues_without_progress"],
                         reason="the site's Slurm runs the job in its default partition (sbatch -p NAME for "
                                "another); the bundle renders the job script only",
                         source=source)
    install = {"builds": builds(cloud, getattr(instance, "name", None)), "partition": partition,
               "max_requeues": requeues, "set_hostname": cloud != "onprem", "source": source,
               **node_size(instance), **records(shared_mount)}
    # on-prem the first host of the list; on clouds the first node of terraform's inventory
    first = hosts[0].name if hosts else None
    return Scheduler(kind="slurm", controller="first-node", controller_host=first,
                     reason=" ".join(cat["controller"]["first_node_reason"].split()), **install)
