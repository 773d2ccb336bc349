"""On-prem policy: the owner's hosts are there to be used. The plan runs on every host unless
leaving some out saves enough, and a note names the hosts left out with the reason."""

from __future__ import annotations

from typing import Any, Callable

from gpuprov.planning.search import search
from gpuprov.recipes import global_batch_tokens
from gpuprov.planning.space import Candidate, Estimator, SearchResult, _group

# Leaving an on-prem host idle must save at least this share of the objective's measure (GPU-hours
# under cost, wall time under time): the owner's machines are there to be used, and a plan that
# leaves one out for a sliver of GPU-hours runs longer for nothing.
ONPREM_LEAVE_OUT_SAVING = 0.10


def _onprem_measure(objective: str, c: Candidate) -> float:
    return c.time_hours if objective == "time" else _gpu_hours(c)


def _prefer_every_host(spec: Any, arch: Any, result: SearchResult, estimator: Estimator,
                       gpu_lookup: Callable[[str], Any]) -> Candidate:
    """On-prem: the run on every host unless leaving hosts out saves ONPREM_LEAVE_OUT_SAVING."""
    best = result.best
    if best is None:  # make_plan says why nothing fits before it asks
        raise ValueError("no candidate to prefer")
    every = min(len(spec.hosts or []), spec.max_nodes)
    if not best.instance.onprem or best.nodes >= every or spec.objective == "gpus" or spec.gpu_count:
        return best
    other = search(spec, arch, estimator=estimator, instances=[best.instance], gpu_lookup=gpu_lookup,
                   only_nodes=every).best
    if other is None:
        return best
    saving = 1 - _onprem_measure(spec.objective, best) / _onprem_measure(spec.objective, other)
    if saving >= ONPREM_LEAVE_OUT_SAVING:
        return best
    measure = "wall time" if spec.objective == "time" else "GPU-hours"
    result.every_host_note = (
        f"On-prem: the plan uses all {every} hosts. Leaving {every - best.nodes} out would save only {saving:.1%} "
        f"of {measure} ({_describe(best)}; all {every}: {_describe(other)}), under the "
        f"{ONPREM_LEAVE_OUT_SAVING:.0%} that justifies idle machines; every host also finishes sooner")
    result.best_by_group[_group(other.instance)] = other
    result.best_by_gpu[other.instance.gpu] = other
    result.best = other
    return other


def _gpu_hours(c: Candidate) -> float:
    return c.time_hours * c.total_gpus


def _describe(c: Candidate) -> str:
    cost = "" if c.cost_usd is None else f", ${c.cost_usd:,.0f}"
    return (f"{c.nodes} node{'s' if c.nodes > 1 else ''}: {c.time_hours:,.1f} h x {c.total_gpus} GPUs = "
            f"{_gpu_hours(c):,.0f} GPU-hours{cost}, {c.sharding}")


def hosts_note(spec: Any, arch: Any, best: Candidate, estimator: Estimator,
               gpu_lookup: Callable[[str], Any]) -> str | None:
    """Say which of the user's on-prem hosts the plan leaves out, why, and what all of them would do.

    The objective decides the node count among 1..len(hosts), as it does in the cloud: under `cost`
    on-prem runs rank by GPU-hours (the owner pays in machine time; a host left out stays free for
    other work), under `time` by wall time, under `gpus` by GPU count. The plan uses the first hosts
    in the order listed; the rest are named here, in `gpuprov plan`, the README and the inventory."""
    hosts = list(spec.hosts or [])
    if not hosts:
        return None
    if not best.instance.onprem:
        return (f"The plan runs on {best.instance.cloud} ({best.instance.name}); none of the {len(hosts)} on-prem "
                f"hosts listed is used (pass --cloud onprem to plan on them)")
    if best.nodes >= len(hosts):
        return None
    used, left = hosts[: best.nodes], hosts[best.nodes:]
    head = (f"On-prem: the plan uses {len(used)} of the {len(hosts)} hosts listed "
            f"({', '.join(h.name for h in used)}: the first {len(used)} in file order); left out: "
            f"{', '.join(f'{h.name} ({h.address})' for h in left)}")
    if spec.max_nodes < len(hosts) and best.nodes == spec.max_nodes:
        return f"{head}; --max-nodes {spec.max_nodes} caps the node count"
    every = min(len(hosts), spec.max_nodes)
    other = search(spec, arch, estimator=estimator, instances=[best.instance], gpu_lookup=gpu_lookup,
                   only_nodes=every).best
    ranked = {"cost": "GPU-hours (the owner pays in machine time)", "time": "wall time",
              "gpus": "GPU count"}[spec.objective]
    if other is None:
        total = every * best.instance.gpus
        batch = global_batch_tokens(spec, total)
        why = (f"on {every} hosts ({total} GPUs) the global batch of {batch:,} tokens "
               f"cannot be formed at seq-len {spec.seq_len} (one sequence per GPU is already more)"
               if spec.seq_len * total > batch else
               f"no configuration on {every} hosts fits memory and the deadline/budget")
    else:
        label = f"all {every} hosts" if every == len(hosts) else f"{every} hosts (--max-nodes {spec.max_nodes})"
        measure = _onprem_measure(spec.objective, best) / _onprem_measure(spec.objective, other)
        saved = (f"; leaving hosts out saves {1 - measure:.0%} of {'wall time' if spec.objective == 'time' else 'GPU-hours'}"
                 f" (hosts are left out only when that saves {ONPREM_LEAVE_OUT_SAVING:.0%} or more)"
                 if spec.objective != "gpus" else "")
        why = f"ranked by {ranked}: chosen {_describe(best)}; {label}: {_describe(other)}{saved}"
    hint = "; --objective time ranks by wall time" if spec.objective != "time" else ""
    return f"{head}. Why: {why}{hint}; reorder the hosts file to choose which hosts run"
