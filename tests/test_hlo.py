"""jaxtrain.tools.hlo: collectives, FLOPs and memory read from compiled steps (8 fake CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.tools import hlo, hlo_groups, hlo_module


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


@pytest.fixture(scope="module")
def mesh3():
    return _mesh((2, 2, 2), ("data", "fsdp", "tensor"))


@pytest.fixture(scope="module")
def mesh2():
    return _mesh((2, 4), ("data", "fsdp"))


def _compile_shard_map(fn, mesh, in_spec, out_spec, *args, check_vma=True):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                              check_vma=check_vma))
    return f.lower(*args).compile()


def _only(colls, kind):
    found = [c for c in colls if c.kind == kind]
    assert len(found) == 1, colls
    return found[0]


# ----------------------------------------------------------------------------- compiled steps

def test_psum_over_one_axis_of_3d_mesh(mesh3):
    x_BD = jnp.ones((8, 16), jnp.float32)  # local block (2, 8) f32 = 64 bytes
    spec = P(("data", "fsdp"), "tensor")
    c = _compile_shard_map(lambda a: jax.lax.psum(a, "fsdp"), mesh3, spec,
                           P("data", "tensor"), x_BD)
    ar = _only(hlo.collectives(c, mesh3), "all-reduce")
    assert ar.axes == ("fsdp",)
    assert (ar.bytes, ar.group_size, ar.count, ar.in_loop) == (64, 2, 1, False)
    assert ar.wire_bytes == pytest.approx(2 * (2 - 1) / 2 * 64)

    c = _compile_shard_map(lambda a: jax.lax.psum(a, ("data", "tensor")), mesh3, spec,
                           P("fsdp"), x_BD)
    ar = _only(hlo.collectives(c, mesh3), "all-reduce")
    assert ar.axes == ("data", "tensor") and ar.group_size == 4 and ar.bytes == 64


def test_all_gather_in_shard_map(mesh3):
    x_BD = jnp.ones((8, 16), jnp.float32)
    c = _compile_shard_map(lambda a: jax.lax.all_gather(a, "tensor", axis=1, tiled=True),
                           mesh3, P(("data", "fsdp"), "tensor"), P(("data", "fsdp")), x_BD,
                           check_vma=False)
    ag = _only(hlo.collectives(c, mesh3), "all-gather")
    assert ag.axes == ("tensor",)
    assert ag.bytes == 2 * 16 * 4  # the gathered (2, 16) f32 result


def test_ppermute(mesh3):
    x_BD = jnp.ones((8, 16), jnp.float32)
    spec = P(("data", "fsdp"), "tensor")
    c = _compile_shard_map(lambda a: jax.lax.ppermute(a, "data", [(0, 1), (1, 0)]), mesh3,
                           spec, spec, x_BD)
    cp = _only(hlo.collectives(c, mesh3), "collective-permute")
    assert cp.axes == ("data",) and cp.bytes == 2 * 8 * 4
    assert cp.wire_bytes == cp.bytes  # every device sends its block once


def test_scan_counts_trip_count_and_loop(mesh3):
    x_BD = jnp.ones((8, 16), jnp.float32)
    spec = P(("data", "fsdp"), "tensor")

    def body(c, _):
        return c * 0.5 + jax.lax.psum(c, "fsdp"), None

    c = _compile_shard_map(lambda a: jax.lax.scan(body, a, None, length=5)[0], mesh3,
                           spec, spec, x_BD)
    colls = hlo.collectives(c, mesh3)
    ar = _only(colls, "all-reduce")
    assert (ar.count, ar.in_loop, ar.count_exact) == (5, True, True)
    assert hlo.summary(colls) == {("all-reduce", ("fsdp",)): 5 * 64}
    assert hlo.loop_collectives(colls, "fsdp") == [ar]
    assert hlo.loop_collectives(colls, ("data", "tensor")) == []
    assert hlo.loop_collectives(colls, "fsdp", kinds=("reduce-scatter",)) == []


def test_gspmd_fsdp_matmul_all_gathers_weights(mesh2):
    w_DF = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh2, P("fsdp", None)))
    x_BD = jax.device_put(jnp.ones((256, 64)), NamedSharding(mesh2, P(("data", "fsdp"), None)))
    f = jax.jit(lambda x, w: jnp.tanh(x @ w),
                out_shardings=NamedSharding(mesh2, P(("data", "fsdp"), None)))
    colls = hlo.collectives(f.lower(x_BD, w_DF).compile(), mesh2)
    gathers = [c for c in colls if c.kind == "all-gather"]
    assert gathers and all(c.axes == ("fsdp",) for c in gathers)
    assert sum(c.bytes for c in gathers) == 64 * 128 * 4
    assert hlo.payload_by_axis(colls)[("fsdp",)] >= 64 * 128 * 4


def test_scanned_fsdp_grad_loop_counts_and_cpu_reduce_scatter(mesh2):
    """Gradients of FSDP weights: AG per layer fwd+bwd, and CPU's all-reduce-then-slice."""
    L = 3
    w_LDD = jax.device_put(jnp.ones((L, 64, 64)), NamedSharding(mesh2, P(None, "fsdp", None)))
    x_BD = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh2, P(("data", "fsdp"), None)))

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
        return jnp.mean(h ** 2)

    f = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh2, P(None, "fsdp", None)))
    compiled = f.lower(w_LDD, x_BD).compile()
    colls = hlo.collectives(compiled, mesh2)
    layer_bytes = 64 * 64 * 4
    ag = hlo.summary(colls)[("all-gather", ("fsdp",))]
    assert ag == 2 * L * layer_bytes  # forward and backward gather every layer once
    assert all(c.in_loop and c.count == L for c in colls)

    # Whatever kind the backend picks, the gradient reduction moves a full layer over fsdp.
    reduced = sum(c.bytes_per_step for c in colls
                  if c.kind in ("all-reduce", "reduce-scatter") and c.axes == ("fsdp",))
    assert reduced == L * layer_bytes
    gpu_like = hlo.reclassify_sliced_all_reduce(colls)
    assert not any(c.kind == "all-reduce" and c.axes == ("fsdp",) for c in gpu_like)
    assert hlo.payload_by_axis(gpu_like) == hlo.payload_by_axis(colls)

    table = hlo.format_summary(colls)
    assert "all-gather" in table and "fsdp" in table and "total" in table

    mem = hlo.memory(compiled)
    assert mem["temp_bytes"] > 0 and mem["argument_bytes"] > 0
    assert mem["total_bytes"] >= mem["temp_bytes"]


def test_group_ids_are_mesh_positions_not_device_ids():
    devices = np.array(jax.devices())[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(2, 4)
    mesh = Mesh(devices, ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    c = _compile_shard_map(lambda a: jax.lax.psum(a, "data"), mesh, P(("data", "fsdp")),
                           P("fsdp"), jnp.ones((8, 16)))
    assert _only(hlo.collectives(c, mesh), "all-reduce").axes == ("data",)


def test_wrong_mesh_is_a_clear_error(mesh3):
    small = _mesh((2, 2), ("data", "fsdp"))
    c = _compile_shard_map(lambda a: jax.lax.psum(a, "fsdp"), mesh3, P(("data", "fsdp")),
                           P("data"), jnp.ones((8, 16)))
    with pytest.raises(hlo_groups.HloMeshMismatch, match="pass the mesh"):
        hlo.collectives(c, small)


def test_compiled_flops_of_matmul():
    M, K, N = 8, 16, 32
    c = jax.jit(lambda a, b: a @ b).lower(jnp.ones((M, K)), jnp.ones((K, N))).compile()
    assert hlo.compiled_flops(c) == pytest.approx(2 * M * N * K, rel=0.05)


def test_flops_and_memory_shapes_across_versions():
    class ListCost:
        def cost_analysis(self):
            return [{"flops": 10.0}, {"flops": 5.0}]

        def memory_analysis(self):
            return None

    assert hlo.compiled_flops(ListCost()) == 15.0
    assert set(hlo.memory(ListCost()).values()) == {None}

    class NoCost:
        def cost_analysis(self):
            return {}

    with pytest.raises(hlo.HloAnalysisUnavailable):
        hlo.compiled_flops(NoCost())


# ----------------------------------------------------------------------------- parser units

def test_replica_groups_explicit_and_empty():
    line = "all-reduce(%p), channel_id=1, replica_groups={{0,2},{1,3}}, to_apply=%add"
    assert hlo_groups.parse_replica_groups(line, 4) == ((0, 2), (1, 3))
    assert hlo_groups.parse_replica_groups("all-reduce(%p), replica_groups={}, to_apply=%a", 4) == (
        (0, 1, 2, 3),)
    assert hlo_groups.parse_replica_groups("collective-permute(%p), source_target_pairs={}", 4) is None


def test_replica_groups_iota():
    assert hlo_groups.parse_replica_groups("x, replica_groups=[4,2]<=[8], y", 8) == (
        (0, 1), (2, 3), (4, 5), (6, 7))
    # [2,4]<=[4,2]T(1,0): iota(8).reshape(4,2).T -> rows of stride 2.
    assert hlo_groups.parse_replica_groups("x, replica_groups=[2,4]<=[4,2]T(1,0), y", 8) == (
        (0, 2, 4, 6), (1, 3, 5, 7))


def test_replica_groups_mesh_form():
    plain = "replica_groups=mesh['a'=2,'b'=4] {'b'}, use_global_device_ids=true"
    assert hlo_groups.parse_replica_groups(plain, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    two = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'c','a'}"
    assert hlo_groups.parse_replica_groups(two, 8) == ((0, 4, 1, 5), (2, 6, 3, 7))
    # Real CPU output: device_ids=([2,4]T(1,0)) lists devices 0,4,1,5,2,6,3,7 over the mesh.
    real = ("all-gather(%p), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,"
            "'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}")
    assert hlo_groups.parse_replica_groups(real, 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    explicit_ids = "replica_groups=mesh[a=2,b=2], device_ids=(0,2,1,3) {a}"
    assert hlo_groups.parse_replica_groups(explicit_ids, 4) == ((0, 1), (2, 3))
    # A sub-axis: b:(2)2 is the minor half of b=4.
    sub = "replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}"
    assert hlo_groups.parse_replica_groups(sub, 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    sub_major = "replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}"
    assert hlo_groups.parse_replica_groups(sub_major, 8) == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_unknown_spelling_is_an_error():
    with pytest.raises(hlo.HloParseError):
        hlo_groups.parse_replica_groups("replica_groups=weird<8>", 8)


def test_source_target_pairs_and_shape_bytes():
    line = "collective-permute(%p), source_target_pairs={{0,1},{1,0},{2,2}}"
    assert hlo_groups.parse_source_target_pairs(line) == ((0, 1), (1, 0), (2, 2))
    assert hlo_module.shape_bytes("f32[2,8]{1,0}") == 64
    assert hlo_module.shape_bytes("(bf16[4,4]{1,0}, s32[], pred[3])") == 32 + 4 + 3
    assert hlo_module.shape_bytes("f8e4m3fn[16]") == 16
    assert hlo_module.shape_bytes("s4[3]") == 2


def test_axes_for_groups(mesh3):
    assert hlo_groups.axes_for_groups([[0, 1, 2, 3, 4, 5, 6, 7]], mesh3) == ("data", "fsdp", "tensor")
    assert hlo_groups.axes_for_groups([[0, 4], [1, 5], [2, 6], [3, 7]], mesh3) == ("data",)
    assert hlo_groups.axes_for_groups([[i] for i in range(8)], mesh3) == ()
    assert hlo_groups.axes_for_groups([[0, 3], [1, 2], [4, 7], [5, 6]], mesh3) is None


_SYNTHETIC = """\
HloModule synthetic, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_rs (p: f32[4,4]) -> f32[1,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %rs = f32[1,4]{1,0} reduce-scatter(%p), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%inner_body (t: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %t = (s32[], f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4,4]{1,0} get-tuple-element(%t), index=1
  %ars = f32[4,4]{1,0} all-reduce-start(%v), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  %ard = f32[4,4]{1,0} all-reduce-done(%ars)
  %rs-start = ((f32[4,4]{1,0}), f32[1,4]{1,0}) async-start(%v), calls=%wrapped_rs
  %rs-done = f32[1,4]{1,0} async-done(%rs-start), calls=%wrapped_rs
  ROOT %o = (s32[], f32[4,4]{1,0}) tuple(%i, %ard)
}

%inner_cond (t: (s32[], f32[4,4])) -> pred[] {
  %t = (s32[], f32[4,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (t: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %t = (s32[], f32[4,4]{1,0}) parameter(0)
  %a = f32[4,4]{1,0} get-tuple-element(%t), index=1
  %b = bf16[4]{0} constant({1,2,3,4})
  %ar2 = (f32[4,4]{1,0}, bf16[4]{0}) all-reduce(%a, %b), channel_id=3, replica_groups={}, to_apply=%add
  ROOT %w = (s32[], f32[4,4]{1,0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

ENTRY %main (p0: f32[2,4]) -> f32[4,4] {
  %p0 = f32[2,4]{1,0} parameter(0)
  %ags = (f32[2,4]{1,0}, f32[4,4]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}
  %agd = f32[4,4]{1,0} all-gather-done(%ags)
  %cps = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(%agd), channel_id=4, source_target_pairs={{0,1},{1,0},{2,2}}
  %cpd = f32[4,4]{1,0} collective-permute-done(%cps)
  %t0 = (s32[], f32[4,4]{1,0}) tuple(%p0, %cpd)
  %loop = (s32[], f32[4,4]{1,0}) while(%t0), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  %unknown = (s32[], f32[4,4]{1,0}) while(%t0), condition=%inner_cond, body=%outer_body
  ROOT %r = f32[4,4]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_synthetic_module_async_tuples_and_nested_loops(mesh3):
    colls = {c.op: c for c in hlo.collectives_from_text(_SYNTHETIC, mesh3)}
    assert set(colls) == {"ags", "cps", "ar2", "ars", "rs"}  # -done ops are not counted again

    ag = colls["ags"]
    assert (ag.kind, ag.axes, ag.bytes, ag.count, ag.in_loop) == (
        "all-gather", ("tensor",), 64, 1, False)
    cp = colls["cps"]
    assert (cp.kind, cp.axes, cp.bytes) == ("collective-permute", ("tensor",), 64)
    assert cp.wire_bytes == pytest.approx(64 * 2 / 8)  # two of eight devices send
    # Tuple operand: f32[4,4] + bf16[4]; body of the known (4) and the unknown while loop.
    ar2 = colls["ar2"]
    assert (ar2.bytes, ar2.axes, ar2.count, ar2.count_exact) == (
        64 + 8, ("data", "fsdp", "tensor"), 4 + 1, False)
    ars = colls["ars"]
    assert (ars.kind, ars.axes, ars.count, ars.in_loop) == ("all-reduce", ("data",), 15, True)
    rs = colls["rs"]
    assert (rs.kind, rs.axes, rs.bytes, rs.count) == ("reduce-scatter", ("fsdp", "tensor"), 64, 15)
    assert rs.wire_bytes == pytest.approx(64 * 3 / 4)


_PIPELINED_LOOP = """\
HloModule pipelined, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_lt (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%p, %n), direction=LT
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %ar = f32[4]{0} all-reduce(%v), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %ar)
}

ENTRY %main (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %one = s32[] constant(1)
  %start = s32[] copy(%one)
  %t0 = (s32[], f32[4]{0}) tuple(%start, %p0)
  %loop = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  ROOT %r = f32[4]{0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_collective_pipelining_rewrote_keeps_its_trip_count(mesh3):
    """XLA:GPU's collective pipelining peels an iteration and drops known_trip_count: the trips
    are read from the induction variable (start 1, after a copy) and the LT bound (7, inside
    a fusion of the condition)."""
    (ar,) = hlo.collectives_from_text(_PIPELINED_LOOP, mesh3)
    assert (ar.count, ar.count_exact, ar.in_loop, ar.axes) == (6, True, True, ("data",))
