"""The planner: choose instance type, node count and parallelism for a TrainingSpec.

The work lives in gpuprov/planning/ by job: space.py (candidates, layouts, the pool), search.py
(the walk and its pruning), messages.py (what the user is told), onprem.py (the hosts policy),
assemble.py (the Plan). This module is their public face.

Search space (the same for the planner and the exhaustive brute force that checks it):
instance type x nodes (1..max_nodes; on-prem: at most one node per host listed) x sharding (single GPU: none; else ddp, zero2, fsdp, and
hsdp with shard group = k nodes for every k that divides the node count, k < nodes) x
activation checkpointing (none, selective, full) x micro-batch (1, 2, 4, ... 32); for full training,
also a model-parallel layout: tensor parallelism inside a node's NVLink domain and context
parallelism for long sequences, with FSDP/HSDP over what they leave (torchtitan's mesh).
A candidate is kept when the memory estimator's per-GPU peak fits under
gpu memory x (1 - safety margin) and the global batch can be formed
(micro_batch x seq_len x GPUs <= global batch tokens). It is then timed (sizing/throughput.py),
costed, filtered by deadline and budget, and ranked by the objective.

The planner prunes what cannot win, without changing the answer:
- instances dominated by a cheaper one with the same GPU, count, links and fabric;
- memory estimates are cached per setup (they do not depend on the instance) and the
  micro-batch scan stops at the first size that does not fit (memory grows with micro-batch);
- a lower bound per instance (pure compute at the assumed utilisation, no recompute, no
  communication; TP layouts add their unhidden TP collectives) skips instances that cannot beat
  the best found for their GPU type;
- HSDP holds at least what FSDP over every GPU holds in the same TP x CP layout: an FSDP miss
  settles the HSDP shapes (and, when FSDP fits nothing, the HSDP layouts) without the estimator.
`search(..., exhaustive=True)` turns every pruning off: the brute force.

On-prem hosts (`--hosts FILE`): the objective picks the node count among 1..len(hosts) as it does
in the cloud (cost ranks on-prem runs by GPU-hours); the plan runs on the first hosts in file order
and never leaves a host out silently: a note names the others with the reason and what all the
hosts would do, and `gpuprov plan`, the bundle README and the inventory list them (hosts_note).
"""

from __future__ import annotations

from gpuprov.planning.assemble import make_plan
from gpuprov.planning.messages import loss_reason, nothing_fits_message
from gpuprov.planning.onprem import hosts_note
from gpuprov.planning.search import search
from gpuprov.planning.space import Candidate, Miss, SearchResult, setup_for, stack_for

__all__ = ["Candidate", "Miss", "SearchResult", "hosts_note", "loss_reason", "make_plan", "nothing_fits_message",
           "search", "setup_for", "stack_for"]
