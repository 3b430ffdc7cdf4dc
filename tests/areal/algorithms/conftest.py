"""Shared helpers for the algorithm tests: tensor comparison that reports how far off it is."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def _assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    what: str = "values",
) -> None:
    """Fail with the max and mean absolute difference (and where the max is) when not close."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    if actual.numel() == 0:
        return
    diff = (actual.double() - expected.double()).abs()
    diff = torch.where(actual.double() == expected.double(), 0.0, diff)  # equal infinities
    bound = atol + rtol * expected.double().abs()
    bad = ~(diff <= bound)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())}/{diff.numel()} entries off; max |diff| = {diff.max().item():.3e} "
        f"at {int(diff.argmax())} (got {actual.flatten()[int(diff.argmax())].item()!r}, "
        f"want {expected.flatten()[int(diff.argmax())].item()!r}), mean |diff| = "
        f"{diff.mean().item():.3e}, atol={atol}, rtol={rtol}"
    )


@pytest.fixture(scope="session")
def assert_close() -> Callable[..., None]:
    """`assert_close(actual, expected, atol=, rtol=, what=)`; exact (0 tolerance) by default.

    Session-scoped so hypothesis tests may use it (it holds no state).
    """
    return _assert_close
