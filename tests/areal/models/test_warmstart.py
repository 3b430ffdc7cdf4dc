"""The warm-started embedded model: SFT numbers, the cache key, reuse and atomic publishing."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.config import RunConfig, load_config
from areal.models import warmstart
from areal.models.tiny import build_char_tokenizer, build_tiny_model
from areal.tasks import load_task

# An easy setting (a+d*k with k <= 2, one-digit a) that a few hundred steps can learn.
EASY = [
    "task.params.max_a=9",
    "task.params.min_k=1",
    "task.params.max_k=2",
    "task.params.num_eval=48",
    "task.params.sft_direct_fraction=0.0",
]


def _cfg(cache_dir: Path, *overrides: str) -> RunConfig:
    return load_config(
        None,
        [
            f"cache_dir={cache_dir}",
            "model.warmstart.steps=4",
            "model.warmstart.batch_size=8",
            *EASY,
            *overrides,
        ],
    )


def test_loss_mask_covers_the_completion_and_eos_only():
    tokenizer = build_char_tokenizer()
    ((ids, targets),) = warmstart.encode_sft(tokenizer, ["1+2*1=?\n"], ["#3"])
    assert targets == [False] * 8 + [True] * 3
    assert ids[-1] == tokenizer.eos_token_id and len(ids) == 11
    short = warmstart.encode_sft(tokenizer, ["9+9*1=?\n"], ["#18"])[0]
    input_ids, attention, loss_mask = warmstart.collate([short, (ids, targets)], 0)
    # row 1 is the shorter one, right-padded; targets are input_ids[:, 1:]
    assert attention[1].tolist() == [1] * 11 + [0]
    assert loss_mask[1].tolist() == [0] * 7 + [1, 1, 1] + [0]
    assert loss_mask[0].tolist() == [0] * 7 + [1, 1, 1, 1]
    targets = input_ids[0, 1:][loss_mask[0].bool()]
    assert tokenizer.decode(targets[:-1]) == "#18" and targets[-1] == tokenizer.eos_token_id


def test_an_episode_trains_on_model_text_only():
    tokenizer = build_char_tokenizer()
    segments = (("[2*3]", True), ("=6\n", False), ("#6", True))
    ((ids, targets),) = warmstart.encode_sft(tokenizer, ["2*3=?\n"], [segments])
    assert tokenizer.decode(ids[:-1]) == "2*3=?\n[2*3]=6\n#6" and ids[-1] == tokenizer.eos_token_id
    assert targets == [False] * 6 + [True] * 5 + [False] * 3 + [True] * 2 + [True]
    _, _, loss_mask = warmstart.collate([(ids, targets)], 0)
    assert loss_mask[0].tolist() == [float(t) for t in targets[1:]]


def test_length_buckets_give_the_loss_and_gradient_of_one_padded_batch():
    tokenizer = build_char_tokenizer()
    task = load_task("arithmetic", {"sft_direct_fraction": 0.5})
    examples = task.sft_examples(0, 24)
    batch = warmstart.encode_sft(
        tokenizer, [e.prompt.text for e in examples], [e.completion for e in examples]
    )
    assert len(warmstart.length_buckets(batch)) >= 2
    model = build_tiny_model(load_config().model.tiny, len(tokenizer), 1, 0, seed=3)

    model.zero_grad()
    bucketed = warmstart.batch_loss(model, batch, tokenizer.pad_token_id)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    num_tokens = sum(sum(targets) for _, targets in batch)
    padded = warmstart.completion_nll(model, *warmstart.collate(batch, 0)) / num_tokens
    padded.backward()
    diffs = [
        (g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters(), strict=True)
    ]
    print(f"loss {bucketed.item():.6f} vs {padded.item():.6f}; grad max diff {max(diffs):.2e}")
    assert bucketed.item() == pytest.approx(padded.item(), rel=1e-5)
    assert max(diffs) < 1e-5


def test_key_changes_with_every_input_and_only_with_those(tmp_path):
    base = _cfg(tmp_path)
    assert warmstart.warm_key(base) == warmstart.warm_key(_cfg(tmp_path))
    variants = [
        "model.tiny.hidden_size=256",
        "model.tiny.num_layers=1",
        "model.warmstart.lr=1e-3",
        "model.warmstart.steps=5",
        "model.warmstart.batch_size=4",
        "task.params.max_k=3",
        "task.params.sft_direct_fraction=0.5",
        "seed=2",
    ]
    keys = {warmstart.warm_key(_cfg(tmp_path, v)) for v in variants}
    assert len(keys) == len(variants) and warmstart.warm_key(base) not in keys
    # things that do not shape the warm model leave the key alone
    unrelated = _cfg(tmp_path, "rollout.temperature=0.7", "trainer.lr=1e-5", "eval.num_samples=4")
    assert warmstart.warm_key(unrelated) == warmstart.warm_key(base)


def test_key_changes_when_the_task_code_changes(tmp_path, monkeypatch):
    module = tmp_path / "my_sft_task.py"
    module.write_text("from areal.tasks.arithmetic import ArithmeticTask as Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg(tmp_path, "task.name=my_sft_task:Mine")
    before = warmstart.warm_key(cfg)
    module.write_text("from areal.tasks.arithmetic import ArithmeticTask as Mine\n# edited\n")
    assert warmstart.warm_key(cfg) != before


def test_second_call_reuses_the_cached_model(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    builds = warmstart.num_builds
    path = warmstart.ensure_warm_model(cfg)
    assert warmstart.num_builds == builds + 1 and warmstart.is_complete(path)
    weights = path / "model.safetensors"
    stamp = (weights.stat().st_mtime_ns, (path / warmstart.METADATA_FILE).read_text())

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached warm model was rebuilt")

    monkeypatch.setattr(warmstart, "build_warm_model", no_rebuild)
    assert warmstart.ensure_warm_model(cfg) == path
    assert warmstart.num_builds == builds + 1
    assert (weights.stat().st_mtime_ns, (path / warmstart.METADATA_FILE).read_text()) == stamp
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.lock"]
    # it is a normal Hugging Face directory
    model = AutoModelForCausalLM.from_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).eos_token_id == model.config.eos_token_id


def test_an_unpublished_leftover_is_rebuilt(tmp_path):
    cfg = _cfg(tmp_path)
    leftover = warmstart.warm_model_dir(cfg)
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half a model")
    path = warmstart.ensure_warm_model(cfg)
    assert path == leftover and warmstart.is_complete(path)
    assert AutoModelForCausalLM.from_pretrained(path) is not None


def _build_in_child(cache_dir: str) -> tuple[str, int]:
    cfg = _cfg(Path(cache_dir), "model.warmstart.steps=30")
    path = warmstart.ensure_warm_model(cfg)
    return str(path), warmstart.num_builds


@pytest.mark.slow
def test_concurrent_processes_build_once_and_never_see_half_a_model(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_in_child, [str(tmp_path)] * 2)
    paths, builds = zip(*results, strict=True)
    assert len(set(paths)) == 1 and sum(builds) == 1
    path = Path(paths[0])
    assert warmstart.is_complete(path)
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


@torch.no_grad()
def _greedy_accuracy(path: Path, task) -> float:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = task.eval_prompts()
    tokenizer.padding_side = "left"
    batch = tokenizer(
        [p.text for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False
    )
    out = model.generate(
        **batch,
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = [task.reward(t, p.reference).reward for t, p in zip(texts, prompts, strict=True)]
    return sum(rewards) / len(rewards)


@pytest.mark.slow
def test_warm_start_lowers_the_loss_and_beats_the_random_model(tmp_path):
    trained_cfg = _cfg(tmp_path, "model.warmstart.steps=300", "model.warmstart.batch_size=32")
    random_cfg = _cfg(tmp_path, "model.warmstart.steps=0")
    task = load_task(trained_cfg.task.name, trained_cfg.task.params)
    trained = warmstart.ensure_warm_model(trained_cfg)
    meta = json.loads((trained / warmstart.METADATA_FILE).read_text())
    before, after = (
        _greedy_accuracy(warmstart.ensure_warm_model(random_cfg), task),
        _greedy_accuracy(trained, task),
    )
    print(
        f"SFT loss {meta['loss_first']:.3f} -> {meta['loss_last']:.3f} in {meta['seconds']} s; "
        f"held-out greedy accuracy {before:.2f} -> {after:.2f}"
    )
    assert meta["loss_last"] < 0.3 * meta["loss_first"]
    assert after >= before + 0.3
