"""checkov (a Terraform security scanner) reports no failed check on the generated Terraform.

checkov lives in its own virtual environment (.checkov-venv, made by .ci/setup.d/10-checkov.sh)
because its pinned dependencies break pytest; it runs offline (--skip-download, BC_SKIP_MAPPING).
The only accepted exceptions are `#checkov:skip=ID:reason` lines in the templates."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from gpuprov.resources import templates_dir
from terraform_support import plans, render_to

REPO = Path(__file__).resolve().parent.parent
CHECKOV = REPO / ".checkov-venv" / "bin" / "checkov"
# One plan per fabric layout (checkov expands count, so each layout's NICs and networks are scanned).
SCANNED = ["aws-p5-16-cr", "aws-g6e-noefa", "gcp-a3mega-2", "gcp-a3ultra-4", "azure-2", "azure-2-ssh", "oci-2",
           "oci-2-ssh"]

pytestmark = pytest.mark.skipif(
    not CHECKOV.exists(),
    reason="CHECKOV NOT INSTALLED: .checkov-venv is missing; run `bash .ci/setup.d/10-checkov.sh` "
           "(tests/run.sh does) to scan the generated Terraform")


def _scan(directory: Path) -> dict:
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    proc = subprocess.run([str(CHECKOV), "-d", str(directory), "--framework", "terraform", "--skip-download",
                           "--compact", "-o", "json"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.stdout.strip(), f"checkov printed nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    report = json.loads(proc.stdout)
    return report[0] if isinstance(report, list) else report


@pytest.mark.slow
def test_checkov_finds_no_failed_check(tmp_path):
    for name in SCANNED:
        render_to(tmp_path / name, plans()[name])
    # One checkov run over all modules (its start-up dominates).
    report = _scan(tmp_path)
    summary = report["summary"]
    failed = [f"{f['check_id']} {f['resource']} ({f['file_path']}): {f['check_name']}"
              for f in report["results"]["failed_checks"]]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 100, summary  # it really scanned every module
    scanned = {Path(c["file_path"]).parts[1] for c in report["results"]["passed_checks"]}
    assert scanned == set(SCANNED), scanned
    # Skips happen only where a template says so, with its reason.
    for skip in report["results"]["skipped_checks"]:
        assert skip["check_result"].get("suppress_comment", "").strip(), skip["check_id"]


def test_every_skip_gives_a_reason():
    """Inline skips must name the check and say why (checkov's syntax: #checkov:skip=ID:reason)."""
    skips = []
    for path in (templates_dir() / "terraform").rglob("*"):
        if path.is_file() and path.name.endswith((".tf", ".tf.j2")):
            for line in path.read_text().splitlines():
                if "checkov:skip" in line:
                    m = re.search(r"#checkov:skip=(CKV2?_[A-Z]+_\d+):(.{40,})", line)
                    assert m, f"{path.name}: skip without an ID and a real reason: {line.strip()}"
                    skips.append(m.group(1))
    assert skips, "no inline skip found: update this test if every skip is gone"
