"""PNG plot of a run's metrics.jsonl rows: loss (SFT and GRPO) and GRPO reward per step."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_metrics(rows: list[dict], path: str | Path) -> Path:
    fig, (ax_loss, ax_reward) = plt.subplots(1, 2, figsize=(10, 4))
    for phase, color in (("sft", "tab:blue"), ("grpo", "tab:orange")):
        pts = [(r["step"], r["loss"]) for r in rows if r["phase"] == phase]
        if pts:
            ax_loss.plot(*zip(*pts, strict=True), color=color, label=phase)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    pts = [(r["step"], r["reward_mean"]) for r in rows if r["phase"] == "grpo"]
    if pts:  # markers too: a single step, or a run at a constant reward, still shows
        ax_reward.plot(*zip(*pts, strict=True), color="tab:green", marker=".")
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("mean reward (GRPO samples)")
    ax_reward.set_ylim(-0.05, 1.05)  # a reward of exactly 0 or 1 off the frame's edge
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
