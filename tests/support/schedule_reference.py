"""The Action-list schedule generators as they were before the array (timeline) form: the test oracle.

A frozen copy of the imperative generators that ``hpcpipe.schedule`` had
before every schedule became one NumPy timeline builder; the tests check that
``Timeline.actions()`` reproduces these lists exactly. Not used by the package.
"""

from hpcpipe.errors import ScheduleError
from hpcpipe.schedule.ir import Action


def _check_sizes(name: str, pp: int, n_micro: int, virtual: int) -> None:
    for label, value in (("pp", pp), ("micro-batches", n_micro), ("virtual stages", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be a positive integer, got {value!r}")


def gpipe(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    _check_sizes("gpipe", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"gpipe runs one stage per rank (virtual stages: {virtual}); "
                            f"use an interleaved schedule for virtual_stages > 1")
    return [[Action("F", r, m) for m in range(n_micro)] + [Action("B", r, m) for m in range(n_micro)]
            for r in range(pp)]


def one_f_one_b(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    _check_sizes("1f1b", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"1f1b runs one stage per rank (virtual stages: {virtual}); "
                            f"use interleaved-1f1b for virtual_stages > 1")
    programs = []
    for r in range(pp):
        warm = min(pp - r - 1, n_micro)
        prog = [Action("F", r, m) for m in range(warm)]
        for i in range(n_micro - warm):
            prog += [Action("F", r, warm + i), Action("B", r, i)]
        prog += [Action("B", r, m) for m in range(n_micro - warm, n_micro)]
        programs.append(prog)
    return programs


def _interleaved_order(pp: int, n_micro: int, virtual: int, backward: bool) -> list[tuple[int, int]]:
    order = []
    for first in range(0, n_micro, pp):
        group = range(first, min(first + pp, n_micro))
        chunks = range(virtual - 1, -1, -1) if backward else range(virtual)
        order += [(c, m) for c in chunks for m in group]
    return order


def interleaved_1f1b(pp: int, n_micro: int, virtual: int = 2) -> list[list[Action]]:
    _check_sizes("interleaved-1f1b", pp, n_micro, virtual)
    if virtual > 1 and n_micro % pp:
        raise ScheduleError(f"interleaved-1f1b needs micro-batches to be a multiple of pp "
                            f"(micro-batches: {n_micro}, pp: {pp}, virtual stages: {virtual})")
    if virtual == 1:
        return one_f_one_b(pp, n_micro, 1)
    total = virtual * n_micro
    fwd = _interleaved_order(pp, n_micro, virtual, backward=False)
    bwd = _interleaved_order(pp, n_micro, virtual, backward=True)
    programs = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
        prog = [Action("F", c * pp + r, m) for c, m in fwd[:warm]]
        for i in range(total - warm):
            c, m = fwd[warm + i]
            prog.append(Action("F", c * pp + r, m))
            c, m = bwd[i]
            prog.append(Action("B", c * pp + r, m))
        prog += [Action("B", c * pp + r, m) for c, m in bwd[total - warm:]]
        programs.append(prog)
    return programs


def zero_bubble_h1(pp: int, n_micro: int, virtual: int = 1) -> list[list[Action]]:
    _check_sizes("zb-h1", pp, n_micro, virtual)
    if virtual != 1:
        raise ScheduleError(f"zb-h1 runs one stage per rank (virtual stages: {virtual})")
    return _greedy_split(pp, n_micro)


def _greedy_split(pp: int, n_micro: int) -> list[list[Action]]:
    programs: list[list[Action]] = [[] for _ in range(pp)]
    f_ready = [[0 if r == 0 else -1] * n_micro for r in range(pp)]      # tick the input is available
    i_ready = [[-1] * n_micro for _ in range(pp)]                        # tick the output gradient is available
    next_f, next_i, next_w = [0] * pp, [0] * pp, [0] * pp
    remaining = 3 * pp * n_micro
    tick = 0
    limit = 3 * n_micro * pp + pp   # every tick some rank works: all ranks' work in sequence is the worst case
    while remaining:
        if tick > limit:
            raise ScheduleError(f"zb-h1 list schedule made no progress (pp: {pp}, micro-batches: {n_micro})")
        done_f, done_i = [], []
        for r in range(pp):
            f, i, w = next_f[r], next_i[r], next_w[r]
            # F first keeps the forward wave (and so the backward chain behind it) moving;
            # f - i < pp - r is 1F1B's warm-up rule, f - w < min(pp, m) bounds the activations held.
            if (f < n_micro and 0 <= f_ready[r][f] <= tick and f - i < pp - r
                    and f - w < min(pp, n_micro)):
                programs[r].append(Action("F", r, f))
                next_f[r] += 1
                done_f.append((r, f))
            elif i < n_micro and 0 <= i_ready[r][i] <= tick and i < f:
                programs[r].append(Action("I", r, i))
                next_i[r] += 1
                done_i.append((r, i))
            elif w < i:
                programs[r].append(Action("W", r, w))
                next_w[r] += 1
            else:
                continue
            remaining -= 1
        # results become visible to neighbours at the next tick
        for r, m in done_f:
            if r + 1 < pp:
                f_ready[r + 1][m] = tick + 1
            else:
                i_ready[r][m] = tick + 1
        for r, m in done_i:
            if r > 0:
                i_ready[r - 1][m] = tick + 1
        tick += 1
    return programs


REFERENCE = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
}
