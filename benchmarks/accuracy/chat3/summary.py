"""Per method: cases run, pass keys found in turn 3, physical compression range (``results.jsonl`` of chat3.py).

    python benchmarks/accuracy/chat3/summary.py
"""

import json
from pathlib import Path

rows = [json.loads(line) for line in (Path(__file__).parent / "results.jsonl").read_text().splitlines()]
print("| method | cases | pass key found | physical compression |\n|---|---|---|---|")
for method in sorted({r["method"] for r in rows}):
    rs = [r for r in rows if r["method"] == method]
    comp = [r["compression_physical"] for r in rs]
    print(f"| `{method}` | {len(rs)} | {sum(r['correct'] for r in rs)} | {min(comp):.2f}-{max(comp):.2f}x |")
