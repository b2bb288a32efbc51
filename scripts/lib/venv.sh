# Sourced by scripts/*: where this checkout's virtualenv is, and the interpreter to run aenv with.
# aenv never installs into the system's python (Debian and Ubuntu mark it externally managed,
# PEP 668); scripts/install makes the virtualenv, everything else runs its python.
#   AENV_VENV   the virtualenv (default: .venv in the checkout)
#   PYTHON      the interpreter that runs aenv (default: the virtualenv's)
AENV_CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
AENV_VENV=${AENV_VENV:-$AENV_CHECKOUT/.venv}
export AENV_VENV

# The virtualenv's interpreter, first on PATH (as `activate` does): a test or tool that runs
# `python3` or `aenv` gets this checkout's, whatever else the machine has.
use_venv() {
  if [ -z "${PYTHON:-}" ] && [ ! -x "$AENV_VENV/bin/python" ]; then
    PYTHON=python3  # no virtualenv made (./scripts/test --fast as a user, in an environment of theirs)
  elif [ -z "${PYTHON:-}" ]; then
    PYTHON=$AENV_VENV/bin/python
    export VIRTUAL_ENV=$AENV_VENV
    export PATH="$AENV_VENV/bin:$PATH"
  fi
  export PYTHON
}
