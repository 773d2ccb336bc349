"""What `up` stages on the cluster before the job starts: the base weights and the dataset.

Decided once per plan (`Plan.staging`, recorded by gpuprov/targets/decide.py): a Hugging Face base is
fetched to {checkpoint root}/models/<id>, a base folder on the machine running `up` copied to
{root}/models/local/<folder name>; a dataset named by `--dataset` is copied (a local file) or
downloaded by the nodes (s3://, gs://, az://) to {root}/data/<run>/raw/, or read by prepare_data.py
itself (hf:ORG/NAME), and prepared into {root}/data/<run>/prepared, the data.path train.yaml reads; a
local directory prepare_data.py already wrote (its meta.json) is copied there as it is.
The checkpoint root is the filesystem every node mounts on a multi-node cluster, so each input is
fetched once. Renderers (launch/, ansible/stage.yml) and `up`'s steps read only this record.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

from gpuprov.plan import Plan, Staging
from gpuprov.validators import dataset_scheme

PREPARED = "prepared"


def _weights(plan: Plan, root: str) -> dict[str, str | None]:
    """Where the base comes from and its folder on the cluster: a Hugging Face id is downloaded there;
    a folder on the machine running `up` (plan.model's path, relative to the bundle) is copied there."""
    from gpuprov.catalog.models import HF_ID

    init = plan.training.init or ("random" if plan.task == "full" else "pretrained")
    base = plan.training.base_weights
    if init != "pretrained" or base is None:
        return {}
    local = str(plan.spec.model).endswith(".json") or base.startswith((".", "/"))  # a path, not an id
    if not local and HF_ID.fullmatch(base) is not None:
        return {"weights_repo": base, "weights_dir": f"{root}/models/{base}"}
    name = _raw_name(base)
    name = "base" if name.strip(".") == "" else name
    return {"weights_local": base, "weights_dir": f"{root}/models/local/{name}"}


def _is_count(value: str) -> bool:
    from gpuprov.errors import GpuprovError
    from gpuprov.specfile import parse_count

    try:
        parse_count(value.strip(), what="--dataset")
        return True
    except GpuprovError:
        return False


def _raw_name(source: str) -> str:
    """The file (or folder) name the source keeps on the cluster."""
    name = PurePosixPath(source.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._=+,@-]", "_", name) or "dataset"


def download_command(source: str, dest: str) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, source of the fact) that copy a dataset URI to `dest` on a node."""
    from gpuprov.catalog.bringup import dataset_download

    scheme = dataset_scheme(source) or "local"
    entry = dataset_download(scheme)
    src = source
    if scheme == "az":  # az://ACCOUNT/CONTAINER/PATH -> the blob's https URL, which azcopy reads
        account, container, path = source.split("://", 1)[1].split("/", 2)
        src = entry["url"].format(account=account, container=container, path=path)
    argv = [part.format(src=src, dest=dest) for part in entry["argv"]]
    if source.endswith("/"):
        argv.append(entry["recursive"])
    return argv, {str(k): str(v) for k, v in entry.get("env", {}).items()}, str(entry["source"])


def _dataset(spec: Any, root: str, run_id: str) -> dict[str, Any]:
    source = (spec.dataset or "").strip()
    if not source or _is_count(source):
        return {}
    scheme = dataset_scheme(source)
    base = f"{root}/data/{run_id}"
    if scheme == "hf":  # prepare_data.py reads it from the Hub on the node
        return {"dataset_kind": "hf", "dataset_source": source, "data_dir": f"{base}/{PREPARED}"}
    if scheme is None and (PurePosixPath(source).name == "meta.json" or Path(source).is_dir()):
        # prepare_data.py's output already: copied as it is to where the job reads it (no tokenizer needed)
        folder = str(PurePosixPath(source).parent if PurePosixPath(source).name == "meta.json" else source)
        return {"dataset_kind": "local", "dataset_source": folder.rstrip("/") + "/",
                "dataset_raw": f"{base}/{PREPARED}/", "data_dir": f"{base}/{PREPARED}", "dataset_prepared": True}
    raw = f"{base}/raw/{_raw_name(source)}" + ("/" if source.endswith("/") else "")
    out: dict[str, Any] = {"dataset_kind": scheme or "local", "dataset_source": source, "dataset_raw": raw,
                           "data_dir": f"{base}/{PREPARED}"}
    if scheme is not None:
        # into <raw>.part, renamed by launch/stage_data.sh once whole
        argv, env, fact = download_command(source, raw.rstrip("/") + ".part" + ("/" if raw.endswith("/") else ""))
        out.update(download_argv=argv, download_env=env, download_source=fact)
    return out


def staging_for(plan: Plan) -> Staging:
    """The plan's staging record (the plan must already carry its provisioning decisions)."""
    from gpuprov.render.launch import run_paths

    paths = run_paths(plan)  # refuses a plan without provisioning decisions
    assert plan.provisioning is not None
    root = plan.provisioning.checkpoint_root
    weights = _weights(plan, root)
    data = _dataset(plan.spec, root, paths["run_id"])
    if data and not weights and not data.get("dataset_prepared"):
        data["data_dir"] = None  # no tokenizer on the cluster to prepare it with: the user's step
    return Staging(seq_len=plan.cluster.seq_len, **weights, **data)


def staging_of(plan: Plan) -> Staging:
    """The recorded staging, or for a plan written before it was recorded: what it implies."""
    return plan.staging if plan.staging is not None else staging_for(plan)
