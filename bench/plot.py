"""Throughput and latency against concurrency, one line per server (matplotlib, PNG)."""

from __future__ import annotations


def plot_levels(
    series: dict[str, list[tuple[int, dict]]],
    path: str,
    title: str = "",
    ceiling: list[tuple[int, float]] | None = None,
) -> None:
    """`series`: server -> [(concurrency, serve.py summary)]; `ceiling`: the float32 roofline."""
    import matplotlib

    matplotlib.use("Agg")  # no display; writes files only
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, points in series.items():
        points = sorted(points, key=lambda p: p[0])
        levels = [c for c, _ in points]
        ax_tp.plot(levels, [s["output_throughput"] for _, s in points], "o-", label=name)
        ax_ttft.plot(levels, [s["ttft_s"]["p50"] for _, s in points], "o-", label=name)
        ax_tpot.plot(levels, [1000 * s["tpot_s"]["p50"] for _, s in points], "o-", label=name)
    if ceiling:
        ax_tp.plot(*zip(*ceiling, strict=True), "k--", label="float32 ceiling")
    for ax, label in (
        (ax_tp, "output tokens/s"),
        (ax_ttft, "TTFT p50 (s)"),
        (ax_tpot, "TPOT p50 (ms)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_tp.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
