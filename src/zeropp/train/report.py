"""What a run leaves behind for a person: the loss plot and the summary table."""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def summarize(name: str, result: dict) -> dict:
    h = result["history"]
    vals = [r["val_loss"] for r in h if "val_loss" in r]
    steady = [r["tokens_per_s"] for r in h[1:]] or [h[0]["tokens_per_s"]]
    inter = statistics.mean(r["inter_node_bytes"] for r in h)
    z3 = result["zero3_inter_node_bytes"]
    return {"config": name, "steps": len(h), "final_train_loss": h[-1]["train_loss"],
            "final_val_loss": vals[-1] if vals else float("nan"),
            "tokens_per_s": statistics.median(steady), "inter_node_MB_per_step": inter / 1e6,
            "vs_zero3_analytic": inter / z3 if z3 else float("nan"),
            "skipped_steps": result["skipped"]}


def table(rows: list[dict]) -> str:
    head = ("| config | steps | final val loss | final train loss | tokens/s | "
            "inter-node MB/step/node | vs ZeRO-3 analytic | skipped |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = r["vs_zero3_analytic"]
        lines.append(f"| {r['config']} | {r['steps']} | {r['final_val_loss']:.4f} | "
                     f"{r['final_train_loss']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['inter_node_MB_per_step']:.2f} | "
                     f"{'n/a (one node)' if math.isnan(vs) else f'{vs:.3f}'} | "
                     f"{r['skipped_steps']} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> bool:
    """Train loss (lines) and validation loss (markers) per configuration.
    Returns False (and draws nothing) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, h in curves.items():
        line, = ax.plot([r["step"] for r in h], [r["train_loss"] for r in h], lw=1,
                        alpha=0.8, label=f"{name} train")
        v = [(r["step"], r["val_loss"]) for r in h if "val_loss" in r]
        if v:
            ax.plot(*zip(*v), "o--", color=line.get_color(), ms=4, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_replicas(groups: dict[int, list[dict]], path: Path, title: str) -> bool:
    """`zeropp train --replicas`: each group's loss, the participants of every sync
    and the cross-node MB each step, one panel each."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, axp, axb) = plt.subplots(3, 1, figsize=(8, 7), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 1, 1]})
    for g, rows in groups.items():
        color = f"C{g}"
        for k in sorted({r["attempt"] for r in rows}):  # a restarted group: from its heal on
            seg = [r for r in rows if r["attempt"] == k]
            first = next((i for i, r in enumerate(seg) if r["committed"]), 0) if k else 0
            seg = seg[first:]
            label = f"replica {g}" if k == 0 else None
            ax.plot([r["step"] for r in seg], [r["train_loss"] for r in seg], lw=1, alpha=0.8,
                    color=color, label=label and f"{label} train")
            v = [(r["step"], r["val_loss"]) for r in seg if "val_loss" in r]
            if v:
                ax.plot(*zip(*v), "o", color=color, ms=4, label=label and f"{label} val")
            p = [(r["step"], r["participants"]) for r in seg if r.get("participants")]
            if p:
                axp.step(*zip(*p), where="post", color=color, label=label)
            axb.plot([r["step"] for r in seg], [r["cross_node_bytes"] / 1e6 for r in seg],
                     lw=1, color=color)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    axp.set_ylabel("participants")
    axb.set_ylabel("cross-node MB")
    axb.set_xlabel("step")
    for a in (ax, axp, axb):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
