# Sourced by the PushT device recipes (context_ab_pusht.sh, finetune_ab_pusht.sh). MIX: round 9's family mix for new
# training episodes (its files: policies of the training pool in cosmos3_gym/tasks/pusht/policy_pools.json).
# EVAL_POOL_A / EVAL_POOL_B: that manifest's evaluation pool, in the two halves the session-24 baseline ran in.
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
