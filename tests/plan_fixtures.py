"""Hand-built sample Plans, one per cloud, for renderer tests that must not depend on the planner.

The numbers are plausible but this is test data, not a source of truth: the catalogs are. Each
plan's fabric (name, NCCL environment, HCAs, subnet manager, MTU) is the fabric catalog's entry for
its instance, so the fixtures cannot drift from the catalog there. Tests that check real output
use `gpuprov.planner` plans as well.
"""

from __future__ import annotations

from gpuprov import __version__
from gpuprov.plan import (
    Cluster, FabricInfo, GpuInfo, Health, Host, HostCheck, InstanceInfo, Memory, ModelInfo, Plan,
    Software, Storage, Throughput, Training,
)
from gpuprov.spec import HostEntry, TrainingSpec
from gpuprov.stack import choose_stack

GiB = 2**30
TINY_LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 172, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_SHAPES = {
    # cloud: (instance, gpu slug, region, nvme count, nvme bytes, cards, efa, price). The fabric is not
    # listed: it comes from the fabric catalog for the instance (OCI cluster networks are roce, not
    # infiniband), see _fabric.
    "aws": ("p5.48xlarge", "h100-80gb", "us-east-1", 8, 3_840_000_000_000, 32, 32, 98.32),
    "gcp": ("a3-megagpu-8g", "h100-80gb", "us-central1", 16, 375_000_000_000, 8, 0, 88.25),
    "azure": ("Standard_ND96isr_H100_v5", "h100-80gb", "eastus", 8, 3_500_000_000_000, 8, 0, 98.32),
    "oci": ("BM.GPU.H100.8", "h100-80gb", "us-ashburn-1", 16, 3_840_000_000_000, 16, 0, 80.0),
    "onprem": ("hgx-h100-8", "h100-80gb", None, 8, 3_840_000_000_000, 8, 0, None),
}

# Variables added on top of the catalog's NCCL environment, for renderer tests that check a plan
# value wins over a vendor profile (the profile sets it to 0 in test_launch_render).
_EXTRA_NCCL_ENV = {"gcp": {"NCCL_FASTRAK_USE_SNAP": "1"}}


def _fabric(cloud: str, instance: str) -> FabricInfo:
    """The catalog's fabric for this instance (on-prem: the server template's), whatever the node count."""
    from gpuprov.catalog.fabrics import get_fabric
    from gpuprov.catalog.instances import get_instance

    inst = get_instance(instance)
    assert inst.cloud == cloud, (cloud, instance)
    fabric = get_fabric(inst.fabric, cloud, instance)
    return fabric.model_copy(update={"gbps_per_gpu": inst.fabric_gbps_per_gpu,
                                     "nccl_env": {**fabric.nccl_env, **_EXTRA_NCCL_ENV.get(cloud, {})}})


def sample_plan(cloud: str = "aws", nodes: int = 2, sharding: str = "hsdp", task: str = "full") -> Plan:
    instance, gpu_slug, region, nvme_n, nvme_b, cards, efa, price = _SHAPES[cloud]
    fabric = _fabric(cloud, instance)
    gpus_per_node = 8
    total = nodes * gpus_per_node
    shard_group = gpus_per_node if sharding == "hsdp" else (1 if sharding in ("ddp", "none") else total)
    spec = TrainingSpec(model="llama-3.1-8b", task=task, cloud=cloud,
                        hosts=[HostEntry(name=f"gpu{i}", address=f"10.0.0.{10 + i}") for i in range(nodes)]
                        if cloud == "onprem" else None)
    return with_bringup(Plan(
        gpuprov_version=__version__,
        spec=spec,
        model=ModelInfo(name="tiny-llama", display_name="Tiny Llama (test)", hf_model_type="llama",
                        params=1_000_000, trainable_params=1_000_000 if task == "full" else 10_000,
                        hf_config=TINY_LLAMA_CONFIG, source="test fixture"),
        task=task,
        gpu=GpuInfo(slug=gpu_slug, name="NVIDIA H100 80GB HBM3", architecture="hopper",
                    memory_bytes=79_646_851_072, bf16_tflops=989.0, fp8_tflops=1979.0,
                    nvlink_gbytes_per_s=450.0, pcie_gen=5, source="test fixture"),
        instance=InstanceInfo(cloud=cloud, name=instance, region=region, gpus=gpus_per_node, vcpus=192,
                              ram_bytes=2048 * GiB, local_nvme_count=nvme_n, local_nvme_bytes_each=nvme_b,
                              network_cards=cards, efa_interfaces=efa, nvswitch=True, pcie_gen=5,
                              price_per_hour_usd=price, price_date="2026-11-01" if price else None,
                              source="test fixture"),
        fabric=fabric,
        cluster=Cluster(cloud=cloud, region=region, instance_type=instance, gpu=gpu_slug,
                        gpus_per_node=gpus_per_node, nodes=nodes, total_gpus=total, sharding=sharding,
                        shard_group=shard_group, replicate=total // shard_group,
                        activation_checkpointing="selective", micro_batch=2, grad_accum=4, seq_len=4096,
                        global_batch_tokens=2 * 4096 * 4 * total, precision="bf16-mixed", optimizer="adamw",
                        offload="none"),
        training=Training(task=task, lora_rank=None if task == "full" else 16,
                          lora_alpha=None if task == "full" else 32,
                          lora_targets=[] if task == "full" else ["q_proj", "v_proj"], tokens=10**9,
                          steps=1000, learning_rate=3e-4, warmup_steps=50, weight_decay=0.1, grad_clip=1.0,
                          checkpoint_every_steps=200, log_every_steps=10),
        memory=Memory(per_gpu_bytes=60 * GiB, breakdown={"parameters": 10 * GiB, "activations": 50 * GiB},
                      model_states_bytes=16 * 10**9, rule_of_thumb_bytes=18 * 10**9,
                      gpu_memory_bytes=79_646_851_072, safety_margin=0.1, fits=True,
                      headroom_bytes=int(79_646_851_072 * 0.9) - 60 * GiB, assumptions=["test fixture"]),
        throughput=Throughput(tokens_per_s=1e5, mfu=0.4, mfu_assumed=0.4, mfu_source="test fixture",
                              flops_per_token=6e9, step_time_s=10.0, compute_time_s=9.0, comm_time_s=1.0,
                              bound="compute"),
        time_hours=2.8,
        cost_usd=None if price is None else round(price * nodes * 2.8, 2),
        host=Host(ram_bytes_required=1280 * GiB, cpu_cores_required=64, nvme_bytes_required=2 * 10**12,
                  checkpoint_bytes=10**11, checkpoints_kept=3,
                  checks=[HostCheck(rule="host RAM >= 1.5x GPU memory", required="960 GiB", actual="2048 GiB",
                                    ok=True, source="test fixture")],
                  bill_of_materials=["2x CPU"] if cloud == "onprem" else None),
        software=Software(os=["ubuntu-22.04", "ubuntu-24.04"], driver_branch="570", open_kernel_modules=True,
                          cuda_version="12.8", nccl_version="2.26.2-1+cuda12.8", fabric_manager=True,
                          efa_installer_version="1.43.2" if fabric.name == "efa" else None, gds=True,
                          source="test fixture"),
        storage=Storage(mount_point="/scratch", raid_name="scratch",
                        device_glob={"aws": "/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*",
                                     "gcp": "/dev/disk/by-id/google-local-nvme-ssd-*"}.get(cloud),
                        devices=nvme_n, expected_bytes=nvme_n * nvme_b),
        health=Health(nccl_allreduce_busbw_gbytes_per_s=460.0, source="test fixture"),
        hosts=spec.hosts,
        stack=choose_stack(task, "bf16-mixed", "llama"),
    ))


def with_bringup(plan: Plan, instance: str | None = None) -> Plan:
    """The plan with purchase, image, access, shared storage and bundle id as the planner fills them
    for its spec and instance type (the catalog's facts, as in a real plan)."""
    from types import SimpleNamespace

    from gpuprov import bringup_plan
    from gpuprov.catalog.instances import get_instance
    from gpuprov.errors import GpuprovError
    from gpuprov.targets.decide import decided

    try:
        inst = get_instance(instance or plan.instance.name)
    except GpuprovError:  # a made-up variant: buy it the way its cloud's sample type is bought
        inst = get_instance(_SHAPES[plan.instance.cloud][0])
    if plan.instance.cloud != "onprem":
        priced, _ = bringup_plan.priced_pool([inst], plan.spec)
        if not priced:
            raise ValueError(f"{plan.instance.name}: no purchase option of {plan.spec} buys it")
        inst = priced[0]
    needs = SimpleNamespace(checkpoint_bytes=plan.host.checkpoint_bytes, checkpoints_kept=plan.host.checkpoints_kept)
    fields = bringup_plan.bringup_fields(plan.spec, inst, plan.cluster.nodes, needs)
    return decided(plan.model_copy(update=fields))
