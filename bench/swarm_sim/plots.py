"""PNG plots of a run (matplotlib: ``pip install -e .[sim]``): per model, the placement's max
flow against the LP bound over the simulated time, and the distribution of per-request tok/s."""

from __future__ import annotations

from pathlib import Path


def plot(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r["model"] for r in results))
    peers = results[0]["peers"]
    stem = "+".join(models)
    written = []

    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model]
        bound_drawn = False
        for r in rows:
            t = [s["t"] / 60 for s in r["samples"]]
            if not bound_drawn:
                ax.plot(t, [s["bound"] / 1000 for s in r["samples"]], "k--", label="LP bound (any placement)")
                bound_drawn = True
            ax.plot(t, [s["flow"] / 1000 for s in r["samples"]], label=f"{r['policy']}: placement max flow")
        ax.set_title(f"{model}, {peers} peers")
        ax.set_xlabel("simulated minutes")
        ax.set_ylabel("thousand tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    written.append(_save(plt, fig, out / f"swarm_sim_{peers}_{stem}_flow.png"))

    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in results if r["model"] == model):
            pairs = sorted(r.get("rates", []))
            if not pairs:
                continue
            total = sum(w for _, w in pairs)
            xs, ys, acc = [], [], 0
            for v, w in pairs:
                acc += w
                xs.append(v)
                ys.append(acc / total)
            ax.plot(xs, ys, label=r["policy"])
        ax.set_xscale("log")
        ax.set_title(f"{model}, {peers} peers: per-request decode speed")
        ax.set_xlabel("tokens/s of a request (log)")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7)
    written.append(_save(plt, fig, out / f"swarm_sim_{peers}_{stem}_request_speed.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
