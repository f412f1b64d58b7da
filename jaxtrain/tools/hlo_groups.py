"""Which devices a collective of an optimized HLO module spans: its replica groups (listed,
iota or mesh-style spellings) or source-target pairs, and the mesh axes those groups form."""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxtrain.tools.hlo_module import HloError, HloParseError, ints


class HloMeshMismatch(HloError):
    """The compiled program's device groups do not fit the mesh passed in."""


_RG_LIST_RE = re.compile(r"replica_groups=\{((?:\s*\{[\d,\s]*\}\s*,?)*)\s*\}")
_RG_IOTA_RE = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_RG_MESH_RE = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{([^{}]*)\}")
_RG_MAXIMAL_RE = re.compile(r"replica_groups=maximal_mesh\[")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\s*\}")


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    return (arr.transpose(perm) if perm else arr).reshape(-1)


def _mesh_device_ids(spec: str | None, n: int) -> np.ndarray:
    """Flat device assignment of a mesh-form replica group (`device_ids=(...)`)."""
    if not spec:
        return np.arange(n)
    spec = spec.strip()
    m = re.fullmatch(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", spec)
    if m:
        return _iota(ints(m.group(2)), ints(m.group(3)) if m.group(3) else None)
    m = re.fullmatch(r"\[([\d,\s]+)\]T\(([\d,\s]+)\)", spec)
    if m:
        return _iota(ints(m.group(1)), ints(m.group(2)))
    ids = ints(spec)
    if len(ids) == n:
        return np.array(ids)
    if math.prod(ids) == n:  # bare `[a,b]`: an untransposed iota
        return np.arange(n)
    raise HloParseError(f"cannot read mesh device_ids=({spec}) for {n} devices")


def _mesh_form_groups(mesh_text: str, device_ids: str | None, axes_text: str) -> np.ndarray:
    """Groups of `mesh['a'=2,'b'=4] {'b'}` (sub-axes `'b':(pre)size` allowed)."""
    names, sizes = [], []
    for name, size in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", mesh_text):
        names.append(name)
        sizes.append(int(size))
    n = math.prod(sizes)
    devices = _mesh_device_ids(device_ids, n)
    refs = []  # (mesh dim, pre_size, size)
    for tok in filter(None, (t.strip() for t in axes_text.split(","))):
        m = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", tok)
        if not m or m.group(1) not in names:
            raise HloParseError(f"unknown mesh axis {tok!r} in replica_groups=mesh[{mesh_text}]")
        dim = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[dim])
        refs.append((dim, pre, size))
    # Split each mesh dim (major to minor) at the sub-axis boundaries, then group over the
    # referenced pieces in the listed order.
    split_dims, piece_index = [], {}
    for dim, full in enumerate(sizes):
        bounds = {1, full}
        for d, pre, size in refs:
            if d == dim:
                bounds |= {pre, pre * size}
        bounds = sorted(bounds)
        for lo, hi in zip(bounds, bounds[1:]):
            piece_index[(dim, lo)] = len(split_dims)
            split_dims.append(hi // lo)
    grouped = [piece_index[(d, pre)] for d, pre, _ in refs]
    others = [i for i in range(len(split_dims)) if i not in grouped]
    group_size = math.prod(split_dims[i] for i in grouped)
    arr = devices.reshape(split_dims).transpose(others + grouped)
    return arr.reshape(-1, group_size)


def parse_replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
    """Device groups of one HLO instruction line, or None when it has no `replica_groups`.

    Reads the three spellings of optimized HLO: explicit lists `{{0,1},{2,3}}`, iota
    `[4,2]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and the mesh form
    `mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}`. `{}` means all `num_devices`.
    """
    if (m := _RG_IOTA_RE.search(line)):
        dims = ints(m.group(1))
        flat = _iota(ints(m.group(2)), ints(m.group(3)) if m.group(3) else None)
        groups = flat.reshape(dims[0], -1) if len(dims) == 2 else flat.reshape(1, -1)
    elif (m := _RG_MESH_RE.search(line)):
        groups = _mesh_form_groups(m.group(1), m.group(2), m.group(3))
    elif _RG_MAXIMAL_RE.search(line):
        return ((0,),)
    elif (m := _RG_LIST_RE.search(line)):
        lists = [ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        lists = [g for g in lists if g]
        if not lists:
            return (tuple(range(num_devices)),)
        return tuple(tuple(g) for g in lists)
    elif "replica_groups=" in line:
        raise HloParseError(f"unrecognised replica_groups spelling in: {line.strip()[:300]}")
    else:
        return None
    return tuple(tuple(int(d) for d in g) for g in groups)


def parse_source_target_pairs(line: str) -> tuple[tuple[int, int], ...] | None:
    """`source_target_pairs={{0,1},{1,0}}` of a collective-permute line, or None."""
    m = _PAIRS_RE.search(line)
    if not m:
        return None
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", m.group(1))
    return tuple((int(a), int(b)) for a, b in pairs)


class MeshIndex:
    """Device groups each subset of mesh axes induces, over logical device positions."""

    def __init__(self, mesh: Any):
        self.names = tuple(mesh.axis_names)
        self.sizes = tuple(int(s) for s in mesh.shape.values())
        self.size = math.prod(self.sizes)
        positions = np.arange(self.size).reshape(self.sizes)
        real = [i for i, s in enumerate(self.sizes) if s > 1]
        self.by_groups: dict[frozenset, tuple[str, ...]] = {}
        # Smallest subsets first so size-1 axes never appear in a match.
        for k in range(len(real) + 1):
            for subset in itertools.combinations(real, k):
                key = self._key(self._groups(positions, subset))
                self.by_groups.setdefault(key, tuple(self.names[i] for i in subset))

    def _groups(self, positions: np.ndarray, subset: Sequence[int]) -> np.ndarray:
        others = [i for i in range(len(self.sizes)) if i not in subset]
        group = math.prod(self.sizes[i] for i in subset)
        return positions.transpose(others + list(subset)).reshape(-1, group)

    @staticmethod
    def _key(groups: Iterable[Iterable[int]]) -> frozenset:
        return frozenset(frozenset(int(d) for d in g) for g in groups)

    def check(self, ids: Iterable[int], line: str) -> None:
        top = max(ids, default=-1)
        if top >= self.size:
            raise HloMeshMismatch(
                f"the compiled step addresses device {top} but the mesh has {self.size} devices "
                f"{dict(zip(self.names, self.sizes))}; pass the mesh the step was compiled with "
                f"(op: {line.strip()[:160]})")

    def axes_for_groups(self, groups: Sequence[Sequence[int]]) -> tuple[str, ...] | None:
        return self.by_groups.get(self._key(groups))

    def axes_for_pairs(self, pairs: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """Mesh axes along which some source and its target differ."""
        moved = set()
        for src, dst in pairs:
            a = np.unravel_index(src, self.sizes)
            b = np.unravel_index(dst, self.sizes)
            moved |= {i for i in range(len(self.sizes)) if a[i] != b[i]}
        return tuple(self.names[i] for i in sorted(moved))


def axes_for_groups(groups: Sequence[Sequence[int]], mesh: Any) -> tuple[str, ...] | None:
    """Mesh axes whose induced device groups equal `groups` (order-insensitive), else None."""
    return MeshIndex(mesh).axes_for_groups(groups)
