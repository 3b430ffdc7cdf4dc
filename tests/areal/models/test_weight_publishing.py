"""Weight publishing: checkpoint names, atomic save/load, in-place copy, buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import areal.models.weights as weights
from areal.config import TinyModelConfig
from areal.models.hf import load_model
from areal.models.tiny import build_char_tokenizer, build_tiny_model
from areal.models.weights import (
    WeightMismatchError,
    bucket_tensors,
    copy_into_model,
    flatten_bucket,
    load_tensors,
    merge_buckets,
    named_tensors,
    save_tensors,
    unflatten_bucket,
)


def _tiny(seed: int):
    tokenizer = build_char_tokenizer()
    return build_tiny_model(
        TinyModelConfig(), len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=seed
    )


def _odd_tensors() -> dict[str, torch.Tensor]:
    """Dtypes, a 0-dim, an empty and a non-contiguous tensor."""
    generator = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(3, 5, generator=generator).bfloat16(),
        "b.f32": torch.randn(7, generator=generator),
        "c.f16": torch.randn(2, 2, 2, generator=generator).half(),
        "d.i64": torch.arange(5),
        "e.bool": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.zeros(0, 4),
        "h.transposed": torch.randn(4, 3, generator=generator).t(),
    }


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), f"{sorted(got)} != {sorted(want)}"
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs"


@pytest.mark.parametrize("name", ["qwen2", "llama", "gpt2", "gemma2"])
def test_named_tensors_use_the_checkpoint_names(model_dirs, name: str) -> None:
    """Names (tied lm_head left out where tied) equal the keys save_pretrained wrote."""
    model = load_model(model_dirs[name])
    with safe_open(model_dirs[name] / "model.safetensors", "pt") as checkpoint:
        keys = set(checkpoint.keys())
    names = [n for n, _ in named_tensors(model)]
    assert len(names) == len(set(names))
    assert set(names) == keys
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ("lm_head.weight" in names) == (not tied)


def test_named_tensors_refuse_models_with_converted_layout() -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_experts=2,
            num_experts_per_tok=1,
            shared_expert_intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.mlp\.experts\.\w+'"):
        list(named_tensors(model))


def test_save_load_round_trip_is_bitwise(tmp_path: Path) -> None:
    tensors = _odd_tensors()
    path = save_tensors(tmp_path / "v1", tensors, metadata={"version": "1"})
    assert path == tmp_path / "v1" / "model.safetensors"
    _assert_same_tensors(load_tensors(tmp_path / "v1"), tensors)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "version": "1"}
    assert [p.name for p in (tmp_path / "v1").iterdir()] == ["model.safetensors"]
    assert path.stat().st_mode & 0o777 == 0o644, "other users (rollout workers) must read it"


def test_model_round_trip_through_disk_is_bitwise(tmp_path: Path) -> None:
    model = _tiny(seed=3)
    save_tensors(tmp_path, named_tensors(model))
    loaded = load_tensors(tmp_path)
    _assert_same_tensors(loaded, dict(named_tensors(model)))


def test_tied_weights_passed_under_both_names_are_saved(tmp_path: Path) -> None:
    model = _tiny(seed=0)
    state = dict(model.named_parameters(remove_duplicate=False))
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    save_tensors(tmp_path, state)
    loaded = load_tensors(tmp_path)
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch) -> None:
    save_tensors(tmp_path, {"w": torch.ones(4)})

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a header")
        raise OSError("disk full")

    monkeypatch.setattr(weights, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_tensors(tmp_path, {"w": torch.zeros(4)})
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert torch.equal(load_tensors(tmp_path)["w"], torch.ones(4))


def test_reader_during_a_save_sees_the_previous_complete_file(tmp_path, monkeypatch) -> None:
    """Freeze the writer half way through its file and read the directory at that moment."""
    save_tensors(tmp_path, {"w": torch.full((1000,), 1.0)})
    real_save_file, seen_mid_write = weights.save_file, []

    def half_written_then_read(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        seen_mid_write.append(load_tensors(tmp_path)["w"])  # a reader arrives now
        Path(filename).write_bytes(data)

    monkeypatch.setattr(weights, "save_file", half_written_then_read)
    save_tensors(tmp_path, {"w": torch.full((1000,), 2.0)})
    assert torch.equal(seen_mid_write[0], torch.full((1000,), 1.0))
    assert torch.equal(load_tensors(tmp_path)["w"], torch.full((1000,), 2.0))


def test_load_tensors_names_a_missing_or_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'v9'}.*does not exist"):
        load_tensors(tmp_path / "v9")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*no \*.safetensors"):
        load_tensors(tmp_path)


def test_load_tensors_reads_a_sharded_checkpoint(tmp_path: Path) -> None:
    model = _tiny(seed=4)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same_tensors(load_tensors(tmp_path), dict(named_tensors(model)))


def test_copy_into_model_matches_a_model_built_from_the_weights(tmp_path, assert_close) -> None:
    target, source = _tiny(seed=0), _tiny(seed=1)
    source.save_pretrained(tmp_path)
    reference = load_model(tmp_path)
    params_before = dict(target.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.AdamW(target.parameters())
    ids = torch.tensor([[5, 17, 30, 42, 8]])
    with torch.no_grad():
        old = target(ids).logits
    copy_into_model(target, load_tensors(tmp_path))
    with torch.no_grad():
        assert_close(target(ids).logits, reference(ids).logits, what="updated vs rebuilt logits")
        assert (target(ids).logits - old).abs().max() > 1e-3
    for name, param in target.named_parameters(remove_duplicate=False):
        assert param is params_before[name], f"{name} was replaced, not updated"
    assert optimizer.param_groups[0]["params"][0] is target.model.embed_tokens.weight
    assert target.lm_head.weight is target.model.embed_tokens.weight, "tie broken"


def test_copy_into_model_converts_dtype(assert_close) -> None:
    target, source = _tiny(seed=0).bfloat16(), _tiny(seed=1)
    copy_into_model(target, named_tensors(source))
    for (name, got), (_, want) in zip(named_tensors(target), named_tensors(source), strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want.bfloat16()), name


def test_copy_into_model_accepts_the_tied_alias() -> None:
    target, source = _tiny(seed=0), _tiny(seed=1)
    tensors = dict(named_tensors(source))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    copy_into_model(target, tensors)
    assert torch.equal(target.model.embed_tokens.weight, source.model.embed_tokens.weight)


def _unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_mismatches_name_the_tensor_and_change_nothing() -> None:
    target, source = _tiny(seed=0), _tiny(seed=1)
    before = {n: p.clone() for n, p in target.named_parameters()}
    good = dict(named_tensors(source))
    cases = [
        (
            {**good, "model.layers.0.mlp.gate.weight": torch.zeros(1)},
            r"tensor 'model\.layers\.0\.mlp\.gate\.weight' is not a parameter of Qwen2ForCausalLM",
        ),
        (
            {**good, "model.norm.weight": torch.zeros(7)},
            r"tensor 'model\.norm\.weight' has shape \(7,\), the model's parameter has \(128,\)",
        ),
        (
            {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
            r"no tensor for parameter 'model\.layers\.1\.mlp\.up_proj\.weight' \(1 parameters",
        ),
        (
            {**good, "lm_head.weight": torch.zeros_like(good["model.embed_tokens.weight"])},
            r"'model\.embed_tokens\.weight' and 'lm_head\.weight' are tied in the model but differ",
        ),
    ]
    for tensors, message in cases:
        with pytest.raises(WeightMismatchError, match=message):
            copy_into_model(target, tensors)
        assert _unchanged(target, before), f"model changed by a refused update ({message})"
    with pytest.raises(WeightMismatchError, match=r"'model\.norm\.weight' is given twice"):
        copy_into_model(target, [("model.norm.weight", torch.ones(128))] * 2, strict=False)


def test_partial_update_with_strict_false() -> None:
    target, source = _tiny(seed=0), _tiny(seed=1)
    before = {n: p.clone() for n, p in target.named_parameters()}
    copy_into_model(target, {"model.norm.weight": source.model.norm.weight}, strict=False)
    for name, param in target.named_parameters():
        want = source.model.norm.weight if name == "model.norm.weight" else before[name]
        assert torch.equal(param, want), name


def test_streamed_update_in_buckets_equals_a_full_update(assert_close) -> None:
    target, source = _tiny(seed=0), _tiny(seed=1)
    for bucket in bucket_tensors(named_tensors(source), max_bytes=64 * 1024):
        buffer, specs = flatten_bucket(bucket)
        copy_into_model(target, unflatten_bucket(buffer.clone(), specs), strict=False)
    for (name, got), (_, want) in zip(named_tensors(target), named_tensors(source), strict=True):
        assert torch.equal(got, want), name


def _sized(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=25), max_bytes=st.integers(1, 120))
def test_buckets_respect_the_limit_and_reassemble(sizes: list[int], max_bytes: int) -> None:
    tensors = _sized(sizes)
    buckets = list(bucket_tensors(tensors, max_bytes))
    for bucket in buckets:
        total = sum(t.numel() * t.element_size() for _, t in bucket)
        assert bucket and (total <= max_bytes or len(bucket) == 1), (
            f"bucket of {len(bucket)} tensors holds {total} > {max_bytes} bytes"
        )
    flat = [name for bucket in buckets for name, _ in bucket]
    assert flat == [name for name, _ in tensors], "order changed or tensors lost"
    for first, second in zip(
        buckets, buckets[1:], strict=False
    ):  # greedy: the next tensor did not fit
        size = second[0][1].numel() * second[0][1].element_size()
        assert sum(t.numel() * t.element_size() for _, t in first) + size > max_bytes
    merged = merge_buckets(buckets)
    assert all(merged[name] is tensor for name, tensor in tensors)


def test_flat_bucket_round_trip_is_bitwise_and_aligned() -> None:
    tensors = _odd_tensors()
    buffer, specs = flatten_bucket(tensors.items())
    assert buffer.dtype == torch.uint8
    assert all(spec.offset % 16 == 0 for spec in specs)
    assert buffer.numel() < sum(s.num_bytes for s in specs) + 16 * len(specs)
    _assert_same_tensors(dict(unflatten_bucket(buffer, specs)), tensors)


def test_flat_bucket_refuses_bad_specs() -> None:
    buffer, specs = flatten_bucket([("w", torch.ones(4))])
    with pytest.raises(ValueError, match=r"tensor 'w' ends at byte 16, past the bucket's 8"):
        unflatten_bucket(buffer[:8], specs)
    bad = [weights.TensorSpec(name="w", dtype="float99", shape=(4,), offset=0, num_bytes=16)]
    with pytest.raises(ValueError, match=r"tensor 'w': unknown dtype 'float99'"):
        unflatten_bucket(buffer, bad)


def test_merge_refuses_a_name_in_two_buckets() -> None:
    with pytest.raises(WeightMismatchError, match=r"tensor 'w' appears in two buckets"):
        merge_buckets([[("w", torch.ones(1))], [("w", torch.ones(1))]])


def test_bucket_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"max_bytes=0 must be >= 1"):
        list(bucket_tensors({"w": torch.ones(1)}, 0))


def test_pruning_never_removes_the_version_just_published(tmp_path: Path) -> None:
    """A resumed run publishes v5 again while the stopped run's v6 and v7 are still there
    (before the resume removes them): v5 must survive its own pruning."""
    from areal.config import load_config
    from areal.workers.trainer.publish import publish_to_disk

    cfg = load_config(overrides=[f"run_dir={tmp_path}", "weight_sync.keep_versions=2"])
    tensors = [("w", torch.zeros(2))]
    for version in (3, 4, 6, 7):
        publish_to_disk(tensors, cfg, version)
    published = publish_to_disk(tensors, cfg, 5)
    assert Path(published).is_dir()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "v000005",
        "v000006",
        "v000007",
    ]
