"""The seed paper's equations (Anthony et al., "Demystifying the Communication Characteristics for
Distributed Transformer Models", Section III), taken literally, in exact arithmetic.

Units are elements ("units of parameters"), as in the paper; multiply by the dtype's size for bytes.
Eqs. 2, 3 and 5 are a volume per device of the group; Eq. 4 is the aggregate over all stages of one
pipeline, per micro-batch, as the paper states them.
"""

from __future__ import annotations

from fractions import Fraction


def eq1_param_count(
    *,
    V: int,
    h: int,
    s: int,
    L: int,
    tied_embeddings: bool = False,
    position: str = "learned",
    x: int = 4,
    ffn: int | None = None,
) -> int:
    """Eq. 1: ``2Vh + sh + L(12h^2 + 8h) + 2h``.

    With the defaults it is the paper's equation literally. The switches generalise it: tied
    embeddings count Vh once, positions other than ``learned`` have no ``sh`` table, and the MLP width
    (``ffn``, else ``x*h``) turns the ``12h^2`` into ``4h^2 + 2h*ffn``.
    """
    embeddings = (1 if tied_embeddings else 2) * V * h
    positions = s * h if position == "learned" else 0
    width = x * h if ffn is None else ffn
    return embeddings + positions + L * (4 * h * h + 2 * h * width + 8 * h) + 2 * h


def llama_param_count(*, V: int, h: int, L: int, a: int, kv_heads: int, ffn: int, tied_embeddings: bool) -> int:
    """The counterpart of Eq. 1 for a Llama-style decoder (no biases, RMSNorm weights only, rotary
    positions): ``2Vh + L(2h^2 + 2h*kv*h/a + 3h*ffn + 2h) + h``, with ``Vh`` once if tied.

    Per layer: the query and output projections (``2h^2``), the grouped key and value projections
    (``kv_heads`` heads of ``h/a``), the SwiGLU MLP's gate, up and down projections (``3h*ffn``) and two
    norm weights; one more norm weight after the last layer.
    """
    embeddings = (1 if tied_embeddings else 2) * V * h
    return embeddings + L * (2 * h * h + 2 * h * kv_heads * (h // a) + 3 * h * ffn + 2 * h) + h


def allreduce_volume(m: int | Fraction, d: int) -> Fraction:
    """Allreduce of a message m over d ranks: ``2m(d-1)/d``."""
    return 2 * Fraction(m) * (d - 1) / d


def allgather_volume(m: int | Fraction, d: int) -> Fraction:
    """Allgather, reduce-scatter and reduce of a message m over d ranks: ``m(d-1)/d``."""
    return Fraction(m) * (d - 1) / d


def eq2_data_parallel(param_count: int, d: int) -> Fraction:
    """Eq. 2, DDP / ZeRO-1 / ZeRO-2: ``2 * param_count * (d-1)/d``."""
    return allreduce_volume(param_count, d)


def eq3_zero3(param_count: int, d: int) -> Fraction:
    """Eq. 3, ZeRO-3: ``3 * param_count * (d-1)/d``."""
    return 3 * Fraction(param_count) * (d - 1) / d


def eq4_pipeline(*, b: int, s: int, h: int, p: int) -> Fraction:
    """Eq. 4, pipeline parallelism: ``2bsh(p-1)``."""
    return Fraction(2 * b * s * h * (p - 1))


def eq5_tensor(*, L: int | Fraction, b: int, s: int, h: int, t: int, recompute: bool = True) -> Fraction:
    """Eq. 5, tensor parallelism: ``(12L+2) * bsh * (t-1)/t``.

    6 all-reduces per layer with activation recomputation (2 forward, 2 recompute, 2 backward), 4
    without, plus one at the embedding; each all-reduce moves 2m. ``recompute=False`` gives (8L+2).
    """
    per_layer = 12 if recompute else 8
    return (per_layer * Fraction(L) + 2) * b * s * h * Fraction(t - 1, t)
