#!/usr/bin/env bash
# Issue 42 item 3: self-forcing with a consistent target (cosmos3_gym/tasks/pusht/self_forcing.py). Fine-tunes the
# shipped PushT model on new simulated episodes plus samples that start from its own frames and continue as gym-pusht
# continues the state read off them, then measures it. Two device calls on one H200 (each under 10 minutes):
#
#   bash benchmarks/recipes/self_forcing_pusht.sh train      # data, rollouts, fine-tune; the held-out block error
#   bash benchmarks/recipes/self_forcing_pusht.sh evaluate   # the evaluation pool at 32 starts x 16 chunks
#
# train: 768 new episodes from dataset seed 101 (the policy-pool manifest's unused dataset seeds; reset seeds in the
# held-out ranges are drawn again) with round 9's family mix (its files: policies of the training pool), 2 rollouts of
# 10 chunks per episode by the shipped model, each chunk's last frame a sample. Then the held-out block error over 16
# chunks and the untouched-block drift under random actions (dataset seed 4,900,000, the protocol of session 24's
# baseline, on training-pool policy families: what may choose between variants), and one side-by-side episode.
# What comes back ($OUT, at most 8 files): the fine-tuned transformer in 15 MB parts (cat them; checkpoint.sha256
# names the whole), self_forcing_samples.png, the side-by-side frames, and train_results.tar.gz (training and
# evaluation JSONs, the training log, the checkpoint's meta.json and MANIFEST.json, the logs).
#
# A CPU check of the mechanics: OUT=/tmp/o WORK=/tmp/w EPISODES=4 ENVS=4 DEPTH=2 ROLLOUTS=1 WORKERS=2
#   TRAIN_ARGS="--smoke --steps-per-episode 40 --chunk 8" EVAL_ARGS=--smoke bash .../self_forcing_pusht.sh train
#
# evaluate: the evaluation pool (policy_pools.json) on reporting seeds, in the two halves of the session-24
# baseline side by side, for MODEL=trained (the train call's model, on a warm machine) or MODEL=builtin (the tree's
# built-in model, once the fine-tuned weights are installed there). Nothing here chooses on the evaluation pool.
set -euo pipefail
STAGE=${1:?train or evaluate}
OUT=${OUT:?set OUT to the output folder}
WORK=${WORK:-/tmp/self_forcing}
ASSETS=cosmos3_gym/tasks/pusht/assets
POLICIES=benchmarks/results/rl/policies
MIX="scripted_random_goal=0.33,scripted=0.17,random=0.1,replay=0.05,uniform=0.1"
MIX="$MIX,file:$POLICIES/rl_pusht_grpo_simulator_policy_starts_h4_cw10.safetensors=0.1"
MIX="$MIX,file:$POLICIES/rl_pusht_grpo_world_model_policy_starts_h4_cw10_ieee.safetensors=0.1"
MIX="$MIX,file:$POLICIES/rl_pusht_grpo_world_model_round6.safetensors=0.05"
EVAL_POOL_A="scripted:6,scripted:15,scripted:35,scripted:70,scripted-physics:5,scripted-physics:15,scripted-physics:35"
EVAL_POOL_A="$EVAL_POOL_A,scripted-physics:75"
EVAL_POOL_B="scripted-physics:120,scripted-frames:5,scripted-frames:15,scripted-frames:35,scripted-frames:70"
EVAL_POOL_B="$EVAL_POOL_B,file:$POLICIES/eval_pool_bc_seed1000000_cpu.safetensors"
EVAL_POOL_B="$EVAL_POOL_B,file:$POLICIES/eval_pool_untrained_seed1000001.safetensors"
WORKERS=${WORKERS:-$(nproc)}
export PYTHONUNBUFFERED=1
RESULTS=$WORK/results
mkdir -p "$RESULTS"

pack() {  # the small files, in one archive (the device returns at most 8 files)
  tar czf "$OUT/train_results.tar.gz" -C "$RESULTS" .
}

if [ "$STAGE" = train ]; then
  python3 benchmarks/recipes/train_pusht.py --part second --first-part $ASSETS --wm-init $ASSETS/checkpoint \
    --data $WORK/data --work $WORK/sf --out $RESULTS/train --episodes "${EPISODES:-768}" --seed 101 \
    --policy-mix "$MIX" --wm-batch 256 --wm-lr "${LR:-1e-4}" --wm-warmup 50 --wm-cond-noise 0.3 \
    --wm-self-forcing-rollouts "${ROLLOUTS:-2}" --wm-self-forcing-depth "${DEPTH:-10}" --wm-seconds 900 \
    --wm-max-steps 40000 --encode-batch-size 128 --workers "$WORKERS" --max-size-mb 60 \
    --wm-self-forcing-envs "${ENVS:-256}" --deadline-s "${DEADLINE_S:-460}" --no-rollout-reward-model --no-evaluate \
    ${TRAIN_ARGS:-} 2>&1 | tee "$RESULTS/train.log"
  checkpoint=$WORK/sf/assets/pusht/checkpoint
  rm -f "$RESULTS/train/pusht_assets.tar.gz"  # 37 MB: over what a device call returns; the parts below replace it
  mv "$RESULTS/train/self_forcing_samples.png" "$OUT/"
  cp "$checkpoint/meta.json" "$checkpoint/MANIFEST.json" "$RESULTS/"
  (cd "$checkpoint/transformer" && sha256sum diffusion_pytorch_model.safetensors > "$RESULTS/checkpoint.sha256" &&
    split -b 15000000 -d diffusion_pytorch_model.safetensors "$OUT/transformer.part")
  pack  # the model is back even if the evaluation below runs out of time
  timeout "${EVAL_SECONDS:-150}" python3 benchmarks/recipes/pusht_fidelity_targets.py \
    --assets $WORK/sf/assets/pusht --decoder light --heldout-seed 4900000 --chunks 16 --random-episodes 32 \
    --policy-starts 0 --video-episodes 1 --workers "$WORKERS" \
    --results-name pusht_fidelity_self_forcing_heldout_16chunks_h200.json --out "$RESULTS/eval" ${EVAL_ARGS:-} 2>&1 |
    tee "$RESULTS/eval.log" || true
  # the side-by-side episode: an mp4, or its frames (.npz) where the machine has no video writer
  find "$RESULTS/eval" -name 'pusht_side_by_side.*' -exec mv {} "$OUT/" \;
  pack
  exit 0
fi

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
