"""Host sizing: the sourced rules of thumb against cloud instances, and on-prem bills of materials."""

from __future__ import annotations

from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.instances import get_instance
from gpuprov.host import check_host, host_needs, make_host, rules, size_onprem

GiB = 2**30


def _needs(inst_name: str, *, nodes=1, params=8_000_000_000, trainable=None, task="full", tokens=10**10,
           offload="none"):
    inst = get_instance(inst_name)
    gpu = get_gpu(inst.gpu)
    return inst, host_needs(gpu_memory_bytes=gpu.memory_bytes, gpus_per_node=inst.gpus, nodes=nodes,
                            params=params, trainable=params if trainable is None else trainable, tokens=tokens,
                            task=task, offload=offload)


def _check(checks, prefix):
    return next(c for c in checks if c.rule.startswith(prefix))


def test_ram_rule_is_one_and_a_half_to_two_times_gpu_memory():
    inst, needs = _needs("p5.48xlarge")
    gpu_mem = get_gpu("h100-80gb").memory_bytes * 8
    assert needs.ram_min_bytes == int(gpu_mem * 1.5) or abs(needs.ram_min_bytes - gpu_mem * 1.5) < 2
    assert abs(needs.ram_recommended_bytes - gpu_mem * 2) < 2
    # offloading the optimizer adds 12 B/param of host RAM, split over the nodes
    _, off = _needs("p5.48xlarge", nodes=2, offload="optimizer")
    assert off.ram_min_bytes - needs.ram_min_bytes == 8_000_000_000 * 12 // 2


def test_checkpoint_is_16_bytes_per_trainable_param():
    _, full = _needs("p5.48xlarge", params=70_000_000_000)
    assert full.checkpoint_bytes == 70_000_000_000 * rules()["nvme"]["checkpoint_bytes_per_param"]
    assert full.checkpoints_kept == 3
    _, lora = _needs("p5.48xlarge", params=70_000_000_000, trainable=200_000_000, task="lora")
    assert lora.checkpoint_bytes == 200_000_000 * 16
    assert lora.nvme_bytes < full.nvme_bytes


def test_p5_passes_every_rule():
    inst, needs = _needs("p5.48xlarge", nodes=4)
    checks = check_host(inst, needs)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert any("Gb/s per GPU" in c.rule for c in checks)  # multi-node adds the fabric rule
    assert all(c.source for c in checks)


def test_small_cloud_instances_fall_short_where_they_do():
    inst, needs = _needs("g5.xlarge")  # 16 GiB RAM, 4 vCPUs for a 24 GB A10G
    checks = check_host(inst, needs)
    assert not _check(checks, "host RAM").ok
    assert not _check(checks, "CPU cores").ok
    inst, needs = _needs("g5.48xlarge", nodes=2)  # 100 Gbps for 8 GPUs = 12.5 per GPU
    checks = check_host(inst, needs)
    fabric = _check(checks, "fabric")
    assert not fabric.ok and "12.5" in fabric.actual
    assert not _check(checks, "NIC and NVMe").ok  # no GPUDirect RDMA path across nodes


def test_single_node_skips_the_fabric_rule():
    inst, needs = _needs("g6e.12xlarge")
    assert not any(c.rule.startswith("fabric") for c in check_host(inst, needs))


def test_onprem_template_is_sized_by_the_rules():
    tmpl, needs = _needs("hgx-h100-8", nodes=2, params=70_000_000_000, tokens=10**11)
    assert tmpl.ram_bytes is None and tmpl.vcpus is None
    sized, bom = size_onprem(tmpl, needs)
    assert sized.ram_bytes >= needs.ram_recommended_bytes
    assert sized.vcpus // 2 >= needs.cores_recommended
    assert sized.nvme_bytes_total >= needs.nvme_bytes
    assert sized.network_cards == 8  # one 400 Gb/s NIC per GPU
    host = make_host(sized, needs, bom)
    assert all(c.ok for c in host.checks)
    assert host.bill_of_materials and any("RAM:" in line for line in bom) and any("NVMe" in line for line in bom)


def test_onprem_entry_box_shares_nics():
    tmpl, needs = _needs("l40s-2x-entry")
    sized, bom = size_onprem(tmpl, needs)
    assert sized.network_cards == 1
    assert sized.ram_bytes >= 2 * get_gpu("l40s-48gb").memory_bytes * 2
