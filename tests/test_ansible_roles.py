"""The roles run for real against this machine (ansible-playbook -c local): the early OS and no-GPU
failures, the health checks that can measure here (RAID/mount size, GPU count), the NCCL
environment files and cufile.json as the roles write them; ansible-lint on the repo's roles."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from ansible_helpers import (
    REPO, has_nvidia_gpu, os_id, playbook, private_dir, recap, write_files,
    write_local_inventory,
)
from gpuprov.render.ansible import render_ansible
from plan_fixtures import sample_plan
from production_lint import production_lint, role_files

ROLES = REPO / "ansible" / "roles"
MY_ROLES = ("gpu_preflight", "nvidia_driver", "nccl", "efa", "infiniband", "gcp_rdma", "gds", "healthcheck",
            "node_baseline", "training_env")


@pytest.fixture(scope="module")
def bundle():
    with private_dir("roles") as root:
        write_files(root, render_ansible(sample_plan("aws")))
        write_local_inventory(root)
        yield root


@pytest.fixture
def scratch(bundle):
    with private_dir("scratch") as path:
        yield path


def _role_play(root, name: str, tasks: list, variables: dict | None = None, gather: bool = True):
    (root / name).write_text(yaml.safe_dump([{
        "name": "test", "hosts": "gpu_nodes", "gather_facts": gather, "gather_subset": ["!all", "network"],
        "vars": variables or {}, "tasks": tasks,
    }], sort_keys=False))
    return name


# ---------------------------------------------------------------- structure


@pytest.mark.parametrize("role", MY_ROLES)
def test_role_layout(role):
    meta = yaml.safe_load((ROLES / role / "meta" / "main.yml").read_text())
    platforms = meta["galaxy_info"]["platforms"]
    assert {"name": "Ubuntu", "versions": ["jammy", "noble"]} in platforms
    defaults = ROLES / role / "defaults" / "main.yml"
    if defaults.exists():
        lines = defaults.read_text().splitlines()
        names = [ln.split(":")[0] for ln in lines if ln and not ln.startswith((" ", "#", "-"))]
        for name in names:  # every knob has a comment right above it (or above its group)
            index = next(i for i, ln in enumerate(lines) if ln.startswith(name + ":"))
            assert index > 0 and lines[index - 1].startswith("#"), f"{role}: {name} has no comment above it"
            assert name.startswith(role + "_"), f"{role}: {name} lacks the role prefix"
    # only ansible.builtin modules: the bundle must run on a bare ansible-core
    for path in (ROLES / role).rglob("*.yml"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.endswith(":") and "." in stripped and not stripped.startswith(("#", "-", "'")):
                module = stripped[:-1]
                if module.count(".") >= 2:
                    assert module.startswith("ansible.builtin."), f"{path}: {module}"


@pytest.mark.slow
def test_repo_roles_pass_ansible_lint_production():
    lint = production_lint()  # one run with the rendered glue (tests/production_lint.py)
    files = role_files(ROLES)
    assert files and not [f for f in files if f.resolve() not in lint.examined], lint.output[-4000:]
    assert lint.issues_under(ROLES) == []


# ---------------------------------------------------------------- early failures


@pytest.mark.slow
def test_unsupported_os_fails_before_anything_changes(bundle):
    # Force the mismatch whatever this machine runs: the check compares real facts to the list.
    result = playbook(bundle, "-i", "local-inventory.yml", "site.yml", "--tags", "gpu", "--check",
                      extra_vars={"gpu_preflight_supported_os": ["ubuntu-99.04"]})
    assert result.returncode != 0
    assert f"({os_id()}); the GPU roles support only ubuntu-99.04" in result.stdout
    assert "Install kernel headers" not in result.stdout and "CUDA repository keyring" not in result.stdout
    counts = recap(result.stdout)
    assert counts["failed"] == 1 and counts["changed"] == 0


@pytest.mark.skipif(has_nvidia_gpu(), reason="this machine has an NVIDIA GPU: the no-GPU path cannot be exercised")
@pytest.mark.parametrize("tags", ["nccl", "health"])
@pytest.mark.slow
def test_no_gpu_fails_early_with_the_reason(bundle, tags):
    target = "health.yml" if tags == "health" else "site.yml"
    result = playbook(bundle, "-i", "local-inventory.yml", target, "--tags", tags, "--check",
                      extra_vars={"gpu_preflight_supported_os": [os_id()]})
    assert result.returncode != 0
    assert "No NVIDIA GPU on node0: no PCI device with vendor 0x10de" in result.stdout
    assert "Check the operating system is supported" in result.stdout  # the OS check passed first
    for later in ("Install NCCL", "Query the GPUs", "Read the loaded NVIDIA driver version"):
        assert later not in result.stdout
    assert recap(result.stdout)["changed"] == 0


# ---------------------------------------------------------------- health checks measuring here
# Each scenario is one include_role with its own vars; ignore_errors lets one playbook run hold
# several scenarios (ansible-playbook start-up dominates these tests), and each still prints its
# own success or failure message.


def _scenarios(role: str, tasks_from: str, cases: list[dict]) -> list[dict]:
    return [{"name": f"case {i}", "ansible.builtin.include_role": {
        "name": role, "tasks_from": tasks_from, "apply": {"ignore_errors": True}}, "vars": case}
        for i, case in enumerate(cases)]


def _passing_preflight():
    return {"gpu_preflight_supported_os": [os_id()], "gpu_preflight_require_gpu": False}


def _run_scenarios(bundle, name: str, role: str, tasks_from: str, cases: list[dict]):
    play = _role_play(bundle, name, _scenarios(role, tasks_from, cases), _passing_preflight())
    result = playbook(bundle, "-i", "local-inventory.yml", play)
    assert result.returncode == 0, result.stdout[-3000:]  # every failure is an ignored, printed one
    return result.stdout


@pytest.mark.slow
def test_raid_check_measures_the_mount(bundle):
    st = os.statvfs("/")
    total = st.f_frsize * st.f_blocks
    out = _run_scenarios(bundle, "raid-check.yml", "healthcheck", "raid.yml", [
        {"healthcheck_mount_point": "/", "healthcheck_expected_bytes": total},
        {"healthcheck_mount_point": "/", "healthcheck_expected_bytes": total * 10},
        {"healthcheck_mount_point": "/no-such-scratch", "healthcheck_expected_bytes": 1},
    ])
    assert f"/ mounted, {round(total / 2**30, 1)} GiB" in out
    assert f"is {round(total / 2**30, 1)} GiB" in out and f"of {round(total * 10 / 2**30, 1)} GiB" in out
    assert "/no-such-scratch is not mounted" in out
    assert out.count("...ignoring") == 2


def _fake_tool(bundle, name: str, output: str, rc: int = 0):
    """A stand-in binary printing a real tool's output format, to exercise the role's parsing."""
    tools = bundle / "fake-bin"
    tools.mkdir(exist_ok=True)
    path = tools / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {rc}\n")
    path.chmod(0o755)
    return tools


# Tail of a real nccl-tests all_reduce_perf run (format of nccl-tests 2.x).
ALL_REDUCE_OUTPUT = """#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
  8589934592    2147483648     float     sum      -1    35791  240.00  420.00      0    35800  239.94  419.90      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 419.95
#"""


@pytest.mark.slow
@pytest.mark.skipif(has_nvidia_gpu(), reason="this machine has an NVIDIA GPU")
def test_health_checks_fail_with_the_measured_value(bundle, scratch):
    tools = _fake_tool(bundle, "all_reduce_perf", ALL_REDUCE_OUTPUT)
    out = _run_scenarios(bundle, "measured.yml", "healthcheck", "nccl.yml", [
        {"healthcheck_nccl_tests_dir": str(tools), "healthcheck_nccl_busbw_min_gbytes_per_s": 400.0, "healthcheck_nccl_net": ""},
        {"healthcheck_nccl_tests_dir": str(tools), "healthcheck_nccl_busbw_min_gbytes_per_s": 460.0, "healthcheck_nccl_net": "",
         "healthcheck_nccl_busbw_enforce": True},
        {"healthcheck_nccl_tests_dir": str(tools), "healthcheck_nccl_busbw_min_gbytes_per_s": 460.0, "healthcheck_nccl_net": ""},
        {"healthcheck_nccl_tests_dir": str(tools), "healthcheck_nccl_busbw_min_gbytes_per_s": None, "healthcheck_nccl_net": ""},
        {"healthcheck_nccl_tests_dir": str(scratch / "none"), "healthcheck_nccl_busbw_min_gbytes_per_s": None, "healthcheck_nccl_net": ""},
    ])
    # the best size's out-of-place busbw (not the average): 420.0
    assert out.count("all_reduce_perf bus bandwidth 420.0 GB/s") == 3  # 400, none, and 460 not enforced
    assert "measured 420.0 GB/s bus bandwidth (minimum 460.0 GB/s" in out  # enforced
    assert "best all-reduce bus bandwidth 420.0 GB/s is below 460.0 GB/s" in out  # the source's warning
    assert "measured -1.0 GB/s" in out  # the probe did not run: fails, never passes silently
    assert out.count("...ignoring") == 2
    # nvidia-smi is absent here: the GPU check fails with what it found
    gpus = _run_scenarios(bundle, "gpus.yml", "healthcheck", "gpus.yml", [{}])
    assert "0 GPU(s) (expected 8)" in gpus and "nvidia-smi rc=" in gpus


# ---------------------------------------------------------------- files the roles write


@pytest.mark.slow
def test_nccl_env_files_as_written_by_the_role(bundle, scratch):
    profile = scratch / "vendor-profile.sh"
    # a vendor profile that reads NCCL_LIB_DIR (as TCPXO's does) and sets its own values
    profile.write_text('export SEEN_LIB_DIR="$NCCL_LIB_DIR"\nexport NCCL_FROM_PROFILE=1\n'
                       'export NCCL_NET=from-profile\n')
    env = {"NCCL_LIB_DIR": "/var/lib/tcpxo/lib64", "NCCL_NET": "gIB", "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
           "ODD": "a b 'c' $HOME"}
    conf, script = scratch / "nccl.conf", scratch / "gpuprov-nccl.sh"
    tasks = [
        {"name": "conf", "ansible.builtin.template": {"src": "roles/nccl/templates/nccl.conf.j2", "dest": str(conf),
                                                      "mode": "0644"}},
        {"name": "profile", "ansible.builtin.template": {"src": "roles/nccl/templates/gpuprov-nccl.sh.j2",
                                                         "dest": str(script), "mode": "0644"}},
    ]
    play = _role_play(bundle, "nccl-files.yml", tasks,
                      {"nccl_env": env, "nccl_env_profile": str(profile)}, gather=False)
    first = playbook(bundle, "-i", "local-inventory.yml", play)
    assert first.returncode == 0, first.stdout[-2000:]
    assert recap(first.stdout)["changed"] == 2
    again = playbook(bundle, "-i", "local-inventory.yml", play)
    assert recap(again.stdout)["changed"] == 0  # idempotent
    check = playbook(bundle, "-i", "local-inventory.yml", play, "--check")
    assert check.returncode == 0 and recap(check.stdout)["changed"] == 0

    lines = [ln for ln in conf.read_text().splitlines() if ln and not ln.startswith("#")]
    assert sorted(lines) == sorted(f"{k}={v}" for k, v in env.items())
    out = subprocess.run(["bash", "-c", f". {script}; env -0"], capture_output=True, text=True, check=True).stdout
    seen = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    assert seen["SEEN_LIB_DIR"] == "/var/lib/tcpxo/lib64"  # exported before the profile ran
    assert seen["NCCL_FROM_PROFILE"] == "1"
    assert seen["NCCL_NET"] == "gIB"  # the plan's value wins over the profile's
    assert seen["ODD"] == "a b 'c' $HOME"  # quoted, not expanded


@pytest.mark.slow
def test_health_check_loads_hpcx_for_the_azure_images_nccl_tests(bundle, scratch):
    """Azure ubuntu-hpc's /opt/nccl-tests is a `make MPI=1` build against HPC-X (azhpc-images
    install_nccl.sh loads mpi/hpcx first): libmpi is found only with that module loaded. The nccl
    role's profile names the module (from the image profile), the health check loads it before
    all_reduce_perf. Stand-ins: a module command that puts a folder on LD_LIBRARY_PATH, and an
    all_reduce_perf that fails as a missing libmpi does unless it is there."""
    from gpuprov.commands.generate import make_plan
    from gpuprov.spec import TrainingSpec

    gv = yaml.safe_load(render_ansible(make_plan(TrainingSpec(model="13b", cloud="azure")))["group_vars/all.yml"])
    mpi = gv["nccl_tests_image_mpi_env"]
    assert gv["nccl_tests_image_dir"] == "/opt/nccl-tests" and mpi["module"] == "mpi/hpcx"
    init = scratch / "modules.sh"
    init.write_text('module() { [ "$1 $2" = "load mpi/hpcx" ] && export LD_LIBRARY_PATH=/opt/hpcx/ompi/lib; }\n')
    bindir = scratch / "build"
    bindir.mkdir()
    (bindir / "all_reduce_perf").write_text(
        '#!/bin/bash\ncase "$LD_LIBRARY_PATH" in *hpcx*) ;; *) echo "error while loading shared libraries: '
        'libmpi.so.40" >&2; exit 127;; esac\n'
        'printf "   1048576    262144     float     sum      -1    10.0  104.86  183.50      0\\n"\n')
    (bindir / "all_reduce_perf").chmod(0o755)
    script = scratch / "gpuprov-nccl.sh"
    tasks = [{"name": "profile", "ansible.builtin.template": {"src": "roles/nccl/templates/gpuprov-nccl.sh.j2",
                                                             "dest": str(script), "mode": "0644"}},
             {"name": "check", "ansible.builtin.include_role": {"name": "healthcheck", "tasks_from": "nccl.yml"}}]
    base = {**_passing_preflight(), "nccl_env": {}, "nccl_env_profile": "", "nccl_tests_bin_dir": str(bindir), "healthcheck_nccl_net": "",
            "healthcheck_nccl_profile": str(script), "healthcheck_expected_gpus": 8, "healthcheck_fabric": "infiniband"}
    image_mpi = {**mpi, "init": str(init)}  # the image's module system, stood in for
    ok = playbook(bundle, "-i", "local-inventory.yml", _role_play(bundle, "hpcx.yml", tasks, {
        **base, "nccl_tests_use_image": True, "nccl_tests_image_mpi_env": image_mpi}))
    assert ok.returncode == 0 and "bus bandwidth 183.5 GB/s" in ok.stdout, ok.stdout[-3000:]
    without = playbook(bundle, "-i", "local-inventory.yml", _role_play(bundle, "no-hpcx.yml", tasks, {
        **base, "nccl_tests_use_image": True, "nccl_tests_image_mpi_env": {}}))
    assert without.returncode != 0 and "rc=127" in without.stdout


@pytest.mark.slow
def test_slurm_node_health_check_drains_a_node_short_of_gpus_or_rdma_devices(bundle, scratch):
    """slurm.conf's HealthCheckProgram: a node whose GPUs or RDMA devices went missing mid-run is
    drained with the reason (nvidia-smi and scontrol stood in for; the RDMA devices are sysfs entries)."""
    dest, sysfs, bindir = scratch / "node-health.sh", scratch / "ib", scratch / "bin"
    sysfs.mkdir()
    bindir.mkdir()
    play = _role_play(bundle, "node-health.yml", [{"name": "script", "ansible.builtin.template": {
        "src": "roles/slurm/templates/node-health.sh.j2", "dest": str(dest), "mode": "0755"}}],
        {"slurm_gpus_per_node": 8, "slurm_health_rdma_devices": 4, "slurm_health_rdma_sysfs": str(sysfs),
         "slurm_health_check_interval": 300}, gather=False)
    assert playbook(bundle, "-i", "local-inventory.yml", play).returncode == 0
    calls = scratch / "scontrol-calls"
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bindir / "nvidia-smi").write_text('#!/bin/sh\ni=0; while [ $i -lt "$GPUS" ]; do echo "GPU $i: NVIDIA H100 (UUID: x)"; '
                                       'i=$((i + 1)); done\n')
    for tool in ("scontrol", "nvidia-smi"):
        (bindir / tool).chmod(0o755)

    def run(gpus: int, devices: int) -> int:
        for old in sysfs.iterdir():
            old.rmdir()
        for i in range(devices):
            (sysfs / f"mlx5_{i}").mkdir()
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "GPUS": str(gpus)}
        return subprocess.run(["sh", str(dest)], env=env, capture_output=True, text=True).returncode

    assert run(8, 4) == 0 and not calls.exists()
    assert run(7, 3) == 1
    (call,) = calls.read_text().splitlines()
    assert call.startswith("update nodename=") and "state=drain" in call
    assert "7 of 8 GPUs" in call and "3 of 4 RDMA devices" in call


def test_cufile_json_never_uses_p2pdma_and_falls_back_to_compat(bundle, scratch):
    dest = scratch / "cufile.json"
    play = _role_play(bundle, "cufile.yml", [{"name": "cufile", "ansible.builtin.template": {
        "src": "roles/gds/templates/cufile.json.j2", "dest": str(dest), "mode": "0644"}}],
        {"gds_mount_point": "/scratch", "gds_mode": "compat"}, gather=False)
    result = playbook(bundle, "-i", "local-inventory.yml", play)
    assert result.returncode == 0, result.stdout[-2000:]
    data = json.loads(dest.read_text())
    assert data["properties"]["use_pci_p2pdma"] is False  # RAID0 is not supported by P2PDMA mode
    assert data["properties"]["allow_compat_mode"] is True
    assert "/scratch" in data["_comment"] and "compat mode" in data["_comment"]


@pytest.mark.slow
def test_gcp_mtu_check_reads_the_real_interfaces(bundle):
    out = _run_scenarios(bundle, "mtu.yml", "gcp_rdma", "main.yml", [
        {"gcp_rdma_mode": "checks-only", "gcp_rdma_mtu": 100000, "gcp_rdma_gpu_nics": ["lo"], "gcp_rdma_gpu_nic_count": 1},
        {"gcp_rdma_mode": "checks-only", "gcp_rdma_mtu": 576, "gcp_rdma_gpu_nics": ["lo"], "gcp_rdma_gpu_nic_count": 1},
    ])
    assert "below MTU 100000: lo " in out
    assert out.count("...ignoring") == 1  # 576 passes on any real interface


def test_skipping_the_hardware_checks_keeps_the_slurm_check_that_resumes_joining_nodes(bundle):
    """health.yml with --skip-tags hardware (a host without the GPUs or fabric to measure): the node
    health check's tasks are left out, the Slurm check, which resumes the nodes that joined, runs;
    --skip-tags health leaves out both."""
    def listed(*flags: str) -> str:
        result = playbook(bundle, "-i", "local-inventory.yml", "health.yml", "--list-tasks", *flags)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    everything, without_hardware, without_health = listed(), listed("--skip-tags", "hardware"), \
        listed("--skip-tags", "health")
    assert "GPU state" in everything and "Every node answers slurmctld" in everything
    assert "GPU state" not in without_hardware and "Every node answers slurmctld" in without_hardware
    assert "Every node answers slurmctld" not in without_health
