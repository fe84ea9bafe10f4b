"""`--report DIR`: the report as JSON plus PNG plots a person can look at.

matplotlib is imported here only, with the Agg backend, so nothing else pays for it.
"""

from __future__ import annotations

from pathlib import Path

from distdoctor.probe.report import Report


def write_report(report: Report, directory: str | Path) -> list[Path]:
    """Write report.json, loss.png and bandwidth.png (when the evidence exists); return the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json"]
    written[0].write_text(report.to_json())
    checks = {check.id: check for check in report.checks}
    loss = checks.get("convergence") or checks.get("loss")
    bandwidth = checks.get("bandwidth")
    if (loss and "loss_per_rank" in loss.details) or (bandwidth and "sizes" in bandwidth.details):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if loss and "loss_per_rank" in loss.details:
            written.append(_plot_loss(plt, loss.details, out / "loss.png"))
        if bandwidth and "sizes" in bandwidth.details:
            written.append(_plot_bandwidth(plt, bandwidth.details, report.backend, out / "bandwidth.png"))
    return written


def _plot_loss(plt, details: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for rank, losses in sorted(details["loss_per_rank"].items(), key=lambda kv: int(kv[0])):
        ax.plot(range(1, len(losses) + 1), losses, marker=".", label=f"rank {rank}")
    if details.get("mean_loss"):
        ax.plot(range(1, len(details["mean_loss"]) + 1), details["mean_loss"], "k-", lw=2, alpha=0.5,
                label="mean over ranks (compared)")
    if details.get("reference_loss"):
        ref = details["reference_loss"]
        ax.plot(range(1, len(ref) + 1), ref, "k--", label="single-process reference")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss per rank against the single-process reference" if details.get("reference_loss")
                 else "loss per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_bandwidth(plt, details: dict, backend: str, path: Path) -> Path:
    sizes = details["sizes"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([row["bytes"] for row in sizes], [row["busbw_GBps"] for row in sizes], marker="o", label="busbw")
    ax.plot([row["bytes"] for row in sizes], [row["algbw_GBps"] for row in sizes], marker=".", ls=":", label="algbw")
    if details.get("link_peak_GBps"):
        ax.axhline(details["link_peak_GBps"], color="grey", ls="--", label="link peak")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"all_reduce bus bandwidth ({backend})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
