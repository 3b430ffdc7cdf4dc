#!/usr/bin/env bash
# Multi-node AReaL-py run under Slurm: controller + trainer ranks on the first node, vLLM
# rollout workers on the others, every worker joining with --connect over CurveZMQ.
#
#   sbatch --nodes=3 --gpus-per-node=8 examples/launch/slurm.sh [extra key=value overrides]
#
# On one node (NODES=1) the rollout workers run beside the trainer; GPUS_PER_NODE=0 is a
# CPU run (tests/examples/test_slurm_launch.py runs it so on a one-node Slurm of localhost).
#
# Needs: this repository and the model at the same paths on every node (a shared file
# system), and KEYS_DIR on that shared file system (or copy server.key + client.key_secret
# to each node, see areal/auth.py).
#SBATCH --job-name=areal
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail

CONFIG=${CONFIG:-examples/gsm8k_qwen2.5_1.5b_vllm.yaml}
PORT=${PORT:-5555}
KEYS_DIR=${KEYS_DIR:-$PWD/runs/keys}
NUM_RANKS=${NUM_RANKS:-8}                   # trainer ranks: all GPUs of the first node
GPUS_PER_NODE=${GPUS_PER_NODE:-8}           # 0: CPUs only

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
if (( ${#NODES[@]} > 1 )); then             # rollout workers on the other nodes
    ROLLOUT_NODES=$(IFS=,; echo "${NODES[*]:1}")
    NUM_ROLLOUT=${NUM_ROLLOUT:-$(( (${#NODES[@]} - 1) * GPUS_PER_NODE ))}
else                                        # one node: beside the trainer
    ROLLOUT_NODES=$HEAD
    NUM_ROLLOUT=${NUM_ROLLOUT:-1}
fi
ROLLOUT_NODE_COUNT=$(( ${#NODES[@]} > 1 ? ${#NODES[@]} - 1 : 1 ))
ADDRESS=tcp://$HEAD:$PORT

python -m areal.auth init "$KEYS_DIR"       # idempotent: keeps existing keys

# One 'cuda:0' per worker: srun --gpus-per-task=1 gives each process its own GPU, which
# it sees as cuda:0 (CUDA_VISIBLE_DEVICES). What matters to remote workers is 'cuda'.
cuda0() { local out=cuda:0; for ((i = 1; i < $1; i++)); do out+=",cuda:0"; done; echo "[$out]"; }
GPU_TASK=() DEVICES=() NO_GPU=()
if (( GPUS_PER_NODE > 0 )); then
    GPU_TASK=(--gpus-per-task=1) NO_GPU=(--gpus=0)
    DEVICES=("trainer.devices=$(cuda0 "$NUM_RANKS")" "rollout.devices=$(cuda0 "$NUM_ROLLOUT")")
fi

# The controller binds every interface of the head node, starts only the reward workers,
# and waits for NUM_RANKS trainer ranks and NUM_ROLLOUT rollout workers to join.
srun --nodes=1 --ntasks=1 --nodelist="$HEAD" "${NO_GPU[@]}" --overlap \
    python -m areal.controller --config "$CONFIG" \
        controller.host=0.0.0.0 controller.port="$PORT" controller.keys_dir="$KEYS_DIR" \
        "controller.remote_kinds=[rollout,trainer]" \
        trainer.num_ranks="$NUM_RANKS" rollout.num_workers="$NUM_ROLLOUT" "${DEVICES[@]}" \
        weight_sync.mode=collective "$@" &
CONTROLLER=$!

# Trainer ranks: one task per GPU of the head node; the rank is the task id. Rank 0 hosts
# the TCPStore where the process groups meet, on the interface that routes to the
# controller (set trainer.store_host otherwise); pin gloo/NCCL with *_SOCKET_IFNAME if the
# nodes have several networks. When a rank is lost, the controller tells the others to stop
# with exit code 75: the loop starts them again and they resume from the newest checkpoint
# (start a lost rank's task again by hand, or let Slurm requeue it).
srun --nodes=1 --ntasks="$NUM_RANKS" --nodelist="$HEAD" "${GPU_TASK[@]}" --overlap \
    bash -c "while :; do python -m areal.workers.trainer --connect $ADDRESS --keys $KEYS_DIR \
                 --worker-id trainer-\$SLURM_PROCID --rank \$SLURM_PROCID; \
             [ \$? -eq 75 ] || break; done" &

# Rollout workers: one vLLM engine per GPU of the other nodes; --rank picks the seed.
srun --nodes="$ROLLOUT_NODE_COUNT" --ntasks="$NUM_ROLLOUT" --nodelist="$ROLLOUT_NODES" \
    "${GPU_TASK[@]}" --overlap \
    bash -c "exec python -m areal.workers.rollout --connect $ADDRESS --keys $KEYS_DIR \
                 --worker-id rollout-\$SLURM_PROCID --rank \$SLURM_PROCID" &

wait "$CONTROLLER"     # the workers exit on the controller's Shutdown
wait
