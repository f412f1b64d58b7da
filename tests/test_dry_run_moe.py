"""How the dry run counts an MoE step's matmuls (CPU only, no compile): the ledger side
(branch_matmul_flops: the routed rows, never every held expert) and the program side (the
grouped GEMM kernels by their buffer rows' routed share, the ragged all-to-all pairs)."""
import pytest

from jaxtrain.config import Config, ModelConfig, MoeConfig, ParallelConfig, TrainConfig
from jaxtrain.ledger import Layout, experts
from jaxtrain.ledger.device_params import layer_params_local
from jaxtrain.tools import dry_run, gpu_program, hlo_module, kernel_flops

H, F, E = 128, 256, 8


def _cfg(**moe) -> Config:
    return Config(model=ModelConfig(vocab_size=512, hidden_size=H, num_layers=4, num_heads=4,
                                    num_kv_heads=2, mlp_size=F, compute_dtype="bfloat16",
                                    moe=MoeConfig(num_experts=E, top_k=2, mlp_size=F, **moe)),
                  parallel=ParallelConfig(), train=TrainConfig(global_batch=16, seq_len=64))


@pytest.mark.parametrize("moe, rows", [({}, 2), ({"dispatch": "capacity",
                                                  "capacity_factor": 0.5}, 1)])
def test_an_moe_layers_matmul_params_are_its_routed_rows_at_any_expert_degree(moe, rows):
    """Per token an MoE layer multiplies attention, norms' none, the router and `rows`
    experts' SwiGLU (top_k dropless; capacity's kept rows), whatever the expert degree:
    layer_params_local holds E/ep experts (all 8 at ep 1, which priced an 8-expert GEMM)."""
    cfg = _cfg(**moe)
    for ep in (1, 4):
        layout = Layout(expert=ep, data=4)
        held = layer_params_local(cfg, 1, ep)
        routed = dry_run.layer_matmul_params(cfg, layout)
        assert routed == held - E / ep * 3 * H * F + rows * 3 * H * F
        assert dry_run.grouped_rows_share(cfg, layout) == rows / (2 * ep)
    assert experts.rows_per_token(cfg) == rows


GROUPED = r"""HloModule m

ENTRY %main (a: s32[8], x: bf16[4096,128], w: bf16[2,128,256], dy: bf16[4096,256]) -> bf16[4096,256] {
  %a = s32[8]{0} parameter(0)
  %x = bf16[4096,128]{1,0} parameter(1)
  %w = bf16[2,128,256]{2,1,0} parameter(2)
  %dy = bf16[4096,256]{1,0} parameter(3)
  %fwd = bf16[4096,256]{1,0} custom-call(%a, %a, %x, %w), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[8]{0}, s32[8]{0}, bf16[4096,128]{1,0}, bf16[2,128,256]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/jaxtrain_grouped_rows/mpmd_map"}, backend_config={module = "sym\00jaxtrain_grouped_rows\00mpmd_map"}
  %dw = bf16[2,128,256]{2,1,0} custom-call(%a, %a, %x, %dy), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[8]{0}, s32[8]{0}, bf16[4096,128]{1,0}, bf16[4096,256]{1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(f)/jaxtrain_grouped_per_group/mpmd_map"}, backend_config={module = "sym\00jaxtrain_grouped_per_group\00mpmd_map"}
  %send = ((bf16[4096,128]{1,0}, bf16[4096,128]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), bf16[4096,128]{1,0}) ragged-all-to-all-start(%x, %x, %a, %a, %a, %a), channel_id=1
  %recv = bf16[4096,128]{1,0} ragged-all-to-all-done(%send)
  ROOT %out = bf16[4096,256]{1,0} add(%fwd, %dy)
}
"""


def test_grouped_gemm_kernels_count_by_their_routed_rows():
    """rows x group (forward, dX) and per group (dW) each 2·M·K·N over the buffer's M rows,
    times the routed share (the kernel's name is read from its serialized module in
    backend_config, as XLA:GPU prints it); other ops nothing; a start/done ragged
    all-to-all is one pair, hidden when a kernel is scheduled between its start and done."""
    comps, entry = hlo_module.parse_module(GROUPED)
    comp = comps[entry]
    counted = {i.name: kernel_flops.grouped_gemm_flops_of(i, 0.25) for i in comp.instrs}
    assert counted["fwd"] == counted["dw"] == 2 * 4096 * 128 * 256 * 0.25
    assert sum(counted.values()) == counted["fwd"] + counted["dw"]
    assert gpu_program.ragged_all_to_alls(GROUPED) == (1, 0)
    assert gpu_program.ragged_pairs_hidden(GROUPED) == 0   # the kernels run before the start
    lines = GROUPED.splitlines()
    dw = next(x for x in lines if x.startswith("  %dw"))
    lines.remove(dw)
    lines.insert(lines.index(next(x for x in lines if x.startswith("  %recv"))), dw)
    assert gpu_program.ragged_pairs_hidden("\n".join(lines)) == 1   # dW between: hidden
    with pytest.raises(ValueError, match="ragged-all-to-all-start"):
        gpu_program.ragged_all_to_alls(GROUPED.replace("  %recv", "  %recv_gone"
                                                       ).replace("ragged-all-to-all-done", "copy"))
