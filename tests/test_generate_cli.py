"""`gpuprov generate/init/schema` and the spec flags: units, file + flag merge, one-line errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gpuprov import bundle
from gpuprov.commands.spec_options import spec_options
from gpuprov.errors import GpuprovError
from gpuprov.specfile import load_hosts, parse_count, parse_hours



def run(*args: str, cwd: Path | None = None, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, cwd=cwd, stdin=stdin,
                          timeout=120)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.decode()
    assert result.returncode == 2, (result.returncode, err)
    assert "Traceback" not in err
    # click's usage errors add a "Usage:"/"Try --help" preamble before their one error line
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Usage: ", "Try '"))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("text,binary,expected", [
    ("20B", False, 20 * 10**9), ("1T", False, 10**12), ("1.5T", False, 1_500_000_000_000),
    ("500M", False, 500 * 10**6), ("10k", False, 10_000), ("2e9", False, 2 * 10**9), ("1_000", False, 1000),
    ("4M", True, 4 * 2**20), ("4Mi", False, 4 * 2**20), ("512K", True, 512 * 1024), (123, False, 123),
])
def test_parse_count(text, binary, expected) -> None:
    assert parse_count(text, binary=binary) == expected


@pytest.mark.parametrize("bad", ["", "B", "1X", "1.5", "-3B", "1e400", "nan", True, 1.5, "1.0000000001k"])
def test_parse_count_rejects(bad) -> None:
    with pytest.raises(GpuprovError):
        parse_count(bad)


@pytest.mark.parametrize("text,expected", [("30d", 720.0), ("12h", 12.0), ("90m", 1.5), ("2w", 336.0), ("36", 36.0),
                                           (48, 48.0), ("1.5d", 36.0)])
def test_parse_hours(text, expected) -> None:
    assert parse_hours(text) == expected


@pytest.mark.parametrize("bad", ["soon", "3 days", "-1h", "", True])
def test_parse_hours_rejects(bad) -> None:
    with pytest.raises(GpuprovError):
        parse_hours(bad)


@click.command()
@spec_options
def _echo_spec(spec) -> None:
    click.echo(spec.model_dump_json())


def _spec(*args: str) -> dict:
    result = CliRunner().invoke(_echo_spec, list(args), catch_exceptions=True)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_flags_build_the_spec_with_units() -> None:
    spec = _spec("--model", "70b", "--tokens", "1T", "--batch-tokens", "4M", "--deadline", "30d",
                 "--gpu", "h100-80gb,a100-80gb", "--gpu", "h200", "--lora-targets", "q_proj,v_proj", "--task", "lora")
    assert spec["model"] == "70b" and spec["tokens"] == 10**12 and spec["global_batch_tokens"] == 4 * 2**20
    assert spec["deadline_hours"] == 720.0 and spec["gpus"] == ["h100-80gb", "a100-80gb", "h200-141gb"]  # H200: SkyPilot's name
    assert spec["lora_targets"] == ["q_proj", "v_proj"] and spec["task"] == "lora"
    assert _spec("--lora-targets", "qv")["lora_targets"] == "qv"


def test_flags_override_file_values(tmp_path: Path) -> None:
    spec_file = tmp_path / "gpuprov.yaml"
    spec_file.write_text("model: 13b\ntokens: 20B\ncloud: gcp\ndeadline_hours: 2d\n")
    spec = _spec("-f", str(spec_file), "--cloud", "aws")
    assert spec["model"] == "13b" and spec["tokens"] == 20 * 10**9 and spec["cloud"] == "aws"
    assert spec["deadline_hours"] == 48.0
    assert spec["seq_len"] == 4096  # model default where neither says


def test_hosts_file_formats(tmp_path: Path) -> None:
    listed = tmp_path / "hosts.yaml"
    listed.write_text("- name: gpu0\n  address: 10.0.0.10\n- {name: gpu1, address: 10.0.0.11, user: ubuntu}\n")
    mapping = tmp_path / "map.yaml"
    mapping.write_text("gpu0: 10.0.0.10\ngpu1: 10.0.0.11\n")
    ini = tmp_path / "hosts.ini"
    ini.write_text("[gpu_nodes]\ngpu0 ansible_host=10.0.0.10\ngpu1 ansible_host=10.0.0.11 ansible_user=ubuntu\n")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        gpu0: {ansible_host: 10.0.0.10}\n"
                         "        gpu1: {ansible_host: 10.0.0.11}\n")
    for path in (listed, mapping, ini, inventory):
        hosts = load_hosts(path)
        assert [(h.name, h.address) for h in hosts] == [("gpu0", "10.0.0.10"), ("gpu1", "10.0.0.11")], path
    # the SSH port, in each format that can state it
    p_ini, p_list, p_inv = (tmp_path / "p.ini", tmp_path / "p.yaml", tmp_path / "p-inventory.yml")
    p_ini.write_text("gpu0 ansible_host=10.0.0.10 ansible_port=2222\n")
    p_list.write_text("- {name: gpu0, address: 10.0.0.10, port: 2222}\n")
    p_inv.write_text("all:\n  children:\n    gpu_nodes:\n      hosts:\n        gpu0: {ansible_host: 10.0.0.10, ansible_port: 2222}\n")
    assert all(load_hosts(p)[0].port == 2222 for p in (p_ini, p_list, p_inv))
    spec = _spec("--hosts", str(listed))
    assert spec["cloud"] == "onprem" and spec["hosts"][1]["user"] == "ubuntu"


@pytest.mark.parametrize("content,message", [
    ("- name: gpu0\n  address: 10.0.0.10\n- name: gpu0\n  address: 10.0.0.11\n", "appears twice"),
    ("- name: 'bad name!'\n  address: 10.0.0.10\n", "name"),
    ("- name: gpu0\n", "address"),
    ("", "no hosts"),
    ("[gpu_nodes]\n=broken\n", "expected"),
    # host variables gpuprov does not carry into the bundle are refused, not dropped
    ("gpu0 ansible_host=10.0.0.10 ansible_ssh_private_key_file=~/.ssh/k\n", "'ansible_ssh_private_key_file' is not read"),
    ("all:\n  children:\n    gpu_nodes:\n      hosts:\n        gpu0: {ansible_host: 10.0.0.1, ansible_become: true}\n",
     "'ansible_become' is not read"),
    ("gpu0 ansible_host=10.0.0.10 ansible_port=70000\n", "port"),
    ("- {name: gpu0, address: 10.0.0.10, port: 0}\n", "port"),
])
def test_bad_hosts_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "hosts"
    path.write_text(content)
    with pytest.raises(GpuprovError, match=message):
        load_hosts(path)


@pytest.mark.parametrize("args,expect", [
    (["--tokens", "many"], "--tokens"),
    (["--deadline", "soon"], "--deadline"),
    (["--seq-len", "0"], "seq-len"),
    (["--task", "pretrain"], "pretrain"),
    (["--safety-margin", "0.95"], "--safety-margin"),
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["-f", "/nonexistent/gpuprov.yaml"], "no such file"),
    (["--hosts", "/nonexistent/hosts.yaml"], "no such file"),
])
def test_bad_flags_one_line_exit_2_nothing_written(tmp_path: Path, args: list[str], expect: str) -> None:
    line = one_line_error(run("generate", *args, "-o", str(tmp_path / "out")))
    assert expect in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,expect", [
    ("model: 70b\ntokens: -5\n", "gpuprov.yaml:2: tokens"),
    ("model: 70b\nmodle: 13b\n", "gpuprov.yaml:2: modle: unknown key"),
    ("seq_len: many\n", "gpuprov.yaml:1: seq_len"),
    ("model: [70b\n", "invalid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
    ("hosts:\n  - name: gpu0\n", "gpuprov.yaml:2: hosts.0.address"),
    ("tokens: 20X\n", "gpuprov.yaml:1: tokens"),
])
def test_bad_spec_file_points_at_the_line(tmp_path: Path, content: str, expect: str) -> None:
    (tmp_path / "gpuprov.yaml").write_text(content)
    line = one_line_error(run("generate", "-f", "gpuprov.yaml", "-o", "out", cwd=tmp_path))
    assert expect in line, line
    assert not (tmp_path / "out").exists()


def test_init_writes_a_valid_commented_spec_and_refuses_to_overwrite(tmp_path: Path) -> None:
    first = run("init", "--model", "70b", "--cloud", "aws", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    text = (tmp_path / "gpuprov.yaml").read_text()
    assert text.count("#") > 10 and "model: 70b" in text and "cloud: aws" in text
    from gpuprov.specfile import load_spec

    from ruamel.yaml import YAML

    yaml, buffer = YAML(typ="rt"), io.StringIO()
    yaml.dump(yaml.load(text), buffer)
    assert buffer.getvalue() == text  # round-trip safe: comments and layout survive a load/dump
    spec = load_spec(tmp_path / "gpuprov.yaml")
    # fine-tuning by default: the recipe's batch in sequences of seq_len, not a pre-training 4M batch
    from gpuprov.recipes import global_batch_tokens

    assert spec.model == "70b" and spec.init == "pretrained" and spec.global_batch_tokens is None
    assert global_batch_tokens(spec, 4) == 8 * spec.seq_len
    assert "deadline_hours: 7d" not in text  # a key named hours holds hours
    before = (tmp_path / "gpuprov.yaml").read_bytes()
    assert "exists" in one_line_error(run("init", cwd=tmp_path))
    assert (tmp_path / "gpuprov.yaml").read_bytes() == before


def test_schema_is_the_models_json_schema_with_units(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")  # comes with ansible-lint (test extra)

    result = run("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    from gpuprov.spec import TrainingSpec

    model = json.loads(json.dumps(TrainingSpec.model_json_schema()))
    assert schema["additionalProperties"] is False and set(schema["properties"]) == set(model["properties"])
    for key in set(model["properties"]) - {"tokens", "global_batch_tokens", "deadline_hours"}:
        assert schema["properties"][key] == model["properties"][key], key
    # what `init` writes (units included) is valid against the schema; typos and bad units are not
    assert run("init", cwd=tmp_path).returncode == 0
    from ruamel.yaml import YAML

    starter = YAML(typ="safe").load((tmp_path / "gpuprov.yaml").read_text())
    jsonschema.validate(starter, schema)
    for bad in ({"tokens": "20X"}, {"deadline_hours": "soon"}, {"modle": "7b"}, {"seq_len": "4k"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate({"tokens": "1T", "global_batch_tokens": "4M", "deadline_hours": "30d"}, schema)


def test_tty_without_output_asks_where(tmp_path: Path) -> None:
    # a pseudo-terminal on stdout: no tar dumped on a screen
    import pty

    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "gpuprov", "generate"], stdout=secondary,
                              stderr=subprocess.PIPE, timeout=60, cwd=tmp_path)
    finally:
        os.close(secondary)
        os.close(primary)
    assert proc.returncode == 2 and b"-o DIR" in proc.stderr


# ---------------------------------------------------------------- end to end (planner + renderers)


def test_generate_directory_and_tar_agree_and_a_redirect_needs_dash_o(tmp_path: Path) -> None:
    args = ["generate", "--model", "llama-3.1-8b", "--task", "lora", "--cloud", "aws", "--tokens", "1B"]
    written = run(*args, "-o", str(tmp_path / "infra"))  # its speed is benchmarks/cli_speed.py's, not a test's
    assert written.returncode == 0, written.stderr.decode()
    streamed = run(*args, "-o", "-")
    with open(tmp_path / "infra.tar", "wb") as out:
        redirected = subprocess.run([sys.executable, "-m", "gpuprov", *args], stdout=out, stderr=subprocess.PIPE,
                                    timeout=120)
    # a tar only with -o -: a redirect (or `| head`) without it gets a one-line question, no binary
    assert streamed.returncode == 0 and redirected.returncode == 2
    assert (tmp_path / "infra.tar").read_bytes() == b"" and b"-o -" in redirected.stderr
    with tarfile.open(fileobj=io.BytesIO(streamed.stdout)) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    on_disk = {p.relative_to(tmp_path / "infra").as_posix(): p.read_bytes()
               for p in (tmp_path / "infra").rglob("*") if p.is_file()}
    extracted = {p.relative_to(tmp_path / "x" / "infra").as_posix(): p.read_bytes()
                 for p in (tmp_path / "x" / "infra").rglob("*") if p.is_file()}
    assert on_disk == extracted
    for name in ("README.md", "topology.svg", "plan.json", "gpuprov.lock"):
        assert name in on_disk
    assert any(p.startswith("terraform/") for p in on_disk) and any(p.startswith("launch/") for p in on_disk)
    assert os.access(tmp_path / "infra" / "launch" / "train.sh", os.X_OK)
    # same input twice: byte-identical
    again = run(*args, "-o", "-")
    assert again.stdout == streamed.stdout


def test_generate_refuses_foreign_dir_and_hand_edits(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "x.txt").write_text("keep")
    line = one_line_error(run("generate", "--model", "7b", "--cloud", "aws", "-o", str(tmp_path / "mine")))
    assert "not a gpuprov bundle" in line
    out = tmp_path / "infra"
    assert run("generate", "--model", "7b", "--cloud", "aws", "-o", str(out)).returncode == 0
    (out / "README.md").write_text("edited\n")
    assert "edited by hand" in one_line_error(run("generate", "--model", "7b", "--cloud", "aws", "-o", str(out)))
    forced = run("generate", "--model", "7b", "--cloud", "aws", "-o", str(out), "--force")
    assert forced.returncode == 0
    assert (out / "README.md").read_text() != "edited\n"
    lock = json.loads((out / bundle.LOCK_NAME).read_text())
    assert lock["spec"]["model"] == "7b"


def test_hosts_imply_onprem_and_conflict_with_another_cloud(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu0, address: 10.0.0.10}\n")
    spec_file = tmp_path / "gpuprov.yaml"
    spec_file.write_text("model: 7b\ncloud: aws\n")
    assert _spec("-f", str(spec_file), "--hosts", str(hosts), "--cloud", "onprem")["cloud"] == "onprem"
    result = CliRunner().invoke(_echo_spec, ["-f", str(spec_file), "--hosts", str(hosts)])
    assert isinstance(result.exception, GpuprovError) and "cloud: aws" in str(result.exception)


def test_output_is_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    from bundle_fixtures import standin_renderers
    from plan_fixtures import sample_plan

    files = bundle.build_bundle(sample_plan(), standin_renderers())
    monkeypatch.chdir(tmp_path)
    bundle.write_bundle("infra", files)
    monkeypatch.chdir(tmp_path / "infra")
    with pytest.raises(GpuprovError, match="current directory"):
        bundle.write_bundle(".", files)
    monkeypatch.chdir(tmp_path / "infra" / "launch")
    with pytest.raises(GpuprovError, match="current directory"):
        bundle.write_bundle("..", files)
    assert bundle.compare_bundle(tmp_path / "infra", files) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["infra"]


def test_summary_names_the_hosts_the_plan_leaves_out(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"- {{name: n{i}, address: 10.0.0.{i}}}\n" for i in range(1, 4)))
    result = run("generate", "--model", "7b", "--task", "lora", "--gpu", "h100-80gb", "--tokens", "1B",
                 "--hosts", str(hosts), "-o", str(tmp_path / "infra"))
    assert result.returncode == 0, result.stderr
    assert b"1 x hgx-h100-8" in result.stderr and b"hosts left out: n2, n3" in result.stderr


def test_commands_printed_for_the_shell_quote_the_bundle_path(tmp_path: Path) -> None:
    """`next: gpuprov validate DIR && ...` and the `gpuprov check DIR` hint are lines users paste into a
    shell: a path with a space or `;` stays one word (it was printed raw: `-o 'x; rm -rf ~'` ran rm)."""
    import shlex

    out = tmp_path / "my infra;touch pwned"
    r = run("generate", "--model", "7b", "--cloud", "aws", "-o", str(out))
    assert r.returncode == 0, r.stderr
    nxt = next(ln for ln in r.stderr.decode().splitlines() if ln.startswith("next: "))
    assert shlex.split(nxt[len("next: "):]) == ["gpuprov", "validate", str(out), "&&", "gpuprov", "up", str(out),
                                                "--dry-run"]
    (out / "README.md").write_text("edited\n")
    line = one_line_error(run("generate", "--model", "7b", "--cloud", "aws", "-o", str(out)))
    assert f"`gpuprov check {shlex.quote(str(out))}`" in line


@pytest.mark.parametrize("output,word", [("", "-o is empty"), (" ", "-o is empty"),
                                         ("a\nb", "control character"), ("x\x1b[31m", "control character")])
def test_generate_refuses_an_empty_or_control_character_output(tmp_path: Path, output: str, word: str) -> None:
    """An empty -o meant the current directory; a newline made a folder no shell line names cleanly."""
    assert word in one_line_error(run("generate", "--model", "7b", "-o", output, cwd=tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model,word", [("", "--model: model is empty"), (" ", "model is empty"),
                                        ("a\nb", "control character")])
def test_init_checks_the_model_before_writing(tmp_path: Path, model: str, word: str) -> None:
    """A bad -m left an invalid gpuprov.yaml behind (the check ran after the write); "" fell back to 7b."""
    assert word in one_line_error(run("init", "-m", model, cwd=tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_init_hint_quotes_the_spec_path(tmp_path: Path) -> None:
    import shlex

    r = run("init", "my run.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"gpuprov generate -f {shlex.quote('my run.yaml')} -o infra/" in r.stderr.decode()


def test_generate_summary_names_the_layout_as_plan_does(tmp_path: Path) -> None:
    """The one-line summary said "fsdp" for a TP4 x FSDP 14 plan: it now uses the candidates table's label."""
    r = run("generate", "--model", "70b", "--tp", "4", "--cloud", "aws", "-o", str(tmp_path / "infra"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "infra" / "plan.json").read_text())
    dp = plan["cluster"]["total_gpus"] // 4
    first = r.stderr.decode().splitlines()[0]
    assert f"TP4 x FSDP {dp}, " in first
    assert f"{plan['training']['steps']:,} optimizer steps" in first  # every summary line shows the steps


@pytest.mark.parametrize("nfs", [None, "nfs1:/export/gpu"])
def test_generate_says_before_validate_when_a_multi_node_onprem_bundle_has_no_shared_filesystem(tmp_path, nfs):
    # validate fails such a bundle (the trainer refuses to start): generate names the fix first,
    # and a bundle given an export validates clean on that check
    example = Path(__file__).resolve().parent.parent / "examples" / "7b-full-onprem"
    out = tmp_path / "b"
    spec = tmp_path / "gpuprov.yaml"  # the example's spec without its own export
    spec.write_text("".join(ln for ln in (example / "gpuprov.yaml").read_text().splitlines(keepends=True)
                            if not ln.startswith("shared_nfs:")))
    args = ["generate", "-f", str(spec), "--hosts", str(example / "hosts.yaml"), "-o", str(out)]
    result = run(*args, *(["--shared-nfs", nfs] if nfs else []))
    assert result.returncode == 0, result.stderr
    fixes = [ln for ln in result.stderr.decode().splitlines() if ln.startswith("fix:")]
    check = run("validate", str(out))
    storage = [ln.split() for ln in check.stdout.decode().splitlines() if ln.split()[1:3] == ["shared", "storage"]]
    assert [row[0] for row in storage] == (["ok"] if nfs else ["fail"])
    if nfs:
        assert not fixes
    else:
        assert len(fixes) == 1 and "--shared-nfs" in fixes[0].split()


REHEARSAL_RUN = ["--model", "tests/rehearsal/fixtures/tiny-llama/config.json", "--from-scratch", "--cloud", "aws",
                 "--gpus", "2", "--seq-len", "128", "--dataset", "tests/rehearsal/fixtures/tiny-data", "--epochs", "3",
                 "--global-batch", "4", "--pp", "1"]


@pytest.mark.parametrize("given,every", [(None, 30), ("7", 7), ("1000", 30)])
def test_checkpoint_every_sets_the_trainers_interval(tmp_path: Path, given: str | None, every: int) -> None:
    """--checkpoint-every N: the trainer saves every N steps (a run shorter than the default hour
    still leaves checkpoints for a lost node's requeued job); past the run's steps, the last one."""
    import yaml

    repo = Path(__file__).resolve().parent.parent
    flags = ["--checkpoint-every", given] if given else []
    made = run("generate", *REHEARSAL_RUN, *flags, "-o", str(tmp_path / "b"), cwd=repo)
    assert made.returncode == 0, made.stderr.decode()
    train = yaml.safe_load((tmp_path / "b" / "launch" / "train.yaml").read_text())
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert train["schedule"]["steps"] == 30 and train["checkpoint"]["every_steps"] == every
    assert plan["training"]["checkpoint_every_steps"] == every
    assert plan["spec"]["checkpoint_every_steps"] == (int(given) if given else None)
