"""`gpuprov validate`'s "plan fits" re-sizes a bundle's plan through the one Plan -> setup path
(gpuprov/sizing/setup.py) and reports the plan's own figure: a bundle generated a second earlier
never fails it. Walked over every committed example (spec and committed plan.json) and
`generate --model 70b` on each cloud, a capacity block and an on-prem hosts file."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import subprocess
from gpuprov.commands.gitops import check_plan
from gpuprov.commands.generate import make_plan
from gpuprov.commands.spec_options import spec_from_flags
from gpuprov.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from regen_examples import EXAMPLES, example_dirs, example_spec  # noqa: E402

FIGURE = re.compile(r"^(\d+\.\d) GiB of (\d+\.\d) GiB usable per GPU on (\S+)")


def _check(tmp_path: Path, plan: Plan) -> None:
    (tmp_path / "plan.json").write_text(plan.model_dump_json(indent=2), encoding="utf-8")
    status, detail = check_plan(tmp_path)
    assert status == "ok", detail
    got = FIGURE.match(detail)
    assert got, detail
    assert float(got.group(1)) == round(plan.memory.per_gpu_bytes / 2**30, 1)
    assert got.group(3) == plan.gpu.slug
    assert "plan:" not in detail  # no second figure: the re-estimate is the plan's own


@pytest.mark.parametrize("directory", example_dirs(), ids=lambda d: d.name)
def test_example_specs_fit_with_the_plans_figure(tmp_path, directory):
    _check(tmp_path, make_plan(example_spec(directory)))


COMMITTED = sorted(EXAMPLES.glob("*/shown/plan.json")) + sorted(EXAMPLES.glob("*/bundle/plan.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.parent.name)
def test_committed_plans_fit_with_their_figure(tmp_path, path):
    _check(tmp_path, Plan.model_validate_json(path.read_text(encoding="utf-8")))


FLAGS = {
    "aws": {"cloud": "aws"}, "gcp": {"cloud": "gcp"}, "azure": {"cloud": "azure"}, "oci": {"cloud": "oci"},
    "aws-capacity-block": {"cloud": "aws", "gpus": ("h200-141gb",), "purchase": "capacity-block",
                           "capacity_reservation_id": "cr-0123456789abcdef0"},
}


@pytest.mark.parametrize("name", list(FLAGS))
def test_generate_70b_fits_with_the_plans_figure(tmp_path, name):
    _check(tmp_path, make_plan(spec_from_flags(None, None, {"model": "70b", **FLAGS[name]})))


def test_generate_70b_onprem_fits_with_the_plans_figure(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"- {{name: gpu{i}, address: 10.0.0.{i + 1}, gpu: h100-80gb, gpus: 8}}\n"
                             for i in range(4)), encoding="utf-8")
    (tmp_path / "b").mkdir()
    _check(tmp_path / "b", make_plan(spec_from_flags(None, str(hosts), {"model": "70b"})))


def test_a_changed_estimate_names_both_figures(tmp_path):
    """A plan whose recorded figure no longer matches today's estimate says so (it is not silent)."""
    plan = make_plan(spec_from_flags(None, None, {"model": "7b", "cloud": "aws"}))
    memory = plan.memory.model_copy(update={"per_gpu_bytes": plan.memory.per_gpu_bytes - 2**30})
    (tmp_path / "plan.json").write_text(plan.model_copy(update={"memory": memory}).model_dump_json(), encoding="utf-8")
    status, detail = check_plan(tmp_path)
    assert status == "ok"
    assert re.search(r"plan: (\d+\.\d) GiB", detail).group(1) == f"{(plan.memory.per_gpu_bytes - 2**30) / 2**30:.1f}"


def test_validate_cli_reports_plan_fits_for_a_fresh_bundle(tmp_path):
    """The user's path: generate, then validate; the "plan fits" row is ok with the plan's figure."""
    out = tmp_path / "infra"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=300)

    r = run("generate", "--model", "70b", "--cloud", "azure", "-o", str(out))
    assert r.returncode == 0, r.stderr
    r = run("validate", str(out), "--offline")
    row = next(line for line in r.stdout.splitlines() if line.split()[:3] == ["ok", "plan", "fits"])
    plan = Plan.model_validate_json((out / "plan.json").read_text(encoding="utf-8"))
    assert row.split()[3] == f"{plan.memory.per_gpu_bytes / 2**30:.1f}"
