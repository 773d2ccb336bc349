"""Import each named module and print their versions as JSON (and torch's CUDA build)."""

import importlib
import json
import sys


def main(names: list[str]) -> int:
    found = {}
    for name in names:
        module = importlib.import_module(name)
        found[name] = getattr(module, "__version__", "?")
    if "torch" in found:
        import torch

        found["torch.version.cuda"] = torch.version.cuda or ""
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
