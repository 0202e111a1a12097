#!/usr/bin/env bash
# Checkpoints of one training run, ranked by the world model against gym-pusht (issue 42: "checkpoints of one
# training run, >= 6, real success spread over >= 20 points: Spearman >= 0.8"). Two device calls on one H100/H200
# with 16 cores:
#
#   bash benchmarks/recipes/checkpoints_ranking_pusht.sh train   # BC then DAgger (rl_pusht.py) with seed SEED
#       # (1300000, the manifest's training range), saving the policy after BC steps SNAPSHOT_STEPS and after every
#       # DAgger round: $OUT/checkpoints_run<SEED>.tar.gz holds rl_pusht.json and policies/ (rl_pusht_snapshot_*,
#       # under 1 MB each).
#       # Commit them as benchmarks/results/rl/policies/eval_pool_run<SEED>_<name>.safetensors (never trained on,
#       # never used to choose: evaluation pool).
#   bash benchmarks/recipes/checkpoints_ranking_pusht.sh grpo    # the same run continued by GRPO in gym-pusht
#       # (below): snapshots of similar skill.
#   bash benchmarks/recipes/checkpoints_ranking_pusht.sh rank    # every file matching POLICIES (default those
#       # committed files) from STARTS (48) reporting seeds (5,000,000..) for CHUNKS (16) chunks in both worlds,
#       # in two processes side by side, then one ranking by final coverage and by success
#       # (merge_policy_rankings.py): $OUT/pusht_fidelity_run<SEED>_checkpoints_{A,B}.json and
#       # pusht_fidelity_run<SEED>_checkpoints_ranking.json. REAL="eval_real.json ..." also ranks the estimates against a
#       # larger real evaluation of the same files and horizon (cosmos3-gym eval-real --real-only --chunks CHUNKS
#       # --first-sim-seed 5000000 --starts 300 --out ..., CPU cores suffice: 26 min on 2 for nine checkpoints).
#
# A CPU check of the mechanics: OUT=/tmp/o TRAIN_ARGS="--tiny --device cpu" SNAPSHOT_STEPS=1,2 bash ... train, then
#   OUT=/tmp/o POLICIES="/tmp/checkpoints_run1300000/out/policies/rl_pusht_snapshot_*" STARTS=2 CHUNKS=1 \
#   EVAL_ARGS="--smoke --device cpu" bash ... rank
set -euo pipefail
STAGE=${1:?train, grpo or rank}
OUT=${OUT:?set OUT to the output folder}
SEED=${SEED:-1300000}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."

case $STAGE in
  train)
    # 600 demonstrations, 90 s of BC and 4 DAgger rounds of 384 episodes: about 7 minutes on an H100 with 16 cores
    # (rl_pusht.py's defaults take two calls).
    work=${WORK:-/tmp/checkpoints_run$SEED}
    python3 benchmarks/rl_pusht.py --out "$work/out" --work "$work/rl_work" --scratch "$work/scratch" \
      --stages demos,bc,dagger --seed "$SEED" --eval-seed 5000000 --demo-episodes 600 --bc-seconds 90 \
      --dagger-episodes 384 --bc-snapshot-steps "${SNAPSHOT_STEPS:-300,1000,3000,8000}" --dagger-snapshots \
      --no-progress ${TRAIN_ARGS:-}
    # One archive: a device call returns at most 8 files.
    tar czf "$OUT/checkpoints_run$SEED.tar.gz" -C "$work/out" rl_pusht.json policies
    ;;
  grpo)
    # The same run continued: GRPO in gym-pusht (rl_pusht.py's defaults) from its last DAgger round, saving the policy
    # after each of GRPO_SNAPSHOTS iterations: checkpoints of similar skill. 300 iterations: ~6 min on an H100 with
    # 16 cores, ~70 min on 2 CPU cores (TRAIN_ARGS="--device cpu --workers 2"). Commit the snapshots as
    # eval_pool_run<SEED>_grpo_sim_it<N>.safetensors.
    work=${WORK:-/tmp/checkpoints_run${SEED}_grpo}
    mkdir -p "$work/policies"
    cp "benchmarks/results/rl/policies/eval_pool_run${SEED}_dagger_round4.safetensors" "$work/policies/rl_pusht_bc.safetensors"
    python3 benchmarks/rl_pusht.py --out "$work/out" --work "$work" --stages grpo_sim --seed "$SEED" \
      --eval-seed 5000000 --demo-episodes 600 --dagger-episodes 384 --iterations "${ITERATIONS:-300}" \
      --grpo-snapshot-iterations "${GRPO_SNAPSHOTS:-25,50,100,150,200,300}" --no-progress ${TRAIN_ARGS:-}
    tar czf "$OUT/checkpoints_run${SEED}_grpo.tar.gz" -C "$work/out" rl_pusht.json policies
    ;;
  rank)
    # shellcheck disable=SC2206  # the pattern is meant to expand
    files=(${POLICIES:-benchmarks/results/rl/policies/eval_pool_run${SEED}_*.safetensors})
    [[ -f ${files[0]} ]] || { echo "POLICIES: no policy file matches ${POLICIES:-the committed run $SEED}" >&2; exit 2; }
    specs=()
    for file in "${files[@]}"; do specs+=("file:$file"); done
    half=$(( (${#specs[@]} + 1) / 2 ))
    first=$(IFS=,; echo "${specs[*]:0:half}")
    second=$(IFS=,; echo "${specs[*]:half}")
    run_part() {  # $1: part name, $2: comma-separated policies
      python3 benchmarks/recipes/pusht_fidelity_targets.py --decoder light --heldout-seed 4900000 --episodes 2 \
        --random-episodes 2 --chunks 2 --video-episodes 0 --policies "$2" --policy-starts "${STARTS:-48}" \
        --policy-chunks "${CHUNKS:-16}" --results-name "pusht_fidelity_run${SEED}_checkpoints_$1.json" --out "$OUT" \
        ${EVAL_ARGS:-} > "$OUT/rank_$1.log" 2>&1
    }
    run_part A "$first" & a=$!
    status=0
    if [[ -n $second ]]; then run_part B "$second" || status=$?; fi
    wait $a || status=$?
    tail -n 5 "$OUT"/rank_*.log
    [[ $status == 0 ]] || exit $status
    parts=("$OUT"/pusht_fidelity_run"${SEED}"_checkpoints_[AB].json)
    # shellcheck disable=SC2086  # REAL may name several eval-real files
    python3 benchmarks/recipes/merge_policy_rankings.py --inputs "${parts[@]}" ${REAL:+--real $REAL} \
      --name "pusht_fidelity_run${SEED}_checkpoints_ranking.json" --out "$OUT"
    ;;
  *) echo "stage: expected train, grpo or rank, got $STAGE" >&2; exit 2 ;;
esac
