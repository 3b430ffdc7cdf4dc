"""LoRA adapters on the tiny models (areal.models.lora), checked against PEFT itself: the
adapter directory we write is one `PeftModel.from_pretrained` loads to the same logits; the
merge equals PEFT's `merge_and_unload`; only adapters train; the same seed gives the same
initial adapters on every rank; bad adapter sets are refused before anything is copied."""

from __future__ import annotations

import pytest
import torch

from areal.config import LoraConfig
from areal.models.hf import load_model
from areal.models.lora import (
    AdapterMismatchError,
    add_adapters,
    adapter_shapes,
    adapter_tensors,
    copy_adapters,
    file_name,
    is_adapter_dir,
    load_adapter_dir,
    merge_into_base,
    param_name,
    peft_config,
    save_adapter_dir,
)
from areal.models.weights import load_tensors

LORA = LoraConfig(rank=4, alpha=8.0)


def _randomise(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        n: torch.randn(t.shape, generator=generator) * 0.1 for n, t in adapter_tensors(model)
    }
    copy_adapters(model, tensors)
    return tensors


def test_only_adapters_train_and_start_at_the_base(tiny_dir, assert_close):
    base = load_model(tiny_dir)
    model = add_adapters(load_model(tiny_dir), LORA, seed=3).eval()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * 7 * base.config.num_hidden_layers  # A and B of 7 projections
    ids = torch.tensor([[5, 9, 17, 33, 2, 60]])
    with torch.no_grad():
        assert_close(model(ids).logits, base(ids).logits, what="B = 0: exactly the base")
    again = add_adapters(load_model(tiny_dir), LORA, seed=3)
    other = add_adapters(load_model(tiny_dir), LORA, seed=4)
    ours, same, different = (dict(adapter_tensors(m)) for m in (model, again, other))
    assert all(torch.equal(ours[n], same[n]) for n in ours)  # every rank starts alike
    assert any(not torch.equal(ours[n], different[n]) for n in ours if "lora_A" in n)


def test_names_round_trip_and_match_the_shapes_of_the_checkpoint(tiny_dir):
    model = add_adapters(load_model(tiny_dir), LORA, seed=0)
    tensors = dict(adapter_tensors(model))
    assert all(n.startswith("base_model.model.model.layers.") for n in tensors)
    assert all(file_name(param_name(n)) == n for n in tensors)
    base_shapes = {n: tuple(t.shape) for n, t in load_tensors(tiny_dir).items()}
    expected = adapter_shapes(base_shapes, LORA)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    with pytest.raises(AdapterMismatchError, match="not named like a PEFT LoRA weight"):
        param_name("model.layers.0.self_attn.q_proj.weight")


def test_saved_directory_loads_in_peft_to_the_same_logits(tiny_dir, tmp_path, assert_close):
    from peft import PeftModel

    model = add_adapters(load_model(tiny_dir), LORA, seed=0).eval()
    tensors = _randomise(model, seed=1)
    save_adapter_dir(tmp_path / "adapter", adapter_tensors(model), LORA, base_model=str(tiny_dir))
    assert is_adapter_dir(tmp_path / "adapter") and not is_adapter_dir(tiny_dir)
    loaded = load_adapter_dir(tmp_path / "adapter")
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    peft_model = PeftModel.from_pretrained(load_model(tiny_dir), tmp_path / "adapter").eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, peft_model(ids).logits
        assert (ours - load_model(tiny_dir)(ids).logits).abs().max() > 1e-3  # the adapter acts
    assert_close(ours, theirs, what="our adapter directory in PEFT")


def test_merge_equals_peft_merge_and_unload(tiny_dir, assert_close):
    from peft import get_peft_model

    model = add_adapters(load_model(tiny_dir), LORA, seed=0).eval()
    tensors = _randomise(model, seed=2)
    merged = merge_into_base(load_tensors(tiny_dir), tensors, LORA)
    peft_model = get_peft_model(load_model(tiny_dir), peft_config(LORA))
    copy_adapters(peft_model.base_model.model, tensors)
    reference = peft_model.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert_close(tensor, reference[name], atol=1e-6, what=f"merged {name}")
    untouched = load_tensors(tiny_dir)
    assert torch.equal(merged["model.embed_tokens.weight"], untouched["model.embed_tokens.weight"])


def test_bad_adapter_sets_are_refused_before_any_copy(tiny_dir):
    model = add_adapters(load_model(tiny_dir), LORA, seed=0)
    before = {n: t.clone() for n, t in adapter_tensors(model)}
    good = {n: torch.ones_like(t) for n, t in before.items()}
    first = next(iter(good))
    cases = [
        (dict(good, **{first: torch.ones(3, good[first].shape[1])}), "has shape"),
        ({n: t for n, t in good.items() if n != first}, "no tensor for adapter weight"),
        (
            dict(good, **{"base_model.model.lm_head.lora_A.weight": torch.ones(4, 8)}),
            "no counterpart",
        ),
    ]
    for tensors, match in cases:
        with pytest.raises(AdapterMismatchError, match=match):
            copy_adapters(model, tensors)
    assert all(torch.equal(t, before[n]) for n, t in adapter_tensors(model))
    with pytest.raises(AdapterMismatchError, match="has no LoRA adapters"):
        copy_adapters(load_model(tiny_dir), good)
    with pytest.raises(ValueError, match="matches no layer"):
        add_adapters(load_model(tiny_dir), LoraConfig(rank=4, target_modules=["nope"]), seed=0)
