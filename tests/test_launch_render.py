"""render_launch: every planned number reaches train.yaml, env.sh exports exactly the plan's fabric
environment, and the shell scripts parse and build the right torchrun / srun command lines.

Fast (no torch): the scripts run with TORCHRUN=echo and fake Slurm tools; test_trainer.py runs them
for real.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuprov.errors import GpuprovError
from gpuprov.plan import SHARED_MOUNT
from gpuprov.render.launch import render_launch, yaml_value
from gpuprov.stack import choose_stack
from plan_fixtures import TINY_LLAMA_CONFIG, sample_plan

CLOUDS = ("aws", "gcp", "azure", "oci", "onprem")
BASH = shutil.which("bash")


def write(files: dict[str, str], root: Path) -> Path:
    launch = root / "launch"
    launch.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (launch / name).write_text(text)
        if name.endswith((".sh", ".sbatch")):
            (launch / name).chmod(0o755)
    return launch


def with_fabric(plan, **update):
    return plan.model_copy(update={"fabric": plan.fabric.model_copy(update=update)})


@pytest.mark.parametrize("cloud", CLOUDS)
def test_files_and_scripts_parse(cloud, tmp_path):
    files = render_launch(sample_plan(cloud))
    trainer = {"train.py", "parallel.py", "prepare_data.py", "train_config.py", "train_runtime.py", "train_model.py",
               "train_data.py", "train_optim.py", "train_checkpoint.py", "train_metrics.py", "train_pipeline.py",
               "train_attention.py"}
    assert set(files) == {"env.sh", "train.sh", "slurm.sbatch", "train.yaml", "fetch_weights.sh", "stage_data.sh"} | trainer
    launch = write(files, tmp_path)
    for name in ("env.sh", "train.sh", "slurm.sbatch", "fetch_weights.sh", "stage_data.sh"):
        subprocess.run([BASH, "-n", str(launch / name)], check=True)
    compile(files["train.py"], "train.py", "exec")
    assert render_launch(sample_plan(cloud)) == files  # pure: same plan, same bytes


def test_trainer_is_standalone():
    """The cluster runs train.py without gpuprov installed: its files import only each other and
    third-party packages, and every sibling it imports ships."""
    files = render_launch(sample_plan())
    imported: set[str] = set()
    for name, text in files.items():
        if name.endswith(".py"):
            tree = ast.parse(text)
            imported |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "gpuprov" not in imported
    assert {"torch", "yaml", "numpy"} <= imported
    siblings = {m for m in imported if m.startswith("train_") or m == "parallel"}
    assert siblings and all(f"{m}.py" in files for m in siblings)


@pytest.mark.parametrize("cloud,nodes,sharding,task", [("aws", 2, "hsdp", "full"), ("gcp", 1, "fsdp", "lora"),
                                                       ("azure", 2, "ddp", "full"), ("oci", 1, "fsdp", "qlora")])
def test_rendered_train_yaml_passes_the_trainers_typed_config(cloud, nodes, sharding, task):
    """Every key the template writes is one the trainer knows, with a value of the right type."""
    import importlib.util

    from gpuprov.resources import templates_dir

    spec = importlib.util.spec_from_file_location("train_config_under_test", templates_dir() / "launch" / "train_config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    cfg = module.from_dict(yaml.safe_load(render_launch(sample_plan(cloud, nodes, sharding, task))["train.yaml"]))
    assert cfg.parallel.sharding == sharding and cfg.task.kind == task
    # the trainer takes every value the planner can write
    import typing

    from gpuprov.plan import Cluster
    from gpuprov.sizing import types

    choices = lambda cls, name: set(typing.get_args(typing.get_type_hints(cls, globalns=vars(module))[name]))  # noqa: E731
    assert set(typing.get_args(types.Offload)) <= choices(module.ParallelSection, "offload")
    assert set(typing.get_args(types.Optimizer)) <= choices(module.OptimizerSection, "name")
    assert set(typing.get_args(typing.get_type_hints(Cluster)["sharding"])) <= choices(module.ParallelSection, "sharding")
    assert set(typing.get_args(typing.get_type_hints(Cluster)["pp_schedule"])) == \
        choices(module.ParallelSection, "pp_schedule") == set(types.PP_SCHEDULES)
    with pytest.raises(SystemExit, match="task.kind: 'qlora4' is not one of full"):
        module.from_dict({**yaml.safe_load(render_launch(sample_plan(cloud, nodes, sharding, task))["train.yaml"]),
                          "task": {"kind": "qlora4"}})


@pytest.mark.parametrize("sharding,task", [("hsdp", "full"), ("fsdp", "lora"), ("ddp", "full")])
def test_train_yaml_carries_the_plan(sharding, task):
    plan = sample_plan("aws", 2, sharding, task)
    cfg = yaml.safe_load(render_launch(plan)["train.yaml"])  # PyYAML: what the trainer uses
    c, t = plan.cluster, plan.training
    assert cfg["model"]["hf_config"] == TINY_LLAMA_CONFIG
    assert cfg["task"]["kind"] == task
    assert cfg["parallel"] == {"sharding": sharding, "replicate": c.replicate, "shard": c.shard_group,
                               "nodes": 2, "gpus_per_node": 8, "activation_checkpointing": "selective",
                               "offload": "none", "tp": 1, "cp": 1, "pp": 1, "pp_schedule": "1F1B"}
    assert cfg["parallel"]["pp"] * cfg["parallel"]["replicate"] * cfg["parallel"]["shard"] == c.total_gpus
    assert cfg["precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "master_dtype": "float32",
                                "tf32": False}
    assert cfg["batch"] == {"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "seq_len": c.seq_len,
                            "global_batch_tokens": c.global_batch_tokens}
    assert cfg["optimizer"]["lr"] == t.learning_rate and cfg["optimizer"]["grad_clip"] == t.grad_clip
    assert cfg["optimizer"]["weight_decay"] == t.weight_decay and cfg["optimizer"]["name"] == "adamw"
    assert cfg["schedule"]["steps"] == t.steps and cfg["schedule"]["warmup_steps"] == t.warmup_steps
    assert cfg["checkpoint"]["every_steps"] == t.checkpoint_every_steps
    assert cfg["checkpoint"]["keep"] == plan.host.checkpoints_kept
    # two nodes: checkpoints on the shared filesystem, never on a node's own NVMe array
    assert cfg["checkpoint"]["dir"].startswith(SHARED_MOUNT + "/checkpoints/")
    assert cfg["logging"]["every_steps"] == t.log_every_steps
    assert cfg["mfu"] == {"flops_per_token": plan.throughput.flops_per_token,
                          "attention_flops_per_token": plan.throughput.attention_flops_per_token,
                          "plan_seq_len": c.seq_len, "peak_tflops_per_gpu": plan.gpu.bf16_tflops}
    assert cfg["plan_estimate"]["memory_per_gpu_bytes"] == plan.memory.per_gpu_bytes
    assert cfg["data"]["dtype"] == "uint16"  # vocab 512
    if task == "lora":
        assert cfg["task"]["lora"] == {"rank": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
        assert cfg["task"]["frozen_dtype"] == "bfloat16"  # the plan sizes the frozen base in bf16
        assert cfg["model"]["init"] == "pretrained"
    else:
        assert cfg["task"]["frozen_dtype"] is None and cfg["model"]["init"] == "random"
    assert cfg["model"]["attn_implementation"] == "sdpa" and cfg["data"]["synthetic"] is False


def test_one_node_checkpoints_stay_on_local_nvme():
    plan = sample_plan("aws", 1, "fsdp", "full")
    cfg = yaml.safe_load(render_launch(plan)["train.yaml"])
    assert cfg["checkpoint"]["dir"].startswith(plan.storage.mount_point + "/checkpoints/")


def test_precision_modes_map_to_dtypes():
    plan = sample_plan()
    for precision, want, tf32 in (("bf16", ("bfloat16", "bfloat16", "bfloat16"), False),
                                  ("fp32", ("float32", "float32", "float32"), True)):
        p = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"precision": precision}),
                                    "stack": choose_stack("full", precision, "llama")})
        got = yaml.safe_load(render_launch(p)["train.yaml"])["precision"]
        assert (got["param_dtype"], got["reduce_dtype"], got["master_dtype"]) == want
        assert got["tf32"] is tf32  # fp32 plans are timed on TF32 tensor cores
    with pytest.raises(GpuprovError):
        choose_stack("full", "fp8", "llama")
    with pytest.raises(GpuprovError, match="no training stack"):
        render_launch(plan.model_copy(update={"stack": None}))


@pytest.mark.parametrize("value", [1e-05, 3e-4, 0.1, 1e20, 2.5, 10000.0, -1e-7])
def test_yaml_floats_read_back_as_floats(value):
    # PyYAML reads "1e-05" as a string; the renderer must always write a float it reads as one.
    assert yaml.safe_load(f"x: {yaml_value(value)}")["x"] == value


def sourced_env(launch: Path, **extra: str) -> dict[str, str]:
    script = f'set -eu; . {launch / "env.sh"}; env -0'
    out = subprocess.run(["env", "-i", f"PATH={os.environ['PATH']}", *(f"{k}={v}" for k, v in extra.items()),
                          BASH, "-c", script], check=True, capture_output=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def test_env_sh_exports_exactly_the_plan_fabric_env(tmp_path):
    tricky = {"NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_ODD": "a b 'c' \"d\" $HOME `x` ;e",
              "FI_PROVIDER": "efa"}
    plan = with_fabric(sample_plan("azure"), nccl_env=tricky)
    env = sourced_env(write(render_launch(plan), tmp_path))
    for key, value in tricky.items():
        assert env[key] == value
    assert env["OMP_NUM_THREADS"] == str(192 // 2 // 8)
    # already-set values of the runtime knobs win (tests and users override them)
    assert sourced_env(tmp_path / "launch", OMP_NUM_THREADS="1")["OMP_NUM_THREADS"] == "1"


def test_env_sh_sources_the_vendor_profile_first(tmp_path):
    profile = tmp_path / "nccl-env-profile.sh"
    profile.write_text("export FROM_PROFILE=yes\nexport NCCL_FASTRAK_USE_SNAP=0\n")
    plan = with_fabric(sample_plan("gcp"), nccl_env_profile=str(profile))
    env = sourced_env(write(render_launch(plan), tmp_path))
    assert env["FROM_PROFILE"] == "yes"
    assert env["NCCL_FASTRAK_USE_SNAP"] == "1"  # the plan's value wins over the profile's
    profile.unlink()
    result = subprocess.run([BASH, "-c", f". {tmp_path / 'launch' / 'env.sh'}"], capture_output=True, text=True)
    assert result.returncode == 0 and "is missing" in result.stderr


def test_env_sh_exports_the_plan_env_before_the_vendor_profile_too(tmp_path):
    """GCP a3-megagpu (TCPXO): the vendor profile reads NCCL_LIB_DIR, so it must be set before it runs."""
    from gpuprov.catalog.fabrics import get_fabric

    fabric = get_fabric("tcpxo", "gcp", "a3-megagpu-8g")
    assert "NCCL_LIB_DIR" in fabric.nccl_env and fabric.nccl_env_profile
    real = write(render_launch(with_fabric(sample_plan("gcp"), **dict(fabric))), tmp_path / "real")
    subprocess.run([BASH, "-n", str(real / "env.sh")], check=True)
    assert real.joinpath("env.sh").read_text().count(f"export NCCL_LIB_DIR={fabric.nccl_env['NCCL_LIB_DIR']}") == 1

    profile = tmp_path / "nccl-env-profile.sh"  # what the TCPXO profile does with NCCL_LIB_DIR, in small
    profile.write_text(': "${NCCL_LIB_DIR:?the profile needs NCCL_LIB_DIR}"\n'
                       'export NCCL_TUNER_CONFIG_PATH="$NCCL_LIB_DIR/a3plus_tuner_config.textproto"\n'
                       'export NCCL_LIB_DIR=/from/the/profile NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY=/from/the/profile\n')
    launch = write(render_launch(with_fabric(sample_plan("gcp"), **{**dict(fabric), "nccl_env_profile": str(profile)})),
                   tmp_path / "fake")
    env = sourced_env(launch)
    assert env["NCCL_TUNER_CONFIG_PATH"] == f"{fabric.nccl_env['NCCL_LIB_DIR']}/a3plus_tuner_config.textproto"
    assert {k: env[k] for k in fabric.nccl_env} == fabric.nccl_env  # and the plan's values win afterwards
    leftover = subprocess.run([BASH, "-c", f". {launch / 'env.sh'}; declare -F gpuprov_nccl_env"])
    assert leftover.returncode != 0  # the helper does not stay in the user's shell


@pytest.mark.parametrize("instance", ["a3-ultragpu-8g", "a4-highgpu-8g"])
def test_env_sh_puts_the_gib_plugin_on_the_library_path_in_a_non_login_shell(instance, tmp_path):
    """GCP a3-ultra / a4: the image adds /usr/local/gib/lib64 to LD_LIBRARY_PATH in /etc/profile.d
    only; `up` submits with sbatch from a non-login shell, so the job's env.sh must (the catalog's
    nccl_lib_path, as Cluster Toolkit's a3-ultra nccl-tests job exports it), ahead of what is there."""
    from gpuprov.catalog import load_data
    from gpuprov.catalog.fabrics import get_fabric

    entry = load_data("fabrics.yaml")["gcp"]["instances"][instance]
    assert entry["nccl_env"]["NCCL_NET"] == "gIB" and entry["nccl_lib_path"]
    fabric = get_fabric(entry["fabric"], "gcp", instance)
    launch = write(render_launch(with_fabric(sample_plan("gcp"), **dict(fabric))), tmp_path)
    env = sourced_env(launch, LD_LIBRARY_PATH="/opt/x/lib")  # env -i: no profile was read
    assert env["LD_LIBRARY_PATH"].split(":") == [*entry["nccl_lib_path"], "/opt/x/lib"]
    assert sourced_env(launch)["LD_LIBRARY_PATH"].split(":") == entry["nccl_lib_path"]


def test_bad_env_name_is_a_clear_error():
    with pytest.raises(GpuprovError, match="not a valid environment variable"):
        render_launch(with_fabric(sample_plan(), nccl_env={"BAD-NAME": "1"}))


def dry_run(launch: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "TORCHRUN": "echo",
            "PYTHON": sys.executable, "GPUPROV_INVENTORY": str(launch / "none.yml"), **env}
    return subprocess.run([BASH, str(launch / "train.sh"), *args], env=full, capture_output=True, text=True)


def test_train_sh_single_node(tmp_path):
    launch = write(render_launch(sample_plan("aws", 1, "fsdp")), tmp_path)
    out = dry_run(launch, "--set", "schedule.steps=5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "--nnodes", "1", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "127.0.0.1:29500", "--rdzv-id", "gpuprov-tiny-llama-full", "--max-restarts", "3",
        str(launch / "train.py"), "--config", str(launch / "train.yaml"), "--set", "schedule.steps=5"]


def test_train_sh_multi_node_needs_a_head(tmp_path):
    launch = write(render_launch(sample_plan("aws", 2)), tmp_path)
    out = dry_run(launch)
    assert out.returncode == 2 and "GPUPROV_HEAD_ADDR" in out.stderr
    out = dry_run(launch, GPUPROV_HEAD_ADDR="10.1.2.3", GPUPROV_NODE_RANK="1", GPUPROV_NPROC_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[words.index("--rdzv-endpoint") + 1] == "10.1.2.3:29500"
    assert words[words.index("--rdzv-conf") + 1] == "is_host=0"
    assert words[words.index("--nproc-per-node") + 1] == "2" and words[words.index("--nnodes") + 1] == "2"


def test_train_sh_reads_head_and_node_rank_from_the_inventory(tmp_path):
    launch = write(render_launch(sample_plan("aws", 2)), tmp_path)
    inventory = tmp_path / "ansible" / "inventory.yml"
    inventory.parent.mkdir()
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    me = addresses[0] if addresses else subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    # this machine second: train.sh must find itself at node rank 1 and join as a store client
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {
        "node-0": {"ansible_host": "10.9.9.9"}, "node-1": {"ansible_host": me}}}}}}))
    out = dry_run(launch, GPUPROV_INVENTORY=str(inventory))
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[words.index("--rdzv-endpoint") + 1] == "10.9.9.9:29500"
    assert "node 1 of 2" in out.stderr
    assert words[words.index("--rdzv-conf") + 1] == "is_host=0"


def test_train_sh_inventory_without_pyyaml(tmp_path):
    """A bare python3 without PyYAML still finds the hosts (regex over the fixed layout)."""
    launch = write(render_launch(sample_plan("aws", 2)), tmp_path)
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n"
                         "        n0:\n          ansible_host: \"10.4.4.4\"\n        n1:\n          ansible_host: 10.4.4.5\n")
    blocker = tmp_path / "noyaml"
    blocker.mkdir()
    (blocker / "yaml.py").write_text("raise ImportError('no PyYAML here')\n")
    out = dry_run(launch, GPUPROV_INVENTORY=str(inventory), PYTHONPATH=str(blocker))
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[words.index("--rdzv-endpoint") + 1] == "10.4.4.4:29500"


def test_onprem_plan_hosts_give_the_head(tmp_path):
    launch = write(render_launch(sample_plan("onprem", 2)), tmp_path)
    words = dry_run(launch).stdout.split()
    assert words[words.index("--rdzv-endpoint") + 1] == "10.0.0.10:29500"


def test_slurm_sbatch_under_fake_slurm(tmp_path):
    launch = write(render_launch(sample_plan("aws", 4, "hsdp")), tmp_path)
    text = (launch / "slurm.sbatch").read_text()
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive"):
        assert f"#SBATCH {directive}\n" in text
    assert "#SBATCH --cpus-per-task" not in text  # --exclusive gives every CPU Slurm manages; vCPUs may exceed it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n'\n")
    # fake srun: record the options, run the command (hostname --ip-address -> a fixed address)
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\necho \"srun $*\" >> \"$SRUN_LOG\"\n"
        "while [[ \"$1\" == -* ]]; do [[ \"$1\" == -w ]] && shift; shift; done\n"
        "if [ \"$1\" = hostname ]; then echo '10.0.0.7 fe80::1'; else exec \"$@\"; fi\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-d]", "SLURM_JOB_NUM_NODES": "4",
           "SLURM_JOB_ID": "77", "SLURM_NODEID": "0", "SLURM_SUBMIT_DIR": str(launch), "TORCHRUN": "echo torchrun",
           "SRUN_LOG": str(tmp_path / "srun.log")}
    out = subprocess.run([BASH, str(launch / "slurm.sbatch"), "--set", "schedule.steps=3"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "torchrun", "--nnodes", "4", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "10.0.0.7:29500", "--rdzv-id", "gpuprov-tiny-llama-full-77-0", "--rdzv-conf", "is_host=1",
        # under Slurm a failure ends the step and the job is requeued (test_slurm_job.py), no in-place restart
        "--max-restarts", "0",
        str(launch / "train.py"), "--config",
        str(launch / "train.yaml"), "--set", "schedule.steps=3"]
    srun_calls = (tmp_path / "srun.log").read_text().splitlines()
    assert srun_calls[0].startswith("srun --nodes=1 --ntasks=1 -w gpu-a hostname")
    assert srun_calls[1].startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 ")


def test_render_is_lazy_about_jinja2():
    code = "import sys, gpuprov.render.launch; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


PLANNER_SPECS = [
    dict(model="llama-3.1-70b", cloud="aws", tokens=10**10),
    dict(model="llama-3.1-8b", cloud="gcp", task="lora"),
    dict(model="llama-3.1-405b", cloud="oci", tokens=10**11),
]


@pytest.mark.parametrize("kw", PLANNER_SPECS, ids=lambda kw: f"{kw['model']}-{kw['cloud']}")
def test_real_planner_output_renders(kw, tmp_path):
    from gpuprov.planner import make_plan
    from gpuprov.spec import TrainingSpec

    plan = make_plan(TrainingSpec(**kw))
    files = render_launch(plan)
    launch = write(files, tmp_path)
    for name in ("env.sh", "train.sh", "slurm.sbatch"):
        subprocess.run([BASH, "-n", str(launch / name)], check=True)
    cfg = yaml.safe_load(files["train.yaml"])
    c = plan.cluster
    assert cfg["model"]["hf_config"] == plan.model.hf_config
    assert (cfg["parallel"]["replicate"], cfg["parallel"]["shard"]) == (c.replicate, c.shard_group)
    assert cfg["parallel"]["sharding"] == c.sharding
    assert cfg["parallel"]["activation_checkpointing"] == c.activation_checkpointing
    assert (cfg["batch"]["micro_batch"], cfg["batch"]["grad_accum"], cfg["batch"]["seq_len"]) == \
        (c.micro_batch, c.grad_accum, c.seq_len)
    assert cfg["mfu"]["flops_per_token"] == plan.throughput.flops_per_token
    if plan.task != "full":
        assert cfg["task"]["lora"]["targets"] == list(plan.training.lora_targets)
    env = sourced_env(launch)
    assert {k: env.get(k) for k in plan.fabric.nccl_env} == dict(plan.fabric.nccl_env)
    words = dry_run(launch, GPUPROV_HEAD_ADDR="10.0.0.1").stdout.split()
    assert words[words.index("--nnodes") + 1] == str(c.nodes)
    assert words[words.index("--nproc-per-node") + 1] == str(c.gpus_per_node)


@pytest.mark.parametrize("task", ["full", "lora", "qlora"])
def test_train_yaml_says_where_the_qlora_base_lives(task):
    """The trainer keeps the NF4 base whole on every GPU (FSDP2 cannot shard bitsandbytes weights)."""
    text = render_launch(sample_plan("aws", 2, "fsdp", task))["train.yaml"]
    assert ("NF4 base weights stay whole on every GPU" in text) == (task == "qlora")
