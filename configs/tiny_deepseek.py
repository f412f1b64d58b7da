"""The CPU DeepSeek-V3 recipe: DeepSeek-V3's architecture at the tiny byte-level size.

Multi-head latent attention (a q low-rank path of rank 32, a KV latent of 32, heads of 16 no-RoPE
+ 16 RoPE dims for q/k and 32 for v), one dense layer first (first_k_dense, DeepSeek's
first_k_dense_replace), then MoE layers of 8 routed experts top-2 plus one shared expert, with
DeepSeek-V3's router: sigmoid scores, group-limited (4 groups, a token's experts from its best
2), the top-k renormalised and scaled by routed_scaling_factor, the auxiliary-loss-free bias
(rate 1e-3) and the small sequence-wise balance loss; RMSNorm eps 1e-6 as DeepSeek-V3's
(HF's DeepseekV3 normalises the latents with 1e-6, so a run exports to it). It trains through
`train.py` on a CPU in seconds with falling loss (tests/test_recipes_deepseek.py);
`--parallel.expert=2` (or 4) on 8 fake devices is its expert-parallel run. Multi-token
prediction as DeepSeek-V3's: one module, its loss factor 0.3, then 0.1 for the last third of the
steps (DeepSeek-V3: after 10T of 14.8T tokens); the export drops it.
"""
import dataclasses

from jaxtrain.config import MlaConfig, MoeConfig, MtpConfig

from . import tiny


def get_config():
    cfg = tiny.get_config()
    mla = MlaConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                    v_head_dim=32)
    moe = MoeConfig(num_experts=8, top_k=2, mlp_size=64, shared_experts=1, first_k_dense=1,
                    score_function="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                    n_group=4, topk_group=2, expert_bias=True, bias_update_rate=1e-3,
                    aux_loss_coeff=0.0, seq_aux_loss_coeff=1e-4)
    mtp = MtpConfig(num_layers=1, loss_scaling_factor=0.3,
                    schedule=f"{cfg.train.steps * 2 // 3}:0.1")
    model = dataclasses.replace(cfg.model, num_kv_heads=cfg.model.num_heads, norm_eps=1e-6,
                                mla=mla, moe=moe, mtp=mtp)
    cfg = dataclasses.replace(cfg, model=model)
    cfg.train.workdir = "runs/tiny_deepseek"
    return cfg
