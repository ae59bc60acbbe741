"""The registry's records: an attention backend, what it declares, and the decisions made on them
(kvconnector.layout.registry holds the records and makes the decisions)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from kvconnector.layout.descriptor import ALL_ORDERS, BLOCK_MAJOR_ORDERS
from kvconnector.layout.views import ViewKind


class ConstraintKind(str, Enum):
    """What a constraint does to a decision (see `decide`)."""

    TMA_ALIGNMENT = "tma_alignment"  # on the views (kvconnector.layout.views meets it)
    FP8_DEQUANT_CONTIGUOUS = "fp8_dequant_contiguous"  # fp8 KV dtypes: head-major interiors only
    PER_TOKEN_HEAD_SCALES = "per_token_head_scales"  # *_per_token_head KV dtypes: refused


@dataclass(frozen=True)
class Constraint:
    """A condition a backend's kernels put on the views, with its source."""

    kind: ConstraintKind
    detail: str
    evidence: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ConstraintKind(self.kind))


@dataclass(frozen=True)
class BackendEntry:
    """What we know about one attention backend, and on what evidence.

    `layouts`: the declared layout set, most preferred first (None: any), as vLLM's
    `supported_kv_cache_layouts()` returns it; `layouts_by_cc` overrides it on given
    compute-capability majors; `vllm_class`: where vLLM defines the backend, for live lookups;
    `test_only`: test support (a reference backend the engine tier registers with vLLM), known
    to the connector but never listed to users (`kvconnector backends`).
    """

    name: str
    view: ViewKind
    reads_strides: bool
    evidence: str
    layouts: tuple[str, ...] | None = None
    layouts_by_cc: tuple[tuple[int, tuple[str, ...] | None], ...] = ()
    constraints: tuple[Constraint, ...] = ()
    vllm_class: str | None = None
    test_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"backend name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.reads_strides, bool):
            raise ValueError(f"backend {self.name!r}: reads_strides must be a bool, "
                             f"got {self.reads_strides!r}")
        if not isinstance(self.test_only, bool):
            raise ValueError(f"backend {self.name!r}: test_only must be a bool, "
                             f"got {self.test_only!r}")
        if not isinstance(self.evidence, str) or not self.evidence:
            raise ValueError(f"backend {self.name!r}: evidence must cite a source, "
                             f"got {self.evidence!r}")
        object.__setattr__(self, "view", ViewKind(self.view))
        object.__setattr__(self, "layouts", _check_layouts(self.name, self.layouts))
        object.__setattr__(self, "layouts_by_cc", tuple(
            (int(major), _check_layouts(self.name, lay)) for major, lay in self.layouts_by_cc))
        object.__setattr__(self, "constraints", tuple(self.constraints))

    def layouts_for(self, compute_capability: tuple[int, int] | None = None
                    ) -> tuple[str, ...] | None:
        """The recorded set on `compute_capability`; when unknown, what every device accepts."""
        if compute_capability is not None:
            return dict(self.layouts_by_cc).get(compute_capability[0], self.layouts)
        return _intersect([self.layouts, *(lay for _, lay in self.layouts_by_cc)])


@dataclass(frozen=True)
class DeclaredLayouts:
    """The layouts a backend accepts, and where that answer came from."""

    layouts: tuple[str, ...] | None  # None: any
    source: str
    live: bool = False  # read from the installed vLLM, not from our record

    @property
    def block_outermost(self) -> tuple[str, ...]:
        """The block-outermost layouts accepted, in our preference order."""
        return tuple(o for o in BLOCK_MAJOR_ORDERS if self.layouts is None or o in self.layouts)


@dataclass(frozen=True)
class Refusal:
    """Why a backend gets no block-outermost layout, and on what evidence."""

    backend: str
    reason: str
    evidence: str


@dataclass(frozen=True)
class LayoutDecision:
    """The block-outermost layout every backend accepts, or the refusals saying why none."""

    layout: str | None
    backends: tuple[str, ...]
    refusals: tuple[Refusal, ...] = ()
    requirements: tuple[str, ...] = ()  # what the views must still meet (e.g. TMA alignment)
    layout_sources: tuple[tuple[str, str], ...] = ()  # (backend, where its layouts came from)

    def explain(self) -> str:
        if self.layout is not None:
            return f"{self.layout} for {', '.join(self.backends)}"
        return "no block-outermost layout: " + "; ".join(
            f"{r.backend}: {r.reason} [{r.evidence}]" for r in self.refusals)


def _check_layouts(name: str, layouts: Iterable[str] | None) -> tuple[str, ...] | None:
    if layouts is None:
        return None
    if isinstance(layouts, str):
        raise ValueError(f"backend {name!r}: layouts must be a collection, got {layouts!r}")
    out = tuple(layouts)
    for layout in out:
        if layout not in ALL_ORDERS:
            raise ValueError(f"backend {name!r}: unknown layout {layout!r}; known: {ALL_ORDERS}")
    return out


def _intersect(sets: list[tuple[str, ...] | None]) -> tuple[str, ...] | None:
    known = [s for s in sets if s is not None]
    return None if not known else tuple(o for o in known[0] if all(o in s for s in known[1:]))
