"""Predictions as people read them (a table and a per-equation summary) and as JSON documents."""

from __future__ import annotations

from dataclasses import asdict
from fractions import Fraction
from typing import Any

from commgate import __version__
from commgate.core.units import human_bytes, number, shown
from commgate.model.expectation import Context, Prediction
from commgate.model.schemes import SCHEMES
from commgate.model.trainers import derived

DOCUMENT_VERSION = 1
FIRST_GROUP_RANKS = 64
"""A row's ``first_group`` lists at most this many of its first group's ranks (``group_size`` says how many it
has): 13B ZeRO-3 at dp 1,048,576 wrote a million ranks in each of its thousand rows, 8.5 GB in memory."""


def prediction_document(p: Prediction, *, matrix: bool = False, detail: bool = True) -> dict[str, Any]:
    """The prediction as JSON: the scenario, the paper's terms and comparison, the ``summary`` (one row
    per phase, op and axis) and totals; with ``detail`` (the default: report.json keeps the full record)
    also ``collectives``, every row of the model per bucket and layer with its source."""
    s = p.scenario
    par = s.parallelism
    steady = _steady_rank0(p)
    doc: dict[str, Any] = {
        "name": s.id,
        "scenario": s.name,
        "file": s.file,
        "scheme": par.scheme,
        "world_size": s.world_size,
        "status": "predicted",
        "model": {k: v for k, v in asdict(s.model).items() if k != "builder"},  # (a function: the trainer's)
        "parallelism": asdict(par),
        "param_count": p.param_count,
        "param_count_eq1": p.param_count_eq1,
        "paper_volume_elements": number(p.paper_volume_elements),
        "paper_terms": [
            {
                "equation": t.equation,
                "formula": t.formula,
                "scope": t.scope,
                "elements": number(t.elements),
                "bytes": number(t.bytes),
            }
            for t in p.paper_terms
        ],
        "paper_comparison": [
            {
                "equation": c.term.equation,
                "paper_bytes": number(c.term.bytes),
                "paper_ranks": len(c.term.ranks),
                "model_bytes": number(c.model_bytes),
                "residuals": [{"name": r.name, "bytes": number(r.bytes), "detail": r.detail} for r in c.residuals],
                "unexplained_bytes": number(c.unexplained_bytes),
            }
            for c in p.comparison()
        ],
        "not_in_paper_rank0": [{"source": src, "bytes": b} for src, b in p.not_in_paper()],
        "collectives": [
            {
                "op": str(c.op),
                "axis": c.axis,
                "group_size": c.group_size,
                "group_count": len(c.groups),
                "first_group": list(c.groups[0][:FIRST_GROUP_RANKS]),  # a data-parallel group can be 10^6
                "dtype": c.dtype,
                "elements_per_call": c.elements,
                "bytes_per_call": c.bytes_per_call,
                "calls_per_step": c.calls,
                "phase": str(c.phase),
                "when": c.when,
                "bytes_per_step": c.bytes_per_step,
                "bus_factor": number(c.bus_factor),
                "wire_bytes_per_step": number(c.wire_bytes_per_step),
                "source": c.source,
                "paper_term": c.paper_term,
            }
            for c in p.collectives
        ],
        "summary": summary(p),
        "totals": {
            "rank0_bytes_per_step": sum(c.bytes_per_step for c in steady),
            "rank0_wire_bytes_per_step": number(sum((c.wire_bytes_per_step for c in steady), Fraction(0))),
            "job_bytes_per_step": p.job_bytes_per_step(),
            "job_wire_bytes_per_step": number(p.job_wire_bytes_per_step()),
        },
        "message_sizes": [{"bytes": b, "calls_per_step": n} for b, n in p.message_sizes().items()],
    }
    if lines := derived(s):  # what the trainer decided (Hugging Face's resolved "auto" values)
        doc["trainer"] = {"name": s.trainer, "options": s.trainer_config, "derived": list(lines)}
    if not detail:
        del doc["collectives"]
    if matrix:
        doc["traffic_matrix"] = [
            {"src": src, "dst": dst, "bytes_per_step": number(b)}
            for (src, dst), b in sorted(p.traffic_matrix().items())
        ]
    return doc


def predictions_document(preds: list[Prediction], *, matrix: bool = False, detail: bool = True) -> dict[str, Any]:
    return {
        "schema_version": DOCUMENT_VERSION,
        "commgate_version": __version__,
        "predictions": [prediction_document(p, matrix=matrix, detail=detail) for p in preds],
    }


def _steady_rank0(p: Prediction) -> list[Any]:
    """The model's rows rank 0 issues every step (not once per run)."""
    return [c for c in p.collectives if not c.once and c.issued_by(0)]


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def summary(p: Prediction) -> list[dict[str, Any]]:
    """One row per (when, phase, op, axis, group size): calls, bytes and wire bytes per step per
    participating rank summed over the model's rows, the paper equations they count toward, and how many
    rows (buckets, layers) it stands for."""
    groups: dict[tuple[str, str, str, str, int], dict[str, Any]] = {}
    for c in p.collectives:
        key = (c.when, str(c.phase), str(c.op), str(c.axis), c.group_size)
        g = groups.setdefault(key, {"calls": 0, "bytes": 0, "wire": Fraction(0), "eqs": set(), "rows": 0})
        g["calls"] += c.calls
        g["bytes"] += c.bytes_per_step
        g["wire"] += c.wire_bytes_per_step
        g["eqs"].add(c.paper_term or "-")
        g["rows"] += 1
    return [
        {
            "when": when,
            "phase": phase,
            "op": op,
            "axis": axis,
            "group_size": n,
            "calls_per_step": g["calls"],
            "bytes_per_step": g["bytes"],
            "wire_bytes_per_step": number(g["wire"]),
            "paper_terms": sorted(g["eqs"]),
            "rows": g["rows"],
        }
        for (when, phase, op, axis, n), g in groups.items()
    ]


def _eqs(terms: list[str]) -> str:
    """The eq column: the equations the rows count toward, "(part)" when some rows count toward none."""
    eqs = [t for t in terms if t != "-"]
    return ", ".join(eqs) + (" (part)" if "-" in terms else "") if eqs else "-"


def _summary_rows(p: Prediction) -> list[list[str]]:
    return [
        [
            r["when"],
            r["phase"],
            r["op"],
            r["axis"],
            str(r["group_size"]),
            str(r["calls_per_step"]),
            human_bytes(r["bytes_per_step"]),
            human_bytes(r["wire_bytes_per_step"]),
            _eqs(r["paper_terms"]),
            str(r["rows"]),
        ]
        for r in summary(p)
    ]


def prediction_text(p: Prediction, *, matrix: bool = False, detail: bool = False) -> str:
    """The prediction for people: by default one row per phase, op and axis (``detail``: every row of
    the model, per bucket and layer), the job's totals, then the paper's equations against the model."""
    lines = [*_heading(p), *_rows_text(p, detail=detail), *_totals_text(p), *_paper_text(p)]
    if matrix:
        lines += _matrix_text(p)
    return "\n".join(lines)


def _heading(p: Prediction) -> list[str]:
    """The scenario's scheme, axes, batch and model, on two lines."""
    s, m, par = p.scenario, p.scenario.model, p.scenario.parallelism
    pairs = (
        ("dp_replicate", par.dp_replicate),
        ("dp", par.dp),
        ("cp", par.cp),
        ("tp", par.tp),
        ("pp", par.pp),
        ("ep", par.ep),
    )
    axes = ", ".join(f"{k}={v}" for k, v in pairs if v > 1)
    ctx = Context(scenario=s)
    eq1 = f"{ctx.eq1_name}: {ctx.eq1:,}" if m.llama else f"Eq. 1: {p.param_count_eq1:,}"
    whose = f"built by trainer {s.trainer}" if m.builder else "your module"
    model = (
        f"  model {m.module} ({whose}, read on the meta device): {m.dtype}; {p.param_count:,} parameters"
        if m.module
        else f"  model {m.preset or 'custom'}: {m.architecture} L={m.L} h={m.h} a={m.a}"
        f"{f' kv_heads={m.kv}' if m.llama else ''} V={m.V} s={m.s} ffn={m.ffn} {m.dtype}"
        f"{' tied' if m.tied_embeddings else ''} {m.position} positions; {p.param_count:,} parameters ({eq1})"
    )
    by = f" by trainer {s.trainer}" if s.trainer != "commgate" else ""  # (commgate's own: as it always read)
    # torch's schemes have no ZeRO stage, nor a pipeline that torch's or Megatron's engine runs
    deepspeed = SCHEMES[par.scheme].deepspeed and (par.pp == 1 or par.pipeline.engine == "deepspeed")
    zero = f"zero stage {par.zero.stage}, " if deepspeed else ""
    return [
        f"{s.id}: {par.scheme}{by} on {s.world_size} ranks ({axes or 'single rank'}), {zero}"
        f"b={par.micro_batch}, m={par.micro_batches}{', checkpointing' if par.activation_checkpointing else ''}",
        model,
        *(f"  {s.trainer}: {line}" for line in derived(s)),
    ]


def _rows_text(p: Prediction, *, detail: bool) -> list[str]:
    """The model's rows: summed per phase, op and axis, or (``detail``) every one with its source."""
    if not detail:
        summary = ["when", "phase", "op", "axis", "n", "calls", "bytes", "wire", "eq", "rows"]
        lines = ["  " + line for line in _table(summary, _summary_rows(p), right={4, 5, 6, 7, 9})]
        if len(p.collectives) > len(_summary_rows(p)):
            lines.append(f"  ({len(p.collectives)} rows of the model summed; --detail lists them with their source)")
        return lines
    headers = ["when", "phase", "op", "axis", "n", "groups", "calls", "bytes/call", "bytes", "wire", "eq", "source"]
    rows = [
        [
            c.when,
            str(c.phase),
            str(c.op),
            c.axis,
            str(c.group_size),
            str(len(c.groups)),
            str(c.calls),
            human_bytes(c.bytes_per_call),
            human_bytes(c.bytes_per_step),
            human_bytes(c.wire_bytes_per_step),
            c.paper_term or "-",
            c.source,
        ]
        for c in p.collectives
    ]
    return ["  " + line for line in _table(headers, rows, right={4, 5, 6, 7, 8, 9})]


def _totals_text(p: Prediction) -> list[str]:
    steady = _steady_rank0(p)
    return [
        f"  per step, rank 0 (from step {max((c.from_step for c in steady), default=0)} on): "
        f"{human_bytes(sum(c.bytes_per_step for c in steady))} in messages, "
        f"{human_bytes(sum((c.wire_bytes_per_step for c in steady), Fraction(0)))} on the wire",
        f"  per step, whole job: {human_bytes(p.job_bytes_per_step())} in messages, "
        f"{human_bytes(p.job_wire_bytes_per_step())} on the wire (rows: per participating rank, per step or once)",
    ]


def _paper_text(p: Prediction) -> list[str]:
    """Each equation against the model, its named terms, what is left; then traffic the paper has not."""
    lines = []
    for c in p.comparison():
        t = c.term
        lines.append(
            f"  {t.equation} ({t.scope}): {t.formula} = {number(t.elements):,} elements = {human_bytes(t.bytes)}; "
            f"model {human_bytes(c.model_bytes)}"
        )
        for r in c.residuals:
            lines.append(f"      {'+' if r.bytes >= 0 else '-'} {human_bytes(abs(r.bytes)):>11}  {r.name}: {r.detail}")
        lines.append(f"      = unexplained {shown(c.unexplained_bytes)} B")
    lines += [f"  not in the paper (rank 0): {human_bytes(b)} per step from {src}" for src, b in p.not_in_paper()]
    return lines


MATRIX_DRAWN = 32
"""Ranks up to which the text traffic matrix is drawn whole (n x n cells); beyond, its heaviest pairs are
listed: a drawn matrix grows with n squared (42 MB of text at dp 2048)."""
MATRIX_PAIRS = 20


def _matrix_text(p: Prediction) -> list[str]:
    tm, n = p.traffic_matrix(), p.scenario.world_size
    if n > MATRIX_DRAWN:
        heaviest = sorted(tm.items(), key=lambda kv: (-kv[1], kv[0]))[:MATRIX_PAIRS]
        lines = [
            f"  traffic matrix, bytes per step (ring model): {n:,} ranks, more than {MATRIX_DRAWN} to draw; "
            f"{len(tm):,} rank pairs exchange bytes, the {len(heaviest)} heaviest below (--json --matrix lists "
            "every pair):"
        ]
        return lines + [f"    {src} -> {dst}: {human_bytes(b)}" for (src, dst), b in heaviest]
    hdr = ["src\\dst", *(str(j) for j in range(n))]
    body = [[str(i), *(human_bytes(tm.get((i, j), 0)) if tm.get((i, j)) else "." for j in range(n))] for i in range(n)]
    lines = ["  traffic matrix, bytes per step sent row -> column (ring model):"]
    return lines + ["    " + line for line in _table(hdr, body, right=set(range(1, n + 1)))]
