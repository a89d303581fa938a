#!/usr/bin/env bash
# Create (or reuse) .venv at the repository root with torch==2.13.0 and the project installed
# editable with its dev extras. Idempotent: a stamp over setup.py + constraints skips the installs
# when nothing changed, so the README commands cost ~1 s on a warm checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.megak3-stamp"
want="$(cat setup.py tools/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "^WARNING: Location" || true
# torch first, from its pinned version (the CPU wheel on this machine), and kept by the constraints.
# numpy with it: torch warns "Failed to initialize NumPy" while the build imports it without numpy.
.venv/bin/python -m pip install -q -c tools/constraints.txt torch==2.13.0 "numpy>=1.24" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch" 2>/dev/null || { echo "bootstrap: torch==2.13.0 failed to install" >&2; exit 1; }
# --no-build-isolation: the C++ extension builds against the installed torch instead of a fresh one.
# PYTHONWARNINGS: setuptools' editable build prints an informational UserWarning ("Editable installation.
# Please be careful with folders ...") that is no fault of the set-up; the install itself is unchanged.
PYTHONWARNINGS="ignore::UserWarning" .venv/bin/python -m pip install -q -c tools/constraints.txt --no-build-isolation -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import megak3, parallel, moonep" || { echo "bootstrap: project install failed" >&2; exit 1; }
echo "$want" > "$stamp"
