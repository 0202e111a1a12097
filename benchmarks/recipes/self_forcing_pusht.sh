#!/usr/bin/env bash
# Issue 42 item 3: self-forcing with a consistent target (cosmos3_gym/tasks/pusht/self_forcing.py), against the plain
# fine-tune on the same data. Fine-tunes the shipped PushT model on new simulated episodes plus samples that start from
# its own frames and continue as gym-pusht continues the state read off them; then the same fine-tune without the
# samples, on the same episodes and for the same step count; each measured on the held-out block error. Calls on one
# warm H200 (each under 10 minutes; session 26 ran them as below, RESULTS.md "Issue 42 item 3"):
#
#   bash benchmarks/recipes/self_forcing_pusht.sh train      # data, rollouts, fine-tune (about 400 s); held-out error
#   STEPS=900 bash benchmarks/recipes/self_forcing_pusht.sh control   # the same episodes, no samples, STEPS steps
#   MODEL=trained bash benchmarks/recipes/self_forcing_pusht.sh evaluate   # the evaluation pool, 32 x 16 chunks
#
# Data: EPISODES (192) new episodes from dataset seed 101 with round 9's family mix (its files: policies of the
# training pool; the manifest's seed notes name 101), ROLLOUTS (3) rollouts of DEPTH (10) chunks per episode by the
# shipped model, each chunk's last frame a sample. The held-out measurement is session 24's baseline protocol (dataset
# seed 4,900,000: training-pool policy families, what may choose between variants): block error over 16 chunks and
# the untouched-block drift under random actions, and one side-by-side episode.
# What comes back ($OUT, at most 8 files): the fine-tuned transformer in 15 MB parts (cat them; checkpoint.sha256
# names the whole), self_forcing_samples.png, the side-by-side episode (mp4, or its frames as .npz), and
# train_results.tar.gz (training and evaluation JSONs, the training log, the checkpoint's meta.json and MANIFEST.json).
#
# A CPU check of the mechanics: OUT=/tmp/o WORK=/tmp/w EPISODES=4 ENVS=4 DEPTH=2 ROLLOUTS=1 WORKERS=2
#   TRAIN_ARGS="--smoke --steps-per-episode 40 --chunk 8 --wm-batch 2" EVAL_ARGS=--smoke bash .../self_forcing_pusht.sh train
#
# evaluate: the evaluation pool (policy_pools.json) on reporting seeds, in the two halves of the session-24 baseline
# side by side, for MODEL=trained (the train call's model, on a warm machine) or MODEL=builtin (the tree's built-in
# model, once fine-tuned weights are installed there). Nothing here chooses on the evaluation pool.
set -euo pipefail
STAGE=${1:?train, control or evaluate}
OUT=${OUT:?set OUT to the output folder}
WORK=${WORK:-/tmp/self_forcing}
ASSETS=cosmos3_gym/tasks/pusht/assets
source "$(dirname "$0")/pusht_pools.sh"  # MIX, EVAL_POOL_A, EVAL_POOL_B
WORKERS=${WORKERS:-$(nproc)}
export PYTHONUNBUFFERED=1
RESULTS=$WORK/results
mkdir -p "$RESULTS"

pack() {  # the small files, in one archive (the device returns at most 8 files)
  tar czf "$OUT/train_results.tar.gz" -C "$RESULTS" .
}

fine_tune() {  # $1 the run's folder under $WORK; the rest: train_pusht.py arguments of that run
  local run=$1
  shift
  python3 benchmarks/recipes/train_pusht.py --part second --first-part $ASSETS --wm-init $ASSETS/checkpoint \
    --data $WORK/data --work "$WORK/$run" --out "$RESULTS/$run" --episodes "${EPISODES:-192}" --seed 101 \
    --policy-mix "$MIX" --wm-batch 256 --wm-lr "${LR:-1e-4}" --wm-warmup 50 --wm-cond-noise 0.3 \
    --encode-batch-size 128 --workers "$WORKERS" --max-size-mb 60 --no-rollout-reward-model --no-evaluate \
    "$@" ${TRAIN_ARGS:-} 2>&1 | tee "$RESULTS/$run.log"
  rm -f "$RESULTS/$run/pusht_assets.tar.gz"  # 37 MB: over what a device call returns; the parts below replace it
  local checkpoint=$WORK/$run/assets/pusht/checkpoint
  cp "$checkpoint/meta.json" "$RESULTS/$run/meta.json"
  cp "$checkpoint/MANIFEST.json" "$RESULTS/$run/MANIFEST.json"
  (cd "$checkpoint/transformer" && sha256sum diffusion_pytorch_model.safetensors > "$RESULTS/$run/checkpoint.sha256" &&
    split -b 15000000 -d diffusion_pytorch_model.safetensors "$OUT/transformer.part")
  pack  # the model is back even if the measurement below runs out of time
}

heldout() {  # $1 the run: its held-out block error over 16 chunks and untouched-block drift, one side-by-side episode
  timeout "${EVAL_SECONDS:-135}" python3 benchmarks/recipes/pusht_fidelity_targets.py \
    --assets "$WORK/$1/assets/pusht" --decoder light --heldout-seed 4900000 --chunks 16 --random-episodes 32 \
    --policy-starts 0 --video-episodes 1 --workers "$WORKERS" \
    --results-name "pusht_fidelity_$1_heldout_16chunks_h200.json" --out "$RESULTS/eval_$1" ${EVAL_ARGS:-} 2>&1 |
    tee "$RESULTS/eval_$1.log" || true
  # the side-by-side episode: an mp4, or its frames (.npz) where the machine has no video writer
  find "$RESULTS/eval_$1" -name 'pusht_side_by_side.*' -exec mv {} "$OUT/" \;
  pack
}

case "$STAGE" in
  train)
    fine_tune sf --wm-self-forcing-rollouts "${ROLLOUTS:-3}" --wm-self-forcing-depth "${DEPTH:-10}" \
      --wm-self-forcing-envs "${ENVS:-256}" --wm-seconds 900 --wm-max-steps 40000 --deadline-s "${DEADLINE_S:-430}"
    mv "$RESULTS/sf/self_forcing_samples.png" "$OUT/"
    heldout sf
    exit 0 ;;
  control)  # the train call's episodes (the same --data), the step count the train call reached
    fine_tune plain --wm-seconds "${SECONDS_BUDGET:-145}" --wm-max-steps "${STEPS:?set STEPS to the step count of the train call}" \
      --deadline-s "${DEADLINE_S:-400}"
    heldout plain
    exit 0 ;;
  evaluate) ;;
  *) echo "stage: expected train, control or evaluate, got $STAGE" >&2; exit 2 ;;
esac

case "${MODEL:?set MODEL to trained or builtin}" in
  trained) assets=$WORK/sf/assets/pusht ;;
  builtin) assets=$ASSETS ;;
  *) echo "MODEL: expected trained or builtin, got $MODEL" >&2; exit 2 ;;
esac
half() {  # $1 A or B: the session-24 baseline's halves of the evaluation pool, 32 reporting starts x 16 chunks
  local policies=$EVAL_POOL_A
  [ "$1" = B ] && policies=$EVAL_POOL_B
  timeout "${EVAL_SECONDS:-500}" python3 benchmarks/recipes/pusht_fidelity_targets.py --assets "$assets" \
    --decoder light --heldout-seed 4900000 --episodes 2 --chunks 2 --random-episodes 2 --policies "$policies" \
    --policy-starts 32 --policy-chunks 16 --video-episodes 0 --workers $((WORKERS / 2)) \
    --results-name "pusht_fidelity_self_forcing_evalpool_16_$1_h200.json" --out "$RESULTS/eval_pool" ${EVAL_ARGS:-} \
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
