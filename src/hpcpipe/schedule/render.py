"""Pictures of schedules: the rank x step grid of programs, ASCII timelines, matplotlib charts."""

from __future__ import annotations

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.costs import COMPUTE, SimResult
from hpcpipe.schedule.ir import Action


def format_grid(programs: list[list[Action]], mark: dict[int, int] | None = None) -> str:
    """Render per-rank programs as a rank x step grid; mark {rank: index} adds '<-- ERROR HERE'."""
    mark = mark or {}
    width = max([len(str(a)) for prog in programs for a in prog] + [6]) + 2
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(len(programs)))]
    for i in range(max((len(p) for p in programs), default=0)):
        cells = []
        for r, prog in enumerate(programs):
            text = str(prog[i]) if i < len(prog) else ""
            cells.append(("*" + text if mark.get(r) == i else text).ljust(width))
        flag = "  <-- ERROR HERE" if i in mark.values() else ""
        lines.append(f"{i:<6}" + "".join(cells).rstrip() + flag)
    return "\n".join(lines)


def _events(result: SimResult) -> list[list[tuple[Action, float, float]]]:
    if result.events is None:
        raise ScheduleError("this result has no per-action events (vectorised simulation); "
                            "simulate with events=True to draw it")
    return result.events


def ascii_timeline(result: SimResult, tick: float | None = None) -> str:
    """Render a simulated step as text, one row per rank, one column per tick (default: smallest F)."""
    events = _events(result)
    computes = [(a, s, e) for ev in events for a, s, e in ev if a.op in COMPUTE and e > s]
    if not computes:
        return ""
    tick = tick or min(e - s for _, s, e in computes)
    pp = len(events)
    chunked = any(a.stage >= pp for a, _, _ in computes)

    def label(a: Action) -> str:
        # with virtual stages, a letter names the chunk: a = stages 0..pp-1, b = the next pp, ...
        return f"{a.op}{a.mb}{chr(ord('a') + a.stage // pp)}" if chunked else f"{a.op}{a.mb}"

    width = max(len(label(a)) for a, _, _ in computes) + 1
    lines = []
    for r, ev in enumerate(events):
        cells: dict[int, str] = {}
        for a, s, e in ev:
            if a.op in COMPUTE:
                for k in range(round(s / tick), round(e / tick)):
                    cells[k] = label(a)
        n = round(result.step_time / tick)
        lines.append(f"rank {r}  " + "".join(cells.get(k, ".").ljust(width) for k in range(n)).rstrip())
    return "\n".join(lines)


_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "ALLREDUCE": "#8172b3",
            "OPT_STEP": "#937860"}


def plot_timeline(rows: list[list[tuple[str, float, float]]], path: str, title: str,
                  xlabel: str = "time (s)") -> None:
    """Draw a rank x time chart of (name, start, end) boxes with matplotlib and save it to path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScheduleError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    end = max((e for row in rows for _, _, e in row), default=1.0)
    for r, row in enumerate(rows):
        for name, s, e in row:
            kind = name if name in _COLOURS else name.lstrip("s0123456789")[:1]
            if kind not in _COLOURS or e <= s:
                continue
            ax.broken_barh([(s, e - s)], (r - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white",
                           linewidth=0.3)
            if (e - s) / end > 0.015 and kind in COMPUTE:
                ax.text((s + e) / 2, r, name.split(kind)[-1] if kind in COMPUTE else "", ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="lower center", bbox_to_anchor=(0.5, 1.08), fontsize=7, ncol=6,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sim_rows(result: SimResult) -> list[list[tuple[str, float, float]]]:
    """Return a simulated step as (name, start, end) rows for plot_timeline."""
    return [[(a.op if a.op not in COMPUTE else f"{a.op}{a.mb}", s, e) for a, s, e in ev] for ev in _events(result)]
