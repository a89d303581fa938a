#!/usr/bin/env bash
# CI step 2: fla's Triton KDA kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)
# against megak3's torch twin, for the lowest and highest fla-core of setup.py's gpu extra.
# Installs triton and each fla-core into its own target dir (two fla versions cannot share one
# environment) under .cache/triton-interp/ (or $MEGAK3_TRITON_PACKAGES), from PyPI, once: a dir
# whose .installed marker exists is reused. Then runs tests/test_fla_triton.py's interpreter test
# with MEGAK3_REQUIRE_TRITON=1 (it skips without; a missing dir fails). Needs the project venv first.
set -euo pipefail
TRITON_VERSION="3.7.1"          # the triton torch 2.13 pins
FLA_VERSIONS="0.4.2 0.5.2"      # setup.py: fla-core>=0.4.2,<0.6 -> lowest and newest 0.5.x
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-.venv/bin/python}"
dest="${MEGAK3_TRITON_PACKAGES:-$root/.cache/triton-interp}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
install() {  # install <dir name> <requirement checked> [more requirements]
  local dir="$dest/$1"
  if [ -f "$dir/.installed" ]; then return; fi
  rm -rf "$dir"
  "$py" -m pip install -q --no-deps -c tools/constraints.txt --target "$dir" "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true
  "$py" - "$dir" "$2" <<'PY'
import importlib.metadata as md, sys
name, version = sys.argv[2].split("==")
norm = lambda s: s.replace("_", "-").lower()
found = [d.version for d in md.distributions(path=[sys.argv[1]]) if norm(d.metadata["Name"]) == norm(name)]
sys.exit(0 if found == [version] else f"ci_triton: {sys.argv[2]} did not install into {sys.argv[1]}")
PY
  touch "$dir/.installed"
}
install "triton-$TRITON_VERSION" "triton==$TRITON_VERSION"
# fla-core needs einops (and packaging, which the venv has); --no-deps keeps torch out
for v in $FLA_VERSIONS; do install "fla-core-$v" "fla-core==$v" "einops==0.8.2"; done
MEGAK3_TRITON_PACKAGES="$dest" MEGAK3_REQUIRE_TRITON=1 "$py" -m pytest -q -p no:cacheprovider -n 2 \
  tests/test_fla_triton.py -k triton_interpreter
