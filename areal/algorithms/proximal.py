"""Log-linear approximation of the proximal policy's log-probs (PPOConfig.prox_logp='loglinear').

Role: the decoupled PPO loss needs log pi_prox for every loss token, where pi_prox is the
trainer's policy at the start of the step. Recomputing it costs a forward pass; this module
instead interpolates, per token, between the behaviour log-prob recorded at generation and
the current log-prob, in proportion to how many versions separate them:

    log pi_prox ~= log pi_behav + alpha * (log pi_theta - log pi_behav)
    alpha = (v_theta - 1 - v_behav) / (v_theta - v_behav)

v_theta is the version of the policy being optimised (the trainer publishes its result as
v_theta), so the proximal policy is version v_theta - 1 and v_behav is the version that
sampled the token. A token sampled by the proximal policy itself (v_behav = v_theta - 1)
gets alpha = 0, its behaviour log-prob; older tokens move towards pi_theta, linearly in
version. alpha < 1 for every finite version, so alpha = 1 only arises through
`loglinear_interpolate`.

Contract: pure and differentiation-free (the result is detached: pi_prox must not carry a
gradient into the loss). Prompt tokens (version -1) are returned unchanged: they are never
in the loss, and no policy sampled them. A sampled token with v_behav >= v_theta is refused
with an error rather than clamped: it would mean the trainer passed the proximal version
instead of v_theta, or a rollout tagged tokens with unpublished weights, and silently
clamping would hide either bug.

It does not compute log-probs or decide when the approximation is good enough.
"""

from __future__ import annotations

import torch

from areal.types import PROMPT_VERSION


def loglinear_interpolate(
    behav_logprobs: torch.Tensor, theta_logprobs: torch.Tensor, alpha: torch.Tensor | float
) -> torch.Tensor:
    """[N] (1 - alpha) * behav + alpha * theta, detached; alpha is [N] or a scalar.

    Written as a weighted sum, not behav + alpha * (theta - behav), so that alpha = 0 gives
    behav and alpha = 1 gives theta bit for bit (for finite inputs).
    """
    behav, theta = behav_logprobs.detach(), theta_logprobs.detach()
    if behav.shape != theta.shape:
        raise ValueError(
            f"behav_logprobs {tuple(behav.shape)} and theta_logprobs {tuple(theta.shape)} "
            "must have the same shape"
        )
    alpha = torch.as_tensor(alpha, dtype=behav.dtype, device=behav.device)
    return (1 - alpha) * behav + alpha * theta


def loglinear_prox_logprobs(
    behav_logprobs: torch.Tensor,
    theta_logprobs: torch.Tensor,
    versions: torch.Tensor,
    theta_version: int,
) -> torch.Tensor:
    """[N] approximate log pi_prox from [N] behaviour and current log-probs and [N] versions.

    `theta_version` is v_theta, the version the current optimisation step will publish
    (the proximal policy is v_theta - 1). Tokens with version -1 keep their behaviour value.
    """
    if versions.shape != behav_logprobs.shape or versions.is_floating_point():
        raise ValueError(
            f"versions must be an integer tensor shaped like the log-probs "
            f"{tuple(behav_logprobs.shape)}, got {versions.dtype} {tuple(versions.shape)}"
        )
    is_prompt = versions == PROMPT_VERSION
    sampled = versions[~is_prompt]
    if len(sampled) and int(sampled.min()) < 0:
        raise ValueError(
            f"token version {int(sampled.min())} is invalid: versions are >= 0, or "
            f"{PROMPT_VERSION} for prompt tokens"
        )
    if len(sampled) and int(sampled.max()) >= theta_version:
        raise ValueError(
            f"token version {int(sampled.max())} >= theta_version={theta_version}: a token "
            "must be sampled by a policy older than the one being optimised. Pass v_theta = "
            "(version of the trainer's weights at the start of the step) + 1"
        )
    gap = (theta_version - versions).to(behav_logprobs.dtype)  # >= 1 on sampled tokens
    alpha = torch.where(is_prompt, 0.0, (gap - 1) / gap)
    interpolated = loglinear_interpolate(behav_logprobs, theta_logprobs, alpha)
    return torch.where(is_prompt, behav_logprobs.detach(), interpolated)
