"""bench_cluster's rows: the same plan found in each round's plans, a row's errors over its rounds, the tables.

A row is one layout at one placement and rate, run once a round. By default every round measures the
planner's profile again right before its runs, so each run is compared with the prediction of its own
round; the row's error is the median of those errors (the VM drifts by tens of per cent within minutes:
a profile measured once at the start, ``--profile-once``, compares the runs with another spell).
"""

from __future__ import annotations

import statistics

LAYOUTS = {"dp=2": (2, 1, 1), "pp=2": (1, 2, 1), "tp=2": (1, 1, 2)}
# what makes two plans the same run (the stage cut is the planner's choice for that profile)
SAME = ("dp", "pp", "tp", "schedule", "virtual_stages", "micro_batches", "micro_batch_size")
STATISTICS = {
    "rounds": "median over the rounds of each round's error (its run's median step after the warm-up) against "
              "the prediction planned from the profile measured at the start of that round",
    "min": "the prediction (from the profile measured once, at the start) against the fastest round's median step",
    "median": "the prediction (from the profile measured once, at the start) against the median over the rounds "
              "of each round's median step",
}


def best_per_layout(plans: list[dict]) -> dict[str, dict]:
    """The fastest plan of each layout (plans come fastest first)."""
    out = {}
    for name, (dp, pp, tp) in LAYOUTS.items():
        out[name] = next(p for p in plans if (p["dp"], p["pp"], p["tp"]) == (dp, pp, tp))
    return out


def same_plan(plans: list[dict], like: dict) -> dict:
    """The fastest plan in ``plans`` run as ``like`` is (layout, schedule, micro-batches); its layout's best if none."""
    found = next((p for p in plans if all(p[k] == like[k] for k in SAME)), None)
    if found is not None:
        return found
    return next(p for p in plans if (p["dp"], p["pp"], p["tp"]) == (like["dp"], like["pp"], like["tp"]))


def describe(p: dict) -> str:
    """A plan in a few words: layout, schedule, micro-batches x size."""
    v = f" v={p['virtual_stages']}" if p["virtual_stages"] > 1 else ""
    return f"dp={p['dp']} pp={p['pp']} tp={p['tp']} {p['schedule']}{v} {p['micro_batches']}x{p['micro_batch_size']}"


def summarise(runs: list[dict], statistic: str) -> dict:
    """A row's predicted and measured step and its error by ``statistic``, from its runs (one a round).

    Each run holds ``predicted_s`` (its round's prediction), ``step_s`` (its median step after the
    warm-up) and ``step_min_s`` (its fastest step). Every statistic is kept: ``errors`` and
    ``errors_fastest`` per round against the round's own prediction, and the first round's prediction
    against the fastest round (``error_first_min``) and the rounds' median (``error_first_median``).
    """
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}: one of {', '.join(STATISTICS)}")
    errors = [r["predicted_s"] / r["step_s"] - 1 for r in runs]
    fastest = [r["predicted_s"] / r["step_min_s"] - 1 for r in runs]
    first = runs[0]["predicted_s"]
    steps = [r["step_s"] for r in runs]
    out = {"errors": errors, "error_rounds": statistics.median(errors),
           "errors_fastest": fastest, "error_fastest": statistics.median(fastest),
           "error_first_min": first / min(steps) - 1, "error_first_median": first / statistics.median(steps) - 1}
    if statistic == "rounds":
        out.update(predicted_s=statistics.median(r["predicted_s"] for r in runs),
                   measured_s=statistics.median(steps), error=out["error_rounds"])
    else:
        out.update(predicted_s=first, measured_s=min(steps) if statistic == "min" else statistics.median(steps),
                   error=out[f"error_first_{statistic}"])
    return out


def print_tables(results: dict) -> None:
    """The tables of docs/cluster.md (markdown)."""
    print(f"\nerror: {STATISTICS[results['statistic']]}; goal: within 15 %")
    print("\n| link | placement | plan | predicted step s | measured step s | error | 15 % goal | errors by round | "
          "fastest step error | bytes/step/link (metrics) | load before | steal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in results["training"]:
        link = max(statistics.median(r["link_bytes_per_step"][k] for r in t["runs"]) for k in range(2))
        loads = [r["load_before"] for r in t["runs"]]
        by_round = " / ".join(f"{e:+.0%}" for e in t["errors"])
        steal = max((r.get("steal_share", 0.0) for r in t["runs"]), default=0.0)
        print(f"| {t['rate']} | {t['placement']} | {t['plan']} | {t['predicted_s']:.3f} | {t['measured_s']:.3f} | "
              f"{t['error']:+.1%} | {'met' if abs(t['error']) <= 0.15 else 'not met'} | {by_round} | "
              f"{t['error_fastest']:+.1%} | {link / 2**20:.2f} MiB | {min(loads):.1f}-{max(loads):.1f} | "
              f"{steal:.1%} |")
    for rate in results["rates"]:
        picks = results["plans"].get(f"{rate}-picks") or [results["plans"].get(f"{rate}-pick")]
        measured = {t["layout"]: t["measured_s"] for t in results["training"]
                    if t["placement"] == "across" and t["rate"] == rate}
        if picks[0] and measured:
            named = [next(n for n, lay in LAYOUTS.items() if lay == (p["dp"], p["pp"], p["tp"])) for p in picks]
            fastest = min(measured, key=measured.get)
            print(f"{rate}, 2 nodes x 1 rank: planner picks {' / '.join(named)} (by round); "
                  f"measured best {fastest} ({measured[fastest]:.3f} s)")
    if results["serving"]:
        print("\n| link | placement | layout | tokens/s | median latency s | link bytes (both ways) | load |")
        print("|---|---|---|---|---|---|---|")
        for s in results["serving"]:
            print(f"| {s['rate']} | {s['placement']} | {s['layout']} | {s['tokens_per_s']:.1f} | "
                  f"{s['latency_p50_s']:.2f} | {sum(s['link_counter_bytes']) / 2**20:.1f} MiB | "
                  f"{s['load_after']:.1f} |")
