#!/bin/sh
# One-line install of Glyd (glyd, glyd-chat):
#   curl -LsSf https://raw.githubusercontent.com/glyd-project/glyd/main/packaging/install.sh | sh
#
# Installs with pipx (into its own virtualenv, console scripts on PATH) with the engine extra that fits
# the machine: "gpu" (vLLM's CUDA build) where nvidia-smi answers, "cpu" (vLLM's CPU build) elsewhere.
# GLYD_EXTRA=none installs the app only (glyd-chat then installs the engine on first run).
# GLYD_SPEC overrides what is installed (a version, a wheel, a checkout), e.g. GLYD_SPEC=./dist/glyd.whl
set -eu

say() { printf '%s\n' "glyd-install: $*" >&2; }
die() { say "$*"; exit 1; }

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    for candidate in python3.12 python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            PYTHON="$candidate"
            break
        fi
    done
fi
[ -n "$PYTHON" ] || die "needs Python 3.10 or newer (python3 --version); install it and run this again"

if [ -z "${GLYD_EXTRA:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        GLYD_EXTRA=gpu
    else
        GLYD_EXTRA=cpu
    fi
fi
SPEC="${GLYD_SPEC:-glyd}"
case "$GLYD_EXTRA" in
    none) TARGET="$SPEC" ;;
    cpu | gpu) TARGET="$SPEC[$GLYD_EXTRA]" ;;
    *) die "GLYD_EXTRA must be cpu, gpu or none (got $GLYD_EXTRA)" ;;
esac

if ! "$PYTHON" -m pipx --version >/dev/null 2>&1 && ! command -v pipx >/dev/null 2>&1; then
    say "installing pipx for $PYTHON (user site)"
    "$PYTHON" -m pip install --user --quiet pipx || die "could not install pipx; see https://pipx.pypa.io"
fi
PIPX="pipx"
command -v pipx >/dev/null 2>&1 || PIPX="$PYTHON -m pipx"

say "installing $TARGET with pipx (the engine is large: this can take several minutes)"
# shellcheck disable=SC2086
$PIPX install --force --python "$PYTHON" "$TARGET"
# shellcheck disable=SC2086
$PIPX ensurepath >/dev/null 2>&1 || true
if [ "$GLYD_EXTRA" = "cpu" ]; then
    # vLLM's CPU build pins its own torch; these optional packages come in mismatched and break it.
    # shellcheck disable=SC2086
    $PIPX runpip glyd uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

say "done. Try:  glyd doctor   then   glyd-chat"
say "(open a new terminal if glyd is not found: pipx added its bin directory to PATH)"
