#!/usr/bin/env bash
# Release check: the README's Python versions still pass. For each Python interpreter found (or
# each one named), builds a virtual environment with the README's set-up (pip install -r
# requirements.txt) and runs a quick subset of the tests in it: the checks where Python versions
# have differed (a launcher started through a path holding "..", the Ctrl-C walks over CPython's
# signal points, the world-size runs), the run-directory contract warm and cold, and the warm
# timeout diagnosis. Not the whole suite (bash .ci/run does that for one Python).
#
#     bash tools/python_versions.sh                       # every python3.N found (pyenv, PATH)
#     bash tools/python_versions.sh /usr/bin/python3.12   # just these
#
# VENVS: where the environments go (default ~/.cache/ddp-lesson-venvs; one per version, reused);
# JOBS: pytest workers per version (default 2). Versions below pyproject's requires-python are
# listed and skipped. Exit status 0 when every version the README promises was found and passed,
# 1 otherwise.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENVS=${VENVS:-$HOME/.cache/ddp-lesson-venvs}
JOBS=${JOBS:-2}
FLOOR=$(sed -n 's/^requires-python = ">=3\.\([0-9]*\)"/\1/p' pyproject.toml)
# what the README promises ("Python 3.10-3.13"): each of these must be found here and pass
PROMISED=$(grep -o 'Python 3\.[0-9]*-3\.[0-9]*' README.md | head -1)
LO=${PROMISED#Python 3.}; LO=${LO%%-*}; HI=${PROMISED##*-3.}
if [[ -z "$PROMISED" || "$LO" != "$FLOOR" ]]; then
  echo "python_versions: README.md promises '${PROMISED:-no range}' but pyproject.toml says >=3.$FLOOR; make them agree." >&2
  exit 1
fi
QUICK=(
  tests/test_pythons.py
  tests/test_world_rank.py
  tests/test_interrupts.py
  tests/test_world_size.py
  tests/test_launch.py::test_run_directory_contract
  "tests/test_timeout_diagnosis.py::test_a_rank_busy_in_a_python_loop_is_busy_not_in_a_collective[warm]"
  "tests/test_timeout_diagnosis.py::test_a_rank_that_never_calls_init_is_the_one_named[warm]"
)

# the interpreters: those named, else one per minor version from pyenv and PATH
declare -A seen
found=()
add() {
  local py=$1 v
  v=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 0
  [[ -n "${seen[$v]:-}" ]] && return 0
  seen[$v]=1
  found+=("$v $py")
}
if (($#)); then
  for py in "$@"; do add "$py"; done
else
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for py in "$root"/versions/*/bin/python3 $(compgen -c python3. | sort -u); do
    [[ -x "$py" ]] || py=$(command -v "$py" 2>/dev/null) || continue
    [[ "$(basename "$py")" =~ ^python3(\.[0-9]+)?$ ]] && add "$py"
  done
fi
if ((${#found[@]} == 0)); then
  echo "python_versions: no Python interpreter found; name one: bash tools/python_versions.sh /path/to/python3.12" >&2
  exit 1
fi

mkdir -p "$VENVS"
summary=()
failed=0
for entry in $(printf '%s\n' "${found[@]}" | sort -t. -k2 -n | tr ' ' '|'); do
  v=${entry%%|*}
  py=${entry#*|}
  if ((${v#3.} < FLOOR)); then
    summary+=("$v  skipped: below requires-python >=3.$FLOOR (torch 2.14.1 has no build for it)")
    continue
  fi
  venv="$VENVS/py$v"
  log="$VENVS/py$v.log"
  echo "python_versions: Python $v ($py): environment $venv, log $log" >&2
  t0=$SECONDS
  if ! { [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"; } >"$log" 2>&1 \
     || ! "$venv/bin/python" -m pip install -q -r requirements.txt >>"$log" 2>&1; then
    summary+=("$v  FAILED to install (pip install -r requirements.txt; see $log)")
    failed=1
    continue
  fi
  # this checkout, whatever checkout the environment's editable install came from
  if PYTHONPATH="$REPO" "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "$JOBS" \
       -o addopts="" --dist loadfile --timeout 300 "${QUICK[@]}" >>"$log" 2>&1; then
    result="passed"
  else
    result="FAILED"
    failed=1
  fi
  summary+=("$v  $result: $(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log" | tail -1) ($((SECONDS - t0)) s; $log)")
done
for ((m = LO; m <= HI; m++)); do
  if [[ -z "${seen[3.$m]:-}" ]]; then
    summary+=("3.$m  NOT CHECKED: the README promises it, but no python3.$m was found or named")
    failed=1
  fi
done
echo
echo "Python versions (quick subset: ${#QUICK[@]} test files or tests; the README promises $PROMISED):"
printf '  %s\n' "${summary[@]}"
exit $failed
