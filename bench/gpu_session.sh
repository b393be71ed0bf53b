#!/bin/bash
# The GPU work of a device lease, in sections that each fit one 10-minute device command.
# Every section installs the carried fla-core wheel (.whl/: bash bench/fetch_wheels.sh), bounds each step with a
# timeout so one hang cannot eat the lease, writes its logs under $OUT and packs extra files into
# one archive (a device call returns at most 8 files).
#
#   bash bench/gpu_session.sh train     # tiny model: ~8 min of training on the H200 (issue tiny-model)
#   bash bench/gpu_session.sh checks    # correctness, one call each on a fresh machine: checks (every kernel vs
#                                       # its reference), checks1 (whole models vs fp32; checkskda: fla's
#                                       # kda_core), checks2 (CUDA graphs vs eager, the engine vs the model alone)
#   bash bench/gpu_session.sh kernels   # python -m bench.kernels (KDA / MLA / MoE / AttnRes vs ceilings, fla)
#   bash bench/gpu_session.sh sweep     # MoE / MLA tile sweeps, k3-slice decode-step profile
#   bash bench/gpu_session.sh moe       # the MoE tile sweep alone
#   bash bench/gpu_session.sh model     # gpu_check_model.py without the k3-slice part
#   bash bench/gpu_session.sh profile48 # kimi-linear-48b decode / prefill steps by kernel family
#   bash bench/gpu_session.sh e2e       # python -m bench.e2e (k3-slice floors, kimi-linear-48b engine vs HF)
#   bash bench/gpu_session.sh engine    # engine check, then 256-request k3-slice throughput (Triton + graphs)
#   bash bench/gpu_session.sh serve48   # kimi-linear-48b behind the HTTP server vs the engine alone (bench serve)
#   bash bench/gpu_session.sh syncs     # no host sync inside a forward step (eager mixed steps and graphs)
#   (also: table, stateprobe, flashkda, flashkdacheck, variantprobe, flashkdagraphs, safegate, sampling, attnres, attnressum, attnresdeep, checks1, checkskda, checks2, prefetch, prefillgraphs, prefillctx, ctxturns, defaults18, chain, ncutma, pgemv, hops, tune, startprof, calib, ctxdecodes, fladirect, debugtiny, quick48, graphdiag, pdlab, ncu, ncukda, dense, kda, gluon, mlagluon, engine48, quant48, gluonpdl, sideab, samestep, verify, ab, hostprefill, prefillon, prefillsmall, prefillstep, prefillab: see each case below)
#   bash bench/gpu_session.sh agentic   # prefix caching on a trace-shaped workload (seed 002, scaled),
#                                       # then greedy tokens with decode graphs on / off / off again
set -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/gpu_work
T0=${T0:-$(date +%s)}  # export T0 to share one budget across sections of one device call
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/fla_core-*.whl || { echo "fla-core wheel missing under .whl/"; exit 3; }
if ls .whl/flash_kda-*.whl > /dev/null 2>&1; then  # FlashKDA, where a flashkda section built it (built there)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/flash_kda-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
all_triton() { export K3SERVE_BACKEND=triton; }  # every Triton kernel (k3serve/ops/backend.py)
left() { echo $(( ${1:-570} - ($(date +%s) - T0) )); }
step() {  # step NAME SECONDS CMD...: run CMD with a timeout, log to $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - T0 )) s"
}

case "$1" in
  train)
    step train "$(left 585)" python3 tools/train_tiny.py --out /tmp/gpu_work/tiny --minutes 15 \
      --max-wall-minutes "${WALL:-7.5}" --batch 32 --seq-len 1024
    tail -c 3000 "$OUT/train.log"
    tar czf "$OUT/tiny.tgz" -C /tmp/gpu_work tiny tiny-mxfp4 ;;
  checks)  # every kernel check: a fresh machine compiles each kernel's every tile (fifty-first session: 524 rows
            # in 308 s; checks1, checks2 and checkskda each take a call of their own)
    step kernels_check "$(left 580)" python3 bench/gpu_check_kernels.py
    grep "FAIL\|checks passed" "$OUT/kernels_check.log"; tail -c 1500 "$OUT/kernels_check.log" ;;
  checks1)  # whole models (bundled tiny, its MXFP4 form, kimi-linear at small widths) vs their fp32 references
    step model "$(left 580)" python3 bench/gpu_check_model.py --skip-slice --skip-kda --out /tmp/gpu_work
    tail -c 3000 "$OUT/model.log" ;;
  flashkda)  # FlashKDA (Moonshot's fused CUTLASS chunked-KDA forward) built from .whl/flash_kda-src.tar.gz
             # (bench/flash_kda_src.sh) with this machine's nvcc for sm_90a; the wheel (or, without pip's wheel
             # support, the built extension) comes back under $OUT: copy it into .whl/ (ignored by git) for the
             # later calls to carry. Forty-first session: nvcc 13.0, built in ~100 s with NVCC_THREADS=16.
    nvcc --version | tail -2 > "$OUT/flashkda_build.log" 2>&1
    rm -rf /tmp/fkda && mkdir -p /tmp/fkda && tar -xzf .whl/flash_kda-src.tar.gz -C /tmp/fkda
    ( cd /tmp/fkda/flash-kda && export FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=${NVCC_THREADS:-8} MAX_JOBS=${MAX_JOBS:-4}
      timeout "$(left "${BUILD_UNTIL:-480}")" python3 -m pip wheel -v --no-build-isolation --no-deps -w "$OUT" . \
        || timeout "$(left "${BUILD_UNTIL:-480}")" python3 setup.py build_ext --inplace ) >> "$OUT/flashkda_build.log" 2>&1
    echo "build rc=$? at $(( $(date +%s) - T0 )) s"
    ls /tmp/fkda/flash-kda/*.so 2>/dev/null && tar -czf "$OUT/flash_kda-built.tgz" -C /tmp/fkda/flash-kda flash_kda \
      $(cd /tmp/fkda/flash-kda && ls *.so)
    grep -i "error\|registers\|spill\|elapsed" "$OUT/flashkda_build.log" | tail -20; tail -5 "$OUT/flashkda_build.log"
    ls -la "$OUT" ;;
  flashkdacheck)  # FlashKDA (the wheel the flashkda section built, in .whl/) against fla at 96 heads, kda_core with
                  # it against the torch reference, then k3-slice's eager prefill steps with it on / off
    step kda_prefill "$(left 200)" python3 -m bench.kernels_kda_prefill --heads 96
    step kda "$(left 400)" python3 bench/gpu_check_model.py --skip-slice --skip-tiny --skip-linear-small --kda-heads 96
    step ab "$(left 580)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_ab \
      --ab "fla:k3serve.ops.fla_backend.FLASH_KDA=False;flashkda:" --out /tmp/gpu_work
    grep "^|" "$OUT/kda_prefill.log"; grep "kda_core" "$OUT/kda.log" | grep "^|"; grep "^|" "$OUT/ab.log" ;;
  variantprobe)  # two variants of module constants on one eager prefill step, the same prompt (PROBE_A / PROBE_B,
                 # default fla against FlashKDA on k3-slice): each KDA layer on the other's inputs, each MoE's
                 # routing and its time on either variant's hidden states, the step alternating
    step probe "$(left 580)" python3 bench/variant_step_probe.py --preset "${PROBE_PRESET:-k3-slice}" \
      --tokens "${PROBE_TOKENS:-512,8192}" --a "${PROBE_A:-fla:k3serve.ops.fla_backend.FLASH_KDA=False}" --b "${PROBE_B:-flashkda:}"
    grep -v "^{" "$OUT/probe.log" | tail -60 ;;
  flashkdagraphs)  # k3-slice's prefill graphs (new prompts, then prompts on cached context) with FlashKDA (default):
                   # replay vs static eager vs flat eager and timed; then the same with fla (FLASH_KDA off)
    all_triton
    step pg "$(left 330)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_graphs,prefill_graphs_context \
      --iters 10 --out /tmp/gpu_work
    step pg_fla "$(left 580)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_graphs,prefill_graphs_context \
      --iters 10 --set k3serve.ops.fla_backend.FLASH_KDA=False --out /tmp/gpu_work/fla
    grep -A14 "^| prompts" "$OUT/pg.log" "$OUT/pg_fla.log"; grep -i "error\|Traceback" "$OUT/pg.log" | head -5 ;;
  safegate)  # fla's bounded-gate path (fla_backend.SAFE_GATE, K3's gate): its kernels against the plain path at
             # 96 heads, kda_core against the torch reference with it, then k3-slice's eager prefill steps on / off
    step kda_prefill "$(left 250)" python3 -m bench.kernels_kda_prefill --heads 96
    step kda "$(left 450)" python3 bench/gpu_check_model.py --skip-slice --skip-tiny --skip-linear-small --kda-heads 4,96
    step ab "$(left 580)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_ab \
      --ab "safe:;plain:k3serve.ops.fla_backend.SAFE_GATE=False" --out /tmp/gpu_work
    cat "$OUT/kda_prefill.log" | grep "^|"; grep "kda_core" "$OUT/kda.log"; tail -c 2500 "$OUT/ab.log" ;;
  checkskda)  # fla's kda_core (chunked prefill + fused recurrent decode, slot-indexed) vs the torch reference
    step kda "$(left 580)" python3 bench/gpu_check_model.py --skip-slice --skip-tiny --skip-linear-small
    tail -c 3000 "$OUT/kda.log" ;;
  checks2)  # CUDA graphs vs eager on kimi-linear-48b, then the engine vs the model alone (bundled tiny)
    step graphs "$(left 360)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --iters 10 --out /tmp/gpu_work
    step engine "$(left 580)" python3 bench/gpu_check_engine.py
    tail -c 2500 "$OUT/graphs.log"; tail -c 1500 "$OUT/engine.log" ;;
  attnressum)  # block summaries (model/attn_res.py SUMMARY_MIN_BLOCKS): the mixer checks with them, the deep slice's
               # graphs against eager, then its step with and without them at layers 84-87 (8-9 sources), and
               # at 24-27 / 36-39 (3 / 4 blocks) from 2 / 3 / 5 blocks
    step attnres_check 150 python3 bench/check_attn_res.py
    step attnres_trace "$(left 170)" python3 bench/attn_res_trace.py --summary 24 8 1
    step graphs_deep "$(left 330)" python3 bench/gpu_check_graphs.py --preset k3-slice --attn-res-depth 36 --parts check --out /tmp/gpu_work
    step attnres_sum "$(left 420)" python3 bench/gpu_check_graphs.py --preset k3-slice --attn-res-depth 84 --parts ab \
      --ab @bench/ab/attn_res_summary.txt --ab-batches 1,4 --ab-rounds 2 --ab-charged 2 --iters 10 --out /tmp/gpu_work
    for d in 24 36; do
      step attnres_min_$d "$(left $((420 + (d - 12) * 6)))" python3 bench/gpu_check_graphs.py --preset k3-slice \
        --attn-res-depth $d --parts ab --ab @bench/ab/attn_res_summary_min.txt --ab-batches 1,4 --ab-rounds 2 \
        --ab-charged 2 --iters 10 --out /tmp/gpu_work
    done
    tail -1 "$OUT/attnres_check.log"; grep "FAIL" "$OUT/attnres_check.log" | head; tail -9 "$OUT/attnres_trace.log"
    grep "^{" "$OUT/graphs_deep.log"; tail -3 "$OUT/graphs_deep.log"
    for f in attnres_sum attnres_min_24 attnres_min_36; do grep -A8 "AttnRes calls" "$OUT/$f.log"; done ;;
  attnresdeep)  # the AttnRes mixers' share of a graph-replayed k3-slice step on its critical path, the slice's
                # layers played at K3's depth (layers 84-87: 8-9 sources, bench/deep_slice.py) and at its own
    step attnres_deep "$(left 300)" python3 bench/gpu_check_graphs.py --preset k3-slice --attn-res-depth 84 --parts ab \
      --ab @bench/ab/attn_res_deep.txt --ab-batches 1,16 --ab-rounds 2 --ab-charged 2 --iters 10 --out /tmp/gpu_work
    grep -A8 "^| variant | set" "$OUT/attnres_deep.log"; grep -A8 "AttnRes calls" "$OUT/attnres_deep.log" ;;
  attnres)  # the AttnRes mixer: GPU checks, then its time at K3's source counts (and over K3's 187 mixers),
            # then its share of a k3-slice decode step
    step attnres_check 240 python3 bench/gpu_check_kernels.py --no-gluon
    step attnres "$(left 400)" python3 -m bench.kernels_small --attn-res
    step attnres_trace "$(left 420)" python3 bench/attn_res_trace.py 9 1
    step profile_slice "$(left 580)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts profile --out /tmp/gpu_work
    tail -3 "$OUT/attnres_check.log"; grep "^|" "$OUT/attnres.log"; tail -8 "$OUT/attnres_trace.log"; grep "kernels, \|_attn_res_kernel" "$OUT/profile_slice.log" ;;
  table)  # python -m bench.kernels --no-sweep: every kernel script's checks and tables, then the one table
           # (cut by the bound, it prints the scripts that finished)
    step kernels "$(left 575)" python3 -m bench.kernels --no-sweep
    sed -n '/^## one table/,$p' "$OUT/kernels.log"; grep "failed\|cut short" "$OUT/kernels.log" | head ;;
  kernels)  # then where a K3 decode step's time goes, by kernel family (AttnRes share: target < 2 %)
    step kernels 450 python3 -m bench.kernels
    step profile_slice "$(left 580)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts profile --out /tmp/gpu_work
    tail -c 8000 "$OUT/kernels.log"; grep -A3 "kernels, " "$OUT/profile_slice.log" ;;
  sweep)  # MoE and MLA tile sweeps (each variant checked, then timed), then the k3-slice step profile
    step moe "$(left 440)" python3 -m bench.kernels_moe
    step profile_slice "$(left 530)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts profile --out /tmp/gpu_work
    step mla "$(left 585)" python3 -m bench.kernels_mla
    grep -v "failed" "$OUT/moe.log" | tail -c 9000; grep -A3 "kernels, " "$OUT/profile_slice.log"; tail -c 3000 "$OUT/mla.log" ;;
  profile48)  # where kimi-linear-48b's decode (batch 1, 64) and 8K-token prefill steps spend GPU time,
              # next to the graph-replayed step's wall time (kernel time vs launch gaps)
    step profile48 "$(left "${PROFILE_UNTIL:-580}")" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts "${PARTS:-timing,profile,profile_prefill}" --iters 10 --out /tmp/gpu_work ${PROFILE_SET:+--set "$PROFILE_SET"}
    grep -A6 "| context" "$OUT/profile48.log"; grep -A14 "kernels, " "$OUT/profile48.log" ;;
  model)  # the model vs the fp32 reference only (tiny presets, fla and every Triton kernel; with the kda_core
          # rows ~450 s)
    step model "$(left "${MODEL_UNTIL:-300}")" python3 bench/gpu_check_model.py --skip-slice --out /tmp/gpu_work
    tail -c 5000 "$OUT/model.log" ;;
  debugtiny)  # the kernels at model sizes; the tiny model with every Triton kernel, stacks printed
              # every 60 s (where the time goes: compiles?); then the graph-replay check on kimi-linear-48b
    step kernels_check 120 python3 bench/gpu_check_kernels.py
    step tiny "${TINY_SECS:-300}" python3 bench/gpu_check_model.py --skip-slice --skip-kda --backends triton \
      --dump-stacks-after 60 --out /tmp/gpu_work
    [ -n "$SKIP_GRAPHS" ] || step graphs_check "$(left 580)" python3 bench/gpu_check_graphs.py --parts check --out /tmp/gpu_work
    tail -c 2500 "$OUT/kernels_check.log"; grep -v "^  File\|^    " "$OUT/tiny.log" | tail -c 3000
    [ -n "$SKIP_GRAPHS" ] || tail -c 2000 "$OUT/graphs_check.log" ;;
  quick48)  # kernel checks, kimi-linear-48b graph timing + decode profile, then the engine run
    step kernels_check 100 python3 bench/gpu_check_kernels.py
    step profile48 "$(left 200)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts timing,profile --iters 10 --out /tmp/gpu_work
    step e2e_engine "$(left 585)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    tail -c 2500 "$OUT/kernels_check.log"; grep -A6 "| context" "$OUT/profile48.log"
    grep -A14 "kernels, " "$OUT/profile48.log"; grep -A6 "### engine_48b" "$OUT/e2e_engine.log" ;;
  graphdiag)  # graph replay vs eager with programmatic dependent launch off, then on, then the engine check
    K3SERVE_PDL=0 step check_nopdl 150 python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts check \
      --out /tmp/gpu_work/nopdl
    step check_pdl "$(left 300)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts check --out /tmp/gpu_work
    step engine_pdl "$(left 400)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts engine --out /tmp/gpu_work/e
    for f in check_nopdl check_pdl engine_pdl; do echo "== $f"; grep -v "^  File\|^    " "$OUT/$f.log" | tail -c 1500; done ;;
  pdlab)  # kimi-linear-48b graph replay checked and timed with programmatic dependent launch, then without
    step graphs_pdl "$(left "${PDL_UNTIL:-380}")" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts check,timing --iters 10 --out /tmp/gpu_work
    K3SERVE_PDL=0 step graphs_nopdl "$(left 580)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts timing --iters 10 --out /tmp/gpu_work/nopdl
    tail -c 1500 "$OUT/graphs_pdl.log"; grep -A7 "| context" "$OUT/graphs_nopdl.log" ;;
  ncu)  # Nsight Compute on one K3 MXFP4 grouped-GEMM launch (gate + up), at decode size by default;
       # prefill: NCU_TOKENS=8192 NCU_UPCASTS=gluon NCU_TILE=64,4,2 (row blocks of 64)
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 0; }
    for up in ${NCU_UPCASTS:-dot_scaled}; do
      step "ncu_$up" "$(left "${NCU_UNTIL:-580}")" "$NCU" --kernel-name regex:_grouped_gemm --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats \
        python3 -m bench.ncu_moe "${NCU_TOKENS:-16}" "$up" $NCU_TILE
      grep -v "^==PROF==" "$OUT/ncu_$up.log" | tail -c 6000
    done ;;
  ncukda)  # Nsight Compute on the KDA decode kernels (probe, core step, fused Triton, fused Gluon; N = 256)
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 0; }
    step ncu_kda "$(left "${NCU_UNTIL:-580}")" "$NCU" --profile-from-start off --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 -m bench.ncu_kda "${NCU_N:-256}"
    grep -v "^==PROF==" "$OUT/ncu_kda.log" | tail -c 20000 ;;
  dense)  # skinny dense GEMMs: cuBLAS vs our grouped GEMM as one expert; then MLA decode by split count
    step dense "$(left 300)" python3 -m bench.kernels_dense
    step mla "$(left 580)" python3 -m bench.kernels_mla --no-sweep
    tail -c 5000 "$OUT/dense.log"; tail -c 4000 "$OUT/mla.log" ;;
  kda)  # the KDA decode kernels (ours, fused mixer variants, fla) against the copy ceiling
    step kda "$(left "${KDA_UNTIL:-580}")" python3 -m bench.kernels_kda_decode
    tail -c 5000 "$OUT/kda.log" ;;
  stateprobe)  # what the KDA decode's state bytes can reach at all (bench/state_stream_probe.py: pipelined TMA /
               # cp.async streams, torch's copy and in-place scale, a flat Triton stream), then the fused mixer's check
    step stateprobe 300 python3 -m bench.state_stream_probe --quick
    step kda_check 150 python3 bench/gpu_check_kernels.py --kda-fused
    cat "$OUT/stateprobe.log"; grep "checks passed" "$OUT/kda_check.log" ;;
  gluon)  # the Gluon kernels: every kernel check (the Gluon MoE, KDA mixer and MLA decode, each
          # family in its own process), the KDA decode bench (its Gluon variant), the Gluon MLA
          # decode sweep. The MoE sweeps are the next call's:
          # MOE_ARGS="--mxfp4-only --mma-only" bash bench/gpu_session.sh moe
    step kernels_check 150 python3 bench/gpu_check_kernels.py --no-gluon
    for fam in moe kda mla; do step "check_$fam" 120 python3 bench/gpu_check_kernels.py --gluon $fam; done
    step kda "$(left 420)" python3 -m bench.kernels_kda_decode
    step mla "$(left 585)" python3 -m bench.kernels_mla --gluon
    grep "FAIL\|checks passed" "$OUT/kernels_check.log"; for fam in moe kda mla; do tail -c 2500 "$OUT/check_$fam.log"; done
    tail -c 3000 "$OUT/kda.log"; tail -c 3000 "$OUT/mla.log" ;;
  mlagluon)  # the Gluon MLA decode alone: its check, then its sweep beside the Triton split kernel
    step check_mla 150 python3 bench/gpu_check_kernels.py --gluon mla
    step mla "$(left "${MLA_UNTIL:-585}")" python3 -m bench.kernels_mla --gluon
    tail -c 1500 "$OUT/check_mla.log"; tail -c 3000 "$OUT/mla.log" ;;
  verify)  # a session's untimed code first: every kernel check, the KDA decode bench, the small
           # kernels (norms, GLU, routing, alignment), then the engine
    step kernels_check 240 python3 bench/gpu_check_kernels.py
    step kda "$(left 300)" python3 -m bench.kernels_kda_decode
    step small "$(left 370)" python3 -m bench.kernels_small
    step e2e_engine "$(left 585)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    grep "FAIL\|checks passed" "$OUT/kernels_check.log"; head -30 "$OUT/kda.log" | tail -24
    grep "^| route \|^| add + rms_norm " "$OUT/small.log"; grep -A6 "### engine_48b" "$OUT/e2e_engine.log" ;;
  ab)  # kimi-linear-48b (AB_PRESET) graph-replayed decode steps under variants of module constants (one model load;
       # AB="name:module.CONST=value,...;...", see gpu_check_graphs.ab_timing), then the step profile;
       # AB_ROUNDS=5: all variants captured first, then timed in 5 alternating rounds (medians)
    step ab "$(left "${AB_UNTIL:-580}")" python3 bench/gpu_check_graphs.py --preset "${AB_PRESET:-kimi-linear-48b}" \
      --parts "ab,${AB_PARTS:-profile}" --ab "${AB:-base:}" --ab-batches "${AB_BATCHES:-1}" \
      --ab-rounds "${AB_ROUNDS:-1}" --top 70 --iters 20 \
      --out /tmp/gpu_work
    grep -A30 "| variant" "$OUT/ab.log"; grep -A75 "kernels, " "$OUT/ab.log" ;;
  hostprefill)  # the fifteenth session's untimed code: the expert-sort and varlen MLA prefill rows, fla with
                # one cu_seqlens pair a step and zero states for new prompts (kda_core checks), then
                # kimi-linear-48b's eager prefill steps with expert_sort's two-launch sort and the
                # one-launch MLA prefill off and on, and a 512-token step's host time by function (cProfile)
    step kernels_check 150 python3 bench/gpu_check_kernels.py --no-gluon
    step kda 150 python3 bench/gpu_check_model.py --skip-tiny --skip-slice
    step prefill "$(left 585)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts prefill_ab,host_prefill \
      --ab "base:;sort:k3serve.ops.expert_sort.SORT_KERNEL=True;varlen:k3serve.model.mla.VARLEN_PREFILL=True;both:k3serve.ops.expert_sort.SORT_KERNEL=True,k3serve.model.mla.VARLEN_PREFILL=True" \
      --top 40 --out /tmp/gpu_work
    grep "FAIL\|expert sort\|checks passed" "$OUT/kernels_check.log"; grep "kda_core" "$OUT/kda.log"
    grep -A26 "| variant | round" "$OUT/prefill.log"; grep -A60 "host time of" "$OUT/prefill.log" | head -c 6000 ;;
  prefillon)  # the prefill defaults of the sixteenth session (two-launch expert sort, one-launch MLA prefill):
              # every kernel check, kimi-linear-48b's prefill steps by kernel, the engine, then fla's kda_core rows
    step kernels_check 150 python3 bench/gpu_check_kernels.py --no-gluon
    step prof "$(left 270)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts profile_prefill \
      --top "${TOP:-60}" --out /tmp/gpu_work
    step e2e_engine "$(left 520)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    step kda "$(left 590)" python3 bench/gpu_check_model.py --skip-tiny --skip-slice
    grep "FAIL\|expert sort\|checks passed" "$OUT/kernels_check.log"; grep -A6 "### engine_48b" "$OUT/e2e_engine.log"
    grep "kda_core" "$OUT/kda.log"; grep -A"$(( ${TOP:-60} + 2 ))" "new tokens" "$OUT/prof.log" | head -c 7000 ;;
  prefillsmall)  # prefill's memory-bound kernels: every kernel check, the sweeps of bench/kernels_prefill.py (short
                 # conv tiles / interior branch / channel order / q-k norm, gated norm, router GEMM), fla's kda_core
                 # rows (also with q and k normalised before: kda.CONV_NORMS_QK; KDA=0 skips them), then kimi-linear-48b's
                 # prefill torch ops by source line and its prefill steps by kernel (PROF=0 skips those)
    step kernels_check 150 python3 bench/gpu_check_kernels.py --no-gluon
    step small "$(left 280)" python3 -m bench.kernels_prefill
    [ "${KDA:-1}" = 0 ] || step kda "$(left "${KDA_UNTIL:-500}")" python3 bench/gpu_check_model.py --skip-tiny --skip-slice
    [ "${PROF:-1}" = 0 ] || step prof "$(left 585)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts op_sources,profile_prefill --top "${TOP:-40}" --out /tmp/gpu_work
    grep "FAIL\|router\|gated\|short conv\|checks passed" "$OUT/kernels_check.log"; grep "^|" "$OUT/small.log"
    [ "${KDA:-1}" = 0 ] || grep "kda_core" "$OUT/kda.log" | grep -v "^|"
    [ "${PROF:-1}" = 0 ] || { grep -A"$(( ${TOP:-40} + 3 ))" "aten ops with GPU time" "$OUT/prof.log"
      grep -A28 "new tokens" "$OUT/prof.log" | head -c 6000; } ;;
  prefillab)  # kimi-linear-48b's eager prefill steps (1 x 512, 16 x 512, 1 x 8192) with the prefill defaults
              # (short conv in channel-first order with fast SiLU, q/k norm in the conv, router GEMM kernel) and
              # with those off (alternating rounds; the short conv's tile forms before the thirty-eighth session are
              # gone), an 8K step's torch ops by source line, then the engine (TTFT)
    C=k3serve.ops.short_conv_triton
    step ab "$(left "${AB_UNTIL:-420}")" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts prefill_ab,op_sources \
      --ab "new:;old:$C.CONV_CHANNELS_FIRST=False,$C.CONV_FAST_SILU=False,k3serve.model.kda.CONV_NORMS_QK=False,k3serve.ops.moe_triton.ROUTER_PREFILL_KERNEL=False" \
      --top 40 --out /tmp/gpu_work
    step e2e_engine "$(left 585)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    grep -A14 "| variant | round" "$OUT/ab.log"; grep -A43 "aten ops with GPU time" "$OUT/ab.log"
    grep -A6 "### engine_48b" "$OUT/e2e_engine.log" ;;
  prefillgraphs)  # prefill steps of new prompts as CUDA graphs (engine/prefill_graphs.py): replay vs static eager vs
                  # flat eager and timed, the engine's greedy tokens with graphs on / off, then the engine's TTFT with
                  # prefill graphs (auto) and without (off)
    step pg "$(left "${PG_UNTIL:-380}")" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts prefill_graphs,engine \
      --iters 10 --out /tmp/gpu_work
    step e2e_engine "$(left 480)" python3 -m bench.e2e --parts engine --engine-batches 1,16 --out /tmp/gpu_work
    step e2e_engine_off "$(left 585)" python3 -m bench.e2e --parts engine --engine-batches 1,16 --prefill-graphs off \
      --out /tmp/gpu_work/off
    grep -v "^  File\|^    " "$OUT/pg.log" | tail -c 5000; grep -A5 "### engine_48b" "$OUT/e2e_engine.log" "$OUT/e2e_engine_off.log" ;;
  prefillctx)  # prompts on cached context in static prefill steps (max_prefill_graph_context, off by default): the
               # replay vs static eager vs flat eager, timed; then the decode / prefill graphs' own checks again
    step pgctx "$(left 400)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts prefill_graphs_context,check --iters 10 --out /tmp/gpu_work
    step pgk3 "$(left 585)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_graphs \
      --iters 5 --out /tmp/gpu_work/k3  # the prefill graphs on K3's layers too (AttnRes, MXFP4 experts)
    grep -v "^  File\|^    " "$OUT/pgctx.log" | tail -c 5000; grep -A12 "| prompts" "$OUT/pgk3.log" ;;
  ctxturns)  # prompts on cached context in static prefill steps (check with one-shot reference columns), then one
             # user's multi-turn chat through the engine with context graphs to 8,192 / off (bench.e2e --parts turns)
    step pgctx "$(left 300)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts prefill_graphs_context --iters 10 --out /tmp/gpu_work
    step turns "$(left 585)" python3 -m bench.e2e --parts turns --out /tmp/gpu_work
    grep -v "^  File\|^    " "$OUT/pgctx.log" | tail -c 4000; grep "warm-up\|timed\|Error" "$OUT/turns.log"; grep -A5 "### turns" "$OUT/turns.log" ;;
  defaults18)  # the eighteenth session's defaults (context graphs to 32K, 1.5x token buckets, fla direct): the engine
               # (batch 1 / 16), the multi-turn chat (capture log), then the prefill graphs' check on K3's layers
    step e2e_engine "$(left 150)" python3 -m bench.e2e --parts engine --engine-batches 1,16 --out /tmp/gpu_work
    export K3SERVE_LOG=INFO; step turns "$(left 330)" python3 -m bench.e2e --parts turns --out /tmp/gpu_work/t
    step pgk3 "$(left 540)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_graphs \
      --iters 5 --out /tmp/gpu_work/k3
    grep -A6 "### engine_48b" "$OUT/e2e_engine.log"; grep "warm-up\|timed\|Error\|captured" "$OUT/turns.log" | cut -c1-300
    grep -A12 "| prompts" "$OUT/pgk3.log" ;;
  chain)  # persistent kernel vs one launch a stage on a chain of dependent GEMVs (bench/gemv_chain.py): does a
          # persistent decode layer have the headroom batch 1 needs?
    step chain "$(left 585)" python3 -m bench.gemv_chain --modes "${MODES:-gemv,pdl,persistent,tma}"
    grep -v "^  File\|^    " "$OUT/chain.log" | tail -40 ;;
  ncutma)  # Nsight Compute on one launch of the TMA chain (bench/gemv_chain.py), 40 stages of 4.7 MB
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 0; }
    step ncu_tma "$(left 580)" "$NCU" --kernel-name regex:_tma_chain --launch-skip 1 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
      python3 -c "import torch; from bench.gemv_chain import Chain; g = torch.Generator('cuda').manual_seed(0); \
c = Chain([2304 if i % 2 == 0 else 1024 for i in range(41)], g); \
[c.run('tma', 132, block_n=32, block_k=256, ring=6, warps=4) for _ in range(3)]; torch.cuda.synchronize()"
    grep -v "^==PROF==" "$OUT/ncu_tma.log" | tail -c 9000 ;;
  pgemv)  # a GEMV fetching its weights into shared memory before its PDL wait (bench/prefetch_gemv.py)
    step pgemv "$(left 585)" python3 -m bench.prefetch_gemv
    grep -v "^  File\|^    " "$OUT/pgemv.log" | tail -80 ;;
  hops)  # the floor of one dependency between small kernels in a graph (bench/hop_cost.py)
    step hops 120 python3 -m bench.hop_cost
    cat "$OUT/hops.log" ;;
  tiles)  # batch-1 tiles inside the graph-replayed step (bench/ab/tiles_batch1.txt: pinned GEMV and
          # grouped-GEMM tiles, MLA split counts), each variant's kernels charged on the critical path;
          # then the step's timeline (each kernel's share at batch 1 and 16)
    step tiles "$(left 400)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts ab \
        --ab @bench/ab/tiles_batch1.txt --ab-batches 1 --ab-rounds 5 --ab-charged 4 --iters 30 --out /tmp/gpu_work
    step timeline "$(left 585)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts timeline \
        --ab-batches 1,16 --top 40 --out /tmp/gpu_work
    grep "^|" "$OUT/tiles.log"; grep "^|\|^batch" "$OUT/timeline.log" ;;
  prefetch)  # a side stream hinting the next GEMV's weights into L2 while short kernels run (bench/l2_prefetch.py)
    step prefetch "$(left 585)" python3 -m bench.l2_prefetch
    grep -v "^  File\|^    " "$OUT/prefetch.log" | tail -80 ;;
  tune)  # tune every autotuned kernel the engine reaches (bench/tune_configs.py) and bring back the file to
         # commit under k3serve/ops/tuned/ (then: startprof on a fresh machine, to see the cold start with it)
    step tune "$(left 560)" python3 -m bench.tune_configs --out "$OUT/tuned.json"
    # the file read back by a fresh process: every entry should apply (none stale)
    step tune_apply 25 python3 -c "from pathlib import Path; from k3serve.ops import tuned_configs as t; \
print(t.apply(path=Path('$OUT/tuned.json')))"
    grep -v "^  File\|^    " "$OUT/tune.log" | tail -20; tail -3 "$OUT/tune_apply.log" ;;
  startprof)  # where an engine start's seconds go (bench/start_profile.py), on the fresh machine's cold Triton
              # cache, then again warm; a server's default batch (8,192 tokens) unless TOKENS is set
    step cold "$(left 400)" python3 -m bench.start_profile --max-num-batched-tokens "${TOKENS:-8192}"
    step warm "$(left 585)" python3 -m bench.start_profile --max-num-batched-tokens "${TOKENS:-8192}"
    grep -A9 "engine start" "$OUT/cold.log" "$OUT/warm.log" ;;
  calib)  # the engine's prefill graphs on K3's layers timed as the engine drops them (replay vs eager launches),
          # then kimi-linear-48b through the engine with this session's defaults
    step calib "$(left 250)" python3 bench/gpu_check_graphs.py --preset k3-slice --parts prefill_calibration \
      --out /tmp/gpu_work/k3
    step e2e_engine "$(left 585)" python3 -m bench.e2e --parts engine --engine-batches 1,16 --out /tmp/gpu_work
    grep "replay_ms\|slower\|Error" "$OUT/calib.log" | cut -c1-400; grep -A6 "### engine_48b" "$OUT/e2e_engine.log" ;;
  ctxdecodes)  # prompts on cached context after decode rows (EngineConfig.prefill_graph_context_decodes): the replay
               # vs static eager vs flat eager, timed, and the buckets the engine would drop; then four users' chats
    step pgcd "$(left 300)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts prefill_graphs_context_decodes,prefill_calibration --iters 10 --out /tmp/gpu_work
    step turns4 "$(left 585)" python3 -m bench.e2e --parts turns4 --out /tmp/gpu_work
    grep -v "^  File\|^    " "$OUT/pgcd.log" | tail -c 6000; grep "warm-up\|timed\|Error" "$OUT/turns4.log" ;;
  fladirect)  # fla's forward without its wrappers (fla_backend.DIRECT_FORWARD, off): the kda_core rows (fla_direct among
              # them), then kimi-linear-48b's eager prefill steps with it off and on, and a 512-token step's host time with it on
    step kda 200 python3 bench/gpu_check_model.py --skip-tiny --skip-slice
    step ab "$(left 585)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts prefill_ab,host_prefill \
      --ab "wrapped:k3serve.ops.fla_backend.DIRECT_FORWARD=False;direct:k3serve.ops.fla_backend.DIRECT_FORWARD=True" \
      --set k3serve.ops.fla_backend.DIRECT_FORWARD=True \
      --top 30 --out /tmp/gpu_work
    grep "kda_core" "$OUT/kda.log" | grep -v "^|"; grep -A14 "| variant | round" "$OUT/ab.log"
    grep -A40 "host time of" "$OUT/ab.log" | head -c 4000 ;;
  prefillstep)  # kimi-linear-48b's prefill steps as the engine runs them (last-token logits) by kernel and torch
                # ops by source line, the engine, then every kernel check (the opt-in router MMA row among them)
    step prof "$(left 150)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts op_sources,profile_prefill \
      --top "${TOP:-30}" --out /tmp/gpu_work
    step e2e_engine "$(left 240)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    step kernels_check "$(left "${CHECK_UNTIL:-380}")" python3 bench/gpu_check_kernels.py --no-gluon
    grep "FAIL\|router\|gated\|checks passed" "$OUT/kernels_check.log"; grep -A6 "### engine_48b" "$OUT/e2e_engine.log"
    grep -A"$(( ${TOP:-30} + 3 ))" "aten ops with GPU time" "$OUT/prof.log"; grep -A22 "new tokens" "$OUT/prof.log" | head -c 5000 ;;
  sampling)  # the sort-free sampler: its checks, the sampler and the kernel alone (BARE="default;skip=0;...";
             # on N(0, 3) and on peaked logits), then the engine sampled at a server's defaults (1M tokens, 256 seqs)
    step sampling_check 200 python3 bench/gpu_check_kernels.py --sampling
    step sampling_bench 180 python3 -m bench.kernels_sampling --bare "${BARE:-default;skip=0;skip=1;skip=1,stages=2;skip=1,stages=4}"
    step sampling_peaked 120 python3 -m bench.kernels_sampling --skip-sampler --peaked --bare "${BARE:-default;skip=0;skip=1;skip=1,stages=2;skip=1,stages=4}"
    step sampling_engine "$(left 570)" python3 -m bench.e2e --parts engine --engine-batches 1,16,64 \
      --max-model-len 1048576 --max-num-seqs 256 --sampling temperature=0.7,top_p=0.95
    tail -1 "$OUT/sampling_check.log"; tail -40 "$OUT/sampling_bench.log"; tail -14 "$OUT/sampling_peaked.log"
    tail -5 "$OUT/sampling_engine.log" ;;
  syncs)  # no host sync inside a forward (bench/check_host_syncs.py): the tiny K3 model, then kimi-linear-48b
    step syncs_48b 240 python3 bench/check_host_syncs.py --preset kimi-linear-48b
    step syncs_tiny "$(left "${SYNCS_UNTIL:-580}")" python3 bench/check_host_syncs.py --preset tiny
    tail -5 "$OUT/syncs_48b.log"; tail -5 "$OUT/syncs_tiny.log" ;;
  serve48)  # kimi-linear-48b behind the HTTP server at a server's defaults (`k3serve serve --preset`, dummy weights):
            # `k3serve bench serve` at SERVE_CONC concurrencies (3 waves each, prompts of 512, 128 tokens out; a warm-up
            # run first), py-spy over both processes during the SPY_CONC run, then the same workload on the engine alone
            # (bench.e2e --parts waves). Needs the server's wheels under .whl/serve/ (README), py-spy's under .whl/tools/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/serve/*.whl $(ls .whl/tools/py_spy-*.whl 2>/dev/null) || { echo "server wheels missing under .whl/serve/ (README)"; exit 3; }
    conc=${SERVE_CONC:-1,16,64,256}
    timeout "$(left 400)" python3 -m k3serve.cli serve --preset "${SERVE_PRESET:-kimi-linear-48b}" --port 8123 $SERVE_ARGS \
      > "$OUT/server.log" 2>&1 &
    spid=$!
    step wait_server "$(left 300)" python3 -c "
import os, time, urllib.request
while True:
    os.kill($spid, 0)  # the server died: stop waiting (see server.log)
    try: urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=2); break
    except Exception: time.sleep(1)"
    for c in ${conc//,/ }; do  # a warm-up run first (new shapes compile), then the timed one
      for run in warm "c$c"; do
        if [ "$run" = "c${SPY_CONC:-256}" ] && [ -x /tmp/site/bin/py-spy ]; then  # where the server's threads spend it
          /tmp/site/bin/py-spy record --pid "$spid" --subprocesses --threads --nonblocking --format raw --rate 250 \
            -d "${SPY_S:-20}" -o "$OUT/spy_all.txt" > "$OUT/serve_spy_all.log" 2>&1 &
          /tmp/site/bin/py-spy record --pid "$spid" --subprocesses --threads --gil --nonblocking --format raw \
            --rate 250 -d "${SPY_S:-20}" -o "$OUT/spy_gil.txt" > "$OUT/serve_spy_gil.log" 2>&1 &
        fi
        step "serve_$run" "$(left 400)" python3 -m k3serve.cli bench serve --url http://127.0.0.1:8123 \
          --input-len 512 --output-len 128 --range-ratio 0 --concurrency "$c" --num-prompts $((c * 3)) --json \
          --client-processes "${SERVE_CLIENTS:-$(( c >= 128 ? c / 64 : 1 ))}"  # one Python client per 64 streams
      done
    done
    wait_spy=$(jobs -p | grep -v "^$spid$"); [ -n "$wait_spy" ] && wait $wait_spy
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/metrics').read().decode())" \
      > "$OUT/server_metrics.txt" 2>&1
    kill "$spid"; wait "$spid"
    [ "${SERVE_ENGINE:-1}" = 1 ] && step e2e_waves "$(left 580)" python3 -m bench.e2e --parts waves \
      --engine-batches "$conc" --out /tmp/gpu_work
    for c in ${conc//,/ }; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print('concurrency', \
      sys.argv[2], {k: r.get(k) for k in ('completed', 'output_token_throughput', 'duration_s', 'client_cpu_s', 'server_engine')}, *(f'{m} median/p99 ' \
      f'{r[m][\"median\"]:.2f}/{r[m][\"p99\"]:.2f}' for m in ('ttft_ms', 'tpot_ms', 'itl_ms')))" \
      "$OUT/serve_c$c.log" "$c" || tail -5 "$OUT/serve_c$c.log"; done
    grep -s -A8 "### waves_48b" "$OUT/e2e_waves.log"
    (cd "$OUT" && tar czf serve_logs.tgz serve_*.log wait_server.log server_metrics.txt && rm serve_*.log wait_server.log \
      server_metrics.txt) ;;
  sideab)  # the step boundary's copies on side streams (engine/transfer.py SIDE_STREAMS): the engine against each
           # request alone first (bundled tiny), then kimi-linear-48b's engine with them off / on, alternating
           # (AB_BATCHES, default 1,16), then the batch-1 engine profile (idle between steps)
    step engine_check 300 python3 bench/gpu_check_engine.py  # (a fresh machine's compiles: over 200 s)
    for r in 1 2; do for v in False True; do
      step "e2e_$v$r" "$(left 500)" python3 -m bench.e2e --parts engine --engine-batches "${AB_BATCHES:-1,16}" \
        --set "k3serve.engine.transfer.SIDE_STREAMS=$v" --out "/tmp/gpu_work/$v$r"
    done; done
    step profile "$(left 585)" python3 -m bench.e2e --parts engine_profile --engine-batches 1 --out /tmp/gpu_work
    tail -c 1200 "$OUT/engine_check.log"
    for f in "$OUT"/e2e_*.log; do echo "== $f"; grep -A4 "### engine_48b" "$f"; done
    tail -c 2500 "$OUT/profile.log" ;;
  samestep)  # the staged-input copy kernel against torch, then the prefill graphs' check with the side streams off
             # (all 8 cases) and on (the [100, 200] + 8 decode rows case alone): is a same-shape mismatch theirs?
    step copy_staged 120 python3 bench/gpu_check_kernels.py --copy-staged
    step pg_off "$(left 400)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b --parts prefill_graphs \
      --iters 2 --set k3serve.engine.transfer.SIDE_STREAMS=False --out /tmp/gpu_work
    PG_CASES=1 step pg_on1 "$(left 585)" python3 bench/gpu_check_graphs.py --preset kimi-linear-48b \
      --parts prefill_graphs --iters 2 --out /tmp/gpu_work
    cat "$OUT/copy_staged.log"; for f in pg_off pg_on1; do echo "== $f"; grep -A12 "| prompts |" "$OUT/$f.log"; done ;;
  engine48)  # kimi-linear-48b through the engine only (bench/e2e.py --parts engine): TTFT and tok/s
    step e2e_engine "$(left 580)" python3 -m bench.e2e --parts engine --out /tmp/gpu_work
    grep -A6 "### engine_48b" "$OUT/e2e_engine.log"
    grep -m3 "shipped file lacks" "$OUT/e2e_engine.log" || echo "every autotuner key met at start was shipped" ;;
  quant48)  # --quantization mxfp4: kimi-linear at small widths (bf16 and quantised experts) vs its fp32 reference,
            # then kimi-linear-48b's engine run with its experts quantised at load (the engine48 section's shape)
    step model "$(left 240)" python3 bench/gpu_check_model.py --skip-slice --skip-kda --skip-tiny --out /tmp/gpu_work
    grep "^| kimi" "$OUT/model.log"
    step e2e_quant "$(left 580)" python3 -m bench.e2e --parts engine --quantization mxfp4 --out /tmp/gpu_work
    grep -A6 "### engine_48b" "$OUT/e2e_quant.log"
    grep -m3 "shipped file lacks" "$OUT/e2e_quant.log" || echo "every autotuner key met at start was shipped" ;;
  gluonpdl)  # the Gluon MoE kernel in the PDL chain (moe_gluon.PDL, PREFETCH; the joined shared expert before the
             # wait): its checks, then kimi-linear-48b -q mxfp4 graph-replayed steps with each part off (AB_PRESET /
             # AB_Q="" for bf16 or k3-slice)
    if [ -z "$NO_CHECK" ]; then
      step gluon_check "$(left 200)" python3 bench/gpu_check_kernels.py --gluon moe
      grep "FAIL\|checks passed\|quantised at load" "$OUT/gluon_check.log"
    fi
    step ab "$(left "${AB_UNTIL:-580}")" python3 bench/gpu_check_graphs.py --preset "${AB_PRESET:-kimi-linear-48b}" \
      ${AB_Q---quantization mxfp4} --parts "ab${AB_PARTS:-}" --ab-batches "${AB_BATCHES:-1,2}" \
      --ab-rounds "${AB_ROUNDS:-3}" --iters 20 ${AB_EXTRA:-} --out /tmp/gpu_work --ab "${AB:-on:;off:k3serve.ops.moe_gluon.PDL=False;\
noprefetch:k3serve.ops.moe_gluon.PREFETCH=False;nostatic:k3serve.ops.moe_triton.SHARED_BEFORE_WAIT=False}"
    grep -A12 "| variant" "$OUT/ab.log"
    if [ -n "$E2E" ]; then  # then the engine run with the experts quantised at load (quant48's)
      step e2e_quant "$(left 580)" python3 -m bench.e2e --parts engine --quantization mxfp4 --out /tmp/gpu_work
      grep -A6 "### engine_48b" "$OUT/e2e_quant.log"
    fi ;;
  moe)  # the MoE tile sweep alone (K3 MXFP4, Kimi bf16 prefill), autotuned table
    step moe "$(left "${MOE_UNTIL:-580}")" python3 -m bench.kernels_moe $MOE_ARGS
    grep -v "failed" "$OUT/moe.log" | tail -c 9000 ;;
  e2e)
    step e2e "$(left 580)" python3 -m bench.e2e --out /tmp/gpu_work
    tail -c 8000 "$OUT/e2e.log"
    tar czf "$OUT/e2e.tgz" -C /tmp/gpu_work . ;;
  engine)  # the engine-vs-model-alone check (short), then k3-slice 256 requests with what is left
    all_triton
    step engine_check 200 python3 bench/gpu_check_engine.py
    step engine_slice "$(left 585)" python3 bench/engine_throughput.py --preset k3-slice --num-prompts 256 \
      --max-num-batched-tokens 8192 --max-seconds "$(( $(left 585) - 160 ))" --sync-timings --json /tmp/gpu_work/slice.json
    tail -c 2500 "$OUT/engine_check.log"; cat /tmp/gpu_work/*.json ;;
  agentic)  # seed 002's trace (many turns, long growing context, short outputs) scaled to one GPU
    all_triton
    step agentic "${AGENTIC_SECONDS:-470}" python3 bench/engine_throughput.py --agentic --preset kimi-linear-48b --sessions 8 \
      --turns 12 --system-len 4096 --min-input 500 --max-input 2000 --min-output 30 --max-output 90 \
      --max-num-batched-tokens 8192 --warmup-runs 1 --json /tmp/gpu_work/agentic.json
    [ -n "$AGENTIC_ONLY" ] || step graphs_engine "$(left 585)" python3 bench/gpu_check_graphs.py --parts engine --out /tmp/gpu_work
    cat /tmp/gpu_work/agentic.json; tail -c 1500 "$OUT/graphs_engine.log" ;;
  debug)  # small-kernel checks at prefill sizes, graph replay check, agentic workload with blocking launches
    all_triton
    step graphs_check 150 python3 bench/gpu_check_graphs.py --parts check,engine --out /tmp/gpu_work
    step kernels_small 120 python3 -m bench.kernels_small
    step kernels_moe 90 python3 -m bench.kernels_moe
    CUDA_LAUNCH_BLOCKING=1 step agentic_dbg "$(left 585)" python3 bench/engine_throughput.py --agentic \
      --preset kimi-linear-48b --sessions 8 --turns 12 --system-len 4096 --min-input 500 --max-input 2000 \
      --min-output 10 --max-output 20 --max-num-batched-tokens 8192 --warmup-runs 0
    tail -c 1200 "$OUT/graphs_check.log"; tail -c 3000 "$OUT/kernels_small.log"; tail -c 1500 "$OUT/kernels_moe.log"
    grep -v "^frame" "$OUT/agentic_dbg.log" | tail -c 3000 ;;
  *)
    echo "usage: bash bench/gpu_session.sh train|checks|checks1|checkskda|checks2|kernels|sweep|moe|gluon|mlagluon|model|debugtiny|quick48|graphdiag|pdlab|ncu|ncukda|dense|kda|engine48|profile48|e2e|engine|agentic|debug|verify|ab"; exit 2 ;;
esac
echo "total $(( $(date +%s) - T0 )) s"
