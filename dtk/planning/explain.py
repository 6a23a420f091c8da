"""The plan and its explanation: ``Plan`` (what ``dtk.plan`` returns), ``--explain_plan``'s table
of every candidate and ``--plot``'s chart."""

from __future__ import annotations

import dataclasses

from dtk.planning.candidates import TIE, TIE_RULE, Candidate
from dtk.planning.cost import MIB, MachineCalibration, StepCalibration, mib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen candidate, every candidate considered, and the figures behind the choice."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    machine: MachineCalibration
    step: StepCalibration
    global_batch_size: int
    table: str

    def explain(self) -> str:
        return explain_plan(self)


def plot_plan(p: Plan, path: str) -> None:
    """Draws every candidate as predicted ms/step against memory per device, with the budget
    as a vertical line and the chosen plan marked, into the PNG ``path`` (needs matplotlib).

    Raises:
      ValueError: matplotlib is not installed (named, with the install command).
    """
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        raise ValueError("drawing the plan needs matplotlib: pip install matplotlib (dtk's bench "
                         "extra)") from None
    timed = [c for c in p.candidates if c.rejected is None and c.predicted_ms is not None]
    fig, ax = plt.subplots(figsize=(9, 6))
    for fits, color, label in ((True, "tab:blue", "fits the budget"),
                               (False, "tab:gray", "over the budget")):
        group = [c for c in timed if c.fits == fits and c is not p.chosen]
        if group:
            ax.scatter([c.memory["total"] / MIB for c in group],
                       [c.predicted_ms for c in group], color=color, label=label, s=30)
    chosen = p.chosen
    ax.scatter([chosen.memory["total"] / MIB], [chosen.predicted_ms], color="tab:red", marker="*",
               s=250, label=f"chosen: {chosen.label}", zorder=3)
    # Candidates at the same point (the same memory and time, e.g. remat or not where remat
    # saves nothing) share one label; labels of nearby points are stacked, not drawn over.
    at: dict[tuple[float, float], list[str]] = {}
    for c in timed:
        at.setdefault((round(c.memory["total"] / MIB, 1), round(c.predicted_ms, 1)),
                      []).append(c.label)
    span_x = max((x for x, _ in at), default=1.0) - min((x for x, _ in at), default=0.0) or 1.0
    span_y = max((y for _, y in at), default=1.0) - min((y for _, y in at), default=0.0) or 1.0
    placed: list[tuple[float, float]] = []
    for (x, y), labels in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        near = sum(1 for px, py in placed  # a label runs right of its point
                   if -0.1 * span_x < x - px < 0.35 * span_x and abs(py - y) < 0.04 * span_y)
        placed.append((x, y))
        ax.annotate(" / ".join(labels), (x, y), fontsize=6, xytext=(4, 2 + 8 * near),
                    textcoords="offset points")
    if chosen.budget is not None:
        ax.axvline(chosen.budget / MIB, color="tab:red", linestyle="--",
                   label=f"budget {chosen.budget / MIB:.0f} MiB per device")
    ax.set_xlabel("memory per device (MiB): weights, optimizer state, gradients, gathered, "
                  "activations")
    ax.set_ylabel("predicted ms per step")
    where = f" (step timed on {p.step.measured_on})" if p.step.measured_on else ""
    ax.set_title(f"dtk plan: {p.machine.devices} {p.machine.device_kind.upper()} devices, global "
                 f"batch {p.global_batch_size}, table {p.table}{where}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def explain_plan(p: Plan) -> str:
    """Every candidate: memory per device, predicted ms/step, and chosen or why not."""
    moe = any(c.experts_bytes for c in p.candidates)
    staged = any(c.stages > 1 for c in p.candidates)
    rows = [("candidate", "weights", "state", "grads", "gathered", "activations", "total",
             *(("experts", "all-to-all") if moe else ()),
             *(("bubble", "boundary") if staged else ()), "ms/step", "")]
    best = p.chosen
    fastest = min((c.predicted_ms or 0.0 for c in p.candidates if c.fits and not c.rejected),
                  default=best.predicted_ms or 0.0)
    for c in sorted(p.candidates, key=lambda c: (c.predicted_ms is None, c.predicted_ms or 0)):
        if c.rejected:
            rows.append((c.label, "", "", "", "", "", "", *(("", "") if moe else ()),
                         *(("", "") if staged else ()), "", f"cannot run: {c.rejected}"))
            continue
        m = c.memory
        if c is best:
            why = "CHOSEN"
        elif not c.fits:
            why = f"over budget by {mib(m['total'] - c.budget)}"
        else:
            ratio = (c.predicted_ms or 0) / (best.predicted_ms or 1) - 1
            if (c.predicted_ms or 0.0) <= fastest * TIE:  # as choose() decides
                why = f"a tie ({ratio:+.1%}): the tie goes to the chosen one"
            else:
                why = f"slower ({ratio:+.0%})"
        rows.append((c.label, *(f"{m[k] / MIB:.1f}" for k in (
            "weights", "optimizer", "gradients", "gathered", "activations", "total")),
            *((f"{c.experts_bytes / MIB:.1f}", f"{c.all_to_all_bytes / MIB:.1f}") if moe else ()),
            *((f"{c.bubble:.0%}" if c.stages > 1 else "", f"{c.boundary_bytes / MIB:.1f}"
               if c.stages > 1 else "") if staged else ()),
            f"{c.predicted_ms:.1f}" if c.predicted_ms is not None else "", why))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    budget = best.budget
    lines = [f"plan for {p.machine.devices} {p.machine.device_kind.upper()} device(s), global batch "
             f"{p.global_batch_size}, table {p.table!r}, budget "
             f"{mib(budget) if budget is not None else 'none'} per device (MiB per device below)"]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    s = p.step
    m = s.measured_ms
    timed = ", ".join(f"{ms:.1f} ms at batch {rows}" for ms, rows in zip(m, s.batch_sizes))
    where = (f"the step timed on {s.measured_on} ({timed}; the replicated step on "
             f"batch={p.machine.devices} does not fit the budget), less that candidate's "
             f"predicted collectives, scaled to every candidate by the cost model"
             f"{'; assumed: ' + s.assumed if s.assumed else ''}" if s.measured_on else
             f"measured {timed} on batch={p.machine.devices}")
    lines.append(f"cost model: {s.a_ms:.1f} ms + {s.e_ms:.3f} ms/example x batch ({where}); remat "
                 f"+{s.remat_share:.0%}; FSDP +{s.fsdp_ms:.1f} ms; a microbatch "
                 f"+{s.microbatch_ms:.1f} ms (FSDP +{s.fsdp_microbatch_ms:.1f} ms) and its "
                 "gradient reduction; a seq axis: each attention layer's keys and values "
                 "gathered and their gradient reduce-scattered, activations / seq; gathers: "
                 + ", ".join(
                     f"axis {n}: {a:.2f} ms + {b:.2f} ms/MiB" for n, (a, b) in
                     sorted(p.machine.gather.items())))
    if moe:
        lines.append("experts: the experts' weights and optimizer state per device (within weights "
                     "and state; divided by the axis sharding the experts); all-to-all: MiB a "
                     "device sends a step, the expert inputs to their experts and back, forward "
                     "and backward, priced as gathers of what a device holds")
    if staged:
        lines.append("stage=S: a pipeline of S stages (1F1B); memory is the largest stage's "
                     "(its optimizer state replicated within it); bubble (S - 1) / (M + S - 1), "
                     "priced as if the stages ran at once (a GPU host; this machine's cores run "
                     "them one after another); boundary: MiB a step moves between stages, "
                     "activations forward and their gradients back")
    if any("seq=" in c.label for c in p.candidates):
        lines.append("attention on a seq axis: priced as the all-gather of keys and values; at "
                     "build time the layout table's sequence_attention (auto: the default) times "
                     "the all-gather against the all-to-all to heads (Ulysses) on the chosen mesh "
                     "and uses the faster, and the log says which (dtk.parallel.sequence)")
    lines.append(f"chosen: {TIE_RULE}")
    lines.append(f"plan: {best.label}: predicted {best.predicted_ms:.1f} ms/step, "
                 f"{mib(best.memory['total'])} per device")
    return "\n".join(lines)
