"""Teacher-forced KL against physical compression for the two importance rules (importance_kl.jsonl).

    .venv/bin/python benchmarks/accuracy/plot_importance_kl.py   # writes importance_kl.png next to this file
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows = [json.loads(line) for line in (HERE / "importance_kl.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 4))
    for peak, label, color in ((False, "mean (paper) + score_after_window", "tab:green"),
                               (True, "peak + score_after_window", "tab:purple")):
        pts = sorted((r["compression_physical"], r["kl"], r["cfg"].split("+")[0]) for r in rows
                     if ("+p" in r["cfg"]) == peak)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label)
        for x, y, name in pts:
            ax.annotate(name.replace("profile", "x1").replace("x1*", "x"), (x, y), textcoords="offset points",
                        xytext=(4, -10), fontsize=7, color=color)
    ax.set_xlabel("physical compression (x fp16)")
    ax.set_ylabel("KL(full || cache), nats per token")
    ax.set_title("qwen2.5-0.5b, 4 GSM8K answers x 256 tokens, teacher-forced\n"
                 "shipped profile thresholds x S, compact_meta", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "importance_kl.png", dpi=120)


if __name__ == "__main__":
    main()
