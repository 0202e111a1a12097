#!/usr/bin/env bash
# Fine-tune A/Bs of the shipped PushT model on the same new episodes, each arm measured on the held-out block error
# (issue 42). Arms, one device call each on one warm H200 (each under 10 minutes; the first simulates the episodes,
# the others reuse them from $WORK/data):
#
#   bash benchmarks/recipes/finetune_ab_pusht.sh plain          # the plain fine-tune, SECONDS_BUDGET (145) s
#   bash benchmarks/recipes/finetune_ab_pusht.sh block-focus    # the same with the block's latent cells weighing
#                                                               # 1 + FOCUS (4) times the rest (--wm-block-focus)
#   bash benchmarks/recipes/finetune_ab_pusht.sh history        # the plain arm with the previous HISTORY (4) actions
#                                                               # as state rows (--wm-action-history)
#   bash benchmarks/recipes/finetune_ab_pusht.sh wide           # the plain arm on the model widened first to
#                                                               # GROW_INTERMEDIATE (1536) MLP units and GROW_HEADS (16)
#                                                               # heads, computing the same function (issue 42 item 6)
#   bash benchmarks/recipes/finetune_ab_pusht.sh context-noise  # the plain arm with context noise at its level's
#                                                               # timestep instead of unlabelled noise: levels from
#                                                               # U(0, CONTEXT_NOISE_MAX (0.5)); measured at inference
#                                                               # levels 0, then CONTEXT_NOISE (0.1) (issue 42 item 4)
#   bash benchmarks/recipes/finetune_ab_pusht.sh self-forcing   # self-forcing samples with a consistent target
#                                                               # (tasks/pusht/self_forcing.py; about 400 s)
#   ARMS="plain focus" bash benchmarks/recipes/finetune_ab_pusht.sh paired
#                                                               # every arm of ARMS (plain first; default plain
#                                                               # ctxnoise; also focus, history, wide) on the same
#                                                               # episodes, each measured on the same held-out
#                                                               # episodes of every seed in SEEDS, then each against
#                                                               # plain episode by episode (paired_fidelity.py)
#                                                               # (more than one call's 10 minutes: call it again
#                                                               # at once on the warm machine, it goes on from
#                                                               # what the first call finished)
#   MODEL=focus bash benchmarks/recipes/finetune_ab_pusht.sh evaluate   # the evaluation pool, 32 x 16 chunks
#
# Session 26 ran self-forcing (then `self_forcing_pusht.sh train`) and plain (then `control`, with STEPS=900), session
# 27 plain and block-focus, session 28 history, session 29 wide (RESULTS.md "Issue 42 item 3", "Issue 42 item 5",
# "Issue 42: state rows", "Issue 42, session 29").
# Data: EPISODES (192) new episodes from dataset seed 101 with round 9's family mix (its files: policies of the
# training pool; the manifest's seed notes name 101). Self-forcing: ROLLOUTS (3) rollouts of DEPTH (10) chunks per
# episode by the shipped model, each chunk's last frame a sample. The held-out measurement is session 24's baseline
# protocol (dataset seed 4,900,000: training-pool policy families, what may choose between variants): block error
# over 16 chunks and the untouched-block drift under random actions, and one side-by-side episode.
# What comes back ($OUT, at most 8 files): the fine-tuned transformer in 15 MB parts (cat them; checkpoint.sha256
# names the whole), self_forcing_samples.png (self-forcing), the side-by-side episode (mp4, or its frames as .npz),
# and train_results.tar.gz (training and evaluation JSONs, the training logs, the checkpoints' meta.json and
# MANIFEST.json, of every arm run on this machine).
#
# A CPU check of the mechanics: OUT=/tmp/o WORK=/tmp/w EPISODES=4 ENVS=4 DEPTH=2 ROLLOUTS=1 WORKERS=2
#   TRAIN_ARGS="--smoke --steps-per-episode 40 --chunk 8 --wm-batch 2" EVAL_ARGS=--smoke bash .../finetune_ab_pusht.sh ARM
#
# evaluate: the evaluation pool (policy_pools.json) on reporting seeds, in the two halves of the session-24 baseline
# side by side, for MODEL=sf, focus, history, wide or plain (that arm's model, on a warm machine) or MODEL=builtin (the tree's
# built-in model, once fine-tuned weights are installed there). Nothing here chooses on the evaluation pool.
set -euo pipefail
STAGE=${1:?plain, block-focus, history, wide, context-noise, paired, self-forcing or evaluate}
OUT=${OUT:?set OUT to the output folder}
WORK=${WORK:-/tmp/finetune_ab}
ASSETS=cosmos3_gym/tasks/pusht/assets
source "$(dirname "$0")/pusht_pools.sh"  # MIX, EVAL_POOL_A, EVAL_POOL_B
WORKERS=${WORKERS:-$(nproc)}
export PYTHONUNBUFFERED=1
RESULTS=$WORK/results
mkdir -p "$RESULTS"

pack() {  # the small files, in one archive (the device returns at most 8 files). Written whole or not at all (the
  # call's time limit can stop it half-way); tar's status 1 is a log that another measurement was still writing
  local partial=$OUT/.train_results.$BASHPID.tar.gz
  tar czf "$partial" -C "$RESULTS" . || [ $? -eq 1 ]
  mv "$partial" "$OUT/train_results.tar.gz"
}

fine_tune() {  # $1 the run's folder under $WORK; the rest: train_pusht.py arguments of that run
  local run=$1
  shift
  if [ -f "$RESULTS/$run/checkpoint.sha256" ]; then  # trained by an earlier call on this warm machine
    echo "$run: trained in an earlier call, kept"
    return
  fi
  python3 benchmarks/recipes/train_pusht.py --part second --first-part $ASSETS --wm-init $ASSETS/checkpoint \
    --data $WORK/data --work "$WORK/$run" --out "$RESULTS/$run" --episodes "${EPISODES:-192}" --seed 101 \
    --policy-mix "$MIX" --wm-batch 256 --wm-lr "${LR:-1e-4}" --wm-warmup 50 --wm-cond-noise 0.3 \
    --encode-batch-size 128 --workers "$WORKERS" --max-size-mb 90 --no-rollout-reward-model --no-evaluate \
    "$@" ${TRAIN_ARGS:-} 2>&1 | tee "$RESULTS/$run.log"
  rm -f "$RESULTS/$run/pusht_assets.tar.gz"  # 37 MB: over what a device call returns; the parts below replace it
  local checkpoint=$WORK/$run/assets/pusht/checkpoint
  cp "$checkpoint/meta.json" "$RESULTS/$run/meta.json"
  cp "$checkpoint/MANIFEST.json" "$RESULTS/$run/MANIFEST.json"
  (cd "$checkpoint/transformer" && sha256sum diffusion_pytorch_model.safetensors > "$RESULTS/$run/checkpoint.sha256" &&
    split -b 15000000 -d diffusion_pytorch_model.safetensors "$OUT/transformer.part")
  pack  # the model is back even if the measurement below runs out of time
}

heldout() {  # $1 the run: its held-out block error over 16 chunks and untouched-block drift, one side-by-side episode;
  # $2 (optional) a suffix naming this measurement of the run; the rest: further pusht_fidelity_targets.py arguments
  local run=$1 name=$1${2:-}
  shift $(($# < 2 ? $# : 2))
  local finished
  finished=$(find "$RESULTS/eval_$name" -name 'pusht_fidelity_*.json' -exec grep -L '"unfinished"' {} + 2>/dev/null) || true
  if [ -n "$finished" ]; then  # measured by an earlier call on this warm machine
    echo "$name: measured in an earlier call, kept"
    return
  fi
  rm -rf "$RESULTS/eval_$name"  # what a call cut short by its time limit left
  timeout "${EVAL_SECONDS:-135}" python3 benchmarks/recipes/pusht_fidelity_targets.py \
    --assets "$WORK/$run/assets/pusht" --decoder light --heldout-seed 4900000 --chunks 16 --random-episodes 32 \
    --policy-starts 0 --video-episodes 1 --workers "$WORKERS" \
    --results-name "pusht_fidelity_${name}_heldout_16chunks_h200.json" --out "$RESULTS/eval_$name" "$@" \
    ${EVAL_ARGS:-} 2>&1 | tee "$RESULTS/eval_$name.log" || true
  # the side-by-side episode: an mp4, or its frames (.npz) where the machine has no video writer
  local video
  for video in $(find "$RESULTS/eval_$name" -name 'pusht_side_by_side.*'); do
    mv "$video" "$OUT/${name}_$(basename "$video")"
  done
  pack
}

arm_args() {  # $1 an arm: sets ARM_ARGS to its train_pusht.py arguments (the plain arm's settings and what differs)
  ARM_ARGS=(--wm-seconds "${SECONDS_BUDGET:-145}" --wm-max-steps "${STEPS:-40000}" --deadline-s "${DEADLINE_S:-400}")
  case "$1" in
    plain) ;;
    focus) ARM_ARGS+=(--wm-block-focus "${FOCUS:-4}") ;;  # the block's latent cells weigh 1 + FOCUS times the rest
    history) ARM_ARGS+=(--wm-action-history "${HISTORY:-4}") ;;  # the previous HISTORY actions as clean state rows
    wide) ARM_ARGS+=(--grow-intermediate "${GROW_INTERMEDIATE:-1536}" --grow-heads "${GROW_HEADS:-16}") ;;
    ctxnoise) ARM_ARGS+=(--wm-cond-noise 0 --wm-context-noise-max "${CONTEXT_NOISE_MAX:-0.5}"
                         --wm-context-noise "${CONTEXT_NOISE:-0.1}") ;;
    *) echo "arm: expected plain, focus, history, wide or ctxnoise, got $1" >&2; exit 2 ;;
  esac
}

single() {  # $1 an arm: trained, then measured once (ctxnoise: at level 0, a clean context as the plain arm's, then
  # at the level it ships with)
  arm_args "$1"
  fine_tune "$1" "${ARM_ARGS[@]}"
  if [ "$1" = ctxnoise ]; then
    heldout ctxnoise _level0 --context-noise 0
    heldout ctxnoise _level"${CONTEXT_NOISE:-0.1}" --context-noise "${CONTEXT_NOISE:-0.1}"
  else
    heldout "$1"
  fi
}

case "$STAGE" in
  plain) single plain; exit 0 ;;
  block-focus) single focus; exit 0 ;;
  history) single history; exit 0 ;;
  wide) single wide; exit 0 ;;  # a wider model (training.growth.grow_width: round 9's function, more units)
  context-noise) single ctxnoise; exit 0 ;;  # unlabelled context noise replaced by noise at its level's timestep
  paired)  # every arm of ARMS trained on the same episodes, then measured on the same held-out episodes of every seed
    # in SEEDS, two measurements at once where the GPU holds them (an H200's 139 GiB; two on an H100 run out of
    # memory); then each arm against the plain one, episode by episode (paired_fidelity.py, into $RESULTS/paired)
    arms=(${ARMS:-plain ctxnoise})
    [ "${arms[0]}" = plain ] || { echo "ARMS: expected plain first (the baseline of every pair), got ${arms[*]}" >&2; exit 2; }
    for arm in "${arms[@]}"; do arm_args "$arm"; done  # every name checked before any training
    for arm in "${arms[@]}"; do
      arm_args "$arm"
      fine_tune "$arm" "${ARM_ARGS[@]}"
    done
    memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1) || memory_mib=0
    slots=1
    [ "$memory_mib" -gt 100000 ] && slots=2
    compared=()  # what each measurement compares with plain: the arm and its inference level, without the seed
    measure() {  # heldout's arguments, in the background once a slot is free; no side by side (a call returns at
      # most 8 files)
      [ "$1" = plain ] || compared+=("$1${2%_s*}")
      while [ "$(jobs -rp | wc -l)" -ge "$slots" ]; do wait -n || true; done
      heldout "$@" --video-episodes 0 &
    }
    for seed in ${SEEDS:-4900000 4900100}; do
      for arm in "${arms[@]}"; do
        case "$arm" in
          ctxnoise) measure ctxnoise "_level0_s$seed" --heldout-seed "$seed" --context-noise 0 ;;
          *) measure "$arm" "_s$seed" --heldout-seed "$seed" ;;
        esac
      done
    done
    if [[ " ${arms[*]} " == *" ctxnoise "* ]]; then  # then at the level it ships with
      for seed in ${SEEDS:-4900000 4900100}; do
        measure ctxnoise "_level${CONTEXT_NOISE:-0.1}_s$seed" --heldout-seed "$seed" --context-noise "${CONTEXT_NOISE:-0.1}"
      done
    fi
    wait
    mkdir -p "$RESULTS/paired"
    for name in $(printf '%s\n' "${compared[@]}" | sort -u); do
      python3 benchmarks/recipes/paired_fidelity.py --baseline "$RESULTS"/eval_plain_s*/pusht_fidelity_*.json \
        --variant "$RESULTS"/eval_"${name}"_s*/pusht_fidelity_*.json --name "paired_${name}_vs_plain.json" \
        --out "$RESULTS/paired" --overwrite 2>&1 | tee "$RESULTS/paired/${name}.log" || true
    done
    pack
    exit 0 ;;
  self-forcing)
    fine_tune sf --wm-self-forcing-rollouts "${ROLLOUTS:-3}" --wm-self-forcing-depth "${DEPTH:-10}" \
      --wm-self-forcing-envs "${ENVS:-256}" --wm-seconds 900 --wm-max-steps 40000 --deadline-s "${DEADLINE_S:-430}"
    mv "$RESULTS/sf/self_forcing_samples.png" "$OUT/"
    heldout sf
    exit 0 ;;
  evaluate) ;;
  *) echo "stage: expected plain, block-focus, history, wide, context-noise, paired, self-forcing or evaluate, got $STAGE" >&2
    exit 2 ;;
esac

case "${MODEL:?set MODEL to sf, focus, history, wide, ctxnoise, plain or builtin}" in
  sf | focus | history | wide | ctxnoise | plain) assets=$WORK/$MODEL/assets/pusht ;;
  builtin) assets=$ASSETS ;;
  *) echo "MODEL: expected sf, focus, history, wide, ctxnoise, plain or builtin, got $MODEL" >&2; exit 2 ;;
esac
half() {  # $1 A or B: the session-24 baseline's halves of the evaluation pool, 32 reporting starts x 16 chunks
  local policies=$EVAL_POOL_A
  [ "$1" = B ] && policies=$EVAL_POOL_B
  timeout "${EVAL_SECONDS:-500}" python3 benchmarks/recipes/pusht_fidelity_targets.py --assets "$assets" \
    --decoder light --heldout-seed 4900000 --episodes 2 --chunks 2 --random-episodes 2 --policies "$policies" \
    --policy-starts 32 --policy-chunks 16 --video-episodes 0 --workers $((WORKERS / 2)) \
    --results-name "pusht_fidelity_${MODEL}_evalpool_16_$1_h200.json" --out "$RESULTS/eval_pool" ${EVAL_ARGS:-} \
    > "$RESULTS/eval_pool_$1.log" 2>&1
}
half A &
first=$!
half B &
second=$!
status=0
wait $first || status=$?
wait $second || status=$?
tail -n 6 "$RESULTS"/eval_pool_*.log
pack
exit $status
