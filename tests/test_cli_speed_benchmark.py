"""benchmarks/cli_speed.py's cache modes find in the user cache what they say (the timings themselves are the
benchmark's to print, never a test's to assert)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("gpuprov_cli_speed_bench", REPO / "benchmarks" / "cli_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _entries(cache: Path, kind: str) -> list[str]:
    return sorted(p.name for p in (cache / "gpuprov" / kind).glob("*")) if (cache / "gpuprov" / kind).is_dir() else []


@pytest.mark.slow
def test_each_cache_mode_hands_a_run_what_it_names(tmp_path, monkeypatch) -> None:
    bench = _bench()
    seen: dict[str, dict[str, list[str]]] = {}

    def record(argv, cache):  # what the timed run's cache folder holds as it starts
        if cache is not None and "plan" in argv:
            seen.setdefault(str(cache), {k: _entries(cache, k) for k in ("catalog", "search")})
        return (0.0, 0.0)

    runners = {}
    for mode in ("warm", "cold", "new"):
        work = tmp_path / mode
        work.mkdir()
        runner = runners[mode] = bench.Runner(sys.executable, ["plan", "--model", "70b"], mode, work, 0)
        runner.prepare()  # real runs: the warm-up, and for `new` the 8b primer
    warm, cold, new = (runners[m] for m in ("warm", "cold", "new"))
    # the primer asked another question: catalogs parsed, one search kept, and not the warm run's search
    assert _entries(new.primed, "catalog") and len(_entries(new.primed, "search")) == 1
    assert _entries(new.primed, "search") != _entries(warm.warm, "search")
    assert _entries(cold.primed, "catalog") == [] and _entries(cold.primed, "search") == []

    monkeypatch.setattr(bench, "_run", record)
    for mode, runner in runners.items():
        seen.clear()
        runner.timed()
        (held,) = seen.values()
        if mode == "warm":  # the same question: its answer is there
            assert held["search"] == _entries(warm.warm, "search") and held["catalog"]
        elif mode == "cold":
            assert held == {"catalog": [], "search": []}
        else:  # catalogs cached, this question's search not
            assert held["catalog"] and held["search"] == _entries(new.primed, "search")
