"""What users of a serious CLI expect: shell completion, a defaults file, hints for the other spelling
of a key, next steps that run as printed, messages cut at word boundaries, the assumed data said."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov.errors import clip


def run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180,
                          env=env, cwd=cwd)


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
    return {**env, "HOME": str(tmp_path / "home"), **extra}


@pytest.mark.parametrize("shell,marker", [("bash", "complete -o nosort -F"), ("zsh", "#compdef gpuprov"),
                                          ("fish", "complete --no-files --command gpuprov")])
def test_completion_prints_clicks_script(shell, marker):
    r = run("completion", shell)
    assert r.returncode == 0 and marker in r.stdout and "_GPUPROV_COMPLETE" in r.stdout


def test_completion_protocol_completes_commands_and_choices(tmp_path):
    def complete(words: str, cword: int) -> list[str]:
        env = _env(tmp_path, _GPUPROV_COMPLETE="bash_complete", COMP_WORDS=words, COMP_CWORD=str(cword))
        r = subprocess.run([sys.executable, "-c", "from gpuprov.cli import main; main()"], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        return [ln.split(",", 1)[1] for ln in r.stdout.splitlines()]

    assert "plan" in complete("gpuprov pl", 1)
    assert complete("gpuprov plan --objective ", 3) == ["cost", "time", "gpus"]
    assert "bash" in complete("gpuprov completion ", 2)


def test_defaults_file_sets_cloud_objective_purchase_and_flags_win(tmp_path):
    xdg = tmp_path / "xdg"
    (xdg / "gpuprov").mkdir(parents=True)
    (xdg / "gpuprov" / "config.yaml").write_text("cloud: gcp\nregion: us-east4\nobjective: time\npurchase: spot\n")
    env = _env(tmp_path, XDG_CONFIG_HOME=str(xdg))
    p = json.loads(run("plan", "--model", "8b", "--task", "lora", "--json", env=env).stdout)
    assert (p["spec"]["cloud"], p["spec"]["region"], p["spec"]["objective"], p["spec"]["purchase"]) == (
        "gcp", "us-east4", "time", ["spot"])
    r = run("plan", "--model", "8b", "--task", "lora", "--cloud", "aws", "--objective", "cost", "--json", env=env)
    p = json.loads(r.stdout)
    # flags win; the file's region belongs to its cloud and steps aside for another
    assert (p["spec"]["cloud"], p["spec"]["region"], p["spec"]["objective"]) == ("aws", None, "cost")
    shown = json.loads(run("config", "--json", env=env).stdout)
    assert shown == {"path": str(xdg / "gpuprov" / "config.yaml"), "exists": True,
                     "values": {"cloud": "gcp", "region": "us-east4", "objective": "time", "purchase": ["spot"]},
                     "keys": ["cloud", "region", "objective", "purchase"]}
    spec = tmp_path / "gpuprov.yaml"  # a spec file is above the defaults
    spec.write_text("model: 8b\ntask: lora\nobjective: gpus\n")
    p = json.loads(run("plan", "-f", str(spec), "--json", env=env).stdout)
    assert p["spec"]["objective"] == "gpus" and p["spec"]["cloud"] == "gcp"


def test_defaults_file_under_home_when_xdg_is_unset(tmp_path):
    conf = tmp_path / "home" / ".config" / "gpuprov" / "config.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text("objective: time\n")
    r = run("config", "--json", env=_env(tmp_path))
    assert json.loads(r.stdout)["values"] == {"objective": "time"}
    assert json.loads(run("config", "--json", env=_env(tmp_path / "elsewhere")).stdout)["exists"] is False


@pytest.mark.parametrize("text,words", [("cloud: mars\n", ["config.yaml:1", "cloud"]),
                                        ("gpus: [h100-80gb]\n", ["config.yaml:1", "gpus", "unknown key"]),
                                        ("objective: [time\n", ["config.yaml"]),
                                        ("- aws\n", ["expected a mapping"])])
def test_a_bad_defaults_file_is_one_line_and_exit_2(tmp_path, text, words):
    xdg = tmp_path / "xdg"
    (xdg / "gpuprov").mkdir(parents=True)
    (xdg / "gpuprov" / "config.yaml").write_text(text)
    env = _env(tmp_path, XDG_CONFIG_HOME=str(xdg))
    for args in (("plan", "--model", "8b"), ("config",)):
        r = run(*args, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert all(w in r.stderr for w in words), r.stderr


@pytest.mark.parametrize("key,other", [("gpu: h100-80gb", "write gpus:"), ("deadline: 48", "write deadline_hours:"),
                                       ("num_gpus: 8", "write gpu_count:"), ("budget: 100", "write budget_usd:")])
def test_the_other_spelling_of_a_key_gets_a_hint(tmp_path, key, other):
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text(f"model: 8b\n{key}\n")
    r = run("plan", "-f", str(spec), env=_env(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and other in r.stderr


def test_estimates_plan_hint_runs_as_printed(tmp_path):
    r = run("estimate", "--model", "70b", "--gpu", "h100-80gb", "--gpus", "8", env=_env(tmp_path))
    hint = r.stdout.split("what would make it fit: ", 1)[1]
    command = hint.split("`gpuprov plan ", 1)[1].split("`", 1)[0]
    assert "..." not in command and " N" not in command
    again = run(*shlex.split("plan " + command), "--json", env=_env(tmp_path))
    assert again.returncode == 0, again.stderr
    p = json.loads(again.stdout)
    assert p["cluster"]["total_gpus"] == 8 and p["cluster"]["gpu"] == "h100-80gb"


def test_messages_are_cut_at_a_word_boundary():
    text = "the spot price is 550 days old: check the current rate at the provider's pricing page today"
    for limit in range(20, len(text)):
        out = clip(text, limit)
        assert len(out) <= limit and out.endswith("...")
        kept = out[:-3]
        assert text.startswith(kept) and not text[len(kept)].isalnum()  # the cut falls between words
    assert clip(text, len(text)) == text
    assert clip("x" * 50, 10) == "x" * 7 + "..."  # one long word: cut where it must be


def test_generate_summary_says_when_the_data_size_is_assumed(tmp_path):
    r = run("generate", "--model", "8b", "--task", "lora", "-o", str(tmp_path / "a"), env=_env(tmp_path))
    first = r.stderr.splitlines()[0]
    assert "the 100,000,000 tokens are assumed" in first and "--dataset" in first
    r = run("generate", "--model", "8b", "--task", "lora", "--tokens", "2B", "-o", str(tmp_path / "b"),
            env=_env(tmp_path))
    first = r.stderr.splitlines()[0]
    assert "2,000,000,000 training tokens" in first and "assumed" not in first
