#!/usr/bin/env bash
# Multi-node AReaL-py run over plain ssh: the controller (and its trainer ranks, spawned
# locally) on this machine, rollout workers started on other machines with --connect.
#
#   examples/launch/ssh.sh gpu-node-1 gpu-node-2 -- [extra key=value overrides]
#
# Needs: passwordless ssh to each host, this repository installed at the same path on each
# (AREAL_DIR), the model at the same path. Keys are copied with scp; nothing else is shared.
set -euo pipefail

HOSTS=()
while [[ $# -gt 0 && $1 != "--" ]]; do HOSTS+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
[[ ${#HOSTS[@]} -gt 0 ]] || { echo "usage: $0 HOST [HOST...] -- [key=value...]" >&2; exit 2; }

CONFIG=${CONFIG:-examples/gsm8k_qwen2.5_1.5b_vllm.yaml}
AREAL_DIR=${AREAL_DIR:-$PWD}
PORT=${PORT:-5555}
KEYS_DIR=${KEYS_DIR:-$PWD/runs/keys}
GPUS_PER_HOST=${GPUS_PER_HOST:-8}
CONTROLLER_HOST=${CONTROLLER_HOST:-$(hostname -f)}   # a name the other hosts can resolve
NUM_ROLLOUT=$(( ${#HOSTS[@]} * GPUS_PER_HOST ))

python -m areal.auth init "$KEYS_DIR"
devices="[cuda:0"; for ((i = 1; i < NUM_ROLLOUT; i++)); do devices+=",cuda:0"; done; devices+="]"

python -m areal.controller --config "$CONFIG" \
    controller.host=0.0.0.0 controller.port="$PORT" controller.keys_dir="$KEYS_DIR" \
    "controller.remote_kinds=[rollout]" rollout.num_workers="$NUM_ROLLOUT" \
    "rollout.devices=$devices" weight_sync.mode=collective "$@" &
CONTROLLER=$!

index=0
for host in "${HOSTS[@]}"; do
    # Only the server's public key and a client key pair leave this machine.
    ssh "$host" "mkdir -p ~/.areal-keys && chmod 700 ~/.areal-keys"
    scp -q "$KEYS_DIR/server.key" "$KEYS_DIR/client.key_secret" "$host:.areal-keys/"
    for ((gpu = 0; gpu < GPUS_PER_HOST; gpu++, index++)); do
        ssh -f "$host" "cd $AREAL_DIR && CUDA_VISIBLE_DEVICES=$gpu nohup \
            python -m areal.workers.rollout --connect tcp://$CONTROLLER_HOST:$PORT \
            --keys ~/.areal-keys --worker-id rollout-$index --rank $index \
            > rollout-$index.log 2>&1 < /dev/null &"
    done
done

wait "$CONTROLLER"     # the rollout workers exit on the controller's Shutdown
