"""Mesh layouts as plain data, hypothesis strategies that draw them, and rank-side builders.

A layout is picklable data (``GradSpec``) drawn in the pytest process and sent to the ranks, which
build real DTensors from it. Each spec names a mesh over the whole world (1-3 dims) and the subset
of its dims the tensor's DTensor mesh spans. The remaining dims are *stripes*: each stripe holds a
different global tensor (an expert on its expert-data-parallel stripe), seeded by the stripe's
coordinates, so the reference is the union of the distinct global tensors of every stripe.

Local shards are cut by this module's own slicing, not by torch's ``distribute_tensor`` (which
does not take ``_StridedShard``), and every builder checks ``full_tensor()`` against the global
tensor it started from: a layout torch reads differently fails loudly rather than passing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PlacementSpec:
    kind: str  # "R", "S" or "SS" (_StridedShard)
    dim: int = 0
    split_factor: int = 1


@dataclass(frozen=True)
class GradSpec:
    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    used_dims: tuple[int, ...]
    placements: tuple[PlacementSpec, ...]  # one per used dim
    dtype: str = "float32"
    seed: int = 0
    zero_fraction: float = 0.0
    scale: float = 1.0

    @property
    def stripe_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.mesh_shape)) if d not in self.used_dims)


# ---------------------------------------------------------------------------------------------
# global tensors (same on every rank and in the pytest process)


def global_tensor(spec: GradSpec, stripe: tuple[int, ...]) -> torch.Tensor:
    """The global tensor of ``spec`` on stripe ``stripe``, from an explicit generator."""
    gen = torch.Generator().manual_seed(hash((spec.seed, stripe)) % (2**31))
    t = torch.randn(spec.shape, generator=gen) * spec.scale
    if spec.zero_fraction > 0:
        mask = torch.rand(spec.shape, generator=gen) < spec.zero_fraction
        t = t.masked_fill(mask, 0.0)
    return t.to(DTYPES[spec.dtype])


def stripes(spec: GradSpec) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(spec.mesh_shape[d]) for d in spec.stripe_dims)))


def stripe_of(rank: int, spec: GradSpec) -> tuple[int, ...]:
    """The stripe that global rank ``rank`` holds a piece of (row-major mesh coordinates, as
    ``init_device_mesh`` lays ranks out, restricted to the stripe dims)."""
    coord, rest = [], rank
    for size in reversed(spec.mesh_shape):
        coord.append(rest % size)
        rest //= size
    coord.reverse()
    return tuple(coord[d] for d in spec.stripe_dims)


def all_global_tensors(specs: list[GradSpec]) -> list[torch.Tensor]:
    return [global_tensor(s, st) for s in specs for st in stripes(s)]


def reference_stats(specs: list[GradSpec], norm_type: float) -> tuple[float, int, bool]:
    """Brute force over the distinct global tensors: float64 norm, zero count, any non-finite."""
    flat = [t.double().flatten() for t in all_global_tensors(specs)]
    if not flat:
        return 0.0, 0, False
    v = torch.cat(flat)
    if v.numel() == 0:
        return 0.0, 0, False
    norm = torch.linalg.vector_norm(v, norm_type).item()
    return norm, int((v == 0).sum()), bool((~torch.isfinite(v)).any())


# ---------------------------------------------------------------------------------------------
# rank side

_MESHES: dict[tuple, object] = {}


def get_mesh(mesh_shape: tuple[int, ...], used_dims: tuple[int, ...] | None = None):
    """A cached DeviceMesh over the whole world (dims named d0, d1, ...), or its submesh."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(f"d{i}" for i in range(len(mesh_shape)))
    key = (mesh_shape, used_dims)
    if key not in _MESHES:
        if used_dims is None or used_dims == tuple(range(len(mesh_shape))):
            _MESHES[key] = _MESHES.get((mesh_shape, None)) or init_device_mesh(
                "cpu", mesh_shape, mesh_dim_names=names
            )
        else:
            _MESHES[key] = get_mesh(mesh_shape)[tuple(names[d] for d in used_dims)]
    return _MESHES[key]


def to_placement(p: PlacementSpec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if p.kind == "R":
        return Replicate()
    if p.kind == "S":
        return Shard(p.dim)
    return _StridedShard(p.dim, split_factor=p.split_factor)


def _shard_order(placements: tuple[PlacementSpec, ...]) -> list[int]:
    """Mesh dims in the order their shards are cut: left to right, except that a _StridedShard
    is cut after the plain shards to its right of the same tensor dim (it shards their pieces)."""
    order = [i for i, p in enumerate(placements) if p.kind == "S"]
    strided = [i for i, p in enumerate(placements) if p.kind == "SS"]
    return order + strided


def local_shard(t: torch.Tensor, spec: GradSpec, coord: tuple[int, ...]) -> torch.Tensor:
    """The piece of global ``t`` that mesh coordinate ``coord`` (full-mesh coordinate) holds."""
    sizes = [spec.mesh_shape[d] for d in spec.used_dims]
    sub = [coord[d] for d in spec.used_dims]
    for i in _shard_order(spec.placements):
        p = spec.placements[i]
        pieces = list(torch.chunk(t, sizes[i], dim=p.dim)) if t.shape[p.dim] > 0 else []
        t = pieces[sub[i]] if sub[i] < len(pieces) else t.narrow(p.dim, 0, 0)
    return t.contiguous()


def build_grad(spec: GradSpec, check: bool = True):
    """This rank's DTensor for ``spec``, checked against ``full_tensor()``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    full_mesh = get_mesh(spec.mesh_shape)
    coord = tuple(full_mesh.get_coordinate())
    stripe = tuple(coord[d] for d in spec.stripe_dims)
    g = global_tensor(spec, stripe)
    mesh = get_mesh(spec.mesh_shape, spec.used_dims)
    placements = tuple(to_placement(p) for p in spec.placements)
    local = local_shard(g, spec, coord)
    dt = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=g.shape, stride=g.stride()
    )
    if check:
        full = dt.full_tensor()
        if not torch.equal(full, g):
            raise AssertionError(
                f"rank {dist.get_rank()}: test layout {spec} does not round-trip through "
                "full_tensor(): the builder's slicing disagrees with torch's"
            )
    return dt


def valid_strided(spec: GradSpec) -> bool:
    """_StridedShard appears only as FSDP-over-TP does: sf equals the product of the sizes of the
    plain shards of the same tensor dim to its right, and those shards divide evenly."""
    sizes = [spec.mesh_shape[d] for d in spec.used_dims]
    for i, p in enumerate(spec.placements):
        if p.kind != "SS":
            continue
        right = [
            j
            for j in range(i + 1, len(sizes))
            if spec.placements[j].kind == "S" and spec.placements[j].dim == p.dim
        ]
        if not right or p.split_factor != math.prod(sizes[j] for j in right):
            return False
        if spec.shape[p.dim] % (p.split_factor * sizes[i]) != 0:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# hypothesis strategies (pytest process)


def _factorizations(n: int, max_dims: int = 3) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(2, n // a):
                if (n // a) % b == 0 and max_dims >= 3:
                    out.append((a, b, n // a // b))
    return out


def mesh_shapes(world_size: int):
    from hypothesis import strategies as st

    return st.sampled_from(_factorizations(world_size))


def grad_specs(
    world_size: int,
    mesh_shape: tuple[int, ...] | None = None,
    *,
    dtypes=("float32", "bfloat16", "float16"),
    allow_stripes: bool = True,
):
    """One GradSpec on a mesh over ``world_size`` ranks: placements from Replicate, Shard and
    _StridedShard, shapes with uneven splits and dims smaller than the mesh (empty shards)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        shape_of_mesh = mesh_shape or draw(mesh_shapes(world_size))
        ndim = len(shape_of_mesh)
        if allow_stripes and ndim > 1 and draw(st.booleans()):
            used = tuple(
                sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1, max_size=ndim - 1)))
            )
        else:
            used = tuple(range(ndim))
        rank = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank)))
        placements = []
        for _ in used:
            kind = draw(st.sampled_from(["R", "S", "S", "SS"]))
            placements.append(PlacementSpec(kind, draw(st.integers(0, rank - 1))))
        # give each _StridedShard the split factor FSDP-over-TP would; drop it where invalid
        sizes = [shape_of_mesh[d] for d in used]
        fixed = []
        for i, p in enumerate(placements):
            if p.kind == "SS":
                sf = math.prod(
                    sizes[j]
                    for j in range(i + 1, len(sizes))
                    if placements[j].kind == "S" and placements[j].dim == p.dim
                )
                p = PlacementSpec("SS", p.dim, sf) if sf > 1 else PlacementSpec("S", p.dim)
            fixed.append(p)
        spec = GradSpec(
            shape=shape,
            mesh_shape=shape_of_mesh,
            used_dims=used,
            placements=tuple(fixed),
            dtype=draw(st.sampled_from(dtypes)),
            seed=draw(st.integers(0, 2**20)),
            zero_fraction=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
            scale=draw(st.sampled_from([1.0, 1e-3, 1e3])),
        )
        if not valid_strided(spec):
            # make the strided dim divide evenly, which is what FSDP-over-TP produces
            shape = list(spec.shape)
            for i, p in enumerate(spec.placements):
                if p.kind == "SS":
                    shape[p.dim] = (
                        p.split_factor
                        * sizes[i]
                        * max(1, shape[p.dim] // (p.split_factor * sizes[i]))
                    )
            spec = GradSpec(**{**spec.__dict__, "shape": tuple(shape)})
        return spec

    return build()


_S, _R = PlacementSpec("S", 0), PlacementSpec("R")
# four named 4-rank layouts of 2-D params (Muon takes them all), for the optimizer tests
OPTIMIZER_LAYOUTS = {
    "1d-uneven-empty": [
        GradSpec((5, 3), (4,), (0,), (_S,)),  # 2, 2, 1, 0 rows
        GradSpec((2, 6), (4,), (0,), (_S,)),  # two ranks empty
        GradSpec((9, 4), (4,), (0,), (_S,)),
    ],
    "hsdp-2x2": [
        GradSpec((6, 4), (2, 2), (0, 1), (_R, _S)),
        GradSpec((3, 5), (2, 2), (0, 1), (_R, _S)),
    ],
    "2d-shard-shard": [
        GradSpec((6, 5), (2, 2), (0, 1), (_S, PlacementSpec("S", 1))),
        GradSpec((4, 4), (2, 2), (0, 1), (_S, PlacementSpec("S", 1))),
    ],
    "dense+expert": [
        GradSpec((8, 3), (2, 2), (0, 1), (_S, _R)),  # dense over all 4 ranks
        GradSpec((6, 4), (2, 2), (1,), (_S,)),  # an expert per stripe of mesh dim 0
    ],
}
