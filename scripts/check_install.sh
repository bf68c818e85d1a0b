#!/usr/bin/env bash
# The package as a user installs it: in a fresh virtual environment that cannot see the system's
# site-packages, `pip install <clone>` (not editable: a built wheel, which must carry conf/ and
# kernels_ptx/), then, from another directory:
#   - `python -m turbo max_new_tokens=8` streams its text on stdout and its stats line on stderr;
#   - the PTX directory the cuda backend reads holds the kernels;
#   - `python -m tui` stops with one line naming the extra (exit status 2);
#   - with the tui extra installed, `python -m tui` starts (drawn on a pseudo-terminal, quit with ctrl+q).
#
#   scripts/check_install.sh [VENV_DIR]      (default $TMPDIR/venv_turbo, /tmp without TMPDIR; recreated)
#
# torch is installed first, on its own, so pip takes a CPU wheel where one is cached or on
# find-links rather than the multi-GB CUDA build.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${TMPDIR:-/tmp}/venv_turbo}
py="$venv/bin/python"
fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$venv"
python3 -m venv "$venv"  # no --system-site-packages: the extras installed there must stay invisible
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q "$repo"

for module in textual cuda.bindings matplotlib hydra_plugins.hydra_joblib_launcher \
              hydra_plugins.hydra_submitit_launcher gguf PIL; do
    if "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('${module%%.*}') is None)"; then
        fail "$module is importable in the core install"
    fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # away from the checkout: the installed package must stand on its own

echo "\$ python -c 'import turbo; print(turbo.__file__)'"
"$py" -c "import turbo; print(turbo.__file__)" | tee "$work/where"
grep -q "^$venv/" "$work/where" || fail "turbo was imported from outside $venv"

echo "\$ python -m turbo max_new_tokens=8"
"$py" -m turbo max_new_tokens=8 >"$work/gen.out" 2>"$work/gen.err"
cat "$work/gen.out"; echo; cat "$work/gen.err"
grep -q "tok/s" "$work/gen.err" || fail "python -m turbo printed no stats line on stderr"
grep -q "tok/s" "$work/gen.out" && fail "python -m turbo printed its stats line on stdout (the text's)"

echo "\$ python -c 'import turbo.backends.cuda_kernels as k; print(k.ptx_dir())'"
ptx=$("$py" -c "import turbo.backends.cuda_kernels as k; print(k.ptx_dir())")
echo "$ptx"; ls "$ptx"
[[ "$ptx" == "$venv"/* ]] || fail "the PTX directory is outside the installed package"
ls "$ptx"/*.sm_90.ptx >/dev/null 2>&1 || fail "no PTX in $ptx"

echo "\$ python -m tui   (core only)"
set +e
"$py" -m tui >"$work/tui.out" 2>"$work/tui.err" </dev/null
rc=$?
set -e
cat "$work/tui.err" >&2
if [[ $rc -ne 2 || $(wc -l <"$work/tui.err") -ne 1 || -s "$work/tui.out" ]] \
        || ! grep -q "pip install 'turbo\[tui\]'" "$work/tui.err"; then
    fail "python -m tui exited $rc; expected status 2 and one line naming turbo[tui]"
fi

echo "\$ pip install '<clone>[tui]' && python -m tui   (quit with ctrl+q after 15 s)"
"$py" -m pip install -q "$repo[tui]"
set +e
(sleep 15; printf '\021') | TERM=xterm-256color COLUMNS=100 LINES=30 \
    script -qefc "$py -m tui max_new_tokens=8" "$work/tui.tty" >/dev/null 2>&1
rc=$?
set -e
screen=$(sed 's/\x1b\[[0-9;?]*[a-zA-Z]//g' "$work/tui.tty")
[[ $rc -eq 0 ]] || fail "python -m tui exited $rc: $(tail -c 400 "$work/tui.tty")"
grep -q "turbo" <<<"$screen" || fail "python -m tui drew nothing naming turbo"
grep -q "Traceback" <<<"$screen" && fail "python -m tui printed a traceback"
echo "python -m tui started, drew its screen and quit with status 0"
echo "OK: a non-editable install runs python -m turbo and python -m tui and finds its configs and PTX"
