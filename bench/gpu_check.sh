#!/usr/bin/env bash
# GPU check of the rollout engines, the trainer and weight publishing on one CUDA machine.
#
#     bash bench/gpu_check.sh OUT_DIR            (from anywhere; DEVICE=cpu dry-runs it here)
#
# Made for a single-GPU machine without network whose Python already has torch and
# transformers (and maybe vLLM): it installs nothing. The source tree is imported through a
# temporary folder that maps areal.controller / areal.workers / areal.sandbox onto their
# folders, as pyproject.toml's package-dir does, so the checkout needs no `pip install`.
# Phases (each bounded; the whole script stays under 8 minutes):
#   env      versions, GPU, which imports work                     -> env.txt
#   cuda     torch engine on CUDA: log-prob parity with the trainer's forward, an
#            interrupted run with two versions, stream-mode (bucketed, CUDA) weights; a
#            background checkpoint (trainer.checkpoint_async) of a model on CUDA, written
#            while it trains on, loaded back equal to the state it was taken of
#                                                                   -> cuda_checks.json
#   pytest   the CPU tests of models, weight publishing, torch engine and interruption,
#            on this machine's torch/transformers; the vLLM tests if vLLM imports
#                                                                   -> pytest.txt
#   bench    bench/engines.py on CUDA (vLLM skipped if absent)     -> bench/, bench.txt
#   run      a short controller run, rollout and trainer on cuda:0, trainer checkpoints
#            (torch.distributed.checkpoint from CUDA) every 4 steps -> run/, run.txt
# Every phase's status is in OUT_DIR/summary.txt; the exit code is 1 if any phase failed.
set -uo pipefail

OUT=$(mkdir -p "${1:?usage: bash bench/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-460}
START=$(date +%s)
PY=${PYTHON:-python}

SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/areal"
for entry in "$REPO"/areal/*; do ln -s "$entry" "$SHIM/areal/"; done
for role in controller workers sandbox; do ln -s "$REPO/$role" "$SHIM/areal/$role"; done
export PYTHONPATH="$SHIM:$REPO/tests/workers/rollout${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$OUT"  # never the checkout's root: its areal/ folder would hide the mapped namespace

: > summary.txt
FAILED=0
phase() {  # phase NAME SECONDS COMMAND...: run with a timeout cut to the time left
  local name=$1 want=$2; shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  local limit=$((want < left ? want : left))
  if ((limit < 20)); then
    echo "$name: SKIPPED (out of time)" | tee -a summary.txt; return
  fi
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$name.txt" 2>&1
  local rc=$?
  local took=$(($(date +%s) - t0))
  if ((rc == 0)); then
    echo "$name: PASSED in ${took}s" | tee -a summary.txt
  elif ((rc == 124 || rc == 137)); then
    echo "$name: TIMED OUT after ${took}s (limit ${limit}s)" | tee -a summary.txt; FAILED=1
  else
    echo "$name: FAILED (exit $rc) in ${took}s; see $name.txt" | tee -a summary.txt; FAILED=1
  fi
}

phase env 60 bash -c "
  nvidia-smi || true
  $PY - <<'EOF'
import importlib, platform
print('python', platform.python_version())
for name in ('torch', 'transformers', 'vllm', 'zmq', 'msgpack', 'uvloop', 'omegaconf',
             'safetensors', 'math_verify', 'pytest', 'pytest_asyncio', 'matplotlib'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', 'ok'))
    except Exception as err:
        print(name, 'MISSING', type(err).__name__, err)
import torch
print('cuda', torch.cuda.is_available(), torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
import areal.workers.rollout.torch_engine  # the mapped namespace works
EOF"
HAVE_VLLM=$($PY -c "import importlib.util as u; print(int(u.find_spec('vllm') is not None))")

phase cuda 120 env DEVICE="$DEVICE" "$PY" - <<'EOF'
"""Torch engine on the GPU against the trainer's forward; stream-mode weights on the GPU."""
import asyncio, json, os, tempfile, time
from pathlib import Path

import torch
from rollout_helpers import random_prompts

from areal.models.hf import load_model
from areal.models.logprobs import packed_logprobs
from areal.models.tiny import save_tiny_model
from areal.models.weights import (bucket_tensors, flatten_bucket, load_tensors, merge_buckets,
                                  named_tensors, save_tensors, unflatten_bucket)
from areal.workers.trainer.checkpoint import BackgroundCheckpoints, load_checkpoint
from areal.workers.rollout.engine import DiskWeights, FinishReason, SamplingParams, TensorWeights
from areal.workers.rollout.interruptible import InterruptibleGenerator
from areal.workers.rollout.torch_engine import TorchEngine

DEVICE = os.environ["DEVICE"]
torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32
torch.backends.cudnn.allow_tf32 = False
ATOL = 2e-4
report = {"device": DEVICE}


def peaked(directory, seed):
    save_tiny_model(directory, seed=seed)
    model = load_model(directory)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(directory)
    return directory


def trainer_lp(model, prompt, tokens, temperature):
    seq = torch.tensor(prompt + tokens, device=DEVICE)
    with torch.no_grad():
        lp = packed_logprobs(model, seq, torch.tensor([0, len(seq)]), temperature=temperature)
    return lp[len(prompt):].float().cpu()


def max_diff(got, want):
    d = (torch.tensor(got, dtype=torch.float64) - want.double()).abs()
    return float(d.max()), float(d.mean())


async def main(tmp):
    dirs = [peaked(Path(tmp) / f"v{s}", s) for s in (0, 1)]
    refs = [load_model(d, device=DEVICE) for d in dirs]
    engine = TorchEngine(dirs[0], device=DEVICE, max_concurrent=64)
    await engine.start()
    try:
        prompts = random_prompts(32, min_len=4, max_len=80, seed=1)
        params = SamplingParams(max_new_tokens=32, temperature=0.7)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(f"r{i}", p, params)
                                      for i, p in enumerate(prompts)))
        report["generate_s"] = time.perf_counter() - t0
        got = [x for o in outs for x in o.logprobs]
        want = torch.cat([trainer_lp(refs[0], p, o.token_ids, 0.7) for p, o in zip(prompts, outs)])
        report["parity_max"], report["parity_mean"] = max_diff(got, want)
        assert report["parity_max"] < ATOL, report

        generator = InterruptibleGenerator(engine, version=0)
        params = SamplingParams(max_new_tokens=96, temperature=1.0)
        tasks = [asyncio.create_task(generator.generate(f"i{i}", p, params))
                 for i, p in enumerate(prompts[:8])]
        await generator.generate("probe", prompts[0], SamplingParams(max_new_tokens=6))
        report["interrupted"] = await generator.update_weights(DiskWeights(dirs[1]), 1)
        worst = 0.0
        for prompt, result in zip(prompts[:8], await asyncio.gather(*tasks)):
            assert result.finish_reason is FinishReason.LENGTH and 1 in result.versions
            for version in (0, 1):
                idx = [i for i, v in enumerate(result.versions) if v == version]
                want = trainer_lp(refs[version], prompt, result.token_ids, 1.0)[idx]
                worst = max(worst, max_diff([result.logprobs[i] for i in idx], want)[0])
        report["interrupted_parity_max"] = worst
        assert worst < ATOL, report

        # Stream mode: the trainer's tensors (on the GPU) bucketed, flattened, rebuilt.
        buckets = [unflatten_bucket(*flatten_bucket(b))
                   for b in bucket_tensors(named_tensors(refs[0]), 1 << 20)]
        await generator.update_weights(TensorWeights(merge_buckets(buckets)), 2)
        out = await engine.generate("s", prompts[1], SamplingParams(max_new_tokens=24,
                                                                    temperature=0.7))
        report["stream_parity_max"] = max_diff(out.logprobs,
                                               trainer_lp(refs[0], prompts[1], out.token_ids,
                                                          0.7))[0]
        assert report["stream_parity_max"] < ATOL, report
    finally:
        await engine.close()
    background_checkpoint(dirs[0], Path(tmp) / "run")


def background_checkpoint(model_dir, run_dir):
    """trainer.checkpoint_async from CUDA: DCP stages the state (and the published weights
    are copied) to CPU memory, the model trains on while the thread writes, and what loads
    back is the state at the checkpoint, not after."""
    def train(model, optimizer, seed):
        ids = torch.randint(3, 90, (4, 32), generator=torch.Generator().manual_seed(seed))
        model(ids.to(DEVICE)).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    model = load_model(model_dir, device=DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, 0)
    taken = {n: t.detach().cpu().clone() for n, t in model.named_parameters()}
    writer = BackgroundCheckpoints()
    t0 = time.perf_counter()
    writer.start(model, optimizer, run_dir, 1, 1, 2, list(model.named_parameters()),
                 save_tensors)
    report["checkpoint_async_wait_s"] = time.perf_counter() - t0
    for seed in (1, 2):  # in place, while the thread writes
        train(model, optimizer, seed)
    written = writer.wait()
    report["checkpoint_async_write_s"] = written.write_s
    fresh = load_model(model_dir, device=DEVICE)
    load_checkpoint(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), written.path)
    loaded = {n: t.detach().cpu() for n, t in fresh.named_parameters()}
    published = load_tensors(written.path / "weights")
    report["checkpoint_async_equal"] = all(
        torch.equal(loaded[n], t) and torch.equal(published[n].cpu(), t) for n, t in taken.items()
    )
    assert report["checkpoint_async_equal"], report


with tempfile.TemporaryDirectory() as tmp:
    asyncio.run(main(tmp))
print(json.dumps(report, indent=2))
Path("cuda_checks.json").write_text(json.dumps(report, indent=2))
EOF

VLLM_TESTS=()
if ((HAVE_VLLM)); then VLLM_TESTS=("$REPO/tests/workers/rollout/test_vllm_engine.py"); fi
phase pytest 150 "$PY" -m pytest -q -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  "$REPO/tests/areal/models" "$REPO/tests/workers/rollout/test_torch_engine.py" \
  "$REPO/tests/workers/rollout/test_interruptible_generation.py" "${VLLM_TESTS[@]}"

phase bench 100 "$PY" "$REPO/bench/engines.py" --device "$DEVICE" --engines vllm,torch,hf \
  --hidden-size 512 --layers 4 --requests 64 --new-tokens 128 --threads 4 --out bench

PLACEMENT=()
if [[ $DEVICE == cuda* ]]; then PLACEMENT=("rollout.devices=[cuda:0]" "trainer.devices=[cuda:0]"); fi
phase run 200 "$PY" -m areal.controller run_dir=run logging.progress=false "${PLACEMENT[@]}" \
  rollout.engine=auto trainer.total_steps=8 trainer.checkpoint_every=4 eval.every_steps=0 \
  eval.max_prompts=64 controller.heartbeat_timeout_s=120

if ((!HAVE_VLLM)); then echo "vllm: SKIPPED (vLLM is not importable here)" | tee -a summary.txt; fi
grep -h -A3 "^engine " bench.txt >> summary.txt 2>/dev/null
grep -h "held-out accuracy\|run finished\|tokens/s" run.txt >> summary.txt 2>/dev/null
grep -h '"event": "checkpoint"' run/metrics.jsonl >> summary.txt 2>/dev/null
echo "total $(($(date +%s) - START))s" | tee -a summary.txt
exit $FAILED
