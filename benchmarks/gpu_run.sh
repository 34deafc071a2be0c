#!/usr/bin/env bash
# Run benchmarks/gpu_check.py on a GPU machine whose image has Python, torch, triton, cuda-bindings and numpy
# but not pydantic, no package registry and no installed kvxfer (the device image; benchmarks/NOTES.md).
#
#   benchmarks/gpu_run.sh [--setup-only] [gpu_check.py options...]
#
# 1. If pydantic does not import, install it and its dependencies from .whl/ (filled here by `make wheels`,
#    carried along with the checkout) into a scratch site folder: pip --no-index, nothing is fetched.
# 2. Make the checkout importable as kvxfer without building: kvxfer/<name> symlinks in that site folder, one
#    per entry of pyproject.toml's package-dir mapping, so every package folder listed there is included.
# 3. Run the check under `timeout`, writing gpu_check.json and gpu_check.log into $OUT.
# --setup-only stops after step 2 and its import check.
#
# Environment: PYTHON (default python3), OUT (default ./out), GPU_CHECK_TIMEOUT_S (default 420: the check is
# sized for about 4.5 minutes by estimate (--dry-run prints it), so a rerun fits in the 15-minute device budget), KVXFER_SITE (default: a
# fresh temporary folder).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-420}"
SITE="${KVXFER_SITE:-$(mktemp -d /tmp/kvxfer-site.XXXXXX)}"
SETUP_ONLY=0
if [[ "${1:-}" == "--setup-only" ]]; then SETUP_ONLY=1; shift; fi
mkdir -p "$OUT" "$SITE"

# 1. pydantic from the carried wheels (pip picks the pydantic-core wheel for this interpreter's tag)
if ! "$PY" -c "import pydantic" 2>/dev/null; then
    if ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        echo "gpu_run: pydantic is missing and $ROOT/.whl has no wheels: run 'make wheels' here and carry .whl" >&2
        exit 3
    fi
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --no-index --find-links "$ROOT/.whl" --no-compile \
        --no-cache-dir --disable-pip-version-check --upgrade --target "$SITE" pydantic || {
        echo "gpu_run: installing pydantic from $ROOT/.whl failed (wheels: $(ls "$ROOT"/.whl | tr '\n' ' '))" >&2
        exit 3
    }
fi

# 2. kvxfer.<name> -> the checkout's folders, as pyproject.toml maps them
"$PY" - "$ROOT" "$SITE" <<'EOF' || exit 3
import sys, tomllib
from pathlib import Path
root, site = Path(sys.argv[1]), Path(sys.argv[2])
mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in mapping.items():
    top, _, name = package.partition(".")
    if top != "kvxfer" or not name or "." in name:
        sys.exit(f"gpu_run: unexpected package-dir entry {package!r} = {folder!r} in pyproject.toml")
    link = site / "kvxfer" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(root / folder, target_is_directory=True)
print("gpu_run: kvxfer." + ", kvxfer.".join(p.partition(".")[2] for p in mapping), "->", root)
EOF
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import kvxfer.planner, kvxfer.executors, pydantic; print('gpu_run: imports ok, pydantic', pydantic.VERSION)" || exit 3
[[ $SETUP_ONLY == 1 ]] && exit 0

# 3. the check; its JSON is rewritten after every section, so a timeout keeps what finished
cd "$ROOT"
echo "gpu_run: gpu_check.py under a ${TIMEOUT_S} s timeout, results in $OUT"
PYTHONUNBUFFERED=1 timeout -k 15 "$TIMEOUT_S" "$PY" benchmarks/gpu_check.py --out "$OUT/gpu_check.json" "$@" \
    2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
[[ $rc == 124 || $rc == 137 ]] && echo "gpu_run: timed out after ${TIMEOUT_S} s; $OUT/gpu_check.json holds the sections that finished"
exit "$rc"
