#!/usr/bin/env bash
# The core install, without extras: in a fresh virtual environment that cannot see the system's
# site-packages, `pip install -e .` runs `python -m turbo`, and `python -m tui` stops with one
# line naming the extra to install (exit status 2).
#
#   scripts/check_core_install.sh [VENV_DIR]      (default /tmp/venv_core; recreated)
#
# torch is installed first, on its own, so pip takes a CPU wheel where one is cached or on
# find-links rather than the multi-GB CUDA build.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-/tmp/venv_core}
py="$venv/bin/python"

rm -rf "$venv"
python3 -m venv "$venv"  # no --system-site-packages: the extras installed there must stay invisible
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q -e "$repo"

for module in textual cuda.bindings matplotlib hydra_plugins.hydra_joblib_launcher \
              hydra_plugins.hydra_submitit_launcher; do
    if "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('${module%%.*}') is None)"; then
        echo "FAIL: $module is importable in the core install" >&2
        exit 1
    fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # away from the checkout: the installed package must stand on its own

echo "\$ python -m turbo max_new_tokens=8"
"$py" -m turbo max_new_tokens=8

echo "\$ python -m tui"
set +e
"$py" -m tui >"$work/tui.out" 2>"$work/tui.err" </dev/null
rc=$?
set -e
cat "$work/tui.err" >&2
if [[ $rc -ne 2 || $(wc -l <"$work/tui.err") -ne 1 || -s "$work/tui.out" ]] \
        || ! grep -q "pip install 'turbo\[tui\]'" "$work/tui.err"; then
    echo "FAIL: python -m tui exited $rc; expected status 2 and one line naming turbo[tui]" >&2
    exit 1
fi
echo "OK: the core install runs python -m turbo; python -m tui names the tui extra"
