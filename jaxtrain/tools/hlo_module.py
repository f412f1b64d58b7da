"""Read the text of an optimized HLO module: computations, instructions, shapes, and the call
graph with how often each computation runs (while loops' trip counts, including those XLA:GPU's
collective pipelining rewrote).

`jaxtrain.tools.hlo` (collectives, FLOPs, memory) and `jaxtrain.tools.gpu_program` read compiled steps
through this; it knows nothing of meshes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re


class HloError(ValueError):
    """Base class for problems reading a compiled step."""


class HloParseError(HloError):
    """The HLO text has a construct this reader does not understand."""


# ----------------------------------------------------------------------------- shapes

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS_RE = re.compile(r"^(?:bf|f|s|u|c|tf)(\d+)")


def _dtype_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    if dtype == "token":
        return 0
    m = _BITS_RE.match(dtype)
    if not m:
        raise HloParseError(f"unknown HLO element type {dtype!r}; extend hlo_module._dtype_bits")
    return int(m.group(1))


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; tuples sum their elements (`(f32[2], bf16[4,4]{1,0})`)."""
    total_bits = 0
    for dtype, dims in _ARRAY_RE.findall(shape):
        elements = 1
        for dim in filter(None, (d.strip() for d in dims.split(","))):
            elements *= int(dim.removeprefix("<="))  # bounded dynamic dims count at their bound
        total_bits += elements * _dtype_bits(dtype)
    return math.ceil(total_bits / 8)


# ----------------------------------------------------------------------------- module text

@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    operand_shapes: list[str | None]
    attrs: str


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: list[Instr]

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instrs}


_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_METADATA_RE = re.compile(r",?\s*metadata=\{[^{}]*\}")


def _matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise HloParseError(f"unbalanced {open_}{close} in HLO: {text[:200]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside any brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(1), _METADATA_RE.sub("", m.group(2)).strip()
    rest = _COMMENT_RE.sub("", rest)  # long operand lists carry `/*index=5*/` comments
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m_op = re.match(r"([\w\-]+)\(", rest)
    if not m_op:
        return None
    opcode = m_op.group(1)
    close = _matching(rest, m_op.end() - 1)
    operands, operand_shapes = [], []
    for tok in _split_top(rest[m_op.end(): close]):
        # Older printers prefix each operand with its shape: `f32[2]{0} %x`.
        head, _, last = tok.rpartition(" ")
        operands.append(last.lstrip("%"))
        operand_shapes.append(head or None)
    return Instr(name, shape, opcode, operands, operand_shapes, rest[close + 1:])


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """Computations of an HLO module text by name, and the entry computation's name."""
    comps: dict[str, Computation] = {}
    entry = None
    current: tuple[str, bool, list[Instr]] | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m:
                current = (m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            name, is_entry, instrs = current
            comps[name] = Computation(name, is_entry, instrs)
            entry = name if is_entry else entry
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current[2].append(instr)
    if entry is None:
        raise HloParseError("no ENTRY computation found; pass the text of compiled.as_text()")
    return comps, entry


# ----------------------------------------------------------------------------- call graph

_CALL_RE = re.compile(
    r"\b(condition|body|calls|to_apply|branch_computations|true_computation|"
    r"false_computation|called_computations)=(\{[^{}]*\}|%?[\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def callees(instr: Instr) -> list[tuple[str, int | None, bool]]:
    """(callee, trip factor or None when unknown, is_loop) for each computation `instr` calls."""
    # An async op's -update/-done repeat `calls=` of its -start; count the start only.
    if instr.opcode.endswith(("-done", "-update")):
        return []
    out = []
    for key, value in _CALL_RE.findall(instr.attrs):
        names = [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
        if instr.opcode == "while" and key in ("body", "condition"):
            m = _TRIP_RE.search(instr.attrs)
            trips = int(m.group(1)) if m else None
            out += [(n, trips, True) for n in names]
        else:
            out += [(n, 1, False) for n in names]
    return out


@dataclasses.dataclass
class _Reach:
    count: int = 0
    in_loop: bool = False
    exact: bool = True


_INDUCTION_RE = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"?(\d+)')
_CONSTANT_RE = re.compile(r"^s32\[\]")


def _constant_value(instr: Instr | None) -> int | None:
    if instr is None or instr.opcode != "constant" or not _CONSTANT_RE.match(instr.shape):
        return None
    m = re.search(r"-?\d+", " ".join(instr.operands))
    return int(m.group(0)) if m else None


def _inferred_trips(loop: Instr, comp: Computation, comps: dict[str, Computation]):
    """Trips of a while loop the compiler left without `known_trip_count` (XLA:GPU's collective
    pipelining rewrites loops and drops it): its induction variable's start (a constant in the
    init tuple) to the constant it is compared against with LT in the condition. None when
    the loop does not have that shape."""
    m = _INDUCTION_RE.search(loop.attrs)
    cond = re.search(r"condition=%?([\w.\-]+)", loop.attrs)
    init = comp.by_name.get(loop.operands[0]) if loop.operands else None
    if not m or not cond or init is None or init.opcode != "tuple":
        return None
    k = int(m.group(1))
    src = comp.by_name.get(init.operands[k]) if k < len(init.operands) else None
    while src is not None and src.opcode in ("copy", "bitcast") and src.operands:
        src = comp.by_name.get(src.operands[0])
    start = _constant_value(src)
    limits = []
    stack = [cond.group(1)]
    while stack:  # the compare may sit inside a fusion the condition calls
        c = comps.get(stack.pop())
        if c is None:
            continue
        for i in c.instrs:
            if i.opcode == "compare" and "direction=LT" in i.attrs:
                limits += [v for v in (_constant_value(c.by_name.get(o)) for o in i.operands)
                           if v is not None]
            stack += [n for n, _, _ in callees(i)]
    if start is None or len(limits) != 1 or limits[0] < start:
        return None
    return limits[0] - start


def _callers(comps: dict[str, Computation], branch_weights: dict | None = None) -> dict:
    """callee -> [(caller, factor, is_loop)]: a loop's trips (None when unknown), a weighted
    conditional's per-branch factor (`branch_weights`: op name -> one factor per branch),
    else 1."""
    callers: dict[str, list] = {n: [] for n in comps}
    for comp in comps.values():
        for instr in comp.instrs:
            weights = (branch_weights or {}).get(instr.name)
            for k, (callee, trips, is_loop) in enumerate(callees(instr)):
                if is_loop and trips is None:
                    trips = _inferred_trips(instr, comp, comps)
                if weights is not None:
                    trips = weights[k]
                if callee in callers:
                    callers[callee].append((comp.name, trips, is_loop))
    return callers


def weighted_runs(comps: dict[str, Computation], entry: str, branch_weights: dict) -> dict:
    """Executions per step of every computation when the branches of the conditionals named
    in `branch_weights` run the given fractions of their switch's runs (factors may be
    arrays, e.g. one per pipeline rank); every other call as `_reach` counts it."""
    callers, memo = _callers(comps, branch_weights), {entry: 1.0}

    def visit(name: str, stack: frozenset):
        if name not in memo:
            memo[name] = sum((visit(c, stack | {name}) * (1 if f is None else f)
                              for c, f, _ in callers[name] if c not in stack), 0.0) \
                if callers[name] else 1.0   # an orphan as `_reach` counts it
        return memo[name]

    for name in comps:
        visit(name, frozenset())
    return memo


def _reach(comps: dict[str, Computation], entry: str) -> dict[str, _Reach]:
    """Executions per step of every computation, summed over call sites."""
    callers = _callers(comps)
    memo: dict[str, _Reach] = {}

    def visit(name: str, stack: frozenset) -> _Reach:
        if name in memo:
            return memo[name]
        if name == entry:
            memo[name] = _Reach(1, False, True)
            return memo[name]
        r = _Reach()
        for caller, trips, is_loop in callers[name]:
            if caller in stack:
                continue  # HLO call graphs are acyclic; guard against odd text anyway
            c = visit(caller, stack | {name})
            r.count += c.count * (trips if trips is not None else 1)
            r.in_loop |= c.in_loop or is_loop
            r.exact &= c.exact and trips is not None
        if not callers[name]:
            # Optimized HLO drops dead computations; an orphan means text we could not link.
            r = _Reach(1, False, False)
        memo[name] = r
        return r

    for name in comps:
        visit(name, frozenset())
    return memo


@functools.lru_cache(maxsize=2)
def parsed(text: str) -> tuple[dict[str, Computation], dict[str, _Reach]]:
    """(computations, their reach) of a module text: parsed once when several readers ask
    (the dry run reads collectives and FLOPs of the same large module)."""
    comps, entry = module(text)
    return comps, _reach(comps, entry)


@functools.lru_cache(maxsize=2)
def module(text: str) -> tuple[dict[str, Computation], str]:
    """parse_module, once per text for the readers that share a module."""
    return parse_module(text)


def ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text)]
