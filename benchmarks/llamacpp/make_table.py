"""Print the markdown table of results.json (for README.md): speeds, KV bytes and the ratios to f16.

    python3 benchmarks/llamacpp/make_table.py [results.json]

Ratios are taken against the f16 run of the same model and prompt length with flash attention on and the
default rotation (the like-for-like baseline: llama.cpp only allows a quantized V cache with flash attention).
"same tokens" = how many of the greedy tokens (first one from the prefill + the decoded ones) equal the f16 run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MiB = 1024 * 1024


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results.json"
    records = json.loads(path.read_text())
    base = {(r["model"], r["prompt_tokens"]): r for r in records
            if r["kv_type"] == "f16" and r["flash_attn"] and not r.get("attn_rot_disabled_env", False)}
    print("| model | prompt | KV | flash attn | KV rotation | decode tok/s median (range of 3) | tok/CPU-s | "
          "speed vs f16 | KV MiB formula (log) | KV vs f16 | RSS MiB | prefill s | same tokens as f16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        b = base.get((r["model"], r["prompt_tokens"]))
        rot = r.get("kv_attn_rot", {})
        rot_txt = "off (env)" if r.get("attn_rot_disabled_env") else ("on" if any(rot.values()) else "n/a")
        same = "-"
        if b is not None and b is not r:
            pairs = zip(r["generated_ids"], b["generated_ids"], strict=True)
            same = next((i for i, (x, y) in enumerate(pairs) if x != y), len(r["generated_ids"]))
            same = f"{same}/{len(r['generated_ids'])}"
        speed = f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}" if b else "-"
        kvr = f"{r['kv_bytes_formula'] / b['kv_bytes_formula']:.4f}" if b else "-"
        spread = r.get("decode_tokens_per_s_each")
        tps = f"{r['decode_tokens_per_s']:.2f}" + (f" ({min(spread):.2f}-{max(spread):.2f})" if spread else "")
        print(f"| {r['model']} | {r['prompt_tokens']} | {r['kv_type']} | {'on' if r['flash_attn'] else 'off'} | "
              f"{rot_txt} | {tps} | {r['decode_tokens_per_cpu_s']:.2f} | {speed} | "
              f"{r['kv_bytes_formula'] / MiB:.2f} ({r.get('kv_log_total_mib')}) | {kvr} | "
              f"{r['rss_bytes'] / MiB:.0f} | {r['prefill_wall_s']:.0f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
