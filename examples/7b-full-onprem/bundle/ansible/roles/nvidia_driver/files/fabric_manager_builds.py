"""Print, as a JSON list of "name=version", the build of each package whose upstream version is
the loaded driver's, taken from the repository apt prefers (the highest pin priority in
`apt-cache policy`).

Usage: fabric_manager_builds.py <loaded driver version> <package>...  ("name=" where none matches)
"""

import json
import re
import subprocess
import sys

VERSION_LINE = re.compile(r"^ (?:\*\*\*| {3}) (\S+) (-?\d+)$", re.M)


def upstream(version: str) -> str:
    return version.split(":")[-1].rsplit("-", 1)[0]


def best_build(policy: str, loaded: str) -> str:
    builds = [(int(prio), version) for version, prio in VERSION_LINE.findall(policy) if upstream(version) == loaded]
    return max(builds)[1] if builds else ""


def main(argv: list[str]) -> int:
    loaded, names = argv[0], argv[1:]
    found = []
    for name in names:
        policy = subprocess.run(["apt-cache", "policy", name], capture_output=True, text=True, check=False).stdout
        found.append(f"{name}={best_build(policy, loaded)}")
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
