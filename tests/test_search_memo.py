"""A search or a bundle answered from the user's cache is what the run would compute: any changed input, source,
catalog, template or role file is a new walk or render, a damaged entry is computed again, and the memos serve
only whole processes (planning/search_memo.py, render/memo.py).

The end-to-end tests run a copy of the checkout, edit it as a developer or a catalog update would, and compare
the warm answer with a run without any cache."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuprov
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.instances import list_instances
from gpuprov.catalog.models import get_model
from gpuprov.planning import search_memo
from gpuprov.planning.search import search
from gpuprov.sizing.memory import estimate_memory
from gpuprov.spec import TrainingSpec

PACKAGE = Path(gpuprov.__file__).resolve().parent


@pytest.fixture
def memo(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GPUPROV_NO_CACHE", raising=False)
    monkeypatch.setattr(search_memo, "ENABLED", True)
    return tmp_path / "cache" / "gpuprov" / "search"


def _search(spec: TrainingSpec, instances=None):
    pool = list(list_instances()) if instances is None else instances
    return search(spec, get_model(spec.model), estimator=estimate_memory, instances=pool, gpu_lookup=get_gpu)


def _answer(result) -> tuple:
    best = result.best
    return (best.instance, best.nodes, best.sharding, best.activation_checkpointing, best.micro_batch,
            best.time_hours, best.cost_usd, sorted(result.best_by_gpu), sorted(result.unfit_gpus), result.evaluated,
            result.memory_calls)


def test_a_remembered_search_is_the_walk_and_another_input_is_another_walk(memo: Path, monkeypatch):
    spec = TrainingSpec(model="8b", task="lora", tokens=100_000_000, cloud="aws")
    walked = _search(spec)
    assert len(list(memo.glob("*.pickle"))) == 1
    calls = []
    monkeypatch.setattr("gpuprov.planning.search._Search.walk_instance", lambda *a: calls.append(a))
    remembered = _search(spec)
    assert not calls and _answer(remembered) == _answer(walked)
    assert remembered is not walked  # a fresh copy: make_plan may change it (on-prem) without touching the entry
    # every input is part of the key: these walk again (and here find nothing, the walk being stubbed)
    assert _search(spec.model_copy(update={"seq_len": 2048})).best is None
    pool = [i for i in list_instances() if i.name != walked.best.instance.name]
    assert _search(spec, pool).best is None
    assert len(calls) > 0


def test_a_damaged_or_foreign_entry_is_walked_again(memo: Path):
    spec = TrainingSpec(model="8b", task="lora", tokens=100_000_000, cloud="gcp")
    walked = _search(spec)
    (entry,) = memo.glob("*.pickle")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    assert _answer(_search(spec)) == _answer(walked)
    other = pickle.dumps(("another key", walked))  # an entry whose recorded key is not this search's
    entry.write_bytes(other)
    assert _answer(_search(spec)) == _answer(walked)
    assert entry.read_bytes() != other  # written again under its own key


def test_the_memo_is_off_for_in_process_callers_and_with_no_cache(memo: Path, monkeypatch):
    spec = TrainingSpec(model="8b", task="lora", tokens=100_000_000, cloud="aws")
    monkeypatch.setattr(search_memo, "ENABLED", False)
    _search(spec)
    monkeypatch.setattr(search_memo, "ENABLED", True)
    monkeypatch.setenv("GPUPROV_NO_CACHE", "1")
    _search(spec)
    assert not memo.exists() or not list(memo.glob("*.pickle"))
    # an estimator the code hash does not cover (a caller's own) is never remembered
    monkeypatch.delenv("GPUPROV_NO_CACHE")
    model = get_model("8b")
    search(spec, model, estimator=lambda a, s: estimate_memory(a, s), instances=list(list_instances()),
           gpu_lookup=get_gpu)
    assert not memo.exists() or not list(memo.glob("*.pickle"))


def test_old_entries_are_removed_beyond_the_limit(memo: Path, monkeypatch):
    monkeypatch.setattr(search_memo, "KEEP", 3)
    for seq in (1024, 2048, 4096, 8192, 512):
        _search(TrainingSpec(model="8b", task="lora", tokens=100_000_000, cloud="aws", seq_len=seq))
    assert len(list(memo.glob("*.pickle"))) == 3


def test_the_code_hash_covers_every_source_and_catalog_file(tmp_path: Path, monkeypatch):
    import gpuprov.resources

    root = tmp_path / "pkg"
    (root / "catalog" / "data").mkdir(parents=True)
    (root / "sizing").mkdir()
    (root / "sizing" / "m.py").write_text("X = 1\n")
    (root / "catalog" / "data" / "t.yaml").write_text("a: 1\n")
    (root / "notes.txt").write_text("not code\n")
    monkeypatch.setattr(gpuprov.resources, "_PACKAGE_DIR", root)

    def tag() -> bytes:
        search_memo.code_tag.cache_clear()
        return search_memo.code_tag()

    first = tag()
    (root / "notes.txt").write_text("still not code\n")
    assert tag() == first
    for path, text in ((root / "sizing" / "m.py", "X = 2\n"), (root / "catalog" / "data" / "t.yaml", "a: 2\n"),
                       (root / "new.py", "")):
        before = tag()
        path.write_text(text)
        assert tag() != before, path
    search_memo.code_tag.cache_clear()


def _tree_tag(root: Path) -> bytes:
    import hashlib

    digest = hashlib.sha256()
    search_memo.hash_tree(digest, str(root), lambda folder, name: True)
    return digest.digest()


def test_a_file_unchanged_for_seconds_is_keyed_by_its_metadata_without_reading_it(tmp_path: Path, monkeypatch):
    f = tmp_path / "m.py"
    f.write_text("X = 1\n")
    old = f.stat().st_mtime_ns - 10 * search_memo.RECENT_NS
    os.utime(f, ns=(old, old))
    monkeypatch.setattr("time.time_ns", lambda: max(old, f.stat().st_ctime_ns) + 2 * search_memo.RECENT_NS)
    first = _tree_tag(tmp_path)
    real_open = open

    def no_read(path, *args, **kwargs):
        assert Path(path) != f, "an old file was read"
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_read)
    assert _tree_tag(tmp_path) == first
    os.utime(f, ns=(old, old + 1))  # any other modification time (a checkout, a copy with -p) is another key
    assert _tree_tag(tmp_path) != first


def test_a_file_changed_within_the_window_is_keyed_by_its_text(tmp_path: Path, monkeypatch):
    """Two writes of one size within one tick of the file system's clock can share every time stamp: a young file
    is keyed by its text alone (the same text in another file, another inode, is the same key)."""
    trees = {}
    for name, text in (("a", "X = 1\n"), ("b", "X = 1\n"), ("c", "X = 2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(text)
        trees[name] = tmp_path / name
    young = max(max(t.joinpath("m.py").stat().st_mtime_ns, t.joinpath("m.py").stat().st_ctime_ns)
                for t in trees.values())
    monkeypatch.setattr("time.time_ns", lambda: young + search_memo.RECENT_NS // 2)
    assert _tree_tag(trees["a"]) == _tree_tag(trees["b"])
    assert _tree_tag(trees["a"]) != _tree_tag(trees["c"])


# ---------------------------------------------------------------- whole processes, on an edited copy


def _plan(copy: Path, env: dict, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "8b", "--task", "lora", "--tokens",
                        "100M", "--cloud", "aws", "--json", *args], cwd=copy, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def copy(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "checkout"
    for folder in ("gpuprov", "templates", "ansible"):
        shutil.copytree(PACKAGE.parent / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(root), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("GPUPROV_NO_CACHE", None)
    return root, env


def test_an_edited_source_file_is_never_answered_from_the_cache(copy):
    root, env = copy
    cold = _plan(root, env)
    assert list((Path(env["XDG_CACHE_HOME"]) / "gpuprov" / "search").glob("*.pickle"))
    assert _plan(root, env) == cold
    assert cold["cluster"]["activation_checkpointing"] != "full"  # else the edit below would change nothing
    walk = root / "gpuprov" / "planning" / "search.py"
    text = walk.read_text()
    line = "self.ac_modes = (fixed_ac,) if fixed_ac else AC_MODES"
    assert line in text
    walk.write_text(text.replace(line, 'self.ac_modes = (fixed_ac,) if fixed_ac else ("full",)'))  # the walk's own
    edited = _plan(root, env)
    assert edited["cluster"]["activation_checkpointing"] == "full"
    assert edited == _plan(root, {**env, "GPUPROV_NO_CACHE": "1"})


def test_an_edited_catalog_price_is_never_answered_from_the_cache(copy):
    root, env = copy
    cold = _plan(root, env)
    name, price = cold["instance"]["name"], cold["instance"]["price_per_hour_usd"]
    catalog = root / "gpuprov" / "catalog" / "data" / "instances.yaml"
    text = catalog.read_text()
    old = f"{{name: {name}, "
    line = next(x for x in text.splitlines() if old in x)
    assert f"price_per_hour_usd: {price}," in line
    catalog.write_text(text.replace(line, line.replace(f"price_per_hour_usd: {price},",
                                                       f"price_per_hour_usd: {price * 2},")))
    edited = _plan(root, env)
    assert edited != cold
    assert edited == _plan(root, {**env, "GPUPROV_NO_CACHE": "1"})



def _generate(copy: Path, env: dict, out: Path) -> dict[str, bytes]:
    r = subprocess.run([sys.executable, "-m", "gpuprov", "generate", "--model", "8b", "--task", "lora", "--tokens",
                        "100M", "--cloud", "gcp", "-o", str(out)], cwd=copy, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_an_edited_template_or_role_is_rendered_again_not_served_from_the_cache(copy, tmp_path: Path):
    root, env = copy
    cold = _generate(root, env, tmp_path / "cold")
    assert list((Path(env["XDG_CACHE_HOME"]) / "gpuprov" / "bundle").glob("*.marshal"))
    assert _generate(root, env, tmp_path / "warm") == cold
    template = root / "templates" / "terraform" / "gcp" / "variables.tf.j2"  # rendered with Jinja
    role = root / "ansible" / "roles" / "nccl" / "defaults" / "main.yml"  # copied as it is
    for path, name in ((template, "terraform/variables.tf"), (role, "ansible/roles/nccl/defaults/main.yml")):
        path.write_text(path.read_text() + "# edited\n")
        out = tmp_path / f"edited-{path.name}"
        edited = _generate(root, env, out)
        assert edited[name].endswith(b"# edited\n"), name
        assert edited == _generate(root, {**env, "GPUPROV_NO_CACHE": "1"}, out.with_name(out.name + "-off"))


def test_the_render_key_covers_templates_roles_and_the_template_engine(tmp_path: Path, monkeypatch):
    import gpuprov.resources
    from gpuprov.render import memo

    for folder in ("templates/launch", "ansible/roles/x"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "templates" / "launch" / "t.j2").write_text("a\n")
    (tmp_path / "ansible" / "roles" / "x" / "main.yml").write_text("b\n")
    monkeypatch.setattr(gpuprov.resources, "_PACKAGE_DIR", tmp_path / "gpuprov")  # a checkout: folders beside it

    def tag() -> bytes:
        memo.data_tag.cache_clear()
        return memo.data_tag()

    for path in (tmp_path / "templates" / "launch" / "t.j2", tmp_path / "ansible" / "roles" / "x" / "main.yml"):
        before = tag()
        path.write_text("changed\n")
        assert tag() != before, path
    jinja = tmp_path / "jinja2"
    shutil.copytree(Path(__import__("jinja2").__file__).parent, jinja, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))  # find_spec("jinja2") now finds the copy
    monkeypatch.delitem(sys.modules, "jinja2", raising=False)
    before = tag()
    (jinja / "__init__.py").write_text((jinja / "__init__.py").read_text().replace("__version__ = ", "__version__ = '9' or "))
    assert tag() != before
    memo.data_tag.cache_clear()
