#!/usr/bin/env bash
# One call on a GPU machine: the test suite on the GPU, then the benchmarks, every result
# written under $OUT and packed into one archive (the device tool returns at most 8 files).
#
#   bash benchmarks/gpu_run.sh [STAGE ...]
#   stages: env tests sanitize consan sweep hopper-sweep gluon-sweep backward-sweep window-sweep decode-sweep
#           attention-small attention-fwd attention-bwd
#           attention-fwd+bwd attention-varlen-window attention-calls attention-decode attention-mla attention-fp8 moe moe-fwd+bwd moe-peers moe-train
#           model model-static moe-sweep
#           moe-bwd-sweep moe-fp8-decode-sweep before-after tc tc-sweep ep moe-fp8
#   (default: all but the sweeps; more than one device call's 10 minutes, so pass stages)
#
# Runs from the repository root without installing (PYTHONPATH), as on a machine with no network.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FLASHMOE_NO_PROGRESS=1
# WHEELS: a folder of wheels carried along (no network there), e.g. a newer transformers and the
# huggingface_hub it needs, or SonicMoE's stack: installed without dependencies into a folder of
# their own, ahead of the machine's packages for every stage. ARCHIVES: a folder of .tar.xz
# archives of packages as they lie in site-packages (a wheel too big for one call's carry, such as
# the CuTe DSL's libraries), unpacked into the same folder; its .pth files are followed.
# SonicMoE (moe-peers), made where pip has a network, into two ignored folders of the checkout:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d WHEELS sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2 \
#     apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
#   (the same for nvidia-cutlass-dsl-libs-cu13==4.4.2, unzipped, then: tar -cJf ARCHIVES/cutlass_dsl.tar.xz
#   -C unzipped .), about 57 MB together.
WHEEL_DIR="${TMPDIR:-/tmp}/flashmoe_wheels"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install --quiet --no-deps --target "$WHEEL_DIR" "$WHEELS"/*.whl || exit 1
fi
if [ -n "${ARCHIVES:-}" ]; then
  mkdir -p "$WHEEL_DIR"
  for archive in "$ARCHIVES"/*.tar.xz; do tar -xJf "$archive" -C "$WHEEL_DIR" || exit 1; done
fi
# JIT_CACHE: a folder (carried, ignored) of the CuTe DSL kernels that SonicMoE and FA4 compile on
# their first calls (QuACK's object cache and the DSL's own, keyed by source and versions), so a
# fresh machine skips those minutes; the call's cache comes back as $OUT/jit_cache.tar.gz, to
# unpack into that folder for the next call.
# SonicMoE's first call on a shape autotunes each QuACK GEMM over its sm90 configurations (22-44),
# compiling every one: past 560 s on a 16-core machine before its tiny check layer had finished
# (`bench moe --sonic-autotune subset` narrows them to four, `bench/sonic.py`).
# The compiles run in QUACK_COMPILE_WORKERS processes (QuACK's default 8): one per core here, so a
# machine with more cores (the multi-GPU kinds) warms it faster.
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
if [ -n "${JIT_CACHE:-}" ]; then
  mkdir -p "$JIT_CACHE/quack" "$JIT_CACHE/cute_dsl" || exit 1
  JIT_CACHE=$(cd "$JIT_CACHE" && pwd)
  export QUACK_CACHE_DIR="$JIT_CACHE/quack" CUTE_DSL_CACHE_DIR="$JIT_CACHE/cute_dsl"
fi
if [ -d "$WHEEL_DIR" ]; then
  export PYTHONPATH="$PYTHONPATH:$WHEEL_DIR"
  for pth in "$WHEEL_DIR"/*.pth; do
    [ -f "$pth" ] && while read -r entry || [ -n "$entry" ]; do
      case "$entry" in ''|'#'*|import*) ;; *) PYTHONPATH="$PYTHONPATH:$WHEEL_DIR/$entry" ;; esac
    done < "$pth"
  done
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests attention-fwd attention-bwd attention-varlen-window attention-calls moe moe-fwd+bwd
                                   moe-train)
TESTS=${TESTS:-tests}            # which tests the tests stage runs
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-explore}  # 60 fresh examples per property test ("gpu": 150)
PYTEST_ARGS=${PYTEST_ARGS:--n 8 --durations=25}  # xdist workers compile kernels in parallel (the image has pytest-xdist); 12 ran the memory-heavy tests out of GPU memory
BENCH_ARGS=${BENCH_ARGS:-}       # extra options for every bench stage, e.g. "--repeats 3"
bench() { python3 -m flashmoe_science bench "$@" --out "$RESULTS" $BENCH_ARGS 2>&1 | tee -a "$RESULTS/bench.log"; }
status=0
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    env)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv \
        | tee "$RESULTS/nvidia_smi.csv"
      python3 -m flashmoe_science doctor 2>&1 | tee "$RESULTS/doctor.txt" || status=1 ;;
    tests)
      # The whole log as it goes (a run stopped at its time limit still leaves it), its end on
      # screen; not results to commit.
      python3 -m pytest -q -p no:cacheprovider -m "not targets" \
        --junitxml="$RESULTS/gpu_tests.xml" $PYTEST_ARGS $TESTS 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -n 40 \
        | tee "$RESULTS/gpu_tests.txt" || status=1 ;;
    sweep) bench attention --sweep --seqlens 4096 --no-plot ;;
    hopper-sweep) bench attention --sweep-hopper --seqlens 4096,16384 --no-plot ;;
    gluon-sweep)  # GLUON_TILES: only these Gluon tiles
      bench attention --sweep-hopper --sweep-gluon --head-dims "${HEAD_DIMS:-64,128,256}" \
        --seqlens "${SEQLENS:-2048,4096,16384}" ${GLUON_TILES:+--gluon-tiles "$GLUON_TILES"} --no-plot ;;
    backward-sweep)
      python3 -m flashmoe_science.bench.sweeps.attention_backward --head-dims "${HEAD_DIMS:-128}" --seqlens 4096 \
        ${GLUON:+--gluon} --out "$RESULTS" 2>&1 | tee -a "$RESULTS/bench.log" ;;
    window-sweep)  # forward (generic and Hopper) and backward candidates on causal windows of $WINDOW at S = 16384
      bench attention --sweep --head-dims 128 --seqlens 16384 --window "${WINDOW:-1024}" --no-plot
      bench attention --sweep-hopper --head-dims 128 --seqlens 16384 --window "${WINDOW:-1024}" --no-plot
      python3 -m flashmoe_science.bench.sweeps.attention_backward --head-dims 128 --seqlens 16384 --window "${WINDOW:-1024}" \
        --out "$RESULTS" 2>&1 | tee -a "$RESULTS/bench.log" ;;
    decode-sweep)  # KV-cache tiles and split counts (bench/sweeps/attention_decode.py)
      python3 -m flashmoe_science.bench.sweeps.attention_decode --out "$RESULTS" 2>&1 | tee -a "$RESULTS/bench.log" ;;
    sanitize)  # compute-sanitizer's four tools over every kernel path at small shapes (benchmarks/sanitize.py)
      for tool in memcheck racecheck synccheck initcheck; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --print-limit 20 \
          python3 benchmarks/sanitize.py > "$RESULTS/sanitize_$tool.txt" 2>&1
        echo "$tool exit $?: $(tail -n 1 "$RESULTS/sanitize_$tool.txt")" | tee -a "$RESULTS/sanitize.txt"
      done ;;
    consan)  # Triton's concurrency sanitizer over the Hopper attention kernels (benchmarks/sanitize.py --consan)
      python3 benchmarks/sanitize.py --consan > "$RESULTS/sanitize_consan.txt" 2>&1
      echo "consan exit $?: $(tail -n 1 "$RESULTS/sanitize_consan.txt")" | tee -a "$RESULTS/sanitize.txt" ;;
    attention-small) bench attention --mode fwd --sections overhead,small --no-plot ;;
    attention-fwd) bench attention --mode fwd ;;
    attention-bwd) bench attention --mode bwd ;;
    attention-fwd+bwd) bench attention --mode fwd+bwd --sections throughput ;;
    attention-varlen-window) bench attention --mode fwd+bwd --sections varlen,window --no-plot ;;
    attention-calls) bench attention --mode fwd+bwd --sections calls --no-plot ;;
    attention-decode)  # 80 cases: at the default 5 x 100 ms timings, 67 took about 7.5 minutes (one call has 10)
      bench attention --mode decode --no-plot --repeats 3 --rep 80 ;;
    attention-fp8) bench attention --mode fp8 --no-plot ${FP8_ARGS:-} ;;  # FP8 forward against bf16 and cuDNN (results attention_fp8)
    attention-mla)  # v's head dim of its own (DeepSeek's 192/128 and 128/64): forward and backward (results *_mla)
      for mode in fwd bwd; do
        bench attention --mode $mode --sections throughput --head-dims 192/128,128/64 --seqlens 1024,4096,16384 \
          --flex-head-dims 0 --no-plot
      done ;;
    moe) bench moe ;;
    moe-fwd+bwd) bench moe --mode fwd+bwd ;;
    moe-peers)  # ours against grouped_mm and SonicMoE (carried: WHEELS, ARCHIVES) at the training sizes, forward+backward
      # then forward; SONIC_AUTOTUNE: all of QuACK's candidates, or (default here) the subset that compiles in minutes
      bench moe --mode fwd+bwd --impls ours gmm sonic --sonic-autotune "${SONIC_AUTOTUNE:-subset}" --no-plot ${MOE_PEERS_ARGS:-}
      bench moe --impls ours gmm sonic --sonic-autotune "${SONIC_AUTOTUNE:-subset}" --tokens 1 8 64 512 4096 16384 \
        --no-plot ${MOE_PEERS_ARGS:-} ;;
    moe-train) bench moe --mode train ;;
    moe-fp8)  # FP8 experts against our bf16 path, grouped_mm and torch._scaled_grouped_mm (results moe_fp8)
      bench moe --impls ours fp8 scaled_gmm gmm --shapes qwen3-30b-a3b deepseek-v2-lite mixtral-8x7b \
        --tokens 1 16 256 4096 16384 --no-plot ;;
    ep)  # expert parallelism over every GPU of the machine (starts itself under torchrun; EP_ARGS: more options)
      bench ep ${EP_ARGS:-} ;;
    tc)  # superconductor Tc, 5-fold, both splits: about 6.5 minutes each (three models a fold: one device call apiece,
         # SPLITS="random"), 2.5 with TC_ARGS="--superconductors-only --ensemble 1 --compare-backends" (both fit one);
         # TC_DATA: SuperCon featurized here (flashmoe-science tc featurize --data
         # ../shared/data/supercon/Supercon_data.csv --out out/data/supercon.pt: the GPU image has no pymatgen or
         # matminer), carried along; TC_ARGS (default --superconductors-only, the issue's protocol)
      for split in ${SPLITS:-random cluster}; do
        python3 -m flashmoe_science tc train --data "${TC_DATA:-out/data/supercon.pt}" --split "$split" \
          --out "$RESULTS/tc_$split" ${TC_ARGS:---superconductors-only} 2>&1 | tee -a "$RESULTS/tc.log"
      done ;;
    tc-sweep)  # Tc model options scored on one fold (bench/sweeps/tc.py)
      python3 -m flashmoe_science.bench.sweeps.tc --data "${TC_DATA:-out/data/supercon.pt}" --out "$RESULTS" \
        2>&1 | tee -a "$RESULTS/tc.log" ;;
    model)  # transformers models end to end; needs transformers >= 5.17 (carry its wheels: no network there)
      bench model ${MODEL_ARGS:-} ;;
    model-static)  # the same models' decode with a static cache, compiled into CUDA graphs (results model_static_decode)
      bench model --static-cache --impls ours sdpa_grouped_mm ${MODEL_ARGS:-} ;;
    before-after)  # ROUNDS (2) times the throughput benchmarks from $BASELINE (an older tree: git archive REV | tar -x -C out/baseline,
                   # carried) and from this one, alternately, into $RESULTS/baseline<round> and current<round>
      for round in $(seq "${ROUNDS:-2}"); do
        for tree in ${TREES:-baseline current}; do
          root=$PWD; [ "$tree" = baseline ] && root=$(cd "${BASELINE:-out/baseline}" && pwd)
          (cd "$root" && export PYTHONPATH="$root" && for args in "attention --mode fwd" "attention --mode bwd"; do
             python3 -m flashmoe_science bench $args --sections throughput --head-dims 64,128 --seqlens 8192 \
               --flex-head-dims 0 --repeats 3 --no-plot --out "$RESULTS/$tree$round"
           done
           python3 -m flashmoe_science bench moe --shapes qwen3-30b-a3b mixtral-8x7b --tokens 16 4096 16384 --impls ours --repeats 3 \
             --no-plot --out "$RESULTS/$tree$round") 2>&1 | tee -a "$RESULTS/bench.log"
        done
      done ;;
    moe-sweep) bench moe --sweep --no-plot ${MOE_SWEEP_ARGS:-} ;;
    moe-bwd-sweep) bench moe --sweep --mode fwd+bwd --no-plot ${MOE_BWD_SWEEP_ARGS:-} ;;
    moe-fp8-decode-sweep)  # FP8 experts' decode tilings (bench/sweeps/moe_fp8_decode.py)
      python3 -m flashmoe_science.bench.sweeps.moe_fp8_decode 2>&1 | tee "$RESULTS/moe_fp8_decode_sweep.txt" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
# The Tc fold models (model.pt, megabytes each) stay out: the device tool returns little.
tar -czf "$OUT/results.tar.gz" --exclude=model.pt -C "$RESULTS" .
[ -n "${JIT_CACHE:-}" ] && tar -czf "$OUT/jit_cache.tar.gz" -C "$JIT_CACHE" .
exit $status
