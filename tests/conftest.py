import sys
from pathlib import Path

# tests import their sibling helpers (plan_fixtures) directly
sys.path.insert(0, str(Path(__file__).resolve().parent))

import os  # noqa: E402
import tempfile  # noqa: E402

# the user's defaults file (~/.config/gpuprov/config.yaml) must not change what the tests plan: every
# gpuprov the tests start reads an empty config folder (tests of the file set their own)
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="gpuprov-test-config-")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="gpuprov-test-cache-")  # compiled templates, parsed catalogs
