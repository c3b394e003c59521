"""Summaries and the plot of a benchmarks/tune.py run."""

from __future__ import annotations

from pathlib import Path


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {
        "mean": round(sum(values) / len(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "n": len(values),
    }


def _loop(m: dict, key: str):
    return (m.get("loop_score") or {}).get(key)


def per_arm(arms: list[dict]) -> list[dict]:
    labels = list(dict.fromkeys(m["arm"] for m in arms))
    out = []
    for label in labels:
        ms = [m for m in arms if m["arm"] == label]
        row = {
            "arm": label,
            "goodput": spread([m["per_request"]["goodput_tokens_per_second"] for m in ms]),
            "throughput": spread([m["per_request"]["tokens_per_second"] for m in ms]),
            "loop_goodput": spread([_loop(m, "goodput_tokens_per_second") for m in ms]),
            "loop_throughput": spread([_loop(m, "tokens_per_second") for m in ms]),
            "itl_p99_s": spread([_loop(m, "itl_p99_s") for m in ms]),
            "ttft_p99_s": spread([_loop(m, "ttft_p99_s") for m in ms]),
            "requests_meeting_slo": [
                f"{m['per_request']['requests_meeting_slo']}/{m['per_request']['requests_seen']}"
                for m in ms
            ],
        }
        if label == "T":
            row["final_max_num_seqs"] = [m["final_max_num_seqs"] for m in ms]
            row["decisions"] = [
                [f"{d['action']} {d['kind']} -> {d['max_num_seqs']}" for d in m["decisions"]]
                for m in ms
            ]
            row["whole_run_goodput"] = spread(
                [m["whole_run"]["per_request"]["goodput_tokens_per_second"] for m in ms]
            )
        out.append(row)
    return out


def _phase(m: dict | None) -> dict | None:
    if not m:
        return None
    pr, ls = m["per_request"], m.get("loop_score") or {}
    return {
        "seconds": round(m["to"] - m["from"], 1),
        "goodput": round(pr["goodput_tokens_per_second"], 2),
        "throughput": round(pr["tokens_per_second"], 2),
        "loop_goodput": ls.get("goodput_tokens_per_second")
        and round(ls["goodput_tokens_per_second"], 2),
        "preemptions_per_minute": ls.get("preemptions_per_minute") is not None
        and round(ls["preemptions_per_minute"], 1),
    }


def _decisions(run: dict) -> list[str]:
    return [
        f"{d['time']:.0f}s {d['action']} {d['kind']} -> {d['max_num_seqs']}"
        for d in run["decisions"]
    ]


def summary(results: dict, args) -> dict:
    rows = per_arm(results["arms"])
    fixed = [r for r in rows if r["arm"] != "T"]
    best = max(fixed, key=lambda r: r["goodput"]["mean"] or 0.0)
    tuned = next(r for r in rows if r["arm"] == "T")
    out: dict = {
        "arms": rows,
        "best_fixed": best["arm"],
        "tuned_over_best_fixed_goodput": round(
            tuned["goodput"]["mean"] / best["goodput"]["mean"], 3
        )
        if best["goodput"]["mean"]
        else None,
    }
    start = next((r for r in fixed if r["arm"] == str(args.start)), None)
    if start and start["goodput"]["mean"]:
        out["tuned_over_start_goodput"] = round(
            tuned["goodput"]["mean"] / start["goodput"]["mean"], 3
        )
    if "thrash" in results:
        t = results["thrash"]
        out["thrash"] = {
            "decisions": _decisions(t),
            "before_first_decision": _phase(t.get("before_first_decision")),
            "after_last_verdict": _phase(t.get("after_last_verdict")),
            "final_max_num_seqs": t["final_max_num_seqs"],
        }
    if "noisy" in results:
        n = results["noisy"]
        trace = [p["max_num_seqs"] for p in n["timeline"]]
        out["noisy"] = {
            "start": n["start"],
            "final": n["final_max_num_seqs"],
            "lowest": min(trace) if trace else None,
            "decisions": _decisions(n),
            "lowers_kept": sum(
                1 for d in n["decisions"] if d["kind"] == "lower" and d["action"] == "keep"
            ),
            "lowers_reverted": sum(
                1 for d in n["decisions"] if d["kind"] == "lower" and d["action"] == "revert"
            ),
            "phases": [
                {"from": p["from"], "to": p["to"], "hog": p["hog"], **(_phase(p) or {})}
                for p in n["phases"]
            ],
        }
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = out["summary"]
    rows = s["arms"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    xs = range(len(rows))
    for offset, key, label, color in (
        (-0.2, "goodput", "goodput, per request", "C0"),
        (0.2, "loop_goodput", "goodput, as the loop scores it (/metrics)", "C2"),
    ):
        means = [r[key]["mean"] or 0 for r in rows]
        lo = [m - (r[key]["min"] or 0) for m, r in zip(means, rows, strict=True)]
        hi = [(r[key]["max"] or 0) - m for m, r in zip(means, rows, strict=True)]
        ax.bar([x + offset for x in xs], means, 0.4, yerr=[lo, hi], capsize=4, label=label,
               color=color)  # fmt: skip
    ax.set_xticks(list(xs), [f"mns {r['arm']}" if r["arm"] != "T" else "tuned" for r in rows])
    ax.set_ylabel("tokens/s within the SLO (mean, min-max)")
    slo = out["slo"]
    ax.set_title(f"goodput per arm; SLO TTFT {slo['ttft_seconds']} s, ITL {slo['itl_seconds']} s")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    means = [r["throughput"]["mean"] or 0 for r in rows]
    lo = [m - (r["throughput"]["min"] or 0) for m, r in zip(means, rows, strict=True)]
    hi = [(r["throughput"]["max"] or 0) - m for m, r in zip(means, rows, strict=True)]
    ax.bar(list(xs), means, 0.5, yerr=[lo, hi], capsize=4, color="C1")
    ax.set_xticks(list(xs), [f"mns {r['arm']}" if r["arm"] != "T" else "tuned" for r in rows])
    ax.set_ylabel("generation tokens/s (mean, min-max)")
    ax.set_title("throughput per arm (all tokens)")
    ax = axes[1][0]
    for i, m in enumerate(a for a in out["arms"] if a["arm"] == "T"):
        tl = m["timeline"]
        ax.step([p["time"] for p in tl], [p["max_num_seqs"] for p in tl], where="post",
                label=f"tuned, repeat {i + 1}")  # fmt: skip
    if "thrash" in out:
        tl = out["thrash"]["timeline"]
        ax.step([p["time"] for p in tl], [p["max_num_seqs"] for p in tl], where="post",
                color="k", ls="--", label="thrash server")  # fmt: skip
    ax.set_yscale("log", base=2)
    ax.set_xlabel("seconds")
    ax.set_ylabel("max_num_seqs")
    ax.set_title("the tuned runs' max_num_seqs over time")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    if "noisy" in out:
        n = out["noisy"]
        tl = n["timeline"]
        ts = [p["time"] for p in tl]
        ax.step(ts, [p["max_num_seqs"] for p in tl], where="post", color="C3",
                label="max_num_seqs")  # fmt: skip
        for p in n["phases"]:
            if p["hog"]:
                ax.axvspan(p["from"], p["to"], color="grey", alpha=0.2)
        for d in n["decisions"]:
            ax.annotate(d["action"], (d["time"], d["max_num_seqs"]), fontsize=7, rotation=45)
        rate = ax.twinx()
        rate.plot(ts, [p["tokens_per_second"] or 0 for p in tl], color="C1", alpha=0.6,
                  label="tokens/s (loop window)")  # fmt: skip
        rate.set_ylabel("tokens/s")
        ax.set_ylabel("max_num_seqs")
        ax.set_xlabel("seconds (grey: CPU hog on the server's core)")
        ax.legend(loc="upper left", fontsize=8)
        rate.legend(loc="upper right", fontsize=8)
        ax.set_title(f"noisy neighbour: {n['start']} -> {n['final_max_num_seqs']}")
    m = out["machine"]
    fig.suptitle(
        f"benchmarks/tune.py {out['date']}: load average {m['load_average_start']} at start, "
        f"{m['load_average_end']} at end",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
