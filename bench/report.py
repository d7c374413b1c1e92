"""Draw docs/benchmarks.png from the JSON bench.pipeline wrote: decode tokens/s against the number of
stages, one line per model, the one-process figure as a dashed line.

  python -m bench.report docs/pipeline.json docs/benchmarks.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: write a file
import matplotlib.pyplot as plt  # noqa: E402


def plot(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["model"] == model]
        single = next(r for r in rows if not r["stages"])
        piped = [r for r in rows if r["stages"]]
        line, = ax.plot([r["stages"] for r in piped], [r["tokens_per_s"] for r in piped], "o-", label=f"{model}: pipeline")
        ax.axhline(single["tokens_per_s"], ls="--", color=line.get_color(), label=f"{model}: one process")
    ax.set_xlabel("stages (processes on one machine)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["stages"] for r in data["rows"] if r["stages"]}))
    ax.set_title("Pipeline vs one process, same weights")
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    plot(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
