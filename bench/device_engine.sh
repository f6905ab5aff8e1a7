#!/usr/bin/env bash
# One GPU call of the in-engine measurements on the Qwen3-8B-shaped model, after ../shared/tools/vllm-on-device staged
# vLLM (the demo model's wheel as its EXTRA file) and `source bench/device_setup.sh` can run. Each STEP keeps its log
# under $OUT and prints a short line; the call's limit is LIMIT seconds (default 590), and the engine bench's deadline
# is what is left of it. Restarts cleanly on a warm machine (the model and its KV tables are kept in /tmp). Carry
# .vllm-device/make_model.py (the staging tool puts it there) in the call that runs the step `model`.
#   STEPS="model speed"   ONLY=off,lossless   PROFILE=8192x32,8192xmax   (both engines side by side: about 530 s)
#   STEPS="model speed"   ONLY=off,lossless   CELLS=8192x32,8192xmax   (only those cells of the grid)
#   STEPS="model speed"   ONLY=off-triton   REF=<this GPU's engine_speed.json>   (one engine against a reference row)
#   STEPS="model values"  (the demo plan's check engines: every value read back, preemption)
#   STEPS="demo"   ONLY=lossless,exact   (the demo model, each KV mode against off: capacity, prompt logprobs and
#                  greedy tokens bit for bit; ONLY=weights-exact,weights-lossless: its Glyd checkpoint in both weights
#                  modes against the bf16 model; each set about 400 s)
#   STEPS="kernels app"   (tests/kernels, the GPU table build, glyd-chat and glyd serve on the GPU; the staging's EXTRA
#                          files carry the server's wheels, bench/serve_requirements.txt; serve_deps.py names the rest)
#   STEPS="serve"   (glyd serve alone, about 190 s on a fresh machine: its first start builds the demo's KV tables)
# Use: bash bench/device_engine.sh
cd "$(dirname "$0")/.." || exit 2
source bench/device_setup.sh >"$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 4; }
MODEL=${MODEL:-/tmp/qwen3-8b}
LIMIT=${LIMIT:-590}
left() { echo $((LIMIT - 10 - SECONDS)); }
rc=0
for step in ${STEPS:-model speed}; do
  t=$SECONDS
  case $step in
    model)  # the model (random bf16 weights) and its KV tables, built on the GPU
      [ -f "$MODEL/config.json" ] || python3 .vllm-device/make_model.py "$MODEL" 4096 36 32 assets/text/*/*.txt \
        >"$OUT/make_model.log" 2>&1 || { tail -20 "$OUT/make_model.log"; exit 5; }
      timeout "$(left)" python3 -m glyd_engine.cli kv build "$MODEL" >"$OUT/kv_build.log" 2>&1
      r=$?; tr '\r' '\n' <"$OUT/kv_build.log" | grep -E '"build_seconds"|"token_bytes_4bit"|Error' ;;
    speed)  # decode tokens a second, lossless against off (FlashAttention 3), each engine its own child
      args=(--model "$MODEL" --plan speed --only "${ONLY:-lossless}" --out "$OUT" --deadline-s "$(left)")
      [ -n "$REF" ] && args+=(--reference "$REF")
      [ -n "$PROFILE" ] && args+=(--profile "$PROFILE")
      [ -n "$CELLS" ] && args+=(--cells "$CELLS")
      python3 bench/engine_gpu.py "${args[@]}" 2>&1 | tail -40; r=${PIPESTATUS[0]} ;;
    values)
      mkdir -p "$OUT/values"
      python3 bench/engine_gpu.py --model "$MODEL" --plan demo --only lossless-check,lossless-stress \
        --out "$OUT/values" --deadline-s "$(left)" 2>&1 | tail -15; r=${PIPESTATUS[0]} ;;
    demo)  # the demo model (real weights) and its Glyd checkpoint, against off
      [ -f /tmp/demo-glyd/config.json ] || python3 -m glyd_engine.cli pack "$DEMO" /tmp/demo-glyd --force \
        >"$OUT/pack.log" 2>&1 || { tail -20 "$OUT/pack.log"; exit 6; }
      mkdir -p "$OUT/demo"
      python3 bench/engine_gpu.py --model "$DEMO" --packed /tmp/demo-glyd --plan demo --only "${ONLY:-lossless,exact}" \
        --out "$OUT/demo" --deadline-s "$(left)" --timeout-s 240 2>&1 | tail -15; r=${PIPESTATUS[0]} ;;
    kernels)
      timeout "$(left)" python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_kv_tables.py \
        >"$OUT/kernels.log" 2>&1; r=$?; tail -3 "$OUT/kernels.log" ;;
    app|serve)  # app: glyd-chat and glyd serve; serve: glyd serve alone (its log under $OUT/pt)
      python3 bench/serve_deps.py 2>&1 | tail -1
      sel=(); [ "$step" = serve ] && sel=(-k serve)
      timeout "$(left)" python3 -m pytest -q -p no:cacheprovider --basetemp="$OUT/pt" tests/app/test_on_gpu.py \
        "${sel[@]}" >"$OUT/$step.log" 2>&1
      r=$?; tail -15 "$OUT/$step.log"
      mkdir -p "$OUT/app-logs"; cp .cache/test-home/cache/logs/*.log "$OUT/app-logs/" 2>/dev/null
      rm -f "$OUT"/pt/*current ;;  # a link: it would not come back
    *) echo "unknown step $step: model, speed, values, demo, kernels, app or serve"; exit 2 ;;
  esac
  echo "== $step rc=$r $((SECONDS - t)) s"
  [ "$r" = 0 ] || rc=$r
done
for f in "$OUT"/*.log "$OUT"/*/*.log; do  # how far each engine got (the sweep prints each cell), and what failed
  grep -HE "sweep ctx|GPU KV cache size|overflow arenas|Error:" "$f" 2>/dev/null | tail -25
done
exit $rc
